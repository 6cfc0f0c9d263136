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
    # Speculation (the core's [worker] speculative settings), modelled since the simulated tokens are
    # not real: each proposed token is kept with probability ``acceptance`` until one is not (0: the
    # worker runs without speculation), and with ``speculative = "draft"`` each of a step's draft steps
    # costs ``draft_ratio`` times a plain decode step of the same batch.
    acceptance: float = 0.0
    draft_ratio: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.kv_bytes_per_s) and self.kv_bytes_per_s > 0):
            raise ValueError(f"{self.core.worker_id}: kv_bytes_per_s must be > 0, got {self.kv_bytes_per_s}")
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"{self.core.worker_id}: acceptance must be in [0, 1], got {self.acceptance}")
        if not (math.isfinite(self.draft_ratio) and self.draft_ratio >= 0):
            raise ValueError(f"{self.core.worker_id}: draft_ratio must be >= 0, got {self.draft_ratio}")

    @property
    def speculates(self) -> bool:
        return self.acceptance > 0 and self.core.config.speculative != "off" and self.kind != "prefill"

    @property
    def worker_id(self) -> str:
        return self.core.worker_id

    @property
    def kind(self) -> str:
        return self.core.kind
