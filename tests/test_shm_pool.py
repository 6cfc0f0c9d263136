"""A shared KV pool has its pages allocated at creation, before the first transfer writes into it."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from pdfabric.kvtransfer.shm_pool import SharedKVPool, populate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page faults counted on Linux")

SHAPE = (4, 256, 16, 8, 64)  # layers, blocks, block_size, kv_heads, head_dim: 4 MiB per layer in bf16


def _faults_while(fn) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _write_all(caches: list[torch.Tensor]) -> None:
    for c in caches:
        c.fill_(1)


@pytest.mark.parametrize("anonymous", [True, False])
def test_created_pool_takes_no_faults_on_first_write(anonymous: bool) -> None:
    pool = SharedKVPool.create(*SHAPE, torch.bfloat16, anonymous=anonymous)
    try:
        pages = sum(c.numel() * c.element_size() for c in pool.caches) // 4096
        assert _faults_while(lambda: _write_all(pool.caches)) < pages // 20
        assert all(int(c.count_nonzero()) == c.numel() for c in pool.caches)
    finally:
        pool.close()


def test_populate_falls_back_to_writing_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the OS has no populate call the pool is zeroed, which allocates its pages just the same."""
    from pdfabric.kvtransfer import shm_pool

    monkeypatch.setattr(shm_pool, "_madvise_populate", lambda t: False)
    pool = SharedKVPool.create(*SHAPE, torch.bfloat16, anonymous=True)
    try:
        pages = sum(c.numel() * c.element_size() for c in pool.caches) // 4096
        assert _faults_while(lambda: _write_all(pool.caches)) < pages // 20
        t = torch.ones(8)
        populate([t])
        assert not bool(t.any())
    finally:
        pool.close()
