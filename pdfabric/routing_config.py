"""The ``[routing]`` settings, validated once: budgets, priority classes, tenants, pools, the wait
queue's limits and the routing policy (``AdmissionConfig``), and the route predictor's settings
(``PredictorConfig``). Plain frozen dataclasses at the bottom of the house, read by the configuration
loader, the router and the simulator in ``bench/``; what they drive is in ``router/`` (``slo.resolve``,
the policies, the predictor)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pdfabric.control import KINDS

# The routing policies (router/routing/policies.py ranks routes by each).
BUDGET, ROUND_ROBIN, LEAST_LOADED = "budget", "round_robin", "least_loaded"
POLICIES = (BUDGET, ROUND_ROBIN, LEAST_LOADED)


def check_policy(policy: str) -> None:
    """Raises ``ValueError`` naming the allowed values if ``policy`` is not one of them."""
    if policy not in POLICIES:
        raise ValueError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")


MAX_BUDGET_MS = 3_600_000.0


def is_sha256_hex(text: str) -> bool:
    """Whether ``text`` is a SHA-256 digest in hex (64 hex digits, either case)."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text.lower())


def _check_ms(owner: str, name: str, value: float, allow_zero: bool = True) -> None:
    ok = math.isfinite(value) and (value > 0 or (allow_zero and value == 0)) and value <= MAX_BUDGET_MS
    if isinstance(value, bool) or not ok:
        raise ValueError(f"{owner}: {name} must be in (0, {MAX_BUDGET_MS:.0f}] ms, got {value!r}")


@dataclass(frozen=True)
class SloClass:
    """A priority class. Budgets of 0 inherit the config default; ``max_wait_ms`` 0 rejects at once
    when no route fits, else the request may wait that long (and never past its TTFT budget). A
    ``background`` class's requests go only where they slow the other classes' sequences by at most
    ``[routing] background_slowdown`` (``predictor.sparing``)."""

    name: str
    priority: int = 0  # higher is served first
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    max_wait_ms: float = 0.0
    background: bool = False

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a class needs a name")
        for name in ("ttft_ms", "itl_ms", "max_wait_ms"):
            _check_ms(f"class {self.name}", name, getattr(self, name))


