"""The colocated worker process: the ZeroMQ loop (``pdfabric.worker.loop``) around a ``ColocatedCore``
(``decode.core``); it moves no KV.

A request's life here:
1. ``Generate`` arrives: the sequence waits in the queue (WAITING).
2. Its prompt is prefilled in chunks under the step's token budget, beside running decodes.
3. Its last prompt chunk yields the first token; it decodes one token per step (RUNNING), each sent
   to the router in the step's ``StepOutputs``.
4. It ends (FINISHED) on a stop token, its length limit, or an ``Abort``; its blocks return to the pool.
"""

from __future__ import annotations

from pdfabric.decode.core import ColocatedCore
from pdfabric.worker.core import CoreSpec, ProfileSource, WorkerCore
from pdfabric.worker.loop import Worker
from pdfabric.worker_config import WorkerConfig


class ColocatedWorker(Worker):
    def make_core(self, cfg: WorkerConfig, spec: CoreSpec, profile: ProfileSource) -> WorkerCore:
        return ColocatedCore(spec, profile)
