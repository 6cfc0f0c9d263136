"""The planner's search space: a candidate deployment (``Candidate``: a prefill:decode split or a
colocated count, with a decode batch cap and a chunk budget), the planner's settings, the caps the
profiles allow, every candidate of ``W`` workers, and a candidate as a deployment config."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pdfabric.bench.goodput import SearchConfig
from pdfabric.bench.metrics import SLO
from pdfabric.config import ServeConfig, WorkerGroup
from pdfabric.profile_file import ProfileFile, for_kind
from pdfabric.routing_config import AdmissionConfig
from pdfabric.worker_config import WorkerConfig

DEFAULT_CAPS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Candidate:
    """One deployment shape: worker counts per kind and the per-worker batch and chunk caps."""

    prefill: int
    decode: int
    colocated: int
    max_running: int
    chunk_tokens: int

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def name(self) -> str:
        split = f"{self.colocated}C" if self.colocated else f"{self.prefill}P+{self.decode}D"
        return f"{split} b{self.max_running} c{self.chunk_tokens}"


@dataclass(frozen=True)
class PlanSettings:
    """What every candidate shares: the SLO, the search, the caps to try, the KV budget."""

    slo: SLO
    search: SearchConfig = field(default_factory=SearchConfig)
    rates: tuple[float, ...] = ()  # swept first (then bisected between pass and fail); (): bisect only
    max_running: tuple[int, ...] = ()  # decode batch caps; (): DEFAULT_CAPS up to the profile's limit
    chunk_tokens: tuple[int, ...] = ()  # prefill chunk budgets; (): the profile's measured limit
    kv_memory_mb: int = WorkerConfig.kv_memory_mb
    transport: str | None = None  # KV transport whose measured rate is used (None: the fastest)
    colocated: bool = True  # try colocated candidates
    disaggregated: bool = True  # try prefill + decode splits

    def __post_init__(self) -> None:
        if self.kv_memory_mb < 0:
            raise ValueError(f"kv_memory_mb must be >= 0 (0: auto), got {self.kv_memory_mb}")
        for name in ("max_running", "chunk_tokens", "rates"):
            if any(v <= 0 for v in getattr(self, name)):
                raise ValueError(f"{name} values must be > 0, got {getattr(self, name)}")
        if not (self.colocated or self.disaggregated):
            raise ValueError("nothing to plan: both colocated and disaggregated candidates are off")


def check_profiles(profiles: Sequence[ProfileFile]) -> None:
    """Profiles that can describe one deployment: one model, one block size, one KV-cache row format
    (prefill and decode workers move blocks as bytes); ``ValueError`` if not."""
    if not profiles:
        raise ValueError("give at least one profile")
    for attr in ("model", "block_size", "kv_cache_dtype"):
        values = {getattr(p, attr) for p in profiles}
        if len(values) > 1:
            raise ValueError(f"the profiles disagree on {attr}: {', '.join(map(str, sorted(values)))}")


def profile_for(profiles: Sequence[ProfileFile], kind: str) -> ProfileFile | None:
    try:
        return for_kind(list(profiles), kind)
    except ValueError:
        return None


def caps(profiles: Sequence[ProfileFile], settings: PlanSettings, notes: list[str] | None = None
         ) -> tuple[list[int], list[int]]:  # fmt: skip
    """The decode batch caps and chunk budgets to try: those asked for (or the defaults) within the
    limits the profiles were measured up to; ``ValueError`` when none is left."""
    decoders = [p for k in ("decode", "colocated") if (p := profile_for(profiles, k))]
    chunkers = [p for k in ("prefill", "colocated") if (p := profile_for(profiles, k))]
    top_batch = min(p.max_running for p in decoders)
    top_chunk = min(p.max_batch_tokens for p in chunkers)
    asked = settings.max_running or tuple(c for c in DEFAULT_CAPS if c < top_batch) + (top_batch,)
    batch = sorted({c for c in asked if c <= top_batch})
    chunk = sorted({c for c in settings.chunk_tokens or (top_chunk,) if c <= top_chunk})
    dropped = sorted(set(asked) - set(batch)), sorted(set(settings.chunk_tokens) - set(chunk))
    limits = (("--max-running", dropped[0], top_batch), ("--chunk-tokens", dropped[1], top_chunk))
    for flag, values, top in limits:
        if values and notes is not None:
            notes.append(f"{flag} {','.join(map(str, values))} left out: above the profiles' measured {top}")
    if not batch:
        raise ValueError(f"--max-running: no cap within the profiles' measured batch limit {top_batch}")
    if not chunk:
        raise ValueError(f"--chunk-tokens: no budget within the profiles' measured limit {top_chunk}")
    return batch, chunk


def candidates(workers: int, profiles: Sequence[ProfileFile], settings: PlanSettings) -> list[Candidate]:
    """Every shape of ``workers`` workers the profiles can stand for, times each cap pair (a chunk
    smaller than the batch cap is skipped: the batch could never fill)."""
    if workers < 1:
        raise ValueError(f"the worker budget must be >= 1, got {workers}")
    shapes: list[tuple[int, int, int]] = []
    if settings.disaggregated and profile_for(profiles, "prefill") and profile_for(profiles, "decode"):
        shapes += [(p, workers - p, 0) for p in range(1, workers)]
    if settings.colocated and profile_for(profiles, "colocated"):
        shapes.append((0, 0, workers))
    batch, chunk = caps(profiles, settings)
    return [Candidate(p, d, c, b, k) for p, d, c in shapes for b in batch for k in chunk if k >= b]


def deployment(candidate: Candidate, profiles: Sequence[ProfileFile], settings: PlanSettings) -> ServeConfig:
    """The candidate as a launchable deployment: the profiles' model, dtype and block size; per-worker
    caps; the SLO as the router's default budgets; each kind's measured thread count and weight
    format (a prefill profile in bfloat16 and a decode one in int4 make pools of each)."""
    ref = profiles[0]
    dtypes = {p.dtype for p in profiles}
    kinds = [k for k in ("prefill", "decode", "colocated") if getattr(candidate, k)]
    threads = {k: profile_for(profiles, k).threads for k in kinds}  # type: ignore[union-attr]
    weights = {k: profile_for(profiles, k).weights for k in kinds}  # type: ignore[union-attr]
    base = WorkerConfig(
        kind="colocated", model=ref.model, dtype=dtypes.pop() if len(dtypes) == 1 and ref.dtype else None,
        block_size=ref.block_size, kv_memory_mb=settings.kv_memory_mb,
        max_batch_tokens=candidate.chunk_tokens, max_running=candidate.max_running,
        threads=threads[kinds[0]] if len(set(threads.values())) == 1 else 0,
        quantization=weights[kinds[0]] if len(set(weights.values())) == 1 else "none",
        kv_cache_dtype=ref.kv_cache_dtype,
    )  # fmt: skip
    routing = AdmissionConfig(ttft_ms=settings.slo.ttft_ms, itl_ms=settings.slo.itl_ms)
    counts = {k: getattr(candidate, k) for k in ("prefill", "decode", "colocated")}
    if (base.threads or not any(threads.values())) and len(set(weights.values())) == 1:
        return ServeConfig(model=ref.model, dtype=base.dtype, worker=base, routing=routing, **counts)
    groups = tuple(
        WorkerGroup(replace(base, kind=k, threads=threads[k], quantization=weights[k]), counts[k])
        for k in kinds
    )
    return ServeConfig(
        model=ref.model,
        dtype=base.dtype,
        prefill=0,
        decode=0,
        colocated=0,
        worker=base,
        groups=groups,
        routing=routing,
    )
