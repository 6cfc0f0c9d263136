"""One tier of the host KV store: a directory of block files, bounded in bytes. No torch here.

A block is one file, ``<key in hex>.kv``: a header (magic, the block's key, the pool's prefix hash it
was saved under, its owner: the identity of the store that wrote it, the payload's length and
crc32, and a crc32 of the header itself), then the payload. It is written under a temporary
name and renamed into place, so a reader sees a whole file or none: a process killed mid-write
leaves only a temporary file, which the next store opened on the directory removes. A file that
fails its checks on reading (another key, another length, a wrong crc32: a torn write after a power
loss, a corrupted disk) is deleted and reported as a miss, never served. A reader holds a shared
``flock`` on the file while it reads it, so that a file the tier recycles is never overwritten under
it (``store_spares``: an evicted file is kept and overwritten by a later write).

Several processes may share a directory (every worker on a host): each keeps a running estimate of
the bytes in it, and when its estimate passes the capacity it lists the directory and deletes the
least recently used files (by modification time, which a read refreshes) down to ``LOW_WATER`` of it;
another process's temporaries (its writes under way, its spare files) count against the capacity too.
What it deletes is recorded (``removed``: key, prefix hash and owner, read from the file's header),
so that the worker can tell the router which prefixes its host's store no longer holds, its own
model's and, by their owners, other models'; so is a file deleted for a payload that failed its
check when its header passes its own (the header names whose block it was). Files of earlier
headers (``PDKVBLK1`` to ``PDKVBLK3``) fail their checks and are deleted as they are read.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from pdfabric.kvtransfer.store_spares import Spares
from pdfabric.proc import alive

MAGIC = b"PDKVBLK4"
# magic, key, prefix hash, owner, payload bytes, crc32 of the payload; then a crc32 of those
_FIELDS = struct.Struct("<8s16s16s8sQI")
HEADER = struct.Struct(_FIELDS.format + "I")
NO_PREFIX = bytes(16)  # a block saved without its prefix hash
NO_OWNER = bytes(8)  # a block saved without its writer's store identity
SUFFIX = ".kv"
TMP_PREFIX = ".tmp-"
LOW_WATER = 0.9  # an eviction pass brings a tier down to this share of its capacity


@dataclass
class TierStats:
    """What one tier did (counted by the process that did it)."""

    hits: int = 0  # blocks read and checked
    bytes_read: int = 0
    writes: int = 0  # blocks written
    bytes_written: int = 0
    evictions: int = 0  # blocks deleted to stay within capacity
    bad: int = 0  # files that failed their checks (deleted)
    write_errors: int = 0  # writes that failed (a full disk, ...): the block is not kept


class TierDir:
    """A directory of block files of at most ``capacity`` bytes (headers included)."""

    def __init__(self, name: str, path: str | Path, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{name} tier capacity must be positive, got {capacity}")
        self.name = name
        self.path = Path(path)
        self.capacity = capacity
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.stats = TierStats()
        self._counter = 0
        self._tag = secrets.token_hex(4)  # two tiers on one directory in one process never share a name
        self._mine = f"{TMP_PREFIX}{os.getpid()}-{self._tag}-"  # this tier's temporaries' names start so
        self._remove_dead_temporaries()
        listing, foreign = self._scan()
        self.used = sum(size for _, size, _ in listing) + foreign  # the blocks', and others' temporaries
        self.spares = Spares(capacity - int(capacity * LOW_WATER))  # evicted files, to write over
        # (key, prefix hash, owner) of the blocks this process deleted to make room, or for a payload
        # that failed its check under an intact header, oldest first; the worker's loop takes them
        # (HostKVStore.take_dropped) while the writer thread adds more (a deque's appends and pops
        # are atomic)
        self.removed: deque[tuple[bytes, bytes, bytes]] = deque(maxlen=1 << 16)
        # keys of the files this process deleted for failing their checks (any thread), oldest first
        self.bad_keys: deque[bytes] = deque(maxlen=1 << 16)

    def file(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}{SUFFIX}"

    def has(self, key: bytes) -> bool:
        return os.path.exists(self.file(key))

    def read(self, key: bytes, payload_bytes: int) -> bytes | None:
        """The payload kept under ``key``, checked (and its recency refreshed), or ``None``."""
        buf = bytearray(HEADER.size + payload_bytes)
        return bytes(memoryview(buf)[HEADER.size :]) if self.read_into(key, memoryview(buf)) else None

    def read_into(self, key: bytes, buf: memoryview, used: bool = True) -> bool:
        """Reads the block file of ``key`` into ``buf`` (its header, then the payload: ``buf`` is as
        long as the whole file must be) and checks it; refreshes its recency and counts a hit unless
        not ``used`` (read ahead: ``hit`` counts it when it is). ``False``: a miss, or a file that
        failed its checks (deleted)."""
        if not self._load_into(self.file(key), key, buf):
            return False
        if used:
            self.hit(key, len(buf) - HEADER.size)
        return True

    def hit(self, key: bytes, payload_bytes: int) -> None:
        """Counts a block read as used, and refreshes its recency."""
        with contextlib.suppress(OSError):
            os.utime(self.file(key))
        self.stats.hits += 1
        self.stats.bytes_read += payload_bytes

    def take(self, path: Path, key: bytes, buf: memoryview) -> bool:
        """Reads the block file of ``key`` at ``path`` whole into ``buf`` (as long as the file must be)
        and checks it, counting no recency or hit (a tier moving its blocks down reads so); ``False``:
        gone, or failed its checks (deleted)."""
        return self._load_into(path, key, buf)

    def _load_into(self, path: Path, key: bytes, buf: memoryview) -> bool:
        """Reads the file at ``path`` into ``buf`` and checks it; a file that fails is deleted."""
        try:
            with open(path, "rb", buffering=0) as f:
                with contextlib.suppress(OSError):  # a file system without locks: read unlocked
                    fcntl.flock(f, fcntl.LOCK_SH)  # a writer recycling the file waits (store_spares)
                n = f.readinto(buf)
                whole = n == len(buf) and not f.read(1)
                inode = os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return False
        except OSError:
            self.stats.bad += 1
            return False
        if not (whole and _valid(buf, key, len(buf) - HEADER.size)):
            try:
                if os.stat(path).st_ino != inode:
                    return False  # recycled since it was opened: another block's file, not a bad one
                path.unlink()
            except OSError:
                return False  # another reader found it bad first and deleted it: counted there
            self.stats.bad += 1
            self.bad_keys.append(key)
            fields = _header(buf[: min(n, HEADER.size)])
            if fields is not None and fields[1] == key and fields[2] != NO_PREFIX:
                self.removed.append(fields[1:4])  # an intact header names whose block is gone
            return False
        return True

    def write(
        self, key: bytes, payload: bytes | memoryview, prefix: bytes = NO_PREFIX, owner: bytes = NO_OWNER
    ) -> bool:
        """Keeps ``payload`` under ``key``, with the pool's ``prefix`` hash it came from and its
        ``owner`` (the writing store's identity; write, then publish by renaming); ``False`` if the
        write failed (the tier then makes room, so that the next one may succeed)."""
        payload = memoryview(payload).cast("B")
        fields = _FIELDS.pack(MAGIC, key, prefix, owner, len(payload), zlib.crc32(payload))
        return self._publish(key, fields + struct.pack("<I", zlib.crc32(fields)), payload)

    def adopt(self, key: bytes, data: memoryview) -> bool:
        """Keeps a block file that another tier's ``take`` read and checked (``data``: the whole file,
        header included) as it is, as ``write`` keeps a payload; ``False`` if the write failed."""
        return self._publish(key, data[: HEADER.size], data[HEADER.size :])

    def touch(self, key: bytes) -> bool:
        """Refreshes the recency of ``key``'s file; ``False`` if the tier has none."""
        try:
            os.utime(self.file(key))
        except OSError:
            return False
        return True

    def _publish(self, key: bytes, header: bytes | memoryview, payload: memoryview) -> bool:
        """Writes a block file under a temporary name (over a spare file where there is one), then
        renames it into place (``write``)."""
        size = len(header) + len(payload)
        spare = self.spares.take()
        tmp = spare[0] if spare is not None else self._temporary()
        try:
            with spare[1] if spare is not None else open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
                if spare is not None and spare[2] > size:
                    f.truncate()
            os.replace(tmp, self.file(key))
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self.stats.write_errors += 1
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self.spares.clear()
                self.evict(int(self.capacity * (1 - LOW_WATER)), free=True)
            return False
        self.stats.writes += 1
        self.stats.bytes_written += len(payload)
        self.used += size
        return True

    def over(self) -> bool:
        return self.used > self.capacity

    def oldest(self, at_least: int = 0) -> list[Path]:
        """The files to remove to come down to ``LOW_WATER`` of capacity (and to free ``at_least``
        bytes), least recently used first; the directory is listed afresh, since other processes
        write to it too."""
        listing, foreign = self._scan()
        listing.sort()
        self.used = sum(size for _, size, _ in listing) + foreign
        excess = max(self.used - int(self.capacity * LOW_WATER), at_least)
        out: list[Path] = []
        for _, size, path in listing:
            if excess <= 0:
                break
            out.append(path)
            excess -= size
        return out

    def remove(self, path: Path, moved: bool = False, free: bool = False) -> None:
        """Deletes one of ``oldest``'s files (gone already: another process took it), or keeps it as
        a spare for a later write unless ``free`` (the space must come back); unless ``moved`` (its
        block went to another tier), records its key, prefix hash and owner in ``removed``."""
        try:
            with open(path, "rb") as f:
                header = f.read(HEADER.size)
                size = os.fstat(f.fileno()).st_size
            if free or not self.spares.keep(path, size, self._temporary()):
                path.unlink()
        except OSError:
            return
        self.used -= size
        self.stats.evictions += 1
        fields = None if moved else _header(header)
        if fields is not None and fields[2] != NO_PREFIX:
            self.removed.append(fields[1:4])

    def evict(self, at_least: int = 0, free: bool = False) -> None:
        """Removes least recently used files down to ``LOW_WATER`` of capacity (and at least
        ``at_least`` bytes), keeping them as spares unless ``free``."""
        for path in self.oldest(at_least):
            self.remove(path, free=free)

    def close(self) -> None:
        """Deletes this tier's spare files (its blocks stay)."""
        self.spares.clear()

    @staticmethod
    def key_of(path: Path) -> bytes | None:
        """The key a block file's name gives (``None`` for anything else)."""
        name = path.name
        if not name.endswith(SUFFIX):
            return None
        try:
            return bytes.fromhex(name[: -len(SUFFIX)])
        except ValueError:
            return None

    def _temporary(self) -> Path:
        """A new name for one of this tier's temporaries (a write under way, a spare file)."""
        self._counter += 1
        return self.path / f"{self._mine}{self._counter}"

    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        """(modification time, size, path) of every block file, and the bytes of other processes' and
        tiers' temporaries."""
        out, foreign = [], 0
        with os.scandir(self.path) as entries:
            for e in entries:
                block = e.name.endswith(SUFFIX)
                if not block and not (e.name.startswith(TMP_PREFIX) and not e.name.startswith(self._mine)):
                    continue
                try:
                    st = e.stat()
                except OSError:
                    continue
                if block:
                    out.append((st.st_mtime, st.st_size, Path(e.path)))
                else:
                    foreign += st.st_size
        return out, foreign

    def _remove_dead_temporaries(self) -> None:
        """Deletes the temporary files of writers that are gone (killed mid-write)."""
        with os.scandir(self.path) as entries:
            for e in entries:
                if not e.name.startswith(TMP_PREFIX):
                    continue
                pid = e.name[len(TMP_PREFIX) :].split("-", 1)[0]
                if not pid.isdigit() or not alive(int(pid)):
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)


