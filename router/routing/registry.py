"""The router's view of its workers: registrations, latest load and liveness (which requests each
holds is ``holders.Holders``'s)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdfabric.control import COLOCATED, DECODE, PREFILL, Heartbeat, Register
from pdfabric.router.routing.prefix_index import PrefixIndex


@dataclass
class WorkerInfo:
    reg: Register
    last_seen: float
    load: Heartbeat | None = None
    drain_sent: bool = False  # the router told it to drain (its heartbeats may not say so yet)
    out_of_blocks: bool = False  # it refused a reservation for want of blocks since its last heartbeat

    @property
    def worker_id(self) -> str:
        return self.reg.worker_id

    @property
    def draining(self) -> bool:
        """It takes no new requests: it drains (told by the router, or on SIGTERM)."""
        return self.drain_sent or (self.load is not None and self.load.draining)

    @property
    def free_blocks(self) -> int:
        return self.load.free_blocks if self.load is not None else self.reg.num_blocks


class Registry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerInfo] = {}
        self.prefixes = PrefixIndex()  # which prefixes each worker reported in its cache
        # which prefixes each host KV store holds (by ``store_key``): what its workers' pools evicted,
        # which went to the store, and what they saved through (``Heartbeat.stored``), less what
        # they or another model's workers deleted from it (``Heartbeat.store_dropped``,
        # ``store_dropped_others``); kept while workers come and go, since the store outlives them
        self.stores = PrefixIndex()

    def register(self, reg: Register) -> WorkerInfo:
        info = WorkerInfo(reg, time.monotonic())
        self.workers[reg.worker_id] = info
        self.prefixes.forget(reg.worker_id)  # a new process: its cache starts empty
        return info

    def heartbeat(self, hb: Heartbeat) -> bool:
        info = self.workers.get(hb.worker_id)
        if info is None:
            return False
        info.load = hb
        info.out_of_blocks = False  # the report was sent after the refusal: it says how full it is
        info.last_seen = time.monotonic()
        self.prefixes.update(hb.worker_id, hb.cached, hb.evicted, info.reg.num_blocks)
        if info.reg.kv_store and (hb.evicted or hb.stored):  # a worker with a store saves what its pool
            # evicts, and with write-through what it reuses
            self.stores.update(store_key(info.reg), hb.evicted + hb.stored, (), info.reg.kv_store_blocks)
        if info.reg.kv_store and hb.store_dropped:
            self.stores.update(store_key(info.reg), (), hb.store_dropped, info.reg.kv_store_blocks)
        for owner, dropped in hb.store_dropped_others.items():  # other models' blocks, same host
            self.stores.drop(store_key(info.reg, owner), dropped)
        return True

    def remove(self, worker_id: str) -> WorkerInfo | None:
        self.prefixes.forget(worker_id)
        return self.workers.pop(worker_id, None)

    def expired(self, timeout_s: float) -> list[str]:
        limit = time.monotonic() - timeout_s
        return [w for w, info in self.workers.items() if info.last_seen < limit]

    def of_kind(self, kind: str) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.reg.kind == kind]

    def count(self, kind: str) -> int:
        return sum(1 for w in self.workers.values() if w.reg.kind == kind)

    def serving(self, served: str) -> list[WorkerInfo]:
        """The workers of one model version (``Register.served``)."""
        return [w for w in self.workers.values() if w.reg.served == served]

    def max_model_len(self, served: str = "") -> int:
        """The longest sequence every serving path of the version can hold (0 with no workers)."""
        lens = [w.reg.max_model_len for w in self.serving(served)]
        return min(lens) if lens else 0


@dataclass(frozen=True)
class Route:
    """Where a request runs: one colocated worker, or a (decode, prefill) pair."""

    colocated: WorkerInfo | None = None
    decode: WorkerInfo | None = None
    prefill: WorkerInfo | None = None


def has_route(registry: Registry, served: str | None = None) -> bool:
    """Whether any route exists at all for the model version ``served`` (None: for any): a colocated
    worker, or a prefill and a decode worker."""
    workers = registry.workers.values() if served is None else registry.serving(served)
    kinds = {w.reg.kind for w in workers}
    return COLOCATED in kinds or (PREFILL in kinds and DECODE in kinds)


def store_key(reg: Register, ident: str = "") -> str:
    """The host KV store a worker shares: its host and the store's id (its directories and salt);
    with ``ident``, that of another store on the worker's host."""
    return f"{reg.host}/{ident or reg.kv_store}"
