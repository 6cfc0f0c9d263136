"""A measured worker profile as a JSON file: what ``pdfabric profile`` writes and the planner reads.

It holds the same ``WorkerProfile`` that workers report to the router (fitted step-time coefficients)
plus what the planner and the simulator need to turn it into workers: the model's KV bytes per token
and block size, the limits the profile was measured up to, and the measured KV transfer rate of each
transport. ``role`` says which worker kinds the profile may stand for, so that a prefill profile from
one machine kind and a decode profile from another can be mixed (heterogeneous hardware).

The file is plain JSON with a ``format`` tag; unknown keys are an error, so a typo never goes unseen.
``live_profiles`` rebuilds the profiles a running deployment's workers refined while serving from its
router's ``/health`` answer.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from pdfabric.control import KINDS
from pdfabric.profile import WorkerProfile

FORMAT = "pdfabric-profile/1"
ANY = "any"  # the profile stands for every worker kind


@dataclass(frozen=True)
class ProfileFile:
    """One measured profile and the facts needed to simulate workers with it."""

    model: str
    profile: WorkerProfile
    kv_bytes_per_token: int  # KV cache bytes one token takes (all layers, K and V)
    block_size: int  # tokens per KV block
    max_batch_tokens: int  # tokens per step the profile was measured up to
    max_running: int  # decode batch it was measured up to
    max_model_len: int = 4096
    role: str = ANY  # "any", or the one worker kind ("prefill", "decode", "colocated") it stands for
    device: str = "cpu"  # "cpu", "cuda", ...
    device_name: str = ""  # e.g. the CPU or GPU model
    threads: int = 0  # compute threads the worker used (CPU), 0: not applicable
    dtype: str = ""
    weights: str = "none"  # how the linear weights were held (a worker's quantization setting)
    weight_bytes: int = 0  # the weights as held in memory (what [worker] memory_mb leaves KV beside)
    kv_cache_dtype: str = "auto"  # what the KV cache stored a row as (a worker's kv_cache_dtype setting)
    kv_bytes_per_s: dict[str, float] = field(default_factory=dict)  # transport name -> measured rate
    seconds: float = 0.0  # how long profiling took
    steps: int = 0  # timed steps behind the fit

    def __post_init__(self) -> None:
        if self.role != ANY and self.role not in KINDS:
            raise ValueError(f"role must be {ANY!r} or one of {', '.join(KINDS)}, got {self.role!r}")
        for name in ("kv_bytes_per_token", "block_size", "max_batch_tokens", "max_running", "max_model_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for transport, rate in self.kv_bytes_per_s.items():
            if not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
                raise ValueError(f"kv_bytes_per_s[{transport!r}] must be > 0, got {rate!r}")

    def describe(self) -> str:
        """A few lines for people: the fit, its error, predicted step times at typical shapes, the
        measured limits and KV rates."""
        pf, p = self, self.profile
        ap, bp, cp = p.prefill
        ad, bd, cd = p.decode
        hw = pf.device_name or pf.device
        threads = f", {pf.threads} threads" if pf.threads else ""
        held = [
            d
            for d in (
                pf.dtype,
                "" if pf.weights == "none" else f"{pf.weights} weights",
                "" if pf.kv_cache_dtype == "auto" else f"{pf.kv_cache_dtype} KV cache",
            )
            if d
        ]
        dtype = f" ({', '.join(held)})" if held else ""
        lines = [
            f"profile of {pf.model}{dtype} on {pf.device} ({hw}{threads}), role {pf.role}: "
            f"{pf.steps} steps in {pf.seconds:.1f}s",
            f"  prefill step = {ap * 1e3:.3f} ms + {bp * 1e6:.3f} us/token + "
            f"{cp * 1e9:.4f} ns/(token x context)   [{p.prefill_samples} steps]",
            f"  decode step  = {ad * 1e3:.3f} ms + {bd * 1e6:.3f} us/sequence + "
            f"{cd * 1e9:.4f} ns/context token   [{p.decode_samples} steps]",
            f"  fit error (median relative): {p.fit_error:.1%}",
        ]
        chunk = pf.max_batch_tokens
        prefill = ", ".join(f"{n}: {p.prefill_seconds(n, chunk) * 1e3:.1f}" for n in (256, 512, 1024))
        lines.append(f"  prefill ms by prompt tokens (chunks of {chunk}): {prefill}")
        decode = ", ".join(f"{b}: {p.decode_step_seconds(b, b * 512) * 1e3:.2f}" for b in (1, 8, 32))
        lines.append(f"  decode step ms by batch (512 tokens each): {decode}")
        lines.append(
            f"  limits measured: {pf.max_batch_tokens} tokens/step, batch {pf.max_running}, "
            f"max_model_len {pf.max_model_len}; KV {pf.kv_bytes_per_token} bytes/token, "
            f"block {pf.block_size}"
        )
        if pf.kv_bytes_per_s:
            rates = ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in sorted(pf.kv_bytes_per_s.items()))
            lines.append(f"  KV transfer: {rates}")
        return "\n".join(lines)

    def serves(self, kind: str) -> bool:
        """Whether this profile may stand for a worker of ``kind``."""
        return self.role in (ANY, kind)

    def kv_rate(self, transport: str | None = None) -> float:
        """Measured KV bytes/s over ``transport``, or the fastest measured one; 0 if none was."""
        if transport is not None:
            if transport not in self.kv_bytes_per_s:
                known = ", ".join(sorted(self.kv_bytes_per_s)) or "none"
                raise ValueError(f"no KV rate measured for transport {transport!r} (measured: {known})")
            return float(self.kv_bytes_per_s[transport])
        return max(self.kv_bytes_per_s.values(), default=0.0)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["profile"] = asdict(self.profile)
        return {"format": FORMAT, **d}

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "profile") -> ProfileFile:
        if d.get("format") != FORMAT:
            raise ValueError(f"{where}: not a pdfabric profile (format {d.get('format')!r}, want {FORMAT!r})")
        known = {f.name for f in fields(cls)}
        body = {k: v for k, v in d.items() if k != "format"}
        unknown = set(body) - known
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        try:
            return cls(profile=WorkerProfile(**body.pop("profile")), **body)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ProfileFile:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"cannot read profile {path}: {e.strerror}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a profile is a JSON object")
        return cls.from_json(data, str(path))


def for_kind(profiles: list[ProfileFile], kind: str) -> ProfileFile:
    """The profile that stands for ``kind``: the one whose role is that kind, else one with role "any"."""
    exact = [p for p in profiles if p.role == kind]
    if exact:
        return exact[0]
    general = [p for p in profiles if p.role == ANY]
    if general:
        return general[0]
    raise ValueError(f"no profile for {kind} workers (roles given: {', '.join(p.role for p in profiles)})")


def live_profiles(health: dict[str, Any]) -> dict[str, ProfileFile]:
    """Each worker's profile from a router's ``/health`` answer, by worker id, with its kind as role;
    the KV rates it reported per transport (if any) under ``bench transfer``'s names (a worker's
    ``zmq`` is ``zmq-tcp``; an older router's single rate counts as ``zmq-tcp`` too)."""
    out: dict[str, ProfileFile] = {}
    for w in health.get("workers", ()):
        try:
            rate = float(w.get("kv_bytes_per_s") or 0.0)
            rates = {"zmq-tcp" if k == "zmq" else k: float(v) for k, v in (w.get("kv_rates") or {}).items()}
            if not rates and rate > 0:
                rates = {"zmq-tcp": rate}
            out[w["id"]] = ProfileFile(
                model=w["model"], profile=WorkerProfile(**w["profile"]),
                kv_bytes_per_token=w["kv_bytes_per_token"], block_size=w["block_size"],
                max_batch_tokens=w["max_batch_tokens"], max_running=w["max_running"],
                max_model_len=w["max_model_len"], role=w["kind"], device="live",
                device_name=f"worker {w['id']}, from /health", weights=w.get("weights", "none"),
                weight_bytes=w.get("weight_bytes", 0), kv_cache_dtype=w.get("kv_cache_dtype", "auto"),
                kv_bytes_per_s={k: v for k, v in rates.items() if v > 0},
                steps=w["profile"]["prefill_samples"] + w["profile"]["decode_samples"],
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"worker {w.get('id', '?')}: no profile in this /health ({exc})") from None
    if not out:
        raise ValueError("the /health answer lists no workers")
    return out
