"""Deployment configuration: frozen dataclasses built from TOML files and CLI flags in one place."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pdfabric.control import KINDS


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

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated) < 0:
            raise ValueError("worker counts must be >= 0")
        if self.prefill + self.decode + self.colocated == 0:
            raise ValueError("a deployment needs at least one worker")
        if (self.prefill == 0) != (self.decode == 0):
            raise ValueError("disaggregated serving needs both prefill and decode workers")
        if not 0 <= self.port < 65536 or not 0 <= self.control_port < 65536:
            raise ValueError("ports must be in 0..65535")
        if self.worker_timeout_s <= 0 or self.request_timeout_s <= 0:
            raise ValueError("timeouts must be positive")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


def load_serve_config(path: str | Path | None, overrides: dict[str, Any]) -> ServeConfig:
    """Reads a TOML deployment config (``[serve]`` and ``[worker]`` tables) and applies CLI overrides
    (keys of either table; ``None`` values are ignored)."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, "rb") as f:
            data = tomllib.load(f)
        unknown = set(data) - {"serve", "worker"}
        if unknown:
            raise ValueError(f"{path}: unknown table(s) {', '.join(sorted(unknown))}")
    serve_keys = {f.name for f in fields(ServeConfig)} - {"worker"}
    worker_keys = {f.name for f in fields(WorkerConfig)} - {"kind", "join", "model", "dtype", "worker_id"}
    serve = dict(data.get("serve", {}))
    worker = dict(data.get("worker", {}))
    for table, allowed, name in ((serve, serve_keys, "serve"), (worker, worker_keys, "worker")):
        bad = set(table) - allowed
        if bad:
            raise ValueError(f"{path}: unknown key(s) in [{name}]: {', '.join(sorted(bad))}")
    given = {k: v for k, v in overrides.items() if v is not None}
    counts = ("prefill", "decode", "colocated")
    if any(k in given for k in counts):  # the command line's deployment replaces the file's
        for k in counts:
            serve.pop(k, None)
    if any(k in serve or k in given for k in counts):
        serve.update({k: serve.get(k, 0) for k in counts})
    for key, value in given.items():
        (serve if key in serve_keys else worker)[key] = value
    cfg = ServeConfig(**serve)
    return replace(cfg, worker=WorkerConfig(kind="colocated", model=cfg.model, dtype=cfg.dtype, **worker))
