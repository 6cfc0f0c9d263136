"""The prefill worker's core: prompts in, first tokens and KV pushes out (no sockets, no clocks).

A request's life here:
1. ``Prefill`` arrives with the prompt, the decode worker's KV endpoint and the blocks it reserved;
   the sequence waits in the queue (WAITING). A prompt that cannot fit ends at once with an error.
2. Its prompt is prefilled in chunks under the step's token budget, batched with other prompts.
3. The step that runs its last chunk opens its transfer (``Step.opens``), so the driver can ship each
   layer as the model finishes it; the step yields the first token: it goes to the router at once
   (this is the TTFT), and the sequence is parked (HANDOFF, its blocks held) while ``PushKV`` ships
   what is left (the last layer, or everything) with the first token riding on it.
4. The transfer ends (``transfer_ended``): DONE frees the blocks and tells the router ``HandedOff``
   (bytes and seconds, which also feed the heartbeat's KV rate); FAILED frees them and sends an error
   delta (the router aborts the decode side). An ``Abort`` at any point frees the blocks and sends
   ``CancelKV``.
"""

from __future__ import annotations

from dataclasses import replace

from pdfabric.control import HandedOff, Prefill, TokenDelta
from pdfabric.engine.prefix_cache import HostTier
from pdfabric.engine.sequence import SeqState, Sequence
from pdfabric.engine.speculate import Proposer
from pdfabric.kvtransfer.state import TransferResult
from pdfabric.worker.core import Out, Step, WorkerCore, WrongMessage, delta_of
from pdfabric.worker.kv import CancelKV, OpenPush, PushKV
from pdfabric.worker.spec import CoreSpec, ProfileSource


class PrefillCore(WorkerCore):
    on_prefilled = "handoff"
    embeds = True

    def __init__(
        self,
        spec: CoreSpec,
        profile: ProfileSource,
        kv_endpoint: str = "",
        proposer: Proposer | None = None,
        store: HostTier | None = None,
    ) -> None:
        super().__init__(spec, profile, kv_endpoint, store=store)  # a prefill worker never speculates
        # request -> (endpoint, remote blocks, leading local blocks the decode worker has cached)
        self._targets: dict[str, tuple[str, tuple[int, ...], int]] = {}

    def on_message(self, msg: object) -> Out:
        if not isinstance(msg, Prefill):
            raise WrongMessage(f"a prefill worker cannot handle {type(msg).__name__}")
        reason = self.too_long(msg.request_id, len(msg.prompt_ids))
        if reason:
            return self.error(msg.request_id, 0, reason)
        self._targets[msg.request_id] = (msg.kv_endpoint, msg.block_ids, msg.skip_blocks)
        self.scheduler.add(Sequence(msg.request_id, msg.prompt_ids, msg.params, frozenset(msg.eos_token_ids)))
        return []

    def schedule(self) -> Step | None:
        """The next step, with an ``OpenPush`` for each prompt whose last chunk it runs (its blocks
        are all allocated by now, and the step writes their final KV layer by layer)."""
        step = super().schedule()
        if step is None:
            return None
        opens = tuple(self._open(c.seq.request_id) for c in step.chunks if c.sample)
        return Step(step.chunks, step.shape, opens)

    def _open(self, request_id: str) -> OpenPush:
        endpoint, remote, skip = self._targets[request_id]
        return OpenPush(request_id, endpoint, tuple(self.tables.table(request_id)[skip:]), remote)

    def stepped(self, changed: list[Sequence]) -> Out:
        deltas: list[TokenDelta] = []
        pushes: Out = []
        for seq in changed:
            if seq.state is not SeqState.HANDOFF:
                continue
            endpoint, remote, skip = self._targets.pop(seq.request_id)
            first = delta_of(seq)
            deltas.append(replace(first, finish_reason=None))  # never a finish: decoding goes on elsewhere
            local = tuple(self.tables.table(seq.request_id)[skip:])
            pushes.append(
                PushKV(
                    seq.request_id, endpoint, local, remote,
                    seq.output_ids[0], seq.output_logprobs[0], seq.output_top[0],
                )  # fmt: skip
            )
        return self.outputs(deltas) + pushes

    def transfer_ended(self, result: TransferResult) -> Out:
        rid = result.request_id
        seq = self.scheduler.get(rid)
        if seq is None or seq.state is not SeqState.HANDOFF:
            return []  # aborted meanwhile: its blocks are already free
        self.scheduler.finish(rid, "handed_off" if result.ok else "error")
        if not result.ok:
            return self.error(rid, 0, f"KV transfer to the decode worker failed: {result.reason}")
        self.kv_rates.add(result)
        return [HandedOff(self.worker_id, rid, result.nbytes, result.seconds)]

    def abort(self, request_id: str, reason: str) -> Out:
        self._targets.pop(request_id, None)
        seq = self.scheduler.get(request_id)
        pushing = seq is not None and seq.state is SeqState.HANDOFF
        self.scheduler.finish(request_id, reason)
        return [CancelKV(request_id, reason)] if pushing else []
