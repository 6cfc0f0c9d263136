"""Every worker kind by its name: the one table the worker process (``pdfabric worker``), the
simulator (``bench.sim_worker``) and the tests read. Its names are ``control.KINDS``, the names the
router and the configs know."""

from __future__ import annotations

from pdfabric.decode.kind import COLOCATED, DECODE
from pdfabric.prefill.kind import PREFILL
from pdfabric.worker.kind import WorkerKind

KINDS: dict[str, WorkerKind] = {k.name: k for k in (PREFILL, DECODE, COLOCATED)}  # control.KINDS' order


def kind(name: str) -> WorkerKind:
    """The worker kind called ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in KINDS:
        raise ValueError(f"worker kind must be one of {', '.join(KINDS)}, got {name!r}")
    return KINDS[name]
