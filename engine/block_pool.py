"""Paged KV-cache bookkeeping in pure Python: a pool of fixed-size blocks and per-sequence tables.

Blocks are reference counted so that a block can be shared (a cached prefix) and returns to the free
list only when its last holder lets go. Allocation is check-then-commit: ``can_allocate`` has no side
effects and running out of blocks is a normal ``None``, not an exception. No torch here: tensors live
in ``kv_cache.py``.

Prefix cache: a full block whose KV is computed can be recorded (``cache``) under the chained hash of
its tokens (``chain_hashes``: each block's hash covers every token before it, salted by the model).
A cached block whose last holder lets go is not wiped: it waits, least recently used first, until
either a new sequence with the same prefix takes it again (``lookup`` then ``acquire``) or the free
list runs dry and ``allocate`` reuses it for something else. Such blocks count as free.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """How many leading full blocks of a sequence may come from the prefix cache: never the block of
    its last token, which the step that computes it samples the next token from."""
    return (num_tokens - 1) // block_size


def prefix_salt(model: str) -> bytes:
    """What the prefix hashes of a worker serving ``model`` start from (the router's view uses it)."""
    return hashlib.blake2b(model.encode(), digest_size=16).digest()


def chain_hashes(
    tokens: Sequence[int], block_size: int, salt: bytes, prev: Sequence[bytes] = ()
) -> list[bytes]:
    """``prev`` extended by the prefix hash of each full block of ``tokens``, the tokens that follow
    the ``len(prev)`` blocks already hashed. Block i's hash covers every token up to its end and
    ``salt`` (model and version), so equal hashes mean equal KV."""
    out = list(prev)
    last = out[-1] if out else salt
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        last = hashlib.blake2b(last + struct.pack(f"<{block_size}q", *block), digest_size=16).digest()
        out.append(last)
    return out


class BlockPool:
    """A free list of block ids ``0 .. num_blocks - 1`` with reference counts, and the prefix cache
    over them. ``on_evict(blocks, hashes)``: told of cached blocks ``allocate`` is about to reuse, while
    their KV is still there (a host store copies them out, ``prefix_cache.HostTier``)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_evict: Callable[[list[int], list[bytes]], None] | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # cached block -> its prefix hash
        self._block_of: dict[bytes, int] = {}  # prefix hash -> the block holding that KV
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, oldest first
        self._stored: list[bytes] = []  # hashes cached since ``take_events``
        self._evicted: list[bytes] = []  # hashes dropped since ``take_events``
        self.on_evict = on_evict

    @property
    def num_free(self) -> int:
        """Blocks ``allocate`` can hand out: free ones and cached ones nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def num_cached(self) -> int:
        """Blocks recorded in the prefix cache (held or not)."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks with one reference each, or ``None`` if the pool cannot supply them.
        Free blocks go first; then cached blocks nobody holds, least recently used first (their
        cache entries are dropped)."""
        if not self.can_allocate(n):
            return None
        blocks = [self._free.popleft() for _ in range(min(n, len(self._free)))]
        evicted: list[bytes] = []
        while len(blocks) < n:
            b, _ = self._idle.popitem(last=False)
            h = self._hash_of.pop(b)
            del self._block_of[h]
            evicted.append(h)
            blocks.append(b)
        if evicted:
            self._evicted += evicted
            if self.on_evict is not None:
                self.on_evict(blocks[len(blocks) - len(evicted) :], evicted)
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def cache(self, block: int, prefix_hash: bytes) -> None:
        """Records a held block whose KV is complete under its prefix hash (a hash already cached
        elsewhere, or a block already cached, leaves things as they are)."""
        if self._refs[block] <= 0:
            raise ValueError(f"block {block} is free and cannot be cached")
        if prefix_hash not in self._block_of and block not in self._hash_of:
            self._block_of[prefix_hash] = block
            self._hash_of[block] = prefix_hash
            self._stored.append(prefix_hash)

    def cached_blocks(self) -> tuple[list[int], list[bytes]]:
        """Every cached block and its prefix hash (what a host store keeps when the worker stops)."""
        return list(self._hash_of), list(self._hash_of.values())

    def take_events(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """The hashes cached and the hashes dropped since the last call (for the router's view of
        this cache); at most ``num_blocks`` of each, the latest (a view that misses some is stale,
        never wrong about the tokens)."""
        stored, evicted = self._stored[-self.num_blocks :], self._evicted[-self.num_blocks :]
        self._stored, self._evicted = [], []
        return tuple(stored), tuple(evicted)

    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of ``hashes`` (no side effects)."""
        blocks = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def acquire(self, blocks: Iterable[int]) -> None:
        """Takes a reference to cached blocks from ``lookup``, held or not."""
        for b in blocks:
            if b not in self._hash_of:
                raise ValueError(f"block {b} is not cached")
            if self._refs[b] == 0:
                del self._idle[b]
            self._refs[b] += 1

    def share(self, blocks: Iterable[int]) -> None:
        """Adds a reference to blocks that are already held."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference from each block; a block with none left returns to the free list, or,
        if cached, waits for reuse as the most recently used."""
        for b in blocks:
            if self._refs[b] <= 0:
                raise ValueError(f"block {b} freed more often than allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._idle[b] = None
                else:
                    self._free.append(b)

    def ref_count(self, block: int) -> int:
        return self._refs[block]


class BlockTables:
    """Each sequence's block table, grown as its token count grows and freed as a whole: the one owner
    of a worker's blocks. A table may be *held* after its sequence ended (``hold``): its blocks stay
    out of the pool, and out of every sequence's reach, until ``free_held`` (a decode worker holds
    the blocks of a transfer it gave up on until no sender can still write into them)."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._tables: dict[Hashable, list[int]] = {}
        self._held: dict[Hashable, list[int]] = {}

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

    def shrink(self, seq_id: Hashable, num_tokens: int) -> int:
        """Frees the blocks of the sequence's table past those ``num_tokens`` tokens need (room grown
        for proposed tokens that were not kept); returns how many."""
        table = self._tables.get(seq_id)
        keep = blocks_for(num_tokens, self.pool.block_size)
        if table is None or len(table) <= keep:
            return 0
        extra = table[keep:]
        del table[keep:]
        self.pool.free(extra)
        return len(extra)

    def attach(self, seq_id: Hashable, blocks: list[int]) -> None:
        """Starts a sequence's table with blocks it already holds a reference to (a cached prefix)."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has a table")
        self._tables[seq_id] = list(blocks)

    def extend(self, seq_id: Hashable, blocks: list[int]) -> None:
        """Continues a sequence's table with blocks it already holds a reference to (the cached
        blocks of the prefix that follows its table's)."""
        self._tables[seq_id].extend(blocks)

    def hold(self, seq_id: Hashable) -> None:
        """Takes the sequence's table away from it without freeing its blocks (``free_held`` does)."""
        table = self._tables.pop(seq_id, None)
        if table is not None:
            self._held.setdefault(seq_id, []).extend(table)

    def free_held(self, seq_id: Hashable) -> int:
        """Frees a held table's blocks; returns how many (0 if none was held for ``seq_id``)."""
        table = self._held.pop(seq_id, [])
        self.pool.free(table)
        return len(table)

    @property
    def held(self) -> int:
        """Tables held (``hold``) and not yet freed."""
        return len(self._held)

    def release(self, seq_id: Hashable) -> int:
        """Frees the sequence's blocks; returns how many it held (0 if it held none)."""
        table = self._tables.pop(seq_id, [])
        self.pool.free(table)
        return len(table)
