"""The router's view of its workers: registrations, latest load, liveness, and the requests each holds."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdfabric.control import COLOCATED, DECODE, PREFILL, Heartbeat, Register


@dataclass
class WorkerInfo:
    reg: Register
    last_seen: float
    load: Heartbeat | None = None
    requests: set[str] = field(default_factory=set)

    @property
    def worker_id(self) -> str:
        return self.reg.worker_id

    @property
    def score(self) -> float:
        """Lower is less loaded: sequences held plus queued prompt work (in units of 1k tokens)."""
        if self.load is None:
            return float(len(self.requests))
        return max(len(self.requests), self.load.running + self.load.waiting) + self.load.queued_tokens / 1000

    @property
    def free_blocks(self) -> int:
        return self.load.free_blocks if self.load is not None else self.reg.num_blocks


class Registry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}

    def register(self, reg: Register) -> WorkerInfo:
        info = WorkerInfo(reg, time.monotonic())
        self.workers[reg.worker_id] = info
        return info

    def heartbeat(self, hb: Heartbeat) -> bool:
        info = self.workers.get(hb.worker_id)
        if info is None:
            return False
        info.load = hb
        info.last_seen = time.monotonic()
        return True

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self.workers.pop(worker_id, None)

    def expired(self, timeout_s: float) -> list[str]:
        limit = time.monotonic() - timeout_s
        return [w for w, info in self.workers.items() if info.last_seen < limit]

    def of_kind(self, kind: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.reg.kind == kind]

    def count(self, kind: str) -> int:
        return sum(1 for w in self.workers.values() if w.reg.kind == kind)

    @property
    def max_model_len(self) -> int:
        """The longest sequence every serving path can hold (0 with no workers)."""
        lens = [w.reg.max_model_len for w in self.workers.values()]
        return min(lens) if lens else 0


@dataclass(frozen=True)
class Route:
    """Where a request runs: one colocated worker, or a (decode, prefill) pair."""

    colocated: WorkerInfo | None = None
    decode: WorkerInfo | None = None
    prefill: WorkerInfo | None = None


def routes(registry: Registry, prompt_len: int) -> list[Route]:
    """The candidate routes for a request, best first: the one place that picks workers.

    Least-loaded first; a decode worker must have free blocks for the prompt. Colocated workers and
    (decode, prefill) pairs compete on the same load score.
    """
    scored: list[tuple[float, int, Route]] = []
    for w in registry.of_kind(COLOCATED):
        scored.append((w.score, len(scored), Route(colocated=w)))
    prefills = sorted(registry.of_kind(PREFILL), key=lambda w: w.score)
    if prefills:
        for d in registry.of_kind(DECODE):
            if d.free_blocks * d.reg.block_size >= prompt_len:
                scored.append((d.score, len(scored), Route(decode=d, prefill=prefills[0])))
    scored.sort(key=lambda t: (t[0], t[1]))
    return [r for _, _, r in scored]
