"""Which blocks each in-flight transfer holds, and handing them back exactly once; no torch here.

The decode worker backs this with its block pool: it reserves blocks for a request (the ids go to the
prefill worker), registers them here, and passes ``release`` = "return these ids to the pool". The
receiver checks every arriving frame against the registered ids and, when a transfer fails or is
aborted, releases them. On success the receiver hands them over (the running sequence now owns them,
nothing is freed). The prefill side uses the same class for the local blocks it ships from.
"""

from __future__ import annotations

from collections.abc import Callable

ReleaseFn = Callable[[str, tuple[int, ...]], None]


class BlockReservations:
    """request id -> block ids held for its transfer; ``release`` is called once per failed request."""

    def __init__(self, release: ReleaseFn | None = None) -> None:
        self._release = release
        self._held: dict[str, tuple[int, ...]] = {}
        self._owner: dict[int, str] = {}

    def reserve(self, request_id: str, blocks: tuple[int, ...]) -> None:
        """Registers ``blocks`` for ``request_id``; ``ValueError`` if the id or a block is already held."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"request {request_id!r}: duplicate block ids")
        taken = [b for b in blocks if b in self._owner]
        if taken:
            raise ValueError(f"blocks {taken[:8]} already held by {self._owner[taken[0]]!r}")
        self._held[request_id] = tuple(blocks)
        for b in blocks:
            self._owner[b] = request_id

    def blocks_of(self, request_id: str) -> tuple[int, ...] | None:
        return self._held.get(request_id)

    def owns(self, request_id: str, blocks: tuple[int, ...] | list[int]) -> bool:
        """True when ``blocks`` are exactly the ones held for ``request_id``, in order."""
        return self._held.get(request_id) == tuple(blocks)

    def _drop(self, request_id: str) -> tuple[int, ...]:
        blocks = self._held.pop(request_id, ())
        for b in blocks:
            del self._owner[b]
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
