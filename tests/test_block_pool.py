from __future__ import annotations

import random

import pytest

from pdfabric.engine.block_pool import BlockPool, BlockTables, blocks_for


def test_allocate_and_free_round_trip() -> None:
    pool = BlockPool(8, 16)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert a is not None and b is not None
    assert sorted(a + b) == list(range(8))
    assert pool.num_free == 0
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 8


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    pool = BlockPool(4, 16)
    assert pool.allocate(3) is not None
    assert not pool.can_allocate(2)
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    assert pool.can_allocate(1) and pool.num_free == 1  # can_allocate has no side effects


def test_refcounts_keep_shared_blocks() -> None:
    pool = BlockPool(4, 16)
    blocks = pool.allocate(2)
    assert blocks is not None
    pool.share(blocks)
    pool.free(blocks)
    assert pool.num_free == 2 and all(pool.ref_count(b) == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free == 4


def test_misuse_is_an_error() -> None:
    pool = BlockPool(2, 16)
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([0])
    with pytest.raises(ValueError, match="is free"):
        pool.share([1])
    with pytest.raises(ValueError):
        BlockPool(0, 16)


def test_tables_grow_by_block_and_release() -> None:
    tables = BlockTables(BlockPool(10, 4))
    assert blocks_for(9, 4) == 3
    assert tables.grow("s", 5) is not None and len(tables.table("s")) == 2
    assert tables.grow("s", 8) is not None and len(tables.table("s")) == 2  # still fits
    assert tables.grow("s", 9) is not None and len(tables.table("s")) == 3
    assert tables.extra_blocks("s", 41) == 8 and not tables.can_grow("s", 41)
    assert tables.grow("s", 41) is None and len(tables.table("s")) == 3  # unchanged when short
    assert tables.release("s") == 3 and tables.pool.num_free == 10
    assert tables.release("s") == 0


def test_random_workload_never_leaks() -> None:
    rng = random.Random(7)
    tables = BlockTables(BlockPool(64, 8))
    lengths: dict[int, int] = {}
    for step in range(2000):
        if lengths and rng.random() < 0.3:
            seq = rng.choice(list(lengths))
            tables.release(seq)
            del lengths[seq]
        else:
            seq = rng.randrange(20)
            want = lengths.get(seq, 0) + rng.randint(1, 30)
            if tables.grow(seq, want) is not None:
                lengths[seq] = want
        held = sum(len(tables.table(s)) for s in lengths)
        assert held + tables.pool.num_free == 64, f"leak at step {step}"
    for seq in list(lengths):
        tables.release(seq)
    assert tables.pool.num_free == 64
