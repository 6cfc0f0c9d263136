"""The colocated worker: prefill and decode in one process, prompt chunks mixed into decode steps.

A request's life here:
1. ``Generate`` arrives: the sequence waits in the queue (WAITING).
2. Its prompt is prefilled in chunks under the step's token budget, beside running decodes.
3. Its last prompt chunk yields the first token; it decodes one token per step (RUNNING), each sent
   to the router in the step's ``StepOutputs``.
4. It ends (FINISHED) on a stop token, its length limit, or an ``Abort``; its blocks return to the pool.
"""

from __future__ import annotations

from typing import Any

from pdfabric.control import Generate
from pdfabric.engine.sequence import Sequence
from pdfabric.worker import Worker, log


class ColocatedWorker(Worker):
    on_prefilled = "decode"

    def handle(self, msg: Any) -> None:
        if not isinstance(msg, Generate):
            log.error("colocated worker ignores %s", type(msg).__name__)
            return
        if not self.fits(msg.request_id, len(msg.prompt_ids)):
            return
        self.scheduler.add(Sequence(msg.request_id, msg.prompt_ids, msg.params, frozenset(msg.eos_token_ids)))
