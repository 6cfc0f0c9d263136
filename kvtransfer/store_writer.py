"""The host KV store's writer thread (``HostKVStore``'s saves), and where each block it writes goes.

A save hands the writer a staging buffer of up to ``CHUNK`` blocks' KV with their keys and prefix
hashes (``put``); the thread writes each block to the RAM tier, or without one to the disk tier if
the admission rule takes it, and returns the buffer for reuse. Buffers are made on demand, at most
``buffers`` of them: ``buffer`` gives ``None`` when all of them wait to be written, and the caller
drops its save rather than wait. The RAM tier over its capacity moves its least recently used blocks
down to the disk (those admitted) and deletes the rest; the disk tier deletes its least recently used.

The admission rule: every block (``admit_all``), or a block read back from the store (``read_back``,
called by the worker's loop as it loads one) or offered to the disk a second time, so that one-off
prompts do not churn the disk.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict

import torch

from pdfabric.kvtransfer.store_tier import HEADER, TierDir

log = logging.getLogger("pdfabric.kvtransfer.host_store")

CHUNK = 16  # blocks per staging buffer (and per read of a hit: HostKVStore.load)
GHOSTS = 1 << 16  # keys remembered as offered once, for the "reused" admission rule
HOT = 1 << 16  # keys remembered as read back from the store


class StoreWriter:
    """Writes queued blocks into ``ram`` / ``disk`` under ``owner`` (the writing store's identity),
    on a thread of its own; staging buffers of shape ``(CHUNK, *block_shape)``, bytes."""

    def __init__(
        self,
        ram: TierDir | None,
        disk: TierDir | None,
        owner: bytes,
        admit_all: bool,
        buffers: int,
        block_shape: tuple[int, ...],
    ) -> None:
        self.ram, self.disk, self.owner, self.admit_all = ram, disk, owner, admit_all
        self.buffers = buffers  # staging buffers at most
        self.block_shape = block_shape
        self._made = 0  # staging buffers allocated so far
        self._free: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()  # written, ready for reuse
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()  # writer thread only
        self._file: memoryview | None = None  # the writer's buffer for a block file moving down
        self._hot: OrderedDict[bytes, None] = OrderedDict()  # read back (the loop adds, the writer reads)
        # blocks to write: their keys, their prefix hashes, their KV in a staging buffer
        self._queue: queue.SimpleQueue[tuple[list[bytes], list[bytes], torch.Tensor] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="kv-store-writer", daemon=True)
        self._thread.start()

    # --- the worker's side (its loop's thread) -----------------------------------------------------

    def buffer(self) -> torch.Tensor | None:
        """A free staging buffer, or ``None`` when all of them wait for the writer (the caller drops
        what it would have saved)."""
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        if self._made >= self.buffers:
            return None
        self._made += 1
        return torch.empty((CHUNK, *self.block_shape), dtype=torch.uint8)

    def put(self, keys: list[bytes], prefixes: list[bytes], buf: torch.Tensor) -> None:
        """Queues the first ``len(keys)`` blocks of ``buf`` (one of ``buffer``'s) to be written."""
        self._queue.put((keys, prefixes, buf))

    def read_back(self, key: bytes) -> None:
        """A block was read from the store: the disk admits it when it leaves RAM."""
        remember(self._hot, key, HOT)

    @property
    def native_id(self) -> int | None:
        """The writer thread's id in the operating system (its CPU time is in ``/proc`` under it)."""
        return self._thread.native_id

    def wait_idle(self, deadline: float) -> None:
        """Waits until everything queued is written (or ``deadline``, on the monotonic clock)."""
        while self._free.qsize() < self._made and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.005)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10.0)

    # --- the writer thread -------------------------------------------------------------------------

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            keys, prefixes, buf = item
            try:
                for key, prefix, row in zip(keys, prefixes, buf, strict=False):  # the first len(keys) rows
                    self._write(key, memoryview(row.reshape(-1).numpy()), prefix)
            except Exception:  # a writer that dies would leave every later save queued forever
                log.exception("host KV store: writing %d blocks failed", len(keys))
            finally:
                self._free.put(buf)

    def _write(self, key: bytes, payload: memoryview, prefix: bytes) -> None:
        """One block: into RAM (a disk hit copied up, or a save), else onto disk if admitted."""
        if self.ram is not None:
            if self.ram.write(key, payload, prefix, self.owner) and self.ram.over():
                self._spill()
        elif self.disk is not None and self._admit(key):
            if self.disk.write(key, payload, prefix, self.owner) and self.disk.over():
                self.disk.evict()

    def _spill(self) -> None:
        """The RAM tier's least recently used blocks go down to the disk tier (those admitted): each
        file read and checked, then written as it is; one the disk holds already (a disk hit copied up)
        only has its recency refreshed there."""
        assert self.ram is not None
        if self._file is None:
            self._file = memoryview(bytearray(HEADER.size + math.prod(self.block_shape)))
        for path in self.ram.oldest():
            key = TierDir.key_of(path)
            moved = False
            if self.disk is not None and key is not None and self._admit(key):
                moved = self.disk.touch(key)
                if not moved and self.ram.take(path, key, self._file):
                    moved = self.disk.adopt(key, self._file)
                    if moved and self.disk.over():
                        self.disk.evict()
            self.ram.remove(path, moved)

    def _admit(self, key: bytes) -> bool:
        """The disk tier's admission rule (module docstring)."""
        if self.admit_all or key in self._hot or key in self._ghosts:
            self._ghosts.pop(key, None)
            return True
        remember(self._ghosts, key, GHOSTS)
        return False


def remember(keys: OrderedDict[bytes, None], key: bytes, limit: int) -> None:
    """Adds ``key`` as the newest of at most ``limit`` keys."""
    keys[key] = None
    keys.move_to_end(key)
    if len(keys) > limit:
        keys.popitem(last=False)
