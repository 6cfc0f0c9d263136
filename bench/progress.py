"""A one-line progress bar on stderr (redrawn in place on a terminal, a plain line every 10 s otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Shows sent / finished counts, statuses and elapsed time; ``enabled=False`` makes it silent."""

    def __init__(self, total: int, label: str = "replay", enabled: bool = True, stream: TextIO | None = None):
        self.total = total
        self.label = label
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_plain = 0.0
        self._drawn = False

    def update(self, sent: int, done: int, counts: dict[str, int], elapsed_s: float) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not self.tty and now - self._last_plain < 10.0:
            return
        self._last_plain = now
        width = 24
        filled = int(width * done / self.total) if self.total else width
        bar = "#" * filled + "-" * (width - filled)
        statuses = " ".join(f"{k}={v}" for k, v in counts.items() if v)
        line = f"{self.label} [{bar}] sent {sent}/{self.total} done {done} {statuses} {elapsed_s:6.1f}s"
        if self.tty:
            self.stream.write("\r\x1b[2K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self._drawn = True

    def note(self, line: str) -> None:
        """A line about an event during the run (shown even when the bar is off); on a terminal it goes
        above the bar, which is redrawn at the next update."""
        if self.tty and self._drawn:
            self.stream.write("\r\x1b[2K")
            self._drawn = False
        self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
