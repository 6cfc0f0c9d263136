"""Deployment configuration: frozen dataclasses built from TOML files and CLI flags in one place."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdfabric.control import KINDS
from pdfabric.kvtransfer.config import CHOICES as KV_TRANSPORTS
from pdfabric.router.routes import PredictorConfig
from pdfabric.router.slo import AdmissionConfig

# [worker] keys a deployment config may set (the rest are fixed by the launcher).
_WORKER_KEYS = frozenset(
    {"pool", "block_size", "num_blocks", "kv_memory_mb", "max_batch_tokens", "max_running", "kv_host",
     "heartbeat_s", "device", "threads", "profile_seconds", "kv_transport"}
)  # fmt: skip


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
    kv_memory_mb: int = 256
    max_batch_tokens: int = 512
    max_running: int = 64
    kv_host: str = "127.0.0.1"  # address a decode worker binds its KV endpoint on
    heartbeat_s: float = 0.25
    device: str = "auto"  # auto (cuda when available, else cpu), cpu, cuda or cuda:N
    threads: int = 0  # torch threads (0: the launcher gives each worker its share of the cores)
    profile_seconds: float = 5.0  # start-up profiling budget (0: none; the profile is then learnt online)
    kv_transport: str = (
        "auto"  # auto (per pair: shm on one host, zmq across, dist when set up) | zmq | shm | dist
    )

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"worker kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        for name in ("block_size", "kv_memory_mb", "max_batch_tokens", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.device != "auto" and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.num_blocks < 0 or self.threads < 0:
            raise ValueError(f"num_blocks and threads must be >= 0, got {self.num_blocks}, {self.threads}")
        if self.heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be positive, got {self.heartbeat_s}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}"
            )

    def kv_blocks(self, kv_bytes_per_token: int) -> int:
        """The KV blocks this worker allocates for a model whose tokens take ``kv_bytes_per_token``:
        ``num_blocks`` if set, else as many as ``kv_memory_mb`` holds (the worker and the simulator
        both use this)."""
        if self.num_blocks:
            return self.num_blocks
        budget, block = self.kv_memory_mb * 2**20, kv_bytes_per_token * self.block_size
        if budget < block:
            raise ValueError(f"a KV budget of {budget} bytes holds no block of {block} bytes")
        return budget // block


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
    served_model_name: str = ""  # the name clients use; default: the model argument
    groups: tuple[WorkerGroup, ...] = ()  # [[workers]]: more workers, with settings of their own
    routing: AdmissionConfig = field(default_factory=AdmissionConfig)  # [routing]: budgets, pools, queue
    predictor: PredictorConfig = field(default_factory=PredictorConfig)  # [routing] prediction settings

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        counts = {k: self.count(k) for k in KINDS}
        if sum(counts.values()) == 0:
            raise ValueError("a deployment needs at least one worker")
        if (counts["prefill"] == 0) != (counts["decode"] == 0):
            raise ValueError("disaggregated serving needs both prefill and decode workers")
        if not 0 <= self.port < 65536 or not 0 <= self.control_port < 65536:
            raise ValueError("ports must be in 0..65535")
        if self.worker_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def count(self, kind: str) -> int:
        """Workers of ``kind`` in the deployment, default pool and groups together."""
        own = {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[kind]
        return own + sum(g.count for g in self.groups if g.kind == kind)

    def launch_plan(self) -> list[tuple[str, WorkerConfig]]:
        """(worker id, config) of every worker to start: the default pool's, then each group's."""
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
            out.append((f"{prefix}-{n}", w))
        return out


def load_serve_config(path: str | Path | None, overrides: dict[str, Any]) -> ServeConfig:
    """Reads a TOML deployment config (``[serve]``, ``[worker]``, ``[routing]`` and ``[[workers]]``)
    and applies CLI overrides (keys of ``[serve]`` or ``[worker]``, and ``routing_policy``; ``None``
    values are ignored). Unknown tables and keys are a ``ValueError`` naming them."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - {"serve", "worker", "routing", "workers"}
        if unknown:
            raise ValueError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}")
    serve_keys = {f.name for f in fields(ServeConfig)} - {"worker", "groups", "routing", "predictor"}
    serve = dict(data.get("serve", {}))
    worker = dict(data.get("worker", {}))
    for table, allowed, name in ((serve, serve_keys, "serve"), (worker, _WORKER_KEYS, "worker")):
        bad = set(table) - allowed
        if bad:
            raise ValueError(f"{path}: unknown key(s) in [{name}]: {', '.join(sorted(bad))}")
    given = {k: v for k, v in overrides.items() if v is not None}
    policy = given.pop("routing_policy", None)
    counts = ("prefill", "decode", "colocated")
    if any(k in given for k in counts):  # the command line's deployment replaces the file's
        for k in counts:
            serve.pop(k, None)
    if any(k in serve or k in given for k in counts) or "workers" in data:
        serve.update({k: serve.get(k, 0) for k in counts})
    for key, value in given.items():
        (serve if key in serve_keys else worker)[key] = value
    model, dtype = serve.get("model", "tiny"), serve.get("dtype")
    base = WorkerConfig(kind="colocated", model=model, dtype=dtype, **worker)
    try:
        groups = tuple(_group(base, t) for t in data.get("workers", ()))
        routing, predictor = _routing(data.get("routing", {}))
        if policy is not None:
            routing = replace(routing, policy=policy)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return ServeConfig(**serve, worker=base, groups=groups, routing=routing, predictor=predictor)


def _group(base: WorkerConfig, table: Any) -> WorkerGroup:
    """One ``[[workers]]`` table: ``kind``, ``count`` (default 1) and any ``[worker]`` key."""
    if not isinstance(table, dict):
        raise ValueError("[[workers]] entries must be tables")
    bad = set(table) - _WORKER_KEYS - {"kind", "count"}
    if bad:
        raise ValueError(f"unknown key(s) in [[workers]]: {', '.join(sorted(bad))}")
    if "kind" not in table:
        raise ValueError("[[workers]] needs a kind (prefill, decode or colocated)")
    settings = {k: v for k, v in table.items() if k != "count"}
    return WorkerGroup(replace(base, **settings), table.get("count", 1))


def _routing(table: Any) -> tuple[AdmissionConfig, PredictorConfig]:
    """The ``[routing]`` table: prediction settings (``safety_margin``, ``seed``, ...) and the rest
    for ``AdmissionConfig.from_mapping``."""
    if not isinstance(table, dict):
        raise ValueError("[routing] must be a table")
    predictor_keys = {f.name for f in fields(PredictorConfig)}
    predictor = PredictorConfig(**{k: v for k, v in table.items() if k in predictor_keys})
    admission = AdmissionConfig.from_mapping({k: v for k, v in table.items() if k not in predictor_keys})
    return admission, predictor
