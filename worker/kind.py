"""A worker kind as a value: which core runs it and how it opens its end of the KV channel. The
kinds are defined in their folders (``prefill.kind``, ``decode.kind``) and listed in one table
(``pdfabric.kinds.table``), which the worker process, the simulator and the tests read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdfabric.cluster_secret import ClusterSecret
from pdfabric.worker.core import WorkerCore
from pdfabric.worker.kv import KVSide
from pdfabric.worker.spec import CoreSpec, ProfileSource
from pdfabric.worker_config import WorkerConfig

if TYPE_CHECKING:
    from pdfabric.engine.prefix_cache import HostTier
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.engine.speculate import Proposer

# A kind's core: built from the worker's spec, its profile source, its KV endpoint ("": none), the
# draft model's proposer and the host KV store (None: none).
CoreFactory = Callable[[CoreSpec, ProfileSource, str, "Proposer | None", "HostTier | None"], WorkerCore]
# A kind's KV side, opened over the model runner's caches (it may move them, as a decode worker's
# receiver moves them into shared memory) for the worker named by the str, speaking to peers that
# hold the cluster secret (None: plain ZeroMQ); the side owns what it opens and closes it.
KVFactory = Callable[[WorkerConfig, str, "ModelRunner", ClusterSecret | None], KVSide]


@dataclass(frozen=True)
class WorkerKind:
    """One kind of worker: its name (``control.KINDS``), its core, and its KV side (``None``: it moves
    no KV, as a colocated worker)."""

    name: str
    core: CoreFactory
    open_kv: KVFactory | None = None
