"""The colocated worker: prefill and decode in one process, prompt chunks mixed into decode steps.

A request's life here:
1. ``Generate`` arrives: the sequence waits in the queue (WAITING); a prompt that cannot fit ends at
   once with an error delta.
2. Its prompt is prefilled in chunks under the step's token budget, beside running decodes.
3. Its last prompt chunk yields the first token; it decodes one token per step (RUNNING), each sent
   to the router in the step's ``StepOutputs``.
4. It ends (FINISHED) on a stop token, its length limit, or an ``Abort``; its blocks return to the pool.
"""

from __future__ import annotations

from pdfabric.config import WorkerConfig
from pdfabric.control import Generate
from pdfabric.core import CoreSpec, Out, ProfileSource, WorkerCore
from pdfabric.engine.sequence import Sequence
from pdfabric.worker import Worker


class ColocatedCore(WorkerCore):
    on_prefilled = "decode"

    def on_message(self, msg: object) -> Out:
        if not isinstance(msg, Generate):
            raise TypeError(f"a colocated worker cannot handle {type(msg).__name__}")
        reason = self.too_long(msg.request_id, len(msg.prompt_ids))
        if reason:
            return self.error(msg.request_id, 0, reason)
        self.scheduler.add(Sequence(msg.request_id, msg.prompt_ids, msg.params, frozenset(msg.eos_token_ids)))
        return []


class ColocatedWorker(Worker):
    """The ZeroMQ loop around a ``ColocatedCore``; it moves no KV."""

    def make_core(self, cfg: WorkerConfig, spec: CoreSpec, profile: ProfileSource) -> WorkerCore:
        return ColocatedCore(spec, profile)