def read_first(
    tiers: tuple[TierDir | None, ...], key: bytes, buf: memoryview, used: bool = True
) -> TierDir | None:
    """Reads the block file of ``key`` into ``buf`` from the first of ``tiers`` that holds it and
    passes its checks (RAM before disk), as ``TierDir.read_into``; that tier, or ``None``."""
    for tier in tiers:
        if tier is not None and tier.read_into(key, buf, used=used):
            return tier
    return None


def _header(data: bytes | bytearray | memoryview) -> tuple[bytes, bytes, bytes, bytes, int, int] | None:
    """A block file's header fields (magic, key, prefix hash, owner, payload bytes, payload crc32)
    when ``data`` starts with a whole header of this version that passes its own check, else ``None``."""
    if len(data) < HEADER.size:
        return None
    *fields, crc = HEADER.unpack_from(data)
    if fields[0] != MAGIC or zlib.crc32(memoryview(data)[: _FIELDS.size]) != crc:
        return None
    return tuple(fields)  # type: ignore[return-value]


def _valid(data: memoryview, key: bytes, payload_bytes: int) -> bool:
    fields = _header(data)
    if fields is None or fields[1] != key or fields[4] != payload_bytes:
        return False
    return zlib.crc32(data[HEADER.size :]) == fields[5]
