"""Who holds each request in the router: the one record of which workers a request was sent to, and
the one place that lets go of them.

A request's life here (no sockets, no clock, no torch; ``core.RouterCore`` owns it and acts on
what it returns):
1. ``routed`` counts it as *pending* load on its route's workers: routed, but not yet in their
   heartbeats (``pending`` is what the routing adds to their last reported load). ``sent`` numbers
   each work message (``Generate``, ``Reserve``, ``Prefill``) sent to a worker; a heartbeat that says
   how many of them the worker had taken in (``heartbeat``) spends the pending load of those, and
   only those: a report written before the work arrived leaves it pending. ``routed`` again moves it
   to another route, ``unrouted`` drops it when no route took it.
2. ``reserving`` records a decode worker asked to reserve KV blocks for it, with what waits for the
   reply; ``replied`` hands that back once (``awaiting`` peeks at it). A worker asked to reserve
   holds the request: its blocks may already be taken when the request ends before the reply.
3. ``hold`` records a worker that got the request's work (``Generate``, ``Prefill``, a granted
   reservation); ``done`` lets go of one that finished with it (its last delta, its KV handed off).
4. ``end`` forgets the request everywhere and returns the workers still holding it, which must get
   an ``Abort`` so that their blocks come back; ``worker_gone`` forgets a worker everywhere and
   returns the requests it held (they end with an error) and those whose reservation reply from it
   will never come (they try their next route).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

W = TypeVar("W")  # what waits for a reservation's reply (its deadline in the router's core)


@dataclass
class _Held(Generic[W]):
    """One request: the workers holding it and the reservation replies awaited from some of them."""

    workers: set[str] = field(default_factory=set)
    awaiting: dict[str, W] = field(default_factory=dict)


class Holders(Generic[W]):
    """Requests -> the workers holding them, workers -> the requests they hold, and the pending load
    (prompt tokens) sent to each worker since its last heartbeat."""

    def __init__(self) -> None:
        self._requests: dict[str, _Held[W]] = {}
        self._by_worker: dict[str, set[str]] = {}
        self._pending: dict[str, dict[str, int]] = {}  # worker id -> {request id: prompt tokens}
        self._sent: dict[str, int] = {}  # worker id -> work messages sent to it since it registered
        self._seq: dict[str, dict[str, int]] = {}  # worker id -> {request id: its message's number}
        self._seen: dict[str, int] = {}  # worker id -> work messages its last heartbeat counted

    # --- pending load ---------------------------------------------------------------------------

    def routed(self, request_id: str, prompt_len: int, workers: Iterable[str]) -> None:
        """Counts the request as pending on ``workers`` (and nowhere else), unless a heartbeat from one
        of them already counts it."""
        self.unrouted(request_id)
        for worker_id in workers:
            seq = self._seq.get(worker_id, {}).get(request_id)
            if seq is None or seq > self._seen.get(worker_id, 0):
                self._pending.setdefault(worker_id, {})[request_id] = prompt_len

    def unrouted(self, request_id: str) -> None:
        for pending in self._pending.values():
            pending.pop(request_id, None)

    def sent(self, request_id: str, worker_id: str) -> None:
        """A work message for the request went to the worker: the next that it numbers."""
        self._sent[worker_id] = seq = self._sent.get(worker_id, 0) + 1
        self._seq.setdefault(worker_id, {})[request_id] = seq

    def pending(self, worker_id: str) -> Iterable[int]:
        """Prompt lengths routed to the worker that its last heartbeat did not count yet."""
        return self._pending.get(worker_id, {}).values()

    def heartbeat(self, worker_id: str, received: int) -> None:
        """The worker's report counts the first ``received`` work messages sent to it."""
        self._seen[worker_id] = received
        seqs, pending = self._seq.get(worker_id, {}), self._pending.get(worker_id, {})
        for request_id in [r for r in pending if seqs.get(r, received + 1) <= received]:
            del pending[request_id]

    # --- holding --------------------------------------------------------------------------------

    def reserving(self, request_id: str, worker_id: str, waiter: W) -> None:
        """``worker_id`` was asked to reserve blocks for the request; ``waiter`` waits for its reply."""
        self.hold(request_id, worker_id)
        self._requests[request_id].awaiting[worker_id] = waiter

    def replied(self, request_id: str, worker_id: str) -> W | None:
        """What waited for ``worker_id``'s reservation reply (once), or None if nothing still does."""
        held = self._requests.get(request_id)
        return held.awaiting.pop(worker_id, None) if held is not None else None

    def awaiting(self, request_id: str, worker_id: str) -> W | None:
        """What waits for ``worker_id``'s reservation reply, or None if nothing does (left in place)."""
        held = self._requests.get(request_id)
        return held.awaiting.get(worker_id) if held is not None else None

    def hold(self, request_id: str, worker_id: str) -> None:
        self._requests.setdefault(request_id, _Held()).workers.add(worker_id)
        self._by_worker.setdefault(worker_id, set()).add(request_id)

    def done(self, request_id: str, worker_id: str) -> bool:
        """``worker_id`` no longer holds the request; whether it did."""
        held = self._requests.get(request_id)
        if held is None or worker_id not in held.workers:
            return False
        held.workers.discard(worker_id)
        held.awaiting.pop(worker_id, None)
        self._by_worker[worker_id].discard(request_id)
        return True

    def end(self, request_id: str) -> tuple[str, ...]:
        """Forgets the request; the workers that still held it (sorted), each owed an ``Abort``."""
        self.unrouted(request_id)
        for seqs in self._seq.values():
            seqs.pop(request_id, None)
        held = self._requests.pop(request_id, None)
        if held is None:
            return ()
        for worker_id in held.workers:
            self._by_worker[worker_id].discard(request_id)
        return tuple(sorted(held.workers))

    def worker_gone(self, worker_id: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Forgets the worker: the requests it held (sorted; they fail with it) and those awaiting a
        reservation reply it will never send (sorted; they try their next route instead)."""
        for table in (self._pending, self._sent, self._seq, self._seen):
            table.pop(worker_id, None)  # a process registering again under this id numbers from 1
        failed, waiting = [], []
        for rid in sorted(self._by_worker.pop(worker_id, ())):
            held = self._requests[rid]
            held.workers.discard(worker_id)
            if held.awaiting.pop(worker_id, None) is not None:
                waiting.append(rid)
            else:
                failed.append(rid)
        return tuple(failed), tuple(waiting)

    # --- views ----------------------------------------------------------------------------------

    def holders(self, request_id: str) -> frozenset[str]:
        held = self._requests.get(request_id)
        return frozenset(held.workers) if held is not None else frozenset()

    def count(self, worker_id: str) -> int:
        """Requests the worker holds."""
        return len(self._by_worker.get(worker_id, ()))

    def on(self, worker_id: str) -> set[str]:
        """Requests the worker holds or that are pending on it."""
        return self._by_worker.get(worker_id, set()) | self._pending.get(worker_id, {}).keys()

    def __len__(self) -> int:
        """Requests held since their first ``hold`` and not yet ended."""
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests
