"""A paged KV cache whose tensors live in shared memory files that another process can map.

The decode worker allocates its cache with ``SharedKVPool.create``; a prefill worker on the same host
maps the same files (``map_caches``) and writes a request's blocks straight into the reserved ones.
Files go under ``/dev/shm`` (RAM) where it exists; the creator unlinks them on ``close()``. An
``anonymous`` pool (what workers use) lives in memfd files instead, named ``/proc/PID/fd/N``: they
vanish with the process however it ends, so a killed worker leaves nothing behind in ``/dev/shm``.

The creator allocates every page of its pool at creation (``populate``). Left to be allocated on
first write, a block's first transfer into a fresh decode worker ran about 5x slower than later ones
(192 MiB: 56 ms against 10 ms on a 2-core VM). A sender's own mapping still fills its page tables
as it first writes each block (about 0.25 ms per MiB there, once per block and sender): filling
them ahead, on a background thread, held the sender's memory map lock long enough to stall its
model steps.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tempfile
import uuid
from pathlib import Path

import torch


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault every page of a range in, writable, in one call
_libc: ctypes.CDLL | None = None


def _madvise_populate(t: torch.Tensor) -> bool:
    """Faults in (allocating where needed) every page under ``t``; False where the OS cannot."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    length = t.data_ptr() + t.numel() * t.element_size() - start
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE) == 0


def populate(caches: list[torch.Tensor]) -> None:
    """Allocates every page of a pool just created (all zeros), so that no transfer faults them in."""
    for t in caches:
        if not _madvise_populate(t):
            t.zero_()


def map_caches(paths: tuple[str, ...], shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """One tensor of ``shape`` per file, sharing its memory; ``ValueError`` if a file's size differs."""
    numel = 1
    for dim in shape:
        numel *= dim
    want = numel * torch.empty((), dtype=dtype).element_size()
    caches = []
    for path in paths:
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise ValueError(f"cannot open shared KV file {path}: {exc.strerror}") from None
        if size != want:
            raise ValueError(f"shared KV file {path} is {size} bytes, expected {want}")
        caches.append(torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape))
    return caches


class SharedKVPool:
    """``caches``: one ``[2, num_blocks, block_size, H, D]`` tensor per layer, in shared memory."""

    def __init__(self, caches: list[torch.Tensor], paths: tuple[str, ...], fds: tuple[int, ...] = ()) -> None:
        self.caches = caches
        self.paths = paths
        self.fds = fds  # anonymous pools: the memfds, open for the pool's life

    @classmethod
    def create(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        directory: str | None = None,
        anonymous: bool = False,
    ) -> SharedKVPool:
        if anonymous and hasattr(os, "memfd_create"):
            return cls._anonymous(num_layers, (2, num_blocks, block_size, kv_heads, head_dim), dtype)
        base = Path(directory) if directory else _shm_dir()
        stem = f"pdfabric-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        shape = (2, num_blocks, block_size, kv_heads, head_dim)
        numel = 2 * num_blocks * block_size * kv_heads * head_dim
        paths = tuple(str(base / f"{stem}-L{i}") for i in range(num_layers))
        caches = []
        try:
            for path in paths:
                caches.append(torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape))
                populate(caches[-1:])
        except BaseException:
            cls(caches, paths).close()
            raise
        return cls(caches, paths)

    @classmethod
    def _anonymous(cls, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype) -> SharedKVPool:
        numel = 1
        for dim in shape:
            numel *= dim
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        fds: list[int] = []
        caches = []
        try:
            for i in range(num_layers):
                fd = os.memfd_create(f"pdfabric-kv-L{i}")
                fds.append(fd)
                os.ftruncate(fd, nbytes)  # reads as zeros
                path = f"/proc/{os.getpid()}/fd/{fd}"
                caches.append(torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape))
                populate(caches[-1:])
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        paths = tuple(f"/proc/{os.getpid()}/fd/{fd}" for fd in fds)
        return cls(caches, paths, tuple(fds))

    def close(self) -> None:
        """Unlinks the files; mappings already made (here or elsewhere) stay valid until dropped."""
        for fd in self.fds:
            os.close(fd)
        if self.fds:
            return
        for path in self.paths:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
