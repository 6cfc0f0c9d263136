"""Transfer states and results shared by every transport; no torch here.

A transfer on either side lives through these states, advanced only by the owner's ``poll()``:

1. WAITING: registered (receiver: blocks reserved; sender: blocks held) but no byte moved yet;
2. TRANSFERRING: some layers have moved, more are expected;
3. DONE: every layer landed and was checked (receiver), or the receiver acknowledged (sender);
4. FAILED: with a reason; the blocks this side held for the transfer have been released.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdfabric.kvtransfer.messages import Meta


class TransferState(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


@dataclass(frozen=True)
class TransferResult:
    """How one transfer ended, on one side. ``meta`` carries the sender's small extras (first token)."""

    request_id: str
    state: TransferState
    reason: str = ""
    nbytes: int = 0
    seconds: float = 0.0
    layers: int = 0
    meta: Meta = field(default_factory=dict)
    transport: str = ""  # how the bytes moved ("zmq", "shm", "dist"); "" before a path was chosen

    @property
    def ok(self) -> bool:
        return self.state is TransferState.DONE


# Called once per finished transfer (either side); the worker exports bytes and seconds from it.
MetricsHook = Callable[[TransferResult], None]


@dataclass
class Transfer:
    """One side's live record of one request's transfer (owned and mutated by its sender or receiver)."""

    request_id: str
    blocks: tuple[int, ...]
    num_layers: int
    deadline: float
    started: float = field(default_factory=time.monotonic)
    state: TransferState = TransferState.WAITING
    reason: str = ""
    nbytes: int = 0
    layers_done: int = 0
    last_progress: float = field(default_factory=time.monotonic)
    meta: Meta = field(default_factory=dict)
    transport: str = ""

    def progress(self, nbytes: int, layers: int) -> None:
        self.state = TransferState.TRANSFERRING
        self.nbytes += nbytes
        self.layers_done += layers
        self.last_progress = time.monotonic()

    def result(self) -> TransferResult:
        return TransferResult(
            self.request_id,
            self.state,
            self.reason,
            self.nbytes,
            time.monotonic() - self.started,
            self.layers_done,
            dict(self.meta),
            self.transport,
        )
