"""The scheduler's side of prefix caching: a prompt starts from the cached blocks of its longest cached
prefix, and a sequence's blocks go into the cache as they fill. No torch here.

The block pool keeps the cache itself (``block_pool.py``: full blocks by their chained prompt hash,
salted by the model, reference-counted, evicted least recently used); ``PrefixCache`` decides what a
sequence looks up and records, and counts the prompt tokens queried and found.

Beyond the pool a ``HostTier`` (the host's KV store, ``kvtransfer/host_store.py``) may hold more: the
pool's evicted blocks go to it (``BlockPool.on_evict``), and a prompt whose cached prefix ends in the
pool continues in the tier, read into fresh blocks before the step that needs them (the tier starts
reading them when the prompt is queued: ``read_ahead``). A decode worker's reservation, which is
answered at once, only finds and reserves the tier's blocks (``attach(..., defer=True)``): the tier
reads them while the prompt's KV comes from the prefill worker, and ``load_deferred`` copies them in
when it has arrived.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from pdfabric.engine.block_pool import BlockTables, cacheable_blocks, chain_hashes
from pdfabric.engine.sequence import Sequence


class HostTier(Protocol):
    """KV blocks kept beyond a worker's pool, by the pool's prefix hashes."""

    ident: str  # the same for every worker that shares it (the router's view keys on it)
    capacity_blocks: int  # blocks it holds at most

    def save(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Takes a copy of the blocks' KV now (they are about to be reused) and keeps it under
        ``hashes``, without making the caller wait for the keeping."""
        ...

    def find(self, hashes: Seq[bytes]) -> int:
        """How many leading ``hashes`` it holds."""
        ...

    def reused(self, blocks: list[int], hashes: list[bytes]) -> None:
        """The pool's ``blocks`` (of ``hashes``) serve a prompt again: a tier that keeps hot prefixes
        at once (write-through) saves those it does not hold, as ``save`` does."""
        ...

    def load(self, hashes: Seq[bytes], blocks: list[int]) -> int:
        """Reads the KV of ``hashes`` into ``blocks``; how many leading ones it read and checked (the
        rest are not to be used)."""
        ...

    def read_ahead(self, hashes: Seq[bytes]) -> None:
        """Starts reading the leading ``hashes`` it holds in the background, for a ``load`` to come
        (without making the caller wait)."""
        ...

    def take_stored(self) -> tuple[bytes, ...]:
        """The hashes ``reused`` saved since the last call (``Heartbeat.stored``)."""
        ...

    def take_dropped(self) -> tuple[bytes, ...]:
        """The hashes of blocks it no longer holds since the last call, as far as it knows
        (``Heartbeat.store_dropped``)."""
        ...

    def counters(self) -> dict[str, float]:
        """What it did since it started, by name (``Heartbeat.kv_store``)."""
        ...


