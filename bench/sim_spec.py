"""What one simulated worker is: its core's identity and limits, its step-time fit and its KV link's
rate (``SimWorker``), shared by the simulation (``bench.simulator``), its workers (``bench.sim_worker``)
and their KV link (``bench.sim_link``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdfabric.profile import WorkerProfile
from pdfabric.worker.spec import CoreSpec


@dataclass(frozen=True)
class SimWorker:
    """One simulated worker: its identity and limits exactly as the worker core takes them (``core``,
    checked by ``CoreSpec`` and its ``WorkerConfig``), its step-time fit, and the KV transfer rate of
    its link."""

    core: CoreSpec
    profile: WorkerProfile
    kv_bytes_per_s: float = 1e9

    def __post_init__(self) -> None:
        if not (math.isfinite(self.kv_bytes_per_s) and self.kv_bytes_per_s > 0):
            raise ValueError(f"{self.core.worker_id}: kv_bytes_per_s must be > 0, got {self.kv_bytes_per_s}")

    @property
    def worker_id(self) -> str:
        return self.core.worker_id

    @property
    def kind(self) -> str:
        return self.core.kind
