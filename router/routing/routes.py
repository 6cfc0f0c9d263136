"""The values route prediction works with: a request's budgets, a worker's load and limits as the
router sees them (``Candidate``), the predictor's settings, and its answer (``Choice``, ``Ranking``),
with the reasons a route does not fit. Plain frozen dataclasses, shared by the router's predictor and
policies, the admission queue and the simulator in ``bench/``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pdfabric.control import COLOCATED, DECODE, PREFILL
from pdfabric.profile import WorkerProfile

# Why a route does not fit. The ``*_unreachable`` ones would not fit even on an idle worker.
TTFT, ITL, BATCH_FULL, KV_FULL = "ttft", "itl", "batch_full", "kv_full"
TTFT_UNREACHABLE, ITL_UNREACHABLE, NO_WORKERS = "ttft_unreachable", "itl_unreachable", "no_workers"
FOREGROUND = "foreground"  # a background request would slow the foreground ones too much (``sparing``)


@dataclass(frozen=True)
class Budgets:
    """A request's latency budgets in milliseconds."""

    ttft_ms: float
    itl_ms: float

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "itl_ms"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number, got {v!r}")


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker last reported (plus what the router has sent it since)."""

    queued_tokens: int = 0  # prompt tokens not yet prefilled
    running: int = 0  # sequences decoding
    waiting: int = 0  # sequences not decoding yet: queued prompts, or reservations awaiting KV
    context_tokens: int = 0  # tokens held by the running and waiting sequences, in all
    free_kv_tokens: int = 0  # free blocks x block size
    kv_bytes_per_s: float = 0.0  # measured KV transfer rate (0: not measured yet)
    prompt_tokens_per_s: float = 0.0  # prompt tokens recently sent to it per second (colocated ITL)
    speculation: float = 1.0  # measured speed-up of its decoding while it speculates (Heartbeat's)

    def with_prefill(self, prompt_len: int, requests: int = 1) -> WorkerLoad:
        """This load once a prompt of ``prompt_len`` tokens (or ``requests`` prompts of that many in
        all) is queued for prefill here."""
        return replace(self, queued_tokens=self.queued_tokens + prompt_len, waiting=self.waiting + requests)

    def with_decode(self, prompt_len: int, requests: int = 1, prefill: bool = False) -> WorkerLoad:
        """This load once a sequence of ``prompt_len`` tokens (or ``requests`` sequences of that many
        in all) has reserved its KV here; with ``prefill`` its prompt is also queued for prefill here
        (a colocated worker's)."""
        return replace(
            self,
            queued_tokens=self.queued_tokens + (prompt_len if prefill else 0),
            waiting=self.waiting + requests,
            context_tokens=self.context_tokens + prompt_len,
            free_kv_tokens=max(0, self.free_kv_tokens - prompt_len),
        )


@dataclass(frozen=True)
class Candidate:
    """One worker as the predictor sees it: its profile, its load and its effective limits."""

    worker_id: str
    kind: str  # PREFILL, DECODE or COLOCATED
    pool: str
    profile: WorkerProfile
    load: WorkerLoad
    max_batch: int  # most sequences decoding at once (the pool's limit if lower than the worker's)
    chunk_tokens: int  # tokens per step (the pool's chunk budget if lower than the worker's)
    kv_bytes_per_token: int = 0  # KV bytes one prompt token takes (what a transfer moves)
    cost: float = 1.0  # the pool's relative cost; cheaper routes are preferred
    speculate_below: int = 0  # it speculates while at most this many sequences decode (Register's)
    host: str = ""  # its machine ("": unknown): a pair on one host moves KV over shared memory
    kv_rates: Mapping[str, float] = field(default_factory=dict)  # measured KV rate per transport
    cached_tokens: int = 0  # of the prompt being ranked, tokens in its prefix cache (as last reported)
    # of those, tokens its host KV store holds and it must read first, and seconds a token's read takes
    store_tokens: int = 0
    store_seconds_per_token: float = 0.0
    background: int = 0  # of the sequences it holds, those of a background class (the router's count)

    def __post_init__(self) -> None:
        if self.kind not in (PREFILL, DECODE, COLOCATED):
            raise ValueError(f"kind must be prefill, decode or colocated, got {self.kind!r}")
        if self.max_batch < 1 or self.chunk_tokens < 1 or self.kv_bytes_per_token < 0 or self.cost < 0:
            raise ValueError(f"{self.worker_id}: max_batch and chunk_tokens must be >= 1, cost >= 0")


@dataclass(frozen=True)
class Choice:
    """A route that fits, with its predicted latencies (ms). ``prefill`` is the colocated worker's
    id for a colocated route (and ``decode`` the same id); so is a decode worker's that prefills the
    prompt's uncached rest itself (``colocated`` too: it gets the prompt as a colocated worker would)."""

    decode: str
    prefill: str
    colocated: bool
    ttft_ms: float
    itl_ms: float
    queue_ms: float
    prefill_ms: float
    transfer_ms: float
    cost: float
    load: float  # max(ttft / ttft budget, itl / itl budget), in [0, 1]
    cached_tokens: int = 0  # prompt tokens its workers hold in their prefix caches (each side's)
    local_prefill: bool = False  # a decode worker that prefills the rest of a prompt it mostly caches
    # the ITL its decode worker's foreground sequences would see without any background one (0: it
    # holds no foreground sequence), beside ``itl_ms``, theirs with this request added
    foreground_itl_ms: float = 0.0


@dataclass(frozen=True)
class Ranking:
    """Feasible routes, best first; when there are none, why, and in how long one should fit."""

    choices: tuple[Choice, ...]
    reason: str = ""  # "" when there are choices
    drain_ms: float = 0.0  # predicted time until a new request like this one would fit (Retry-After)
    wait_ms: float = 0.0  # predicted time this request would wait in the router before one fits
    unreachable: bool = False  # True: no route would fit even if every worker were idle
    reasons: tuple[tuple[str, int], ...] = ()  # how many routes failed for each reason

    @property
    def fits(self) -> bool:
        return bool(self.choices)
