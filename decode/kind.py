"""The decode kinds: ``DECODE``, a ``DecodeCore`` (``decode.core``) whose KV side is a kvtransfer
``KVReceiver`` bound at the worker's KV endpoint (``ReceiverSide``), and ``COLOCATED``, a
``ColocatedCore`` that prefills its own prompts and moves no KV.

On a CPU a decode worker's cache lives in anonymous shared memory, so that a prefill worker on the
same host writes the blocks straight into it; others send ZeroMQ frames (or use torch.distributed
when configured)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from pdfabric.cluster_secret import ClusterSecret
from pdfabric.decode.core import ColocatedCore, DecodeCore
from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.reservations import BlockReservations
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.worker.kind import WorkerKind
from pdfabric.worker.kv import CancelKV, ExpectKV, OpenPush, PushKV
from pdfabric.worker_config import WorkerConfig

if TYPE_CHECKING:
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.kvtransfer.shm_pool import SharedKVPool

QUARANTINE_S = 3.0  # a failed shared-memory transfer's blocks: back to the pool after this, at the latest


class ReceiverSide:
    """A decode worker's KV side: ``ExpectKV`` / ``CancelKV`` on the receiver state machine; the blocks
    it releases (after a failure or abort) are reported back for the core to free. It owns the shared
    memory the caches live in, when they do (``shm``), and frees it on ``close``."""

    def __init__(
        self, caches: list, config: TransferConfig, host: str, shm: SharedKVPool | None, tiled: bool
    ) -> None:
        self.shm = shm
        shm_paths = shm.paths if shm is not None else ()
        self._released: list[str] = []
        self._failed: list[TransferResult] = []
        from pdfabric.kvtransfer.receiver import KVReceiver  # with torch: the kind stays torch-free

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

    def refused_peers(self) -> int:
        return self.receiver.refusals.count

    def close(self) -> None:
        self.receiver.close()
        if self.shm is not None:
            self.shm.close()


def open_receiver(
    cfg: WorkerConfig, worker_id: str, runner: ModelRunner, secret: ClusterSecret | None
) -> ReceiverSide:
    """A decode worker's KV side: on a CPU with shared memory allowed, the runner's caches move into
    an anonymous shared-memory pool first, so that a prefill worker on this host can write into them."""
    from pdfabric.kvtransfer.shm_pool import SharedKVPool  # with torch: the kind stays torch-free

    shm = None
    if runner.device.type == "cpu" and cfg.kv_transport in ("auto", "shm"):
        first = runner.kv_caches[0]
        shm = SharedKVPool.create(
            runner.config.num_layers, first.shape[1], first.shape[2], first.shape[3], first.shape[4],
            first.dtype, anonymous=True,
        )  # fmt: skip
        runner.kv_caches = shm.caches
    config = TransferConfig(
        transport=cfg.kv_transport, name=worker_id, shm_quarantine_s=QUARANTINE_S, secret=secret,
        encrypt=cfg.kv_encryption,
    )  # fmt: skip
    return ReceiverSide(runner.kv_caches, config, cfg.kv_host, shm, runner.kv_tiled)


DECODE = WorkerKind("decode", DecodeCore, open_receiver)
COLOCATED = WorkerKind("colocated", ColocatedCore)
