"""Helpers for the KV-transfer tests: a fake block pool, random caches, and a loop that polls both sides."""

from __future__ import annotations

import hashlib
import time

import torch

from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.reservations import BlockReservations
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.state import TransferResult


class FakePool:
    """A free list with the one property the tests check: every block comes back exactly once."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = set(range(total))

    def allocate(self, n: int, scattered: bool = False) -> tuple[int, ...]:
        ids = sorted(self.free)
        picked = ids[::2][:n] if scattered and len(ids[::2]) >= n else ids[:n]
        assert len(picked) == n, "fake pool exhausted"
        self.free -= set(picked)
        return tuple(picked)

    def take(self, blocks: tuple[int, ...]) -> tuple[int, ...]:
        """Allocates exactly ``blocks`` (the test chose them)."""
        assert set(blocks) <= self.free, "fake pool: block already taken"
        self.free -= set(blocks)
        return blocks

    def release(self, request_id: str, blocks: tuple[int, ...]) -> None:
        assert not (set(blocks) & self.free), f"{request_id}: block freed twice"
        self.free |= set(blocks)

    def reservations(self) -> BlockReservations:
        return BlockReservations(self.release)

    @property
    def all_free(self) -> bool:
        return len(self.free) == self.total


def make_caches(
    layers: int,
    blocks: int,
    dtype: torch.dtype,
    seed: int | None = 0,
    block_size: int = 4,
    heads: int = 2,
    dim: int = 8,
) -> list[torch.Tensor]:
    """Random caches (``seed``) or zeros (``seed=None``), ``[2, blocks, block_size, heads, dim]`` each."""
    shape = (2, blocks, block_size, heads, dim)
    if seed is None:
        return [torch.zeros(shape, dtype=dtype) for _ in range(layers)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(dtype) for _ in range(layers)]


def digest(caches: list[torch.Tensor], blocks: tuple[int, ...]) -> str:
    """sha256 of ``cache[:, blocks]`` over all layers, as raw bytes (bit-identity check)."""
    h = hashlib.sha256()
    ids = torch.tensor(blocks, dtype=torch.int64)
    for cache in caches:
        h.update(cache.index_select(1, ids).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def pump(
    sender: KVSender | None,
    receiver: KVReceiver | None,
    want: int,
    timeout_s: float = 10.0,
    want_got: int | None = None,
) -> tuple[list[TransferResult], list[TransferResult]]:
    """Polls both sides until ``want`` results came back on each side present (``want_got`` on the
    receiver when given: 0 polls it only to answer the sender), or ``timeout_s``."""
    want_got = want if want_got is None else want_got
    sent: list[TransferResult] = []
    got: list[TransferResult] = []
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if sender is not None:
            sent += sender.poll()
        if receiver is not None:
            got += receiver.poll()
        if (sender is None or len(sent) >= want) and (receiver is None or len(got) >= want_got):
            break
        time.sleep(0.001)
    return sent, got
