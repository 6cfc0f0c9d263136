"""The decode worker: receives prompts' KV from prefill workers and decodes them in one running batch.

A request's life here:
1. ``Reserve`` arrives: blocks for the prompt are reserved and their ids sent back (``Reserved``);
   the sequence waits for its KV (WAITING_FOR_KV). No room: an empty reply with the reason.
2. A prefill worker pushes the prompt's KV into those blocks; its last message carries the first
   token. The sequence joins the running batch at the next step boundary (RUNNING).
3. One token per step, streamed to the router in each step's ``StepOutputs``.
4. It ends (FINISHED) on a stop token, its length limit, an ``Abort`` or a failed transfer; its blocks
   return to the pool. A transfer that fails ends the request with an error delta.
"""

from __future__ import annotations

from typing import Any

from pdfabric.config import WorkerConfig
from pdfabric.control import Reserve, Reserved, StepOutputs, TokenDelta
from pdfabric.engine.sequence import Sequence
from pdfabric.kvtransfer.link import KVReceiver
from pdfabric.worker import Worker, log


class DecodeWorker(Worker):
    on_prefilled = "decode"  # only preempted sequences are prefilled (recomputed) here

    def __init__(self, cfg: WorkerConfig, parent_pid: int = 0) -> None:
        super().__init__(cfg, parent_pid)
        self.receiver = KVReceiver(self.runner.kv_caches, self.cfg.block_size, self.cfg.kv_host)
        self.watch(self.receiver.sock)

    def kv_endpoint(self) -> str:
        return self.receiver.endpoint

    def handle(self, msg: Any) -> None:
        if not isinstance(msg, Reserve):
            log.error("decode worker ignores %s", type(msg).__name__)
            return
        seq = Sequence(msg.request_id, msg.prompt_ids, msg.params, frozenset(msg.eos_token_ids))
        if len(msg.prompt_ids) >= self.max_model_len:
            blocks, reason = None, f"prompt of {len(msg.prompt_ids)} tokens does not fit {self.max_model_len}"
        else:
            blocks, reason = self.scheduler.reserve(seq), "no free KV blocks"
        if blocks is None:
            self.send(Reserved(self.worker_id, msg.request_id, (), reason))
            return
        self.receiver.expect(msg.request_id, tuple(blocks))
        self.send(Reserved(self.worker_id, msg.request_id, tuple(blocks)))

    def poll_transfers(self) -> None:
        deltas = []
        for result in self.receiver.poll():
            if not result.ok:
                self.scheduler.finish(result.request_id, "error")
                error = f"KV transfer from the prefill worker failed: {result.reason}"
                deltas.append(TokenDelta(result.request_id, 1, (), (), "error", error))
                continue
            seq = self.scheduler.kv_arrived(result.request_id, result.first_token, result.first_logprob)
            if seq is not None and seq.finish_reason is not None:  # the first token ended it
                deltas.append(TokenDelta(seq.request_id, 1, (), (), seq.finish_reason))
        if deltas:
            self.send(StepOutputs(self.worker_id, tuple(deltas)))

    def abort(self, request_id: str, reason: str) -> None:
        self.receiver.abort(request_id, reason)
        self.scheduler.finish(request_id, reason)

    def close(self) -> None:
        self.receiver.close()
        super().close()
