"""Round trips through each transport in one process: blocks arrive bit-identical, nothing leaks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.shm_pool import SharedKVPool
from pdfabric.kvtransfer.state import TransferResult, TransferState
from tests.kvtransfer_helpers import FakePool, digest, make_caches, pump

LAYERS = 3


class Pair:
    """A sender and a receiver over one transport, each with its own fake block pool."""

    def __init__(
        self,
        transport: str,
        bind: str,
        dtype: torch.dtype,
        blocks: int,
        checksum: bool,
        chunk_bytes: int = TransferConfig.chunk_bytes,
    ) -> None:
        self.src_pool, self.dst_pool = FakePool(blocks), FakePool(blocks)
        self.src = make_caches(LAYERS, blocks, dtype, seed=1)
        self.shm: SharedKVPool | None = None
        if transport == "shm":
            self.shm = SharedKVPool.create(LAYERS, blocks, 4, 2, 8, dtype)
            self.dst = self.shm.caches
        else:
            self.dst = make_caches(LAYERS, blocks, dtype, seed=None)
        cfg = TransferConfig(transport=transport, timeout_s=10, checksum=checksum, chunk_bytes=chunk_bytes)
        self.receiver = KVReceiver(
            self.dst, cfg, self.dst_pool.reservations(), bind, shm_paths=self.shm.paths if self.shm else ()
        )
        self.sender = KVSender(self.src, cfg, self.src_pool.reservations())

    def transfer(self, rid: str, n: int, layerwise: bool, scattered: bool) -> tuple[TransferResult, ...]:
        local = self.src_pool.allocate(n, scattered)
        remote = self.dst_pool.allocate(n, not scattered)
        self.receiver.expect(rid, remote)
        self.sender.start(rid, self.receiver.endpoint, local, remote)
        if layerwise:
            for layer in range(LAYERS):
                self.sender.send_layers(
                    rid, layer, layer + 1, {"first_token": 42} if layer == LAYERS - 1 else None
                )
        else:
            self.sender.send(rid, {"first_token": 42})
        sent, got = pump(self.sender, self.receiver, 1)
        assert [r.state for r in sent + got] == [TransferState.DONE] * 2, (sent, got)
        assert digest(self.dst, remote) == digest(self.src, local)
        assert got[0].meta == {"first_token": 42} and got[0].layers == LAYERS
        assert got[0].nbytes == sent[0].nbytes == 2 * LAYERS * n * 4 * 2 * 8 * self.src[0].element_size()
        self.dst_pool.release(rid, remote)  # the decode worker owns handed-over blocks; free them here
        return sent[0], got[0]

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        if self.shm is not None:
            self.shm.close()
        assert self.src_pool.all_free and self.dst_pool.all_free


def _bind(kind: str, tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/kv.sock" if kind == "zmq-ipc" else "tcp://127.0.0.1:*"


@pytest.fixture
def pair_factory(tmp_path: Path) -> Iterator:
    made: list[Pair] = []

    def make(
        kind: str, dtype: torch.dtype = torch.bfloat16, blocks: int = 64, checksum: bool = False
    ) -> Pair:
        transport = "shm" if kind == "shm" else "zmq"
        made.append(Pair(transport, _bind(kind, tmp_path), dtype, blocks, checksum))
        return made[-1]

    yield make
    for p in made:
        p.close()


KINDS = ["zmq-tcp", "zmq-ipc", "shm"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])  # int8 rows
def test_round_trip_dtypes(pair_factory, kind: str, dtype: torch.dtype) -> None:
    pair = pair_factory(kind, dtype, checksum=True)
    pair.transfer("a", 5, layerwise=False, scattered=False)
    pair.transfer("b", 5, layerwise=True, scattered=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 17, 300])
@pytest.mark.parametrize("layerwise", [False, True])
def test_round_trip_block_counts(pair_factory, kind: str, n: int, layerwise: bool) -> None:
    pair = pair_factory(kind, blocks=2 * n + 2)
    pair.transfer("r", n, layerwise=layerwise, scattered=False)
    pair.transfer("s", n, layerwise=layerwise, scattered=True)


@pytest.mark.parametrize("kind", KINDS)
def test_many_concurrent_requests(pair_factory, kind: str) -> None:
    pair = pair_factory(kind, blocks=200)
    plans = {}
    for i in range(12):
        rid = f"q{i}"
        local, remote = pair.src_pool.allocate(3 + i), pair.dst_pool.allocate(3 + i, scattered=i % 2 == 0)
        pair.receiver.expect(rid, remote)
        pair.sender.start(rid, pair.receiver.endpoint, local, remote)
        plans[rid] = (local, remote)
    for layer in range(LAYERS):  # interleaved layer-wise sends across requests
        for rid in plans:
            pair.sender.send_layers(rid, layer, layer + 1)
    sent, got = pump(pair.sender, pair.receiver, len(plans))
    assert sorted(r.request_id for r in got if r.ok) == sorted(plans)
    assert sorted(r.request_id for r in sent if r.ok) == sorted(plans)
    for rid, (local, remote) in plans.items():
        assert digest(pair.dst, remote) == digest(pair.src, local)
        pair.dst_pool.release(rid, remote)


def test_receiver_reports_layers_as_they_land(pair_factory) -> None:
    pair = pair_factory("zmq-tcp")
    local, remote = pair.src_pool.allocate(4), pair.dst_pool.allocate(4)
    pair.receiver.expect("w", remote)
    pair.sender.start("w", pair.receiver.endpoint, local, remote)
    for layer in range(LAYERS - 1):
        pair.sender.send_layers("w", layer, layer + 1)
        while pair.receiver.layers_ready("w") <= layer:
            pair.sender.poll()
            assert not pair.receiver.poll()  # nothing ends before the last layer
        assert pair.receiver.layers_ready("w") == layer + 1
        assert pair.receiver.state("w") is TransferState.TRANSFERRING
    pair.sender.send_layers("w", LAYERS - 1, LAYERS)
    sent, got = pump(pair.sender, pair.receiver, 1)
    assert got[0].ok and sent[0].ok
    pair.dst_pool.release("w", remote)


@pytest.mark.parametrize(("kind", "layers_per_chunk"), [("zmq-tcp", 1), ("zmq-tcp", 2), ("shm", 1)])
def test_whole_request_send_leaves_in_chunks_over_zmq(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, layers_per_chunk: int
) -> None:
    seen: list[tuple[int, int, int, dict]] = []
    on_chunk = KVReceiver._on_chunk

    def spy(self: KVReceiver, peer: bytes, chunk, frames: list) -> None:
        seen.append((chunk.seq, chunk.layer_start, chunk.layer_end, dict(chunk.meta)))
        on_chunk(self, peer, chunk, frames)

    monkeypatch.setattr(KVReceiver, "_on_chunk", spy)
    n = 5
    layer_bytes = 2 * n * 4 * 2 * 8 * 2  # keys and values of n blocks: block size 4, 2 heads, dim 8, bf16
    transport = "shm" if kind == "shm" else "zmq"
    pair = Pair(transport, _bind(kind, tmp_path), torch.bfloat16, 32, False, layers_per_chunk * layer_bytes)
    try:
        pair.transfer("a", n, layerwise=False, scattered=True)  # checks bytes, meta and layers
    finally:
        pair.close()
    if kind == "shm":  # the copy is the sender's own: one control message says all layers landed
        want = [(0, 0, LAYERS)]
    else:
        want = [
            (i, l0, min(l0 + layers_per_chunk, LAYERS))
            for i, l0 in enumerate(range(0, LAYERS, layers_per_chunk))
        ]
    assert [s[:3] for s in seen] == want
    assert [s[3] for s in seen] == [{}] * (len(want) - 1) + [{"first_token": 42}]  # meta rides the last
