"""Deployment configuration: frozen dataclasses built from TOML files and CLI flags in one place."""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdfabric.cluster_config import AutoscaleConfig, RayConfig
from pdfabric.control import KINDS
from pdfabric.kvtransfer.config import CHOICES as KV_TRANSPORTS
from pdfabric.router.routes import PredictorConfig
from pdfabric.router.slo import AdmissionConfig, is_sha256_hex

if TYPE_CHECKING:
    from pdfabric.model_versions import ModelConfig

# WorkerConfig fields a deployment's [worker] and [[workers]] tables may not set: the launcher fixes
# them per process (kind, join, worker_id) or takes them from [serve] (model, dtype).
_PER_PROCESS = frozenset({"kind", "join", "model", "dtype", "worker_id", "served"})


# kv_memory_mb = 0 (the default) sizes a worker's KV cache by its model: room for max_running
# sequences of AUTO_KV_TOKENS tokens each, and never less than AUTO_KV_MIN_MB. A fixed 256 MiB held
# about 11,000 SmolLM2 tokens (17 requests of 640): under load the scheduler preempted and recomputed
# and admission refused half the requests.
AUTO_KV_TOKENS = 1024
AUTO_KV_MIN_MB = 256


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process."""

    kind: str
    join: str = ""  # the router's control address, tcp://HOST:PORT
    model: str = "tiny"
    dtype: str | None = None
    pool: str = "default"
    worker_id: str = ""
    block_size: int = 16
    num_blocks: int = 0  # 0: as many as kv_memory_mb holds
    kv_memory_mb: int = 0  # 0: auto, sized by the model (see AUTO_KV_TOKENS)
    max_batch_tokens: int = 512
    max_running: int = 64
    kv_host: str = "127.0.0.1"  # address a decode worker binds its KV endpoint on
    heartbeat_s: float = 0.25
    drain_timeout_s: float = 30.0  # SIGTERM: exit once idle, or after this long (what is left fails over)
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda or cuda:N
    threads: int = 0  # torch threads (0: the launcher gives each worker its share of the cores)
    profile_seconds: float = 5.0  # start-up profiling budget (0: none; the profile is then learnt online)
    kv_transport: str = (
        "auto"  # auto (per pair: shm on one host, zmq across, dist when set up) | zmq | shm | dist
    )
    prefix_caching: bool = True  # keep computed full blocks for prompts that share their prefix
    served: str = ""  # the model version it serves, "name@version" ("": the deployment's one model)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"worker kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("block_size", "max_batch_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kv_memory_mb < 0:
            raise ValueError(f"kv_memory_mb must be >= 0 (0: auto), got {self.kv_memory_mb}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_blocks < 0 or self.threads < 0:
            raise ValueError(f"num_blocks and threads must be >= 0, got {self.num_blocks}, {self.threads}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}"
            )

    def to_json(self) -> str:
        """Every field, as the one JSON object ``worker_config_from_json`` reads back."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)}, separators=(",", ":"))

    def kv_blocks(self, kv_bytes_per_token: int) -> int:
        """The KV blocks this worker allocates for a model whose tokens take ``kv_bytes_per_token``:
        ``num_blocks`` if set, else as many as ``kv_memory_mb`` holds, else (auto) room for
        ``max_running`` sequences of ``AUTO_KV_TOKENS`` tokens and never less than ``AUTO_KV_MIN_MB``
        (the worker and the simulator both use this)."""
        if self.num_blocks:
            return self.num_blocks
        block = kv_bytes_per_token * self.block_size
        if self.kv_memory_mb:
            budget = self.kv_memory_mb * 2**20
        else:
            budget = max(AUTO_KV_MIN_MB * 2**20, self.max_running * AUTO_KV_TOKENS * kv_bytes_per_token)
        if budget < block:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {block} bytes")
        return budget // block


WORKER_KEYS = frozenset(f.name for f in fields(WorkerConfig)) - _PER_PROCESS  # [worker] table keys
# The Python types a WorkerConfig field accepts, by its annotation (bool is refused where int is asked).
_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "str | None": (str, type(None)), "bool": (bool,),
}  # fmt: skip


def worker_default(name: str) -> Any:
    """A ``WorkerConfig`` field's default: what flag help texts quote, so it is written once."""
    f = next(f for f in fields(WorkerConfig) if f.name == name)
    if f.default is MISSING:
        raise ValueError(f"WorkerConfig.{name} has no default")
    return f.default


def worker_config(
    table: Mapping[str, Any], base: WorkerConfig, allowed: frozenset[str], where: str
) -> WorkerConfig:
    """``base`` with the settings in ``table``: the one loader for a deployment's ``[worker]`` and
    ``[[workers]]`` tables and for the serialized config a worker process receives. A key outside
    ``allowed`` or a value of the wrong type is a ``ValueError`` naming it (``where`` says where);
    the values themselves are checked by ``WorkerConfig.__post_init__``."""
    bad = set(table) - allowed
    if bad:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(sorted(bad))}")
    annotations = {f.name: str(f.type) for f in fields(WorkerConfig)}
    for key, value in table.items():
        types = _TYPES[annotations[key]]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            want = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ValueError(f"{where}: {key} must be {want}, got {value!r}")
    return replace(base, **table)


