"""The prefill worker process: the ZeroMQ loop (``pdfabric.worker.loop``) around a ``PrefillCore``, with a
kvtransfer ``KVSender`` as its KV side.

A request's life here (the core's states, ``prefill.core``):
1. WAITING: ``Prefill`` queued it with the decode worker's KV endpoint and reserved blocks;
2. prefilled in chunks, batched with other prompts; the last chunk samples the first token, which
   goes to the router at once;
3. the step that runs its last chunk starts the sender's transfer (WAITING for the receiver's
   ``PeerInfo``, then TRANSFERRING, over shared memory, ZeroMQ tcp or torch.distributed as the pair
   allows) and ships each layer as the model finishes it; HANDOFF: ``PushKV`` after the step ships
   the last layer with the first token;
4. the transfer ends DONE (``HandedOff``, blocks freed) or FAILED (error delta, blocks freed); an
   ``Abort`` cancels it at any point.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import zmq

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.state import TransferResult
from pdfabric.prefill.core import PrefillCore
from pdfabric.worker.core import (
    CancelKV,
    CoreSpec,
    ExpectKV,
    OpenPush,
    ProfileSource,
    PushKV,
    WorkerCore,
    kv_meta,
)
from pdfabric.worker.loop import KVSide, Worker
from pdfabric.worker_config import WorkerConfig


class SenderSide:
    """A prefill worker's KV side over the sender state machine. Layer by layer when the cache is on
    the CPU: ``layer_hook`` starts the step's ``OpenPush`` transfers and ships layer ``i`` of each as
    the model finishes it (all but the last); ``PushKV`` after the step ships the rest with the first
    token. Elsewhere (a GPU cache, where a per-layer host copy would stall the device) ``PushKV``
    ships every layer at once.

    A transfer's reported ``seconds`` run from ``PushKV`` (the end of the prefill step) to the
    receiver's acknowledgement: the latency the transfer adds after the compute, which is what the
    router's TTFT prediction and the heartbeat's KV rate stand for. Counting from the layer-wise
    start would charge the step's own compute to the link."""

    endpoint = ""

    def __init__(self, sender: KVSender) -> None:
        self.sender = sender
        self.num_layers = sender.layout.num_layers
        self.layerwise = sender.caches[0].device.type == "cpu"
        self._sent: dict[str, int] = {}  # request -> layers shipped so far
        self._pushed: dict[str, float] = {}  # request -> when PushKV came (monotonic seconds)

    def layer_hook(self, opens: tuple[OpenPush, ...]) -> Callable[[int], None] | None:
        if not self.layerwise:
            return None
        for o in opens:
            self.sender.start(o.request_id, o.endpoint, o.local_blocks, o.remote_blocks)
            self._sent[o.request_id] = 0
        ids = [o.request_id for o in opens]

        def after_layer(layer: int) -> None:
            if layer + 1 >= self.num_layers:  # the last layer leaves with the first token
                return
            for rid in ids:
                self.sender.send_layers(rid, layer, layer + 1)
                self._sent[rid] = layer + 1

        return after_layer

    def sockets(self) -> list[zmq.Socket]:
        return self.sender.sockets()

    def command(self, cmd: PushKV | ExpectKV | CancelKV) -> None:
        if isinstance(cmd, PushKV):
            self._pushed[cmd.request_id] = time.monotonic()
            sent = self._sent.pop(cmd.request_id, None)
            if sent is None:
                self.sender.start(cmd.request_id, cmd.endpoint, cmd.local_blocks, cmd.remote_blocks)
                sent = 0
            meta = kv_meta(cmd)
            self.sender.send_layers(cmd.request_id, sent, self.num_layers, meta)
        elif isinstance(cmd, CancelKV):
            self._sent.pop(cmd.request_id, None)
            self._pushed.pop(cmd.request_id, None)
            self.sender.abort(cmd.request_id, cmd.reason)
        else:
            raise TypeError(f"a prefill worker's KV side cannot {type(cmd).__name__}")

    def poll(self) -> tuple[list[TransferResult], list[str]]:
        results = self.sender.poll()
        now = time.monotonic()
        for i, r in enumerate(results):
            pushed = self._pushed.pop(r.request_id, None)
            if pushed is not None:
                results[i] = replace(r, seconds=max(0.0, now - pushed))
        return results, []

    def close(self) -> None:
        self.sender.close()


class PrefillWorker(Worker):
    def make_core(self, cfg: WorkerConfig, spec: CoreSpec, profile: ProfileSource) -> WorkerCore:
        return PrefillCore(spec, profile)

    def make_kv(self, cfg: WorkerConfig) -> KVSide | None:
        config = TransferConfig(transport=cfg.kv_transport, name=self.worker_id)
        return SenderSide(KVSender(self.runner.kv_caches, config, tiled=self.runner.kv_tiled))
