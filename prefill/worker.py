"""The prefill worker: computes prompts and ships their KV to the decode worker the router chose.

A request's life here:
1. ``Prefill`` arrives with the prompt, the decode worker's KV endpoint and the blocks it reserved;
   the sequence waits in the queue (WAITING).
2. Its prompt is prefilled in chunks under the step's token budget, batched with other prompts.
3. The last chunk yields the first token: it goes to the router at once (this is the TTFT), and the
   sequence is parked (HANDOFF) while its KV blocks are pushed to the decode worker, with the first
   token riding on the transfer's final message.
4. When the transfer is done the blocks are freed and the router is told ``HandedOff``; if it fails
   the router gets an error delta (and aborts the decode side), and the blocks are freed all the same.
   An ``Abort`` at any point cancels the transfer and frees the blocks.
"""

from __future__ import annotations

from typing import Any

from pdfabric.config import WorkerConfig
from pdfabric.control import HandedOff, Prefill, StepOutputs, TokenDelta
from pdfabric.engine.sequence import SeqState, Sequence
from pdfabric.kvtransfer.link import KVSender
from pdfabric.worker import Worker, delta_of, log


class PrefillWorker(Worker):
    on_prefilled = "handoff"

    def __init__(self, cfg: WorkerConfig, parent_pid: int = 0) -> None:
        super().__init__(cfg, parent_pid)
        self.sender = KVSender(self.runner.kv_caches, self.cfg.block_size)
        self.sender.on_new_socket = self.watch
        self._targets: dict[str, tuple[str, tuple[int, ...]]] = {}  # request -> (endpoint, remote blocks)

    def handle(self, msg: Any) -> None:
        if not isinstance(msg, Prefill):
            log.error("prefill worker ignores %s", type(msg).__name__)
            return
        if not self.fits(msg.request_id, len(msg.prompt_ids)):
            return
        self._targets[msg.request_id] = (msg.kv_endpoint, msg.block_ids)
        self.scheduler.add(Sequence(msg.request_id, msg.prompt_ids, msg.params, frozenset(msg.eos_token_ids)))

    def after_step(self, changed: list[Sequence]) -> list[TokenDelta]:
        deltas = []
        for seq in changed:
            if seq.state is not SeqState.HANDOFF:
                continue
            endpoint, remote_blocks = self._targets.pop(seq.request_id)
            first = delta_of(seq)
            deltas.append(
                TokenDelta(first.request_id, 0, first.token_ids, first.logprobs)
            )  # never a finish here
            self.sender.start(
                seq.request_id,
                endpoint,
                tuple(self.tables.table(seq.request_id)),
                remote_blocks,
                seq.output_ids[0],
                seq.output_logprobs[0],
            )
        return deltas

    def poll_transfers(self) -> None:
        for result in self.sender.poll():
            self.scheduler.finish(result.request_id, "handed_off" if result.ok else "error")
            if result.ok:
                self.send(HandedOff(self.worker_id, result.request_id, result.nbytes, result.seconds))
            else:
                error = f"KV transfer to the decode worker failed: {result.reason}"
                self.send(
                    StepOutputs(self.worker_id, (TokenDelta(result.request_id, 0, (), (), "error", error),))
                )

    def abort(self, request_id: str, reason: str) -> None:
        self._targets.pop(request_id, None)
        self.sender.abort(request_id, reason)
        self.scheduler.finish(request_id, reason)

    def close(self) -> None:
        self.sender.close()
        super().close()