def worker_config_from_json(text: str) -> WorkerConfig:
    """The ``WorkerConfig`` that ``WorkerConfig.to_json`` wrote, through the deployment's loader; every
    field must be present, so that the sending and the receiving side never fill in a default each."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"worker config is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("worker config must be a JSON object")
    every = frozenset(f.name for f in fields(WorkerConfig))
    missing = every - set(data)
    if missing:
        raise ValueError(f"worker config lacks {', '.join(sorted(missing))}")
    if not isinstance(data["kind"], str):
        raise ValueError(f"worker config: kind must be str, got {data['kind']!r}")
    return worker_config(data, WorkerConfig(kind=data["kind"]), every, "worker config")


@dataclass(frozen=True)
class WorkerGroup:
    """``count`` workers of one kind started with their own settings (a ``[[workers]]`` table), e.g.
    a decode pool with a small batch for tight inter-token latency."""

    worker: WorkerConfig
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"[[workers]] count must be >= 0, got {self.count}")

    @property
    def kind(self) -> str:
        return self.worker.kind


@dataclass(frozen=True)
class ServeConfig:
    """A whole deployment: the router and its worker pools."""

    model: str = "tiny"
    dtype: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    control_port: int = 0  # 0: a free port chosen at start
    # Worker counts; a config or command line that sets any of them sets the others to 0.
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    worker: WorkerConfig = field(default_factory=lambda: WorkerConfig(kind="colocated"))
    worker_timeout_s: float = 10.0  # heartbeats missing this long: the worker is gone
    request_timeout_s: float = 600.0  # a request with no progress this long ends with an error
    max_failovers: int = 2  # times a request may move off failed workers mid-stream (0: never)
    shutdown_drain_s: float = 30.0  # on SIGTERM / Ctrl-C: requests in flight get this long to finish
    admin_key_sha256: str = ""  # hex SHA-256 of the key admin endpoints require ("": no key needed)
    served_model_name: str = ""  # the name clients use; default: the model argument
    audit_log: str = ""  # file the admin endpoints' audit log is appended to ("": stderr)
    idempotency_ttl_s: float = 600.0  # how long a response is replayed to its Idempotency-Key (0: off)
    idempotency_max_entries: int = 10000  # responses kept for replay; past that the oldest is forgotten
    groups: tuple[WorkerGroup, ...] = ()  # [[workers]]: more workers, with settings of their own
    models: tuple[ModelConfig, ...] = ()  # [[models]]: named models with versions and workers of their own
    routing: AdmissionConfig = field(default_factory=AdmissionConfig)  # [routing]: budgets, pools, queue
    predictor: PredictorConfig = field(default_factory=PredictorConfig)  # [routing] prediction settings
    ray: RayConfig = field(default_factory=RayConfig)  # [ray]: workers placed on a Ray cluster
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # [autoscale]: pools resized

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        counts = {k: self.count(k) for k in KINDS}
        own = {k: self.own_count(k) for k in KINDS}
        if sum(counts.values()) == 0 and self.control_port == 0:
            raise ValueError(
                "a deployment needs at least one worker, or a fixed control_port that workers started "
                "elsewhere join (pdfabric worker --join)"
            )
        if (own["prefill"] == 0) != (own["decode"] == 0):
            raise ValueError("disaggregated serving needs both prefill and decode workers")
        if not 0 <= self.port < 65536 or not 0 <= self.control_port < 65536:
            raise ValueError("ports must be in 0..65535")
        if self.worker_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        if self.max_failovers < 0:
            raise ValueError(f"max_failovers must be >= 0, got {self.max_failovers}")
        if self.shutdown_drain_s < 0:
            raise ValueError(f"shutdown_drain_s must be >= 0, got {self.shutdown_drain_s}")
        key = self.admin_key_sha256
        if key and not is_sha256_hex(key):
            raise ValueError("admin_key_sha256 must be 64 hex digits (printf %s KEY | sha256sum)")
        if not self.idempotency_ttl_s >= 0:
            raise ValueError(f"idempotency_ttl_s must be >= 0, got {self.idempotency_ttl_s}")
        if self.idempotency_max_entries < 1:
            raise ValueError(
                f"idempotency_max_entries must be at least 1, got {self.idempotency_max_entries}"
            )
        if any(m.name == self.model_name for m in self.models) and sum(own.values()):
            raise ValueError(f"[[models]] {self.model_name!r} is also the name of [serve]'s model")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def count(self, kind: str) -> int:
        """Workers of ``kind`` in the deployment, default pool and groups together."""
        own = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[kind]
        versions = sum(v.count(kind) for m in self.models for v in m.versions)
        return own + sum(g.count for g in self.groups if g.kind == kind) + versions

    def own_count(self, kind: str) -> int:
        """Workers of ``kind`` serving the ``[serve]`` model (every one but the ``[[models]]``')."""
        return self.count(kind) - sum(v.count(kind) for m in self.models for v in m.versions)

    def launch_plan(self) -> list[tuple[str, WorkerConfig]]:
        """(worker id, config) of every worker to start: the default pool's, then each group's; each
        config whole but for ``join`` (known once the router is bound) and ``threads`` when 0."""
        plan: list[tuple[str, WorkerConfig]] = []
        seen: dict[str, int] = {}
        for kind in KINDS:
            for _ in range(getattr(self, kind)):
                plan.append((kind, replace(self.worker, kind=kind)))
        for g in self.groups:
            prefix = g.kind if g.worker.pool == "default" else f"{g.kind}-{g.worker.pool}"
            plan += [(prefix, g.worker)] * g.count
        out = []
        for prefix, w in plan:
            n = seen.get(prefix, 0)
            seen[prefix] = n + 1
            worker_id = f"{prefix}-{n}"
            out.append((worker_id, replace(w, worker_id=worker_id, model=self.model, dtype=self.dtype)))
        from pdfabric.model_versions import version_plan  # it imports this module

        return out + [p for m in self.models for v in m.versions for p in version_plan(m, v)]

    def pool_worker(self, kind: str, worker_id: str) -> WorkerConfig:
        """The config of one more ``kind`` worker of the default pool (a scaler adds these)."""
        return replace(self.worker, kind=kind, worker_id=worker_id, model=self.model, dtype=self.dtype)


def load_serve_config(path: str | Path | None, overrides: dict[str, Any]) -> ServeConfig:
    """Reads a TOML deployment config (``[serve]``, ``[worker]``, ``[routing]``, ``[[workers]]`` and
    ``[[models]]``, see ``pdfabric.model_versions``) and applies CLI overrides (keys of ``[serve]`` or
    ``[worker]``, and ``routing_policy``; ``None`` values are ignored). Unknown tables and keys are a
    ``ValueError`` naming them."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - {"serve", "worker", "routing", "workers", "models", "ray", "autoscale"}
        if unknown:
            raise ValueError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}")
    tables = {"worker", "groups", "routing", "predictor", "models", "ray", "autoscale"}
    serve_keys = {f.name for f in fields(ServeConfig)} - tables
    serve = dict(data.get("serve", {}))
    worker = dict(data.get("worker", {}))
    bad = set(serve) - serve_keys
    if bad:
        raise ValueError(f"{path}: unknown key(s) in [serve]: {', '.join(sorted(bad))}")
    given = {k: v for k, v in overrides.items() if v is not None}
    policy = given.pop("routing_policy", None)
    ray_address = given.pop("ray_address", None)
    counts = ("prefill", "decode", "colocated")
    if any(k in given for k in counts):  # the command line's deployment replaces the file's
        for k in counts:
            serve.pop(k, None)
    if any(k in serve or k in given for k in counts) or "workers" in data or "models" in data:
        serve.update({k: serve.get(k, 0) for k in counts})
    for key, value in given.items():
        (serve if key in serve_keys else worker)[key] = value
    try:
        model, dtype = serve.get("model", ServeConfig.model), serve.get("dtype")
        first = WorkerConfig("colocated", model=model, dtype=dtype)
        base = worker_config(worker, first, WORKER_KEYS, "[worker]")
        groups = tuple(_group(base, t) for t in data.get("workers", ()))
        from pdfabric.model_versions import parse_models  # it imports this module

        models = parse_models(data.get("models", []), base)
        routing, predictor = _routing(data.get("routing", {}))
        if policy is not None:
            routing = replace(routing, policy=policy)
        ray = RayConfig.from_mapping(data.get("ray", {}))
        if ray_address is not None:
            ray = replace(ray, address=ray_address)
        autoscale = AutoscaleConfig.from_mapping(data.get("autoscale", {}))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}" if path is not None else str(exc)) from None
    return ServeConfig(
        **serve, worker=base, groups=groups, models=models, routing=routing, predictor=predictor, ray=ray,
        autoscale=autoscale,
    )  # fmt: skip


def _group(base: WorkerConfig, table: Any) -> WorkerGroup:
    """One ``[[workers]]`` table: ``kind``, ``count`` (default 1) and any ``[worker]`` key."""
    if not isinstance(table, dict):
        raise ValueError("[[workers]] entries must be tables")
    if "kind" not in table:
        raise ValueError("[[workers]] needs a kind (prefill, decode or colocated)")
    settings = {k: v for k, v in table.items() if k != "count"}
    worker = worker_config(settings, base, WORKER_KEYS | {"kind"}, "[[workers]]")
    return WorkerGroup(worker, table.get("count", 1))


def _routing(table: Any) -> tuple[AdmissionConfig, PredictorConfig]:
    """The ``[routing]`` table: prediction settings (``safety_margin``, ``seed``, ...) and the rest
    for ``AdmissionConfig.from_mapping``."""
    if not isinstance(table, dict):
        raise ValueError("[routing] must be a table")
    predictor_keys = {f.name for f in fields(PredictorConfig)}
    predictor = PredictorConfig(**{k: v for k, v in table.items() if k in predictor_keys})
    admission = AdmissionConfig.from_mapping({k: v for k, v in table.items() if k not in predictor_keys})
    return admission, predictor
