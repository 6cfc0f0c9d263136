"""Blocks of the host KV store read ahead of their load (``HostKVStore.read_ahead``). No torch here.

A prompt queued on a worker names the keys of its blocks after the pool's; a reader thread reads each
run of them (RAM first, then disk, every file checked) until one is missing, and keeps the files'
bytes, at most ``capacity`` blocks (the oldest dropped first: a prompt that never came to load them).
``take`` hands a block over once. A block read here counts as a tier's hit only when it is taken and
used (``TierDir.hit``).
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict

from pdfabric.kvtransfer.store_tier import HEADER, TierDir, read_first


class ReadAhead:
    def __init__(self, ram: TierDir | None, disk: TierDir | None, payload_bytes: int, capacity: int) -> None:
        self.ram, self.disk = ram, disk
        self.file_bytes = HEADER.size + payload_bytes
        self.capacity = capacity
        self._held: OrderedDict[bytes, tuple[bytearray, TierDir]] = OrderedDict()  # key -> file, tier
        self._lock = threading.Lock()
        self._wanted: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-store-reader", daemon=True)
        self._thread.start()

    def want(self, keys: list[bytes]) -> None:
        """Reads the leading run of ``keys`` the tiers hold, in the background."""
        self._wanted.put(keys)

    def take(self, key: bytes) -> tuple[bytearray, TierDir] | None:
        """The block file of ``key`` as read ahead (checked) and the tier it came from, or ``None``."""
        with self._lock:
            return self._held.pop(key, None)

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self._wanted.put(None)
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while (keys := self._wanted.get()) is not None:
            for key in keys:
                with self._lock:
                    if key in self._held:
                        continue
                buf = bytearray(self.file_bytes)
                tier = read_first((self.ram, self.disk), key, memoryview(buf), used=False)
                if tier is None:
                    break
                with self._lock:
                    self._held[key] = (buf, tier)
                    while len(self._held) > self.capacity:
                        self._held.popitem(last=False)
