"""Which blocks each in-flight transfer may touch, and saying exactly once when it no longer can; no
torch here.

This is a transfer's record, not the blocks' owner: a decode worker's blocks belong to its core's
``BlockTables``, which reserved them for the request (the ids go to the prefill worker) and registered
them here. The receiver checks every arriving frame against the registered ids and, when a transfer
fails or is aborted, releases them: ``release`` is called to say that no sender can write into them
any more (the worker's core then frees them). On success the receiver hands them over (the running
sequence keeps them; nothing is called). The prefill side uses the same class for the local blocks it
ships from; there transfers only read their blocks, and two may share one (a cached prefix), so it
is not ``exclusive``.
"""

from __future__ import annotations

from collections.abc import Callable

ReleaseFn = Callable[[str, tuple[int, ...]], None]


class BlockReservations:
    """request id -> block ids held for its transfer; ``release`` is called once per failed request."""

    def __init__(self, release: ReleaseFn | None = None, exclusive: bool = True) -> None:
        self._release = release
        self.exclusive = exclusive  # a block is held by one request at most
        self._held: dict[str, tuple[int, ...]] = {}
        self._owner: dict[int, str] = {}  # block -> the (first) request holding it
        self._holders: dict[int, int] = {}  # block -> how many requests hold it

    def reserve(self, request_id: str, blocks: tuple[int, ...]) -> None:
        """Registers ``blocks`` for ``request_id``; ``ValueError`` if the id is already held, or, when
        ``exclusive``, a block is."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"request {request_id!r}: duplicate block ids")
        taken = [b for b in blocks if b in self._owner]
        if taken and self.exclusive:
            raise ValueError(f"blocks {taken[:8]} already held by {self._owner[taken[0]]!r}")
        self._held[request_id] = tuple(blocks)
        for b in blocks:
            self._owner.setdefault(b, request_id)
            self._holders[b] = self._holders.get(b, 0) + 1

    def blocks_of(self, request_id: str) -> tuple[int, ...] | None:
        return self._held.get(request_id)

    def owns(self, request_id: str, blocks: tuple[int, ...] | list[int]) -> bool:
        """True when ``blocks`` are exactly the ones held for ``request_id``, in order."""
        return self._held.get(request_id) == tuple(blocks)

    def _drop(self, request_id: str) -> tuple[int, ...]:
        blocks = self._held.pop(request_id, ())
        for b in blocks:
            self._holders[b] -= 1
            if self._holders[b] == 0:
                del self._holders[b], self._owner[b]
            elif self._owner[b] == request_id:
                self._owner[b] = next(r for r, held in self._held.items() if b in held)
        return blocks

    def release(self, request_id: str) -> tuple[int, ...]:
        """Forgets the request and gives its blocks back through the release callback (once)."""
        blocks = self._drop(request_id)
        if blocks and self._release is not None:
            self._release(request_id, blocks)
        return blocks

    def hand_over(self, request_id: str) -> tuple[int, ...]:
        """Forgets the request without releasing: its blocks now belong to whoever runs it."""
        return self._drop(request_id)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    @property
    def held_blocks(self) -> int:
        return len(self._owner)
