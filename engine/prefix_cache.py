"""The scheduler's side of prefix caching: a prompt starts from the cached blocks of its longest cached
prefix, and a sequence's blocks go into the cache as they fill. No torch here.

The block pool keeps the cache itself (``block_pool.py``: full blocks by their chained prompt hash,
salted by the model, reference-counted, evicted least recently used); ``PrefixCache`` decides what a
sequence looks up and records, and counts the prompt tokens queried and found.
"""

from __future__ import annotations

from pdfabric.engine.block_pool import BlockTables, cacheable_blocks, chain_hashes
from pdfabric.engine.sequence import Sequence


class PrefixCache:
    """Prefix caching for one scheduler's sequences; ``salt`` None: off (nothing is looked up or kept)."""

    def __init__(self, tables: BlockTables, salt: bytes | None) -> None:
        self.tables = tables
        self.salt = salt
        self.prompt_tokens = 0  # prompt tokens scheduled for the first time (prefix cache queries)
        self.hit_tokens = 0  # of those, found in the cache

    def attach(self, seq: Sequence) -> None:
        """A waiting sequence without blocks starts from the cached blocks of its longest cached
        prefix; never its last token, which the step that computes it samples from."""
        if seq.prefix_hit is None:
            self.prompt_tokens += len(seq.prompt_ids)
        if self.salt is None or seq.params.prompt_logprobs:  # scored prompts run whole
            seq.prefix_hit = 0
            return
        pool = self.tables.pool
        blocks = pool.lookup(self.hashes(seq, cacheable_blocks(seq.num_tokens, pool.block_size)))
        if seq.prefix_hit is None:
            seq.prefix_hit = min(len(blocks) * pool.block_size, len(seq.prompt_ids))
            self.hit_tokens += seq.prefix_hit
        if blocks:
            pool.acquire(blocks)
            self.tables.attach(seq.request_id, blocks)
        seq.num_cached, seq.recorded = len(blocks) * pool.block_size, len(blocks)

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
