"""The decode-side cores (no sockets, no clocks, no torch): ``DecodeCore`` for a disaggregated decode
worker, ``ColocatedCore`` for a worker that also prefills.

A request's life in a ``DecodeCore``:
1. ``Reserve`` arrives: blocks for the prompt are reserved, ``ExpectKV`` tells the KV receiver to
   accept them, and their ids go back to the router (``Reserved``); the sequence waits for its KV
   (WAITING_FOR_KV). No room, or a prompt that cannot fit: an empty ``Reserved`` with the reason.
2. The KV lands (``transfer_ended`` DONE); its first token rides on it. Blocks of the prompt that
   the host store held (found, not read, at the reservation) are read in. The sequence joins the
   running batch at the next step boundary (RUNNING), or ends at once if that token finished it; if
   a store block failed its check, it is first computed again here from there (WAITING).
3. One token per step, streamed to the router in each step's ``StepOutputs``.
4. It ends (FINISHED) on a stop token or its length limit (blocks freed at once), or while its KV is
   still in flight: on an ``Abort`` (``CancelKV``) or a failed transfer (an error delta). Then its
   blocks stay out of the pool (held by the worker's ``BlockTables``, their one owner) until the
   receiver says no sender can still write into them (``kv_released``).
A decode worker that holds most of a prompt in its prefix cache may get it as ``Generate`` instead
(the router's local prefill): it then lives as in a ``ColocatedCore``.

A request's life in a ``ColocatedCore``:
1. ``Generate`` arrives: the sequence waits in the queue (WAITING); a prompt that cannot fit ends at
   once with an error delta.
2. Its prompt is prefilled in chunks under the step's token budget, beside running decodes.
3. Its last prompt chunk yields the first token; it decodes one token per step (RUNNING), each sent
   to the router in the step's ``StepOutputs``.
4. It ends (FINISHED) on a stop token, its length limit, or an ``Abort``; its blocks return to the pool.
"""

from __future__ import annotations

from pdfabric.control import Generate, Reserve, Reserved, TokenDelta
from pdfabric.engine.sequence import SeqState, Sequence
from pdfabric.kvtransfer.state import TransferResult
from pdfabric.worker.core import Out, WorkerCore, WrongMessage
from pdfabric.worker.kv import CancelKV, ExpectKV, first_token_of


class DecodeCore(WorkerCore):
    on_prefilled = "decode"  # preempted sequences are recomputed here, and prompts sent with Generate

    def on_message(self, msg: object) -> Out:
        if isinstance(msg, Generate):  # its prefix is cached here: the router chose to prefill the rest here
            return _queue_prompt(self, msg)
        if not isinstance(msg, Reserve):
            raise WrongMessage(f"a decode worker cannot handle {type(msg).__name__}")
        rid = msg.request_id
        seq = Sequence(rid, msg.prompt_ids, msg.params, frozenset(msg.eos_token_ids), branches=msg.branches)
        reason = self.cannot_take(msg)
        if reason:
            return [Reserved(self.worker_id, rid, (), reason)]
        reserved = self.scheduler.reserve(seq)
        if reserved is None:
            return [Reserved(self.worker_id, rid, (), "no free KV blocks", no_room=True)]
        table, cached = reserved
        sent = tuple(table[cached:])  # the cached prefix's KV is here already
        return [ExpectKV(rid, sent), Reserved(self.worker_id, rid, sent, cached_blocks=cached)]

    def transfer_ended(self, result: TransferResult) -> Out:
        rid = result.request_id
        seq = self.scheduler.get(rid)
        if seq is None or seq.state is not SeqState.WAITING_FOR_KV:
            return []  # aborted meanwhile
        if not result.ok:
            self._quarantine(rid, "error")
            return self.error(rid, 1, f"KV transfer from the prefill worker failed: {result.reason}")
        seq = self.scheduler.kv_arrived(rid, *first_token_of(result.meta))
        if seq is not None and seq.finish_reason is not None:  # the first token ended it
            return self.outputs([TokenDelta(rid, 1, (), (), seq.finish_reason, choice=seq.params.choice)])
        return []

    def abort(self, request_id: str, reason: str) -> Out:
        seq = self.scheduler.get(request_id)
        if seq is not None and seq.state is SeqState.WAITING_FOR_KV:
            self._quarantine(request_id, reason)
            return [CancelKV(request_id, reason)]
        self.scheduler.finish(request_id, reason)
        return []

    def kv_released(self, request_id: str) -> Out:
        self.tables.free_held(request_id)
        return []

    def _quarantine(self, request_id: str, reason: str) -> None:
        """Ends the sequence but keeps its blocks out of the pool until ``kv_released``."""
        self.tables.hold(request_id)
        self.scheduler.finish(request_id, reason)


class ColocatedCore(WorkerCore):
    on_prefilled = "decode"
    embeds = True

    def on_message(self, msg: object) -> Out:
        if not isinstance(msg, Generate):
            raise WrongMessage(f"a colocated worker cannot handle {type(msg).__name__}")
        return _queue_prompt(self, msg)


def _queue_prompt(core: WorkerCore, msg: Generate) -> Out:
    """Queues a prompt for prefill and decoding here; one that cannot fit ends at once with an error."""
    reason = core.cannot_take(msg)
    if reason:
        return core.error(msg.request_id, 0, reason)
    eos = frozenset(msg.eos_token_ids)
    core.scheduler.add(Sequence(msg.request_id, msg.prompt_ids, msg.params, eos, branches=msg.branches))
    return []
