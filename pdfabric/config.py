"""Deployment configuration: frozen dataclasses built from TOML files and CLI flags in one place."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdfabric.cluster_config import AutoscaleConfig, RayConfig
from pdfabric.control import KINDS
from pdfabric.model_versions import ServedModel, parse_models, version_plan
from pdfabric.routing_config import (
    AdmissionConfig,
    BatchJobsConfig,
    EmbeddingConfig,
    PredictorConfig,
    is_sha256_hex,
    known_keys,
)
from pdfabric.worker_config import WORKER_KEYS, WorkerConfig, worker_config


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
    admin_key_sha256: str = ""  # hex SHA-256 of the key admin endpoints require ("": loopback callers only)
    served_model_name: str = ""  # the name clients use; default: the model argument
    audit_log: str = ""  # file the admin endpoints' audit log is appended to ("": stderr)
    # The cluster secret's file ("": PDFABRIC_CLUSTER_SECRET, else a random one for this run), which
    # workers need to join the router and to push KV (docs/security.md).
    cluster_secret_file: str = ""
    idempotency_ttl_s: float = 600.0  # how long a response is replayed to its Idempotency-Key (0: off)
    idempotency_max_entries: int = 10000  # responses kept for replay; past that the oldest is forgotten
    groups: tuple[WorkerGroup, ...] = ()  # [[workers]]: more workers, with settings of their own
    models: tuple[ServedModel, ...] = ()  # [[models]]: named models with versions and workers of their own
    routing: AdmissionConfig = field(default_factory=AdmissionConfig)  # [routing]: budgets, pools, queue
    predictor: PredictorConfig = field(default_factory=PredictorConfig)  # [routing] prediction settings
    ray: RayConfig = field(default_factory=RayConfig)  # [ray]: workers placed on a Ray cluster
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)  # [autoscale]: pools resized
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)  # [embeddings]: batching
    batches: BatchJobsConfig = field(default_factory=BatchJobsConfig)  # [batches]: /v1/batches jobs

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
        return out + [p for m in self.models for v in m.versions for p in version_plan(m, v)]

    def pool_worker(self, kind: str, worker_id: str) -> WorkerConfig:
        """The config of one more ``kind`` worker of the default pool (a scaler adds these)."""
        return replace(self.worker, kind=kind, worker_id=worker_id, model=self.model, dtype=self.dtype)


# The tables a deployment's TOML file may have
TABLES = frozenset(
    {
        "serve", "worker", "speculative", "kv_store", "routing", "workers", "models", "ray", "autoscale",
        "embeddings", "batches",
    }
)  # fmt: skip


def load_serve_config(path: str | Path | None, overrides: dict[str, Any]) -> ServeConfig:
    """Reads a TOML deployment config (``[serve]``, ``[worker]``, ``[speculative]``, ``[routing]``,
    ``[embeddings]``, ``[batches]``, ``[[workers]]`` and ``[[models]]``, see ``pdfabric.model_versions``)
    and applies CLI overrides (keys of ``[serve]`` or ``[worker]``, and ``routing_policy``; ``None``
    values are ignored).
    Unknown tables and keys are a ``ValueError`` naming them."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - TABLES
        if unknown:
            raise ValueError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}")
    tables = {
        "worker", "groups", "routing", "predictor", "models", "ray", "autoscale", "embeddings", "batches",
    }  # fmt: skip
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
    try:
        worker.update(_worker_table("speculative", data.get("speculative", {}), SPECULATIVE_KEYS, worker))
        worker.update(_worker_table("kv_store", data.get("kv_store", {}), KV_STORE_KEYS, worker))
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    for key, value in given.items():
        (serve if key in serve_keys else worker)[key] = value
    try:
        model, dtype = serve.get("model", ServeConfig.model), serve.get("dtype")
        first = WorkerConfig("colocated", model=model, dtype=dtype)
        base = worker_config(worker, first, WORKER_KEYS, "[worker]")
        groups = tuple(_group(base, t) for t in data.get("workers", ()))
        models = parse_models(data.get("models", []), base)
        routing, predictor = _routing(data.get("routing", {}))
        if policy is not None:
            routing = replace(routing, policy=policy)
        ray = RayConfig.from_mapping(data.get("ray", {}))
        if ray_address is not None:
            ray = replace(ray, address=ray_address)
        autoscale = AutoscaleConfig.from_mapping(data.get("autoscale", {}))
        embeddings = EmbeddingConfig(**known_keys(EmbeddingConfig, data.get("embeddings", {}), "embeddings"))
        batches = BatchJobsConfig(**known_keys(BatchJobsConfig, data.get("batches", {}), "batches"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}" if path is not None else str(exc)) from None
    return ServeConfig(
        **serve, worker=base, groups=groups, models=models, routing=routing, predictor=predictor, ray=ray,
        autoscale=autoscale, embeddings=embeddings, batches=batches,
    )  # fmt: skip


# [speculative] keys and the [worker] keys they set
SPECULATIVE_KEYS = {
    "method": "speculative", "k": "speculative_k", "below": "speculative_below",
    "draft_model": "draft_model", "draft_quantization": "draft_quantization", "draft_layers": "draft_layers",
    "draft_cache": "draft_cache",
}  # fmt: skip


# [kv_store] keys and the [worker] keys they set
KV_STORE_KEYS = {
    k: f"kv_store_{k}"
    for k in ("ram_mb", "ram_dir", "disk_dir", "disk_mb", "disk_admission", "queue_mb", "write_through")
}


def _worker_table(name: str, table: Any, keys: dict[str, str], worker: dict[str, Any]) -> dict[str, Any]:
    """A table that names ``[worker]`` settings by shorter keys (``[speculative]``: ``method``, ``k``,
    ``below``, ``draft_model``, ``draft_quantization``, ``draft_layers``, ``draft_cache``;
    ``[kv_store]``: ``ram_mb``, ``ram_dir``, ``disk_dir``, ``disk_mb``, ``disk_admission``, ``queue_mb``,
    ``write_through``) as those settings; a setting given in both tables is an error, the command
    line's flags override either."""
    if not isinstance(table, dict):
        raise ValueError(f"[{name}] must be a table")
    bad = set(table) - set(keys)
    if bad:
        raise ValueError(f"unknown key(s) in [{name}]: {', '.join(sorted(bad))}")
    settings = {keys[k]: v for k, v in table.items()}
    twice = sorted(k for k in settings if k in worker)
    if twice:
        raise ValueError(f"set in both [{name}] and [worker]: {', '.join(twice)}")
    return settings


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
