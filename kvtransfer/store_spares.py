"""A tier's spare block files: the files it evicted, kept to be overwritten by its next writes. No
torch here.

Creating a file and deleting one cost the kernel more than the bytes in them (a new inode; on tmpfs
new pages, zeroed; on ext4 a search of the inode tables once many files were deleted), and a full
tier deletes a block for every block it writes. So a block file leaving a tier is renamed to a
temporary name instead (``TierDir`` names them: a reader only ever opens ``<key>.kv``), and the
tier's next write overwrites the oldest spare in place and renames it into place as it would a new
file: write, then publish, as before.

A reader that opened the file before it was renamed may be reading it still. Readers hold a shared
``flock`` while they read (``TierDir``), and a spare is overwritten only under an exclusive one taken
without waiting: a spare that a reader holds is deleted instead (the reader keeps its bytes). A
reader that opened the file but takes its lock after the overwrite reads another block's whole
file, which fails its key check: a miss, never a wrong block. A process killed with spares leaves
temporaries, which the next store opened on the directory deletes, as it does a killed write's. On
a file system without ``flock`` nothing is recycled.

A tier keeps at most ``capacity`` bytes of spares (what one eviction pass frees), counted apart from
its blocks: what its writes take from the spares they do not add to the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections import deque
from pathlib import Path
from typing import BinaryIO


class Spares:
    """A tier's spare files, oldest first; used by its writer's thread only."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.bytes = 0  # in the spares now
        self.enabled = True  # False once the file system refused a lock
        self._files: deque[tuple[Path, int]] = deque()  # (path, size)

    def keep(self, path: Path, size: int, name: Path) -> bool:
        """Renames the block file at ``path`` (``size`` bytes) to the temporary ``name`` to be
        overwritten later; ``False`` when the spares are full (the caller deletes it). Raises
        ``OSError`` when the file is gone (another process took it)."""
        if not self.enabled or self.bytes + size > self.capacity:
            return False
        os.rename(path, name)
        self._files.append((name, size))
        self.bytes += size
        return True

    def take(self) -> tuple[Path, BinaryIO, int] | None:
        """The oldest spare that no reader holds, open for writing under an exclusive lock (closing
        it releases the lock), with its size; ``None`` when there is none."""
        while self._files:
            path, size = self._files.popleft()
            self.bytes -= size
            try:
                f = open(path, "r+b")  # noqa: SIM115 - the caller writes and closes it
            except OSError:
                continue
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                f.close()
                with contextlib.suppress(OSError):
                    os.unlink(path)
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    self.clear()
                    self.enabled = False  # no locks here: readers could not be told apart
                continue
            return path, f, size
        return None

    def clear(self) -> None:
        """Deletes every spare (the device is full, or the store closes)."""
        while self._files:
            path, _ = self._files.popleft()
            with contextlib.suppress(OSError):
                os.unlink(path)
        self.bytes = 0