@dataclass(frozen=True)
class Tenant:
    """A tenant: its share of the wait queue (``weight``), class and budgets (0: inherit), and the
    platform's hold on it (``router/platform/tenants.py``): the SHA-256 of its API keys, the models it may use
    (empty: all) and its limits (0: none), enforced at admission."""

    name: str
    weight: float = 1.0
    slo_class: str = ""  # "": the default class
    ttft_ms: float = 0.0
    itl_ms: float = 0.0
    api_keys_sha256: tuple[str, ...] = ()  # hex SHA-256 of each key that authenticates as this tenant
    models: tuple[str, ...] = ()  # model names it may use ("": every model served)
    requests_per_min: int = 0  # requests admitted in any 60 s
    tokens_per_min: int = 0  # prompt plus generated tokens in any 60 s
    max_concurrency: int = 0  # requests in flight at once
    max_context: int = 0  # prompt plus max_tokens per request

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a tenant needs a name")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"tenant {self.name}: weight must be > 0, got {self.weight!r}")
        for name in ("ttft_ms", "itl_ms"):
            _check_ms(f"tenant {self.name}", name, getattr(self, name))
        for name in ("api_keys_sha256", "models"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"tenant {self.name}: {name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        for digest in self.api_keys_sha256:
            if not is_sha256_hex(digest):
                raise ValueError(
                    f"tenant {self.name}: api_keys_sha256 entries must be 64 hex digits "
                    "(printf %s KEY | sha256sum)"
                )
        for name in ("requests_per_min", "tokens_per_min", "max_concurrency", "max_context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"tenant {self.name}: {name} must be an integer >= 0, got {value!r}")


@dataclass(frozen=True)
class PoolConfig:
    """A named pool of one worker kind and its limits (0: the worker's own limit)."""

    name: str
    kind: str
    max_batch: int = 0  # decode/colocated: most sequences decoding at once
    chunk_tokens: int = 0  # prefill/colocated: tokens per step
    cost: float = 1.0  # relative cost of a route through this pool; cheaper routes are preferred

    def __post_init__(self) -> None:
        if not self.name or self.kind not in KINDS:
            raise ValueError(f"pool {self.name!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.max_batch < 0 or self.chunk_tokens < 0:
            raise ValueError(f"pool {self.name}: max_batch and chunk_tokens must be >= 0")
        if not (math.isfinite(self.cost) and self.cost >= 0):
            raise ValueError(f"pool {self.name}: cost must be >= 0, got {self.cost!r}")

    def limits(self, worker_max_batch: int, worker_chunk_tokens: int) -> tuple[int, int]:
        """(max_batch, chunk_tokens) for a worker of this pool: the lower of pool and worker."""
        return (
            min(worker_max_batch, self.max_batch or worker_max_batch),
            min(worker_chunk_tokens, self.chunk_tokens or worker_chunk_tokens),
        )


# Loose by default: a deployment without budgets is routed by predicted load and only turns away requests
# that could not start for a long time. Tight budgets are opted into per request, tenant or class.
_DEFAULT_CLASSES = (
    SloClass("interactive", priority=10, max_wait_ms=10_000.0),
    SloClass("batch", priority=0, ttft_ms=60_000.0, itl_ms=1000.0, max_wait_ms=60_000.0, background=True),
)


@dataclass(frozen=True)
class AdmissionConfig:
    """Budgets, classes, tenants, pools, the wait queue's limits and the routing policy (the ``[routing]``
    table). ``policy`` is ``budget`` (routes that meet the budgets), or a baseline to measure it
    against: ``round_robin`` or ``least_loaded`` (see ``pdfabric.router.routing.policies``)."""

    ttft_ms: float = 30_000.0
    itl_ms: float = 5_000.0
    default_class: str = "interactive"
    classes: tuple[SloClass, ...] = _DEFAULT_CLASSES
    tenants: tuple[Tenant, ...] = ()
    pools: tuple[PoolConfig, ...] = ()
    queue_capacity: int = 256  # requests waiting at once, all tenants
    poll_probes: int = 32  # waiting requests tried per poll before giving up until the next one
    # how long a waiting request may see later ones admitted past it (they fit, it does not: a long
    # prompt waiting for KV room); after that they wait behind it (0: never past a waiting one; None,
    # the default: until its deadline)
    max_overtake_ms: float | None = None
    min_retry_ms: int = 100
    max_retry_ms: int = 60_000
    policy: str = BUDGET
    # how much a background class's request may slow the foreground sequences of the worker it goes to
    # (predicted ITL: 0.1 is 10% slower; 0 sends it only to workers that decode no foreground sequence)
    background_slowdown: float = 0.1
    _class_of: dict[str, SloClass] = field(init=False, repr=False, compare=False)
    _tenant_of: dict[str, Tenant] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_policy(self.policy)
        _check_ms("routing", "ttft_ms", self.ttft_ms, allow_zero=False)
        _check_ms("routing", "itl_ms", self.itl_ms, allow_zero=False)
        for what, items in (("class", self.classes), ("tenant", self.tenants)):
            names = [i.name for i in items]
            if len(set(names)) != len(names):
                raise ValueError(f"routing: duplicate {what} names in {names}")
        pools = [(p.kind, p.name) for p in self.pools]
        if len(set(pools)) != len(pools):
            raise ValueError(f"routing: duplicate pools in {pools}")
        object.__setattr__(self, "_class_of", {c.name: c for c in self.classes})
        object.__setattr__(self, "_tenant_of", {t.name: t for t in self.tenants})
        digests = [d.lower() for t in self.tenants for d in t.api_keys_sha256]
        if len(set(digests)) != len(digests):
            raise ValueError("routing: one API key is given to two tenants")
        for t in self.tenants:
            if t.slo_class and t.slo_class not in self._class_of:
                raise ValueError(f"tenant {t.name}: unknown class {t.slo_class!r}")
        if self.default_class not in self._class_of:
            raise ValueError(f"routing: default_class {self.default_class!r} is not a declared class")
        if self.queue_capacity < 0 or self.poll_probes < 1:
            raise ValueError("routing: queue_capacity must be >= 0 and poll_probes >= 1")
        if self.max_overtake_ms is not None:
            _check_ms("routing", "max_overtake_ms", self.max_overtake_ms)
        if not 1 <= self.min_retry_ms <= self.max_retry_ms:
            raise ValueError("routing: need 1 <= min_retry_ms <= max_retry_ms")
        if not (math.isfinite(self.background_slowdown) and self.background_slowdown >= 0):
            raise ValueError(f"routing: background_slowdown must be >= 0, got {self.background_slowdown}")

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> AdmissionConfig:
        """Builds the config from a parsed ``[routing]`` TOML table (``classes``, ``tenants`` and
        ``pools`` as arrays of tables); unknown keys are a ValueError naming them."""
        data = dict(known_keys(cls, table, "routing"))
        for key, item in (("classes", SloClass), ("tenants", Tenant), ("pools", PoolConfig)):
            if key in data:
                data[key] = tuple(item(**known_keys(item, t, f"routing.{key}")) for t in data[key])
        return cls(**data)

    def slo_class(self, name: str) -> SloClass:
        if name not in self._class_of:
            raise ValueError(f"unknown class {name!r}; declared: {', '.join(self._class_of)}")
        return self._class_of[name]

    def tenant(self, name: str) -> Tenant:
        """The tenant's config; an undeclared tenant gets weight 1 and the default class."""
        return self._tenant_of.get(name) or Tenant(name or "-")

    def pool(self, kind: str, name: str) -> PoolConfig:
        """The declared pool, or an unlimited one of that name."""
        for p in self.pools:
            if p.kind == kind and p.name == name:
                return p
        return PoolConfig(name or "default", kind)


def known_keys(cls: type, table: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    allowed = {f.name for f in fields(cls) if f.init}
    unknown = set(table) - allowed
    if unknown:
        raise ValueError(f"unknown key(s) in [{where}]: {', '.join(sorted(unknown))}")
    return table


@dataclass(frozen=True)
class PredictorConfig:
    safety_margin: float = 0.1  # predictions are inflated by this fraction
    tie_tolerance: float = 0.05  # routes whose load is within this of the best are equals
    default_kv_bytes_per_s: float = 1e9  # transfer rate assumed before any is measured
    colocated_prefill_share: float = 1.0  # most of the colocated steps predicted to carry a prompt chunk
    mean_remaining_tokens: int = 128  # assumed output still to come per running sequence (drain time)
    max_queue_share: float = 0.5  # queued work ahead may take at most this share of the TTFT budget
    # A decode worker whose prefix cache holds all but at most this many of a prompt's tokens is also
    # ranked as a route of its own: it prefills the rest itself, and no KV moves (0: never).
    local_prefill_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.max_queue_share <= 1:
            raise ValueError("max_queue_share must be in (0, 1]")
        if self.safety_margin < 0 or not 0 <= self.tie_tolerance <= 1:
            raise ValueError("safety_margin must be >= 0 and tie_tolerance in [0, 1]")
        if self.default_kv_bytes_per_s <= 0 or self.mean_remaining_tokens < 1:
            raise ValueError("default_kv_bytes_per_s must be > 0 and mean_remaining_tokens >= 1")
        if not 0 <= self.colocated_prefill_share <= 1:
            raise ValueError("colocated_prefill_share must be in [0, 1]")
        if self.local_prefill_tokens < 0:
            raise ValueError("local_prefill_tokens must be >= 0")


@dataclass(frozen=True)
class EmbeddingConfig:
    """``[embeddings]``: how the router batches embedding inputs (``router/routing/batcher.py``)."""

    batch_tokens: int = 8192  # a batch's tokens at most (an input longer than this goes alone)
    batch_inputs: int = 256  # a batch's inputs at most
    # A batch leaves this long before its oldest input's deadline less its predicted compute: the
    # room left for the trip to the worker, its queue and the reply.
    margin_ms: float = 25.0
    # An input's latency budget when its request gives no "slo" ttft_ms (0: its tenant's or class's
    # TTFT budget, as for generation).
    budget_ms: float = 0.0
    length_buckets: bool = True  # inputs of one batch are of one power-of-two length bucket

    def __post_init__(self) -> None:
        if self.batch_tokens < 1 or self.batch_inputs < 1:
            raise ValueError("[embeddings] batch_tokens and batch_inputs must be at least 1")
        _check_ms("embeddings", "margin_ms", self.margin_ms)
        _check_ms("embeddings", "budget_ms", self.budget_ms)


@dataclass(frozen=True)
class BatchJobsConfig:
    """``[batches]``: ``/v1/files`` and ``/v1/batches`` (``router/platform/batch_jobs.py``)."""

    # where files and batches are kept, across restarts ("": PDFABRIC_CACHE_DIR's "batches" folder)
    dir: str = ""
    max_in_flight: int = 4  # a router's batch lines running at once, all batches together
    slo_class: str = "batch"  # the class its lines are admitted in (the lowest priority by default)
    retries: int = 3  # times a line answered 5xx is sent again before it is written as failed
    max_file_mb: int = 200  # an uploaded file's size at most
    # a tenant's files (uploads and its batches' output and error files) at most, in all; 0: no limit
    tenant_storage_mb: int = 2048

    def __post_init__(self) -> None:
        if self.max_in_flight < 1 or self.retries < 0 or self.max_file_mb < 1 or self.tenant_storage_mb < 0:
            raise ValueError(
                "[batches] max_in_flight and max_file_mb must be >= 1, retries and tenant_storage_mb >= 0"
            )
