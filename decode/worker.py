"""The decode worker process: the ZeroMQ loop (``pdfabric.worker.loop``) around a ``DecodeCore``, with a
kvtransfer ``KVReceiver`` as its KV side, bound at the worker's KV endpoint.

A request's life here (the core's states, ``decode.core``):
1. WAITING_FOR_KV: ``Reserve`` reserved its blocks; ``ExpectKV`` registers them with the receiver
   (WAITING), whose checks then accept chunks only for exactly those blocks (TRANSFERRING);
2. RUNNING once every layer has landed (the receiver's DONE; the first token rides on it);
3. one token per step, streamed to the router;
4. FINISHED on a stop token or its length (blocks freed), or on an ``Abort`` / failed transfer while
   the KV is in flight: then the receiver holds the blocks until no sender can still write into them
   and reports them released (``kv_released``), which returns them to the pool.

On a CPU the cache lives in anonymous shared memory, so a prefill worker on the same host writes
the blocks straight into it; others send ZeroMQ frames (or use torch.distributed when configured).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from pdfabric.decode.core import DecodeCore
from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.reservations import BlockReservations
from pdfabric.kvtransfer.shm_pool import SharedKVPool
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.worker.core import CancelKV, CoreSpec, ExpectKV, OpenPush, ProfileSource, PushKV, WorkerCore
from pdfabric.worker.loop import KVSide, Worker
from pdfabric.worker_config import WorkerConfig

QUARANTINE_S = 3.0  # a failed shared-memory transfer's blocks: back to the pool after this, at the latest


class ReceiverSide:
    """A decode worker's KV side: ``ExpectKV`` / ``CancelKV`` on the receiver state machine; the blocks
    it releases (after a failure or abort) are reported back for the core to free."""

    def __init__(
        self, caches: list, config: TransferConfig, host: str, shm_paths: tuple[str, ...], tiled: bool
    ) -> None:
        self._released: list[str] = []
        self._failed: list[TransferResult] = []
        reservations = BlockReservations(release=lambda rid, _: self._released.append(rid))
        self.receiver = KVReceiver(caches, config, reservations, f"tcp://{host}:*", shm_paths, tiled=tiled)
        self.endpoint = self.receiver.endpoint

    def sockets(self) -> list[zmq.Socket]:
        return [self.receiver.sock]

    def layer_hook(self, opens: tuple[OpenPush, ...]) -> Callable[[int], None] | None:
        return None

    def command(self, cmd: PushKV | ExpectKV | CancelKV) -> None:
        rid = cmd.request_id
        if isinstance(cmd, ExpectKV):
            try:
                self.receiver.expect(rid, cmd.blocks)
            except ValueError as exc:  # the core reserved them, so this is a bug: fail the request
                self._failed.append(TransferResult(rid, TransferState.FAILED, str(exc)))
                self._released.append(rid)
        elif isinstance(cmd, CancelKV):
            if self.receiver.state(rid) is None:  # already ended: nothing can write into the blocks
                self._released.append(rid)
            else:
                self.receiver.abort(rid, cmd.reason)
        else:
            raise TypeError(f"a decode worker's KV side cannot {type(cmd).__name__}")

    def poll(self) -> tuple[list[TransferResult], list[str]]:
        results = self._failed + self.receiver.poll()
        released, self._released, self._failed = self._released, [], []
        return results, released

    def close(self) -> None:
        self.receiver.close()


class DecodeWorker(Worker):
    def make_core(self, cfg: WorkerConfig, spec: CoreSpec, profile: ProfileSource) -> WorkerCore:
        return DecodeCore(spec, profile)

    def make_kv(self, cfg: WorkerConfig) -> KVSide | None:
        runner = self.runner
        self.shm: SharedKVPool | None = None
        if runner.device.type == "cpu" and cfg.kv_transport in ("auto", "shm"):
            c = runner.config
            first = runner.kv_caches[0]
            self.shm = SharedKVPool.create(
                c.num_layers, first.shape[1], first.shape[2], first.shape[3], first.shape[4], first.dtype,
                anonymous=True,
            )  # fmt: skip
            runner.kv_caches = self.shm.caches
        config = TransferConfig(
            transport=cfg.kv_transport, name=self.worker_id, shm_quarantine_s=QUARANTINE_S
        )
        paths = self.shm.paths if self.shm is not None else ()
        return ReceiverSide(runner.kv_caches, config, cfg.kv_host, paths, runner.kv_tiled)

    def close(self) -> None:
        super().close()
        if self.shm is not None:
            self.shm.close()
