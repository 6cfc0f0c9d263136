"""The prefill worker process: the ZeroMQ loop (``pdfabric.worker``) around a ``PrefillCore``, with a
kvtransfer ``KVSender`` as its KV side.

A request's life here (the core's states, ``prefill.core``):
1. WAITING: ``Prefill`` queued it with the decode worker's KV endpoint and reserved blocks;
2. prefilled in chunks, batched with other prompts; the last chunk samples the first token, which
   goes to the router at once;
3. HANDOFF: ``PushKV`` starts the sender's transfer (WAITING for the receiver's ``PeerInfo``, then
   TRANSFERRING, over shared memory, ZeroMQ tcp or torch.distributed as the pair allows);
4. the transfer ends DONE (``HandedOff``, blocks freed) or FAILED (error delta, blocks freed); an
   ``Abort`` cancels it at any point.
"""

from __future__ import annotations

import zmq

from pdfabric.config import WorkerConfig
from pdfabric.core import CancelKV, CoreSpec, ExpectKV, ProfileSource, PushKV, WorkerCore
from pdfabric.kvtransfer.config import TransferConfig
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.state import TransferResult
from pdfabric.prefill.core import PrefillCore
from pdfabric.worker import KVSide, Worker


class SenderSide:
    """A prefill worker's KV side: ``PushKV`` ships every layer through the sender state machine."""

    endpoint = ""

    def __init__(self, sender: KVSender) -> None:
        self.sender = sender

    def sockets(self) -> list[zmq.Socket]:
        return self.sender.sockets()

    def command(self, cmd: PushKV | ExpectKV | CancelKV) -> None:
        if isinstance(cmd, PushKV):
            self.sender.start(cmd.request_id, cmd.endpoint, cmd.local_blocks, cmd.remote_blocks)
            meta = {"first_token": cmd.first_token, "first_logprob": cmd.first_logprob}
            self.sender.send(cmd.request_id, meta)
        elif isinstance(cmd, CancelKV):
            self.sender.abort(cmd.request_id, cmd.reason)
        else:
            raise TypeError(f"a prefill worker's KV side cannot {type(cmd).__name__}")

    def poll(self) -> tuple[list[TransferResult], list[str]]:
        return self.sender.poll(), []

    def close(self) -> None:
        self.sender.close()


class PrefillWorker(Worker):
    def make_core(self, cfg: WorkerConfig, spec: CoreSpec, profile: ProfileSource) -> WorkerCore:
        return PrefillCore(spec, profile)

    def make_kv(self, cfg: WorkerConfig) -> KVSide | None:
        config = TransferConfig(transport=cfg.kv_transport, name=self.worker_id)
        return SenderSide(KVSender(self.runner.kv_caches, config))
