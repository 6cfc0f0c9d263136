"""KV transfer with caches on a CUDA device: GPU to GPU over ZeroMQ, GPU sender into a host shm pool,
host sender into a GPU receiver. Bit-identical, nothing leaks."""

from __future__ import annotations

import pytest
import torch

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.shm_pool import SharedKVPool
from tests.kvtransfer_helpers import FakePool, digest, make_caches, pump

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

LAYERS, BLOCKS = 3, 96


@pytest.mark.parametrize(
    ("src_dev", "dst"), [("cuda", "cuda"), ("cuda", "shm"), ("cpu", "cuda"), ("cuda", "cpu")]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_round_trip(src_dev: str, dst: str, dtype: torch.dtype) -> None:
    spool, rpool = FakePool(BLOCKS), FakePool(BLOCKS)
    src = [c.to(src_dev) for c in make_caches(LAYERS, BLOCKS, dtype, seed=4)]
    shm = SharedKVPool.create(LAYERS, BLOCKS, 4, 2, 8, dtype) if dst == "shm" else None
    dst_caches = shm.caches if shm else [c.to(dst) for c in make_caches(LAYERS, BLOCKS, dtype, None)]
    cfg = TransferConfig(transport="shm" if shm else "zmq", timeout_s=20, checksum=True)
    receiver = KVReceiver(dst_caches, cfg, rpool.reservations(), shm_paths=shm.paths if shm else ())
    sender = KVSender(src, cfg, spool.reservations())
    try:
        for rid, n, scattered, layerwise in (
            ("a", 1, False, False),
            ("b", 40, True, True),
            ("c", 40, False, True),
        ):
            local, remote = spool.allocate(n, scattered), rpool.allocate(n, not scattered)
            receiver.expect(rid, remote)
            sender.start(rid, receiver.endpoint, local, remote)
            if layerwise:
                for layer in range(LAYERS):
                    sender.send_layers(rid, layer, layer + 1)
            else:
                sender.send(rid)
            sent, got = pump(sender, receiver, 1, timeout_s=20)
            assert [r.ok for r in sent + got] == [True, True], (sent, got)
            cpu_dst = [c.cpu() for c in dst_caches]
            assert digest(cpu_dst, remote) == digest([c.cpu() for c in src], local)
            rpool.release(rid, remote)
    finally:
        sender.close()
        receiver.close()
        if shm:
            shm.close()
    assert spool.all_free and rpool.all_free
