"""Paged KV-cache bookkeeping in pure Python: a pool of fixed-size blocks and per-sequence tables.

Blocks are reference counted so that a block can be shared (a cached prefix) and returns to the free
list only when its last holder lets go. Allocation is check-then-commit: ``can_allocate`` has no side
effects and running out of blocks is a normal ``None``, not an exception. No torch here: tensors live
in ``kv_cache.py``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class BlockPool:
    """A free list of block ids ``0 .. num_blocks - 1`` with reference counts."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with one reference each, or ``None`` if the pool cannot supply them."""
        if not self.can_allocate(n):
            return None
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Adds a reference to blocks that are already held."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference from each block; a block with none left returns to the free list."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class BlockTables:
    """Each sequence's block table, grown as its token count grows and freed as a whole."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._tables: dict[Hashable, list[int]] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def __len__(self) -> int:
        return len(self._tables)

    def table(self, seq_id: Hashable) -> list[int]:
        return self._tables[seq_id]

    def extra_blocks(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks the sequence still needs to hold ``num_tokens`` tokens in total."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, blocks_for(num_tokens, self.pool.block_size) - have)

    def can_grow(self, seq_id: Hashable, num_tokens: int) -> bool:
        return self.pool.can_allocate(self.extra_blocks(seq_id, num_tokens))

    def grow(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Makes room for ``num_tokens`` tokens in total; returns the table, or ``None`` (and changes
        nothing) when the pool is short."""
        new = self.pool.allocate(self.extra_blocks(seq_id, num_tokens))
        if new is None:
            return None
        table = self._tables.setdefault(seq_id, [])
        table.extend(new)
        return table

    def detach(self, seq_id: Hashable) -> list[int]:
        """Forgets the sequence's table without freeing its blocks; the caller frees them later."""
        return self._tables.pop(seq_id, [])

    def release(self, seq_id: Hashable) -> int:
        """Frees the sequence's blocks; returns how many it held (0 if it held none)."""
        table = self._tables.pop(seq_id, [])
        self.pool.free(table)
        return len(table)
