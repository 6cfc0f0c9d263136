"""The host's KV store: the blocks a worker's pool evicts, kept in RAM (a directory in shared memory)
and on disk, for every worker on the host and across restarts (docs/kvtransfer.md#the-host-kv-store).

A block's life in it:

1. ``save(blocks, hashes)``: the pool is about to reuse cached blocks. Their KV is copied out at once
   into one host buffer and queued for the writer thread (``store_writer.StoreWriter``), which
   writes each block to the RAM tier (without one, to the disk tier, if the admission rule takes
   it). The queue is bounded in bytes: a save that finds it full is dropped and counted; the step
   never waits for a write. With
   ``write_through``, ``reused(blocks, hashes)`` saves the same way a prefix the pool serves again
   (the first time it is reused), so the host's other workers find it while this worker still holds
   it, and a crash does not lose it.
2. The RAM tier over its capacity moves its least recently used blocks down to the disk tier, those
   the admission rule takes (``"reused"``: blocks read back from the store, or offered twice), and
   deletes the rest; the disk tier deletes its least recently used.
3. ``find(hashes)`` and ``load(hashes, blocks)``: a prompt's cached prefix continues here. Each block is
   read (RAM first, then disk), checked and written into the worker's blocks; a disk hit is copied
   back up to RAM by the writer. ``read_ahead(hashes)``, as the prompt is queued, has a reader thread
   read and check its blocks into memory (``store_ahead.ReadAhead``, at most ``queue_mb`` of them)
   while the worker's current step runs; ``load`` then only copies those into the cache.

A block's key is its prefix hash (the pool's, salted by the model name) hashed again with the store's
salt, which names what makes KV bytes differ: the checkpoint (its files' names, sizes and times), the
served version, weight format, linear kernels, KV cache dtype and layout (element type included). Another
model, version or layout has other keys, so its blocks are never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from pdfabric.kvtransfer.frames import host, layout_of
from pdfabric.kvtransfer.messages import KVLayout
from pdfabric.kvtransfer.store_ahead import ReadAhead
from pdfabric.kvtransfer.store_tier import HEADER, NO_OWNER, TierDir, TierStats, read_first
from pdfabric.kvtransfer.store_writer import CHUNK, HOT, StoreWriter, remember
from pdfabric.worker_config import WorkerConfig

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # the widest that divides a block's bytes
THROUGH = 1 << 16  # prefix hashes remembered as saved through (write-through), and reported at most


def default_ram_dir() -> Path:
    """Where the RAM tier lives unless configured: shared memory (``/dev/shm``), else the temp dir; one
    per user (the directory is the user's alone)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"pdfabric-kv-store-{os.getuid()}"


def store_salt(cfg: WorkerConfig, model_dir: Path, layout: KVLayout) -> bytes:
    """What every key of a worker's blocks is salted with: everything that makes its KV bytes differ."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file()) if model_dir.is_dir() else []
    checkpoint = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    what = {
        "model": str(model_dir.resolve()), "checkpoint": checkpoint, "served": cfg.served,
        "quantization": cfg.quantization, "linears": cfg.linears,
        "kv_cache_dtype": cfg.kv_cache_dtype, "layout": asdict(layout),
    }  # fmt: skip
    return hashlib.blake2b(json.dumps(what, sort_keys=True).encode(), digest_size=16).digest()


class HostKVStore:
    """The RAM and disk tiers of one host, seen by one worker (a ``prefix_cache.HostTier``).

    ``caches()`` gives the worker's cache tensors at the time of the call (a decode worker moves them
    into shared memory after the store is made)."""

    def __init__(
        self,
        cfg: WorkerConfig,
        salt: bytes,
        caches: Callable[[], list[torch.Tensor]],
        tiled: bool = False,
        burst_blocks: int = 0,
    ) -> None:
        """``burst_blocks``: the most blocks the worker's pool may evict at once (a longest prompt's:
        a decode worker reserves a prompt's blocks whole, and a hit read from the store gets its blocks
        in one allocation); the staging buffers hold at least that many whatever ``kv_store_queue_mb``
        says, so that one such allocation never drops a save."""
        if not cfg.kv_store_ram_mb and not cfg.kv_store_disk_mb:
            raise ValueError("a host KV store needs kv_store_ram_mb or kv_store_disk_mb")
        self.salt = salt
        self.caches = caches
        self.layout = layout_of(caches(), tiled)
        self.payload_bytes = self.layout.transfer_bytes(1)
        ram_dir = Path(cfg.kv_store_ram_dir) if cfg.kv_store_ram_dir else default_ram_dir()
        ram_mb, disk_mb = cfg.kv_store_ram_mb, cfg.kv_store_disk_mb
        self.ram = TierDir("ram", ram_dir, ram_mb << 20) if ram_mb else None
        self.disk = TierDir("disk", cfg.kv_store_disk_dir, disk_mb << 20) if disk_mb else None
        self.write_through = cfg.kv_store_write_through
        self._through: OrderedDict[bytes, None] = OrderedDict()  # hashes saved through, the latest
        self._stored: list[bytes] = []  # hashes saved through since ``take_stored``
        self._lost: list[bytes] = []  # hashes found but not there to load (a file that failed its check)
        self._asked: OrderedDict[bytes, bytes] = OrderedDict()  # key -> prefix hash of blocks to be read
        tiers = [str(t.path.resolve()) for t in (self.ram, self.disk) if t is not None]
        self.ident = hashlib.blake2b(json.dumps([*tiers, salt.hex()]).encode(), digest_size=8).hexdigest()
        self._removed: list[bytes] = []  # hashes of this store's blocks its tiers deleted (TierDir.removed)
        self._others: dict[str, list[bytes]] = {}  # owner -> prefix hashes: other stores' blocks deleted
        self.capacity_blocks = sum(t.capacity for t in (self.ram, self.disk) if t is not None) // (
            HEADER.size + self.payload_bytes
        )
        # Blocks move from the cache to the writer in staging buffers of CHUNK blocks, reused so that
        # their pages are touched once: at most queue_mb of them wait to be written, or a burst's.
        # A block dropped costs more than its own tokens: a later prompt's hit ends at the first
        # block the store lacks.
        buffers = max(
            (cfg.kv_store_queue_mb << 20) // (CHUNK * self.payload_bytes), -(-burst_blocks // CHUNK), 1
        )
        self.writer = StoreWriter(
            self.ram, self.disk, owner=bytes.fromhex(self.ident),  # in the header of every block written
            admit_all=cfg.kv_store_disk_admission == "all",
            buffers=buffers,
            block_shape=(self.layout.num_layers, 2, self.layout.block_bytes),
        )  # fmt: skip
        self._word = next(w for w in WORDS if self.layout.block_bytes % w.itemsize == 0)
        self._loading = torch.empty((CHUNK, HEADER.size + self.payload_bytes), dtype=torch.uint8)
        self.dropped = 0
        self.load_seconds = 0.0
        # blocks read ahead of their load, at most queue_mb of them
        cap = max(CHUNK, (cfg.kv_store_queue_mb << 20) // (HEADER.size + self.payload_bytes))
        self.ahead = ReadAhead(self.ram, self.disk, self.payload_bytes, cap)
        self.ahead_hits = 0  # blocks a load found read ahead

    def key(self, prefix_hash: bytes) -> bytes:
        return hashlib.blake2b(self.salt + prefix_hash, digest_size=16).digest()

    # --- the worker's side (its loop's thread) -----------------------------------------------------

    def save(self, blocks: list[int], hashes: list[bytes]) -> None:
        keys = [self.key(h) for h in hashes]
        keep = [i for i, k in enumerate(keys) if not self._has(k)]
        for start in range(0, len(keep), CHUNK):
            part = keep[start : start + CHUNK]
            buf = self.writer.buffer()
            if buf is None:
                self.dropped += len(keep) - start
                return
            self.gather([blocks[i] for i in part], buf[: len(part)])
            self.writer.put([keys[i] for i in part], [hashes[i] for i in part], buf)

    def reused(self, blocks: list[int], hashes: list[bytes]) -> None:
        if not self.write_through:
            return
        new = [i for i, h in enumerate(hashes) if h not in self._through]
        if not new:
            return
        dropped = self.dropped
        self.save([blocks[i] for i in new], [hashes[i] for i in new])
        if self.dropped == dropped:  # queued (or held already); a full queue drops it, and it is
            for i in new:  # offered again when reused again
                remember(self._through, hashes[i], THROUGH)
            self._stored += [hashes[i] for i in new]
            del self._stored[:-THROUGH]

    def take_dropped(self) -> tuple[bytes, ...]:
        """The prefix hashes of this model's blocks (this store's salt) that this worker deleted from
        the store since the last call: evicted from the disk, or from RAM without a place on disk, and
        those a load found gone (a file that failed its check, by this process or another). Another
        process's deletions to make room are its own to report; the blocks of other stores (another
        model's, or the same model's with other tiers) this worker deleted go to ``take_dropped_others``."""
        self._sort_removed()
        dropped, self._lost, self._removed = self._lost + self._removed, [], []
        for tier in (self.ram, self.disk):
            while tier is not None and tier.bad_keys:  # failed a check when read (by the loop or the reader)
                prefix = self._asked.get(tier.bad_keys.popleft())
                if prefix is not None:
                    dropped.append(prefix)
        return tuple(dict.fromkeys(dropped))  # a block that failed its check is in both records

    def take_dropped_others(self) -> dict[str, tuple[bytes, ...]]:
        """The prefix hashes of other stores' blocks this worker deleted (to make room, or for a
        payload that failed its check under an intact header), by the identity (``ident``) of the
        store that wrote each, since the last call."""
        self._sort_removed()
        others, self._others = self._others, {}
        return {owner: tuple(prefixes) for owner, prefixes in others.items()}

    def _sort_removed(self) -> None:
        """Takes what the tiers deleted (``TierDir.removed``): this store's blocks for
        ``take_dropped``, other stores' by their owner for ``take_dropped_others`` (blocks written
        without one are not told)."""
        for tier in (self.ram, self.disk):
            while tier is not None and tier.removed:
                key, prefix, owner = tier.removed.popleft()
                if self.key(prefix) == key:
                    self._removed.append(prefix)
                elif owner != NO_OWNER:
                    self._others.setdefault(owner.hex(), []).append(prefix)

    def take_stored(self) -> tuple[bytes, ...]:
        """The prefix hashes saved through since the last call (for the router's view of the store)."""
        stored, self._stored = tuple(self._stored), []
        return stored

    def find(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if not self._has(self.key(h)):
                break
            n += 1
        return n

    def load(self, hashes: Sequence[bytes], blocks: list[int]) -> int:
        self._ask(hashes[: len(blocks)])
        start = time.perf_counter()
        n = 0
        for first in range(0, min(len(hashes), len(blocks)), CHUNK):
            chunk = hashes[first : first + CHUNK]
            got = self._load_chunk(chunk, blocks[first : first + len(chunk)])
            n += got
            if got < len(chunk):
                if not self._has(self.key(chunk[got])):  # deleted for a failed check (or made room for)
                    self._lost = [*self._lost[-HOT:], chunk[got]]
                break
        self.load_seconds += time.perf_counter() - start
        return n

    def flush(self, blocks: list[int], hashes: list[bytes], timeout_s: float = 8.0) -> None:
        """Saves the worker's cached blocks (it is stopping) and waits, at most ``timeout_s``, for every
        queued write; more than the staging buffers hold is saved in turns."""
        deadline = time.monotonic() + timeout_s
        step = self.writer.buffers * CHUNK
        for i in range(0, len(blocks), step):
            self.writer.wait_idle(deadline)
            self.save(blocks[i : i + step], hashes[i : i + step])
        self.writer.wait_idle(deadline)

    def read_ahead(self, hashes: Sequence[bytes]) -> None:
        self.ahead.want(self._ask(hashes))

    def _ask(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The keys of ``hashes``, remembered with them (a block that fails its check when read is
        reported by its prefix hash: ``take_dropped``)."""
        keys = [self.key(h) for h in hashes]
        for key, h in zip(keys, hashes, strict=True):
            self._asked[key] = h
            self._asked.move_to_end(key)
        while len(self._asked) > HOT:
            self._asked.popitem(last=False)
        return keys

    def close(self) -> None:
        self.writer.close()
        self.ahead.close()
        for tier in (self.ram, self.disk):
            if tier is not None:
                tier.close()

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {
            "dropped": self.dropped, "load_seconds": self.load_seconds, "ahead_hits": self.ahead_hits
        }  # fmt: skip
        for name, tier in (("ram", self.ram), ("disk", self.disk)):
            stats = asdict(tier.stats if tier is not None else TierStats())
            out.update({f"{name}_{field}": value for field, value in stats.items()})
        return out

    def gather(self, blocks: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' KV as host bytes, ``[n, layers, 2, bytes of a block's keys]`` (into ``out``)."""
        caches = self.caches()
        n = len(blocks)
        if out is None:
            out = torch.empty((n, len(caches), 2, self.layout.block_bytes), dtype=torch.uint8)
        idx = torch.tensor(blocks, dtype=torch.int64, device=caches[0].device)
        words = out.view(self._word)  # copies move words, not bytes: several times faster
        for layer, cache in enumerate(caches):
            # cache: [2, num_blocks, block_size, H, D] -> the blocks' words: [2, n, words of a block]
            picked = cache.view(self._word).view(2, cache.shape[1], -1).index_select(1, idx)
            words[:, layer].copy_(host(picked).transpose(0, 1))
        return out

    def _load_chunk(self, hashes: Sequence[bytes], blocks: list[int]) -> int:
        """Reads up to CHUNK blocks (RAM first, then disk) into the cache's ``blocks``; how many of
        the leading ones were there and checked."""
        rows = self._loading.numpy()
        promote: dict[int, bytes] = {}  # disk hits to copy up to RAM: row -> key
        n = 0
        for key in map(self.key, hashes):
            row = memoryview(rows[n])
            ahead = self.ahead.take(key)
            if ahead is not None:
                data, tier = ahead
                row[:] = data
                tier.hit(key, self.payload_bytes)  # counted now that it is used
                self.ahead_hits += 1
            elif (tier := read_first((self.ram, self.disk), key, row)) is None:
                break
            if tier is self.disk and self.ram is not None:
                promote[n] = key
            self.writer.read_back(key)
            n += 1
        if not n:
            return 0
        payload = self._loading[:n, HEADER.size :].view(n, self.layout.num_layers, 2, -1)
        self._scatter(payload, blocks[:n])
        buf = self.writer.buffer() if promote else None
        if buf is not None:
            buf[: len(promote)].copy_(payload[list(promote)])
            self.writer.put(list(promote.values()), [hashes[i] for i in promote], buf)
        return n

    def _scatter(self, payload: torch.Tensor, blocks: list[int]) -> None:
        """Writes ``payload`` (``gather``'s shape; a view will do) into the worker's ``blocks``."""
        caches = self.caches()
        idx = torch.tensor(blocks, dtype=torch.int64, device=caches[0].device)
        words = payload.view(self._word)
        for layer, cache in enumerate(caches):
            src = words[:, layer].transpose(0, 1).to(cache.device)  # [2, n, words of a block]
            cache.view(self._word).view(2, cache.shape[1], -1).index_copy_(1, idx, src)

    def _has(self, key: bytes) -> bool:
        return (self.ram is not None and self.ram.has(key)) or (self.disk is not None and self.disk.has(key))
