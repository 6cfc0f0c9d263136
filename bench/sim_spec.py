"""What one simulated worker is: its core's identity and limits, its step-time fit and its KV link's
rate (``SimWorker``), shared by the simulation (``bench.simulator``), its workers (``bench.sim_worker``)
and their KV link (``bench.sim_link``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdfabric.control import KINDS
from pdfabric.profile import WorkerProfile
from pdfabric.worker.core import CoreSpec


@dataclass(frozen=True)
class SimWorker:
    """One simulated worker: its identity and limits exactly as the worker core takes them (``core``,
    with ``CoreSpec``'s defaults), its step-time fit, and the KV transfer rate of its link."""

    core: CoreSpec
    profile: WorkerProfile
    kv_bytes_per_s: float = 1e9

    def __post_init__(self) -> None:
        c = self.core
        if c.kind not in KINDS:
            raise ValueError(f"{c.worker_id}: kind must be one of {', '.join(KINDS)}, got {c.kind!r}")
        for name in ("max_running", "max_batch_tokens", "num_blocks", "block_size", "max_model_len"):
            if getattr(c, name) < 1:
                raise ValueError(f"{c.worker_id}: {name} must be at least 1, got {getattr(c, name)}")
        if c.kv_bytes_per_token < 0 or not c.heartbeat_s > 0:
            raise ValueError(f"{c.worker_id}: kv_bytes_per_token must be >= 0 and heartbeat_s > 0")
        if not (math.isfinite(self.kv_bytes_per_s) and self.kv_bytes_per_s > 0):
            raise ValueError(f"{c.worker_id}: kv_bytes_per_s must be > 0, got {self.kv_bytes_per_s}")

    @property
    def worker_id(self) -> str:
        return self.core.worker_id

    @property
    def kind(self) -> str:
        return self.core.kind