class PrefixCache:
    """Prefix caching for one scheduler's sequences; ``salt`` None: off (nothing is looked up or kept)."""

    def __init__(self, tables: BlockTables, salt: bytes | None, tier: HostTier | None = None) -> None:
        self.tables = tables
        self.salt = salt
        self.tier = tier
        self.prompt_tokens = 0  # prompt tokens scheduled for the first time (prefix cache queries)
        self.hit_tokens = 0  # of those, found in the cache (the pool or the tier)
        self.tier_hit_tokens = 0  # of those, read from the tier
        self._deferred: dict[str, tuple[list[bytes], list[int]]] = {}  # request -> tier hashes, blocks

    def attach(self, seq: Sequence, defer: bool = False) -> None:
        """A waiting sequence without blocks starts from the cached blocks of its longest cached
        prefix; never its last token, which the step that computes it samples from. With ``defer``
        the tier's part gets fresh blocks but is not read yet: ``load_deferred`` reads it."""
        if seq.prefix_hit is None:
            self.prompt_tokens += len(seq.prompt_ids)
        seq.from_cache = 0
        if self.salt is None or seq.runs_whole:  # scored prompts and pooled ones run whole
            seq.prefix_hit = 0
            return
        seq.num_cached = seq.recorded = 0
        self._continue(seq, defer)
        if seq.prefix_hit is None:
            seq.prefix_hit = 0

    def extend(self, seq: Sequence) -> None:
        """A waiting sequence without blocks: ``attach``. One computed to the end of its table's last
        block continues from the cache where it can: the pool's blocks of the prefix that follows
        (another prompt computed them meanwhile), then the tier's (``attach`` takes at most the blocks
        the pool has free then, so a long prompt's hit may have been cut short)."""
        if seq.request_id not in self.tables:
            self.attach(seq)
            return
        if self.salt is None or seq.runs_whole or seq.request_id in self._deferred:
            return
        have = len(self.tables.table(seq.request_id))
        if seq.num_cached == have * self.tables.pool.block_size and seq.recorded == have:
            self._continue(seq, defer=False)

    def _continue(self, seq: Sequence, defer: bool) -> None:
        """Takes the cached blocks of the prefix past the sequence's ``num_cached`` tokens (a whole
        number of blocks, all of them cached) into its table and counts them."""
        pool = self.tables.pool
        have = seq.num_cached // pool.block_size
        hashes = self.hashes(seq, cacheable_blocks(seq.num_tokens, pool.block_size))[have:]
        blocks = pool.lookup(hashes)
        pool.acquire(blocks)
        if self.tier is not None and blocks:
            self.tier.reused(blocks, hashes[: len(blocks)])
        loaded: list[int] = []
        if self.tier is not None and len(blocks) < len(hashes):
            rest = hashes[len(blocks) :]
            loaded = self._claim(seq.request_id, rest) if defer else self._load(rest)
        if not blocks and not loaded:
            return
        if have:
            self.tables.extend(seq.request_id, blocks + loaded)
        else:
            self.tables.attach(seq.request_id, blocks + loaded)
        seq.num_cached += (len(blocks) + len(loaded)) * pool.block_size
        # blocks claimed for a deferred load enter the pool's cache once read (``load_deferred``)
        seq.recorded += len(blocks) if seq.request_id in self._deferred else len(blocks) + len(loaded)
        seq.from_cache += (len(blocks) + len(loaded)) * pool.block_size
        if seq.output_ids and seq.prefix_hit is not None:
            return  # computed again after a preemption: its prompt was counted the first time
        hit = min(seq.from_cache, len(seq.prompt_ids))
        gain = max(0, hit - (seq.prefix_hit or 0))  # a prompt that restarts counts its best attempt
        seq.prefix_hit = (seq.prefix_hit or 0) + gain
        self.hit_tokens += gain
        self.tier_hit_tokens += min(len(loaded) * pool.block_size, gain)

    def load_deferred(self, seq: Sequence) -> bool:
        """Reads the tier's blocks that ``attach(seq, defer=True)`` claimed (read ahead meanwhile, so
        mostly a copy); False if a block was missing or failed its check: then the blocks from there
        on hold no KV, the counts say so, and the caller computes the prompt again."""
        claimed = self._deferred.pop(seq.request_id, None)
        if claimed is None:
            return True
        hashes, blocks = claimed
        good = self._read(hashes, blocks)  # those read are cached: a recompute finds them
        seq.recorded += good
        if good == len(blocks):
            return True
        lost = min((len(blocks) - good) * self.tables.pool.block_size, seq.prefix_hit or 0)
        self.hit_tokens -= lost
        self.tier_hit_tokens -= lost
        seq.prefix_hit = (seq.prefix_hit or 0) - lost
        return False

    def forget(self, request_id: str) -> None:
        """A sequence that ended: a deferred load it had is not to be done (its blocks go with it)."""
        self._deferred.pop(request_id, None)

    def _claim(self, request_id: str, hashes: list[bytes]) -> list[int]:
        """``_fresh``'s blocks, to be read by ``load_deferred``; the tier starts reading them now."""
        blocks = self._fresh(hashes)
        if blocks:
            assert self.tier is not None
            self.tier.read_ahead(hashes[: len(blocks)])
            self._deferred[request_id] = (hashes[: len(blocks)], blocks)
        return blocks

    def read_ahead(self, seq: Sequence) -> None:
        """A sequence just queued: asks the tier to start reading the blocks of its prompt that follow
        what the pool holds, so that the step running meanwhile overlaps the reads and ``attach``
        finds them read."""
        if self.tier is None or self.salt is None or seq.runs_whole or seq.prefix_hit is not None:
            return
        pool = self.tables.pool
        hashes = self.hashes(seq, cacheable_blocks(seq.num_tokens, pool.block_size))
        held = len(pool.lookup(hashes))
        if held < len(hashes):
            self.tier.read_ahead(hashes[held:])

    def _load(self, hashes: list[bytes]) -> list[int]:
        """``_fresh``'s blocks read: those read and checked, cached in the pool (a prompt that cannot
        run yet and gives them back leaves them cached)."""
        blocks = self._fresh(hashes)
        if not blocks:
            return []
        pool = self.tables.pool
        good = self._read(hashes[: len(blocks)], blocks)
        pool.free(blocks[good:])
        return blocks[:good]

    def _fresh(self, hashes: list[bytes]) -> list[int]:
        """Fresh blocks for the leading ``hashes`` the tier holds, as many as the pool can supply."""
        assert self.tier is not None
        pool = self.tables.pool
        n = min(self.tier.find(hashes[: pool.num_free]), pool.num_free)
        blocks = pool.allocate(n) if n else []
        assert blocks is not None
        return blocks

    def _read(self, hashes: list[bytes], blocks: list[int]) -> int:
        """Reads the tier's ``hashes`` into ``blocks`` and caches in the pool the leading ones read
        and checked; how many those are."""
        assert self.tier is not None
        good = self.tier.load(hashes, blocks)
        for b, h in zip(blocks[:good], hashes, strict=False):
            self.tables.pool.cache(b, h)
        return good

    def hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """The prefix hashes of the sequence's first ``n`` full blocks."""
        have, bs = len(seq.block_hashes), self.tables.pool.block_size
        if n > have:
            assert self.salt is not None
            more = seq.token_slice(have * bs, n * bs)
            seq.block_hashes = chain_hashes(more, bs, self.salt, seq.block_hashes)
        return seq.block_hashes[:n]

    def record(self, seq: Sequence) -> None:
        """Puts the sequence's newly completed blocks into the cache."""
        bs = self.tables.pool.block_size
        full = seq.num_cached // bs
        if self.salt is None or full <= seq.recorded:
            return
        table, hashes = self.tables.table(seq.request_id), self.hashes(seq, full)
        for i in range(seq.recorded, full):
            self.tables.pool.cache(table[i], hashes[i])
        seq.recorded = full
