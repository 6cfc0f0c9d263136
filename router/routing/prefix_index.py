"""The router's view of its workers' prefix caches: which prefix hashes each worker reported cached
(``Heartbeat.cached``) and not since dropped (``Heartbeat.evicted``).

The view only steers routing and its TTFT prediction: a worker that no longer holds a prefix the
view credits it with just computes it again, so a stale view costs time, never tokens. It holds at
most the worker's block count per worker (the oldest entries go first) and forgets a worker that is
gone or registers again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pdfabric.engine.block_pool import cacheable_blocks, chain_hashes, prefix_salt


class PrefixIndex:
    def __init__(self) -> None:
        self._held: dict[str, OrderedDict[bytes, None]] = {}  # worker -> hashes, oldest first
        self._limit: dict[str, int] = {}

    def update(self, worker_id: str, cached: Sequence[bytes], evicted: Sequence[bytes], limit: int) -> None:
        held = self._held.setdefault(worker_id, OrderedDict())
        self._limit[worker_id] = limit
        for h in evicted:
            held.pop(h, None)
        for h in cached:
            held[h] = None
            held.move_to_end(h)
        while len(held) > limit:
            held.popitem(last=False)

    def drop(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """Removes ``hashes`` from what ``worker_id`` holds (nothing if it holds none)."""
        held = self._held.get(worker_id)
        if held:
            for h in hashes:
                held.pop(h, None)

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)
        self._limit.pop(worker_id, None)

    def cached_blocks(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of a prompt with these prefix hashes the worker holds."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


def prompt_hashes(prompt_ids: Sequence[int], block_size: int, model: str) -> tuple[bytes, ...]:
    """The prefix hashes a worker computes for this prompt's blocks that may come from its cache
    (every full block before the last token)."""
    usable = cacheable_blocks(len(prompt_ids), block_size) * block_size
    return tuple(chain_hashes(prompt_ids[:usable], block_size, prefix_salt(model)))
