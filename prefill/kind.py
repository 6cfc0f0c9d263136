"""The prefill kind (``PREFILL``): a ``PrefillCore`` (``prefill.core``) whose KV side is a kvtransfer
``KVSender`` (``SenderSide``): each finished prompt's blocks leave for the decode worker's reserved
ones, layer by layer as the model computes them where the cache is on the CPU, the first token with
the last layer."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import zmq

from pdfabric.cluster_secret import ClusterSecret
from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.state import TransferResult
from pdfabric.prefill.core import PrefillCore
from pdfabric.worker.kind import WorkerKind
from pdfabric.worker.kv import CancelKV, ExpectKV, OpenPush, PushKV, kv_meta
from pdfabric.worker_config import WorkerConfig

if TYPE_CHECKING:
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.kvtransfer.sender import KVSender


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

    def refused_peers(self) -> int:
        return 0  # it binds nothing: it connects to the decode workers' endpoints

    def close(self) -> None:
        self.sender.close()


def open_sender(
    cfg: WorkerConfig, worker_id: str, runner: ModelRunner, secret: ClusterSecret | None
) -> SenderSide:
    """A prefill worker's KV side: a sender over the runner's caches, as they are laid out. (The sender
    is imported here, with torch: the kind itself, and so the simulator, stays torch-free.)"""
    from pdfabric.kvtransfer.sender import KVSender

    config = TransferConfig(
        transport=cfg.kv_transport, name=worker_id, secret=secret, encrypt=cfg.kv_encryption
    )
    return SenderSide(KVSender(runner.kv_caches, config, tiled=runner.kv_tiled))


PREFILL = WorkerKind("prefill", PrefillCore, open_sender)
