"""Fault cases: each transfer ends FAILED with a reason on the sides that know of it; no block leaks."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import msgpack
import pytest
import torch
import zmq

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.frames import as_bytes, crc32, pack_layer
from pdfabric.kvtransfer.messages import Ack, KVChunk
from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.wire import decode, encode
from tests.kvtransfer_helpers import FakePool, make_caches, pump

LAYERS, BLOCKS = 2, 16
FAST = TransferConfig(timeout_s=0.5, idle_timeout_s=0.3, checksum=True)


@pytest.fixture
def rx() -> Iterator[tuple[KVReceiver, FakePool]]:
    pool = FakePool(BLOCKS)
    receiver = KVReceiver(make_caches(LAYERS, BLOCKS, torch.bfloat16, None), FAST, pool.reservations())
    yield receiver, pool
    receiver.close()
    assert pool.all_free, "receiver leaked blocks"


@pytest.fixture
def tx() -> Iterator[tuple[KVSender, FakePool]]:
    pool = FakePool(BLOCKS)
    sender = KVSender(make_caches(LAYERS, BLOCKS, torch.bfloat16, 3), FAST, pool.reservations())
    yield sender, pool
    sender.close()
    assert pool.all_free, "sender leaked blocks"


@pytest.fixture
def raw(rx: tuple[KVReceiver, FakePool]) -> Iterator[zmq.Socket]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(rx[0].endpoint)
    yield sock
    sock.close(linger=0)


def _chunk_frames(
    rid: str, blocks: tuple[int, ...], layers: range = range(LAYERS), seq: int = 0
) -> tuple[KVChunk, list[memoryview]]:
    caches = make_caches(LAYERS, BLOCKS, torch.bfloat16, 5)
    tensors = [t for layer in layers for t in pack_layer(caches[layer], blocks)]
    nbytes = tensors[0].numel() * 2
    chunk = KVChunk(
        rid, seq, layers.start, layers.stop, blocks, "bfloat16", nbytes, tuple(crc32(t) for t in tensors)
    )
    return chunk, [as_bytes(t).tobytes() for t in tensors]


def _fail_one(receiver: KVReceiver, sock: zmq.Socket | None = None) -> tuple[TransferResult, Ack | None]:
    _, got = pump(None, receiver, 1, timeout_s=5)
    assert len(got) == 1 and got[0].state is TransferState.FAILED and got[0].reason
    ack = None
    if sock is not None and sock.poll(2000):
        ack = decode(sock.recv())
    return got[0], ack


def test_truncated_frame(rx, raw) -> None:
    receiver, pool = rx
    blocks = pool.allocate(3)
    receiver.expect("t", blocks)
    chunk, frames = _chunk_frames("t", blocks)
    frames[1] = frames[1][:-10]
    raw.send_multipart([encode(chunk), *frames])
    result, ack = _fail_one(receiver, raw)
    assert "truncated" in result.reason and ack == Ack("t", False, result.reason)


def test_missing_frame(rx, raw) -> None:
    receiver, pool = rx
    blocks = pool.allocate(2)
    receiver.expect("m", blocks)
    chunk, frames = _chunk_frames("m", blocks)
    raw.send_multipart([encode(chunk), *frames[:-1]])
    assert "tensor frames" in _fail_one(receiver)[0].reason


def test_wrong_checksum(rx, raw) -> None:
    receiver, pool = rx
    blocks = pool.allocate(4)
    receiver.expect("c", blocks)
    chunk, frames = _chunk_frames("c", blocks)
    frames[2] = bytes([frames[2][0] ^ 1]) + frames[2][1:]
    raw.send_multipart([encode(chunk), *frames])
    result, _ = _fail_one(receiver, raw)
    assert "checksum mismatch in frame 2 (layer 1)" == result.reason


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"dtype": "float16"}, "dtype"),
        ({"seq": 1}, "out of order"),
        ({"layer_end": LAYERS + 1}, "layer range"),
        ({"frame_nbytes": 8}, "frame size"),
        ({"blocks": (15, 14)}, "not the ones reserved"),
        ({"checksums": (1,)}, "checksums for"),
    ],
)
def test_bad_headers(rx, raw, change: dict, words: str) -> None:
    receiver, pool = rx
    blocks = pool.allocate(2)
    receiver.expect("h", blocks)
    chunk, frames = _chunk_frames("h", blocks)
    raw.send_multipart([encode(replace(chunk, **change)), *frames])
    assert words in _fail_one(receiver, raw)[0].reason


def test_layer_sent_twice(rx, raw) -> None:
    receiver, pool = rx
    blocks = pool.allocate(2)
    receiver.expect("d", blocks)
    for seq in (0, 1):
        chunk, frames = _chunk_frames("d", blocks, range(0, 1), seq)
        raw.send_multipart([encode(chunk), *frames])
    assert "sent twice" in _fail_one(receiver, raw)[0].reason


def test_garbage_message_is_dropped(rx, raw) -> None:
    receiver, pool = rx
    receiver.expect("g", pool.allocate(1))
    raw.send_multipart([b"\xc1garbage", b"more"])
    raw.send(msgpack.packb(["Chunk", {"request_id": 5}]))
    assert receiver.poll() == [] and receiver.state("g") is TransferState.WAITING
    receiver.abort("g", "test over")


def test_unknown_request(rx, tx) -> None:
    (receiver, _), (sender, pool) = rx, tx
    sender.start("u", receiver.endpoint, pool.allocate(2), (0, 1))
    sender.send("u")
    sent, _ = pump(sender, receiver, 1, timeout_s=5, want_got=0)
    assert sent[0].state is TransferState.FAILED and sent[0].reason == "receiver refused: unknown request"


def test_destination_blocks_not_owned(rx, tx) -> None:
    (receiver, rpool), (sender, spool) = rx, tx
    mine = rpool.allocate(2)
    receiver.expect("o", mine)
    sender.start("o", receiver.endpoint, spool.allocate(2), (mine[0], 15))
    sender.send("o")
    sent, got = pump(sender, receiver, 1, timeout_s=5)
    assert "not the ones reserved" in got[0].reason and "not the ones reserved" in sent[0].reason


def test_receiver_gone_before_handshake(tx) -> None:
    sender, pool = tx
    pool2 = FakePool(BLOCKS)
    receiver = KVReceiver(make_caches(LAYERS, BLOCKS, torch.bfloat16, None), FAST, pool2.reservations())
    endpoint = receiver.endpoint
    receiver.close()
    sender.start("g", endpoint, pool.allocate(2), (0, 1))
    sender.send("g")
    sent, _ = pump(sender, None, 1, timeout_s=5)
    assert sent[0].state is TransferState.FAILED and "receiver gone?" in sent[0].reason


def test_receiver_gone_mid_transfer(tx) -> None:
    sender, pool = tx
    rpool = FakePool(BLOCKS)
    receiver = KVReceiver(make_caches(LAYERS, BLOCKS, torch.bfloat16, None), FAST, rpool.reservations())
    remote = rpool.allocate(2)
    receiver.expect("m", remote)
    sender.start("m", receiver.endpoint, pool.allocate(2), remote)
    sender.send_layers("m", 0, 1)
    while receiver.layers_ready("m") == 0:
        sender.poll()
        receiver.poll()
    receiver.close()  # fails its side ("receiver closed") and releases its blocks
    assert rpool.all_free
    sender.send_layers("m", 1, 2)
    sent, _ = pump(sender, None, 1, timeout_s=5)
    assert sent[0].state is TransferState.FAILED and sent[0].reason


def test_sender_gone_mid_transfer(rx, raw) -> None:
    receiver, pool = rx
    blocks = pool.allocate(3)
    receiver.expect("s", blocks)
    chunk, frames = _chunk_frames("s", blocks, range(0, 1))
    raw.send_multipart([encode(chunk), *frames])
    while receiver.layers_ready("s") == 0:
        assert receiver.poll() == []
    raw.close(linger=0)  # vanishes without a word after the first layer
    result, _ = _fail_one(receiver)
    assert result.reason.startswith("sender stalled") and result.layers == 1


def test_abort_from_sender(rx, tx) -> None:
    (receiver, rpool), (sender, spool) = rx, tx
    remote = rpool.allocate(3)
    receiver.expect("a", remote)
    sender.start("a", receiver.endpoint, spool.allocate(3), remote)
    sender.send_layers("a", 0, 1)
    while receiver.layers_ready("a") == 0:
        sender.poll()
        receiver.poll()
    sender.abort("a", "client disconnected")
    sent, got = pump(sender, receiver, 1, timeout_s=5)
    assert sent[0].reason == "aborted by sender: client disconnected"
    assert got[0].reason == "aborted by sender: client disconnected"


@pytest.mark.parametrize("after_first_layer", [True, False])
def test_abort_from_receiver(rx, tx, after_first_layer: bool) -> None:
    (receiver, rpool), (sender, spool) = rx, tx
    remote = rpool.allocate(3)
    receiver.expect("b", remote)
    sender.start("b", receiver.endpoint, spool.allocate(3), remote)
    if after_first_layer:
        sender.send_layers("b", 0, 1)
        while receiver.layers_ready("b") == 0:
            sender.poll()
            receiver.poll()
    receiver.abort("b", "decode worker draining")
    _, got = pump(None, receiver, 1)
    assert got[0].reason == "aborted by receiver: decode worker draining"
    sender.send_layers("b", 1, 2)  # a late layer learns why
    sent, late = pump(sender, receiver, 1, timeout_s=5, want_got=0)
    assert late == []
    assert "aborted by receiver: decode worker draining" in sent[0].reason


def test_receiver_timeout(rx) -> None:
    receiver, pool = rx
    receiver.expect("late", pool.allocate(2))
    result, _ = _fail_one(receiver)
    assert result.reason == "no KV arrived within 0.5s"


def test_layout_mismatch(tx) -> None:
    sender, pool = tx
    rpool = FakePool(BLOCKS)
    receiver = KVReceiver(make_caches(LAYERS, BLOCKS, torch.float16, None), FAST, rpool.reservations())
    try:
        receiver.expect("x", rpool.allocate(2))
        sender.start("x", receiver.endpoint, pool.allocate(2), receiver.reservations.blocks_of("x") or ())
        sender.send("x")
        sent, got = pump(sender, receiver, 1, timeout_s=5)
        assert "layout" in sent[0].reason and got[0].reason.startswith("aborted by sender: receiver layout")
    finally:
        receiver.close()
    assert rpool.all_free


def test_block_count_mismatch(tx) -> None:
    sender, pool = tx
    sender.start("n", "tcp://127.0.0.1:1", pool.allocate(3), (0, 1))
    assert sender.poll()[0].reason == "3 local blocks but 2 reserved remotely"


def test_metrics_hook_sees_every_end(rx) -> None:
    receiver, pool = rx
    seen: list[TransferResult] = []
    receiver.metrics = seen.append
    receiver.expect("h1", pool.allocate(1))
    receiver.abort("h1", "x")
    assert [r.request_id for r in seen] == ["h1"] and seen[0].state is TransferState.FAILED


def test_shm_checksum_mismatch_and_stray_frames() -> None:
    from pdfabric.kvtransfer.shm_pool import SharedKVPool

    pool = FakePool(BLOCKS)
    shm = SharedKVPool.create(LAYERS, BLOCKS, 4, 2, 8, torch.bfloat16)
    cfg = TransferConfig(transport="shm", timeout_s=5, checksum=True)
    receiver = KVReceiver(shm.caches, cfg, pool.reservations(), shm_paths=shm.paths)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.endpoint)
    try:
        for rid, frames, words in (
            ("k", [], "checksum mismatch in layer 0 keys"),
            ("f", [b"x"], "unexpected"),
        ):
            blocks = pool.allocate(2)
            receiver.expect(rid, blocks)
            chunk = KVChunk(rid, 0, 0, LAYERS, blocks, "bfloat16", 2 * 4 * 2 * 8 * 2, (1, 2, 3, 4))
            sock.send_multipart([encode(chunk), *frames])
            result, ack = _fail_one(receiver, sock)
            assert words in result.reason and ack is not None and not ack.ok
    finally:
        sock.close(linger=0)
        receiver.close()
        shm.close()
    assert pool.all_free


def test_shm_failed_blocks_wait_out_quarantine() -> None:
    """With shm a sender may still write into the blocks: they come back only after the quarantine,
    except when the sender itself aborted."""
    from pdfabric.kvtransfer.shm_pool import SharedKVPool

    rpool, spool = FakePool(BLOCKS), FakePool(BLOCKS)
    shm = SharedKVPool.create(LAYERS, BLOCKS, 4, 2, 8, torch.bfloat16)
    cfg = TransferConfig(transport="shm", timeout_s=5, shm_quarantine_s=0.3)
    receiver = KVReceiver(shm.caches, cfg, rpool.reservations(), shm_paths=shm.paths)
    sender = KVSender(make_caches(LAYERS, BLOCKS, torch.bfloat16, 3), cfg, spool.reservations())
    try:
        receiver.expect("q", rpool.allocate(3))
        receiver.abort("q", "client gone")
        assert receiver.poll()[0].reason == "aborted by receiver: client gone"
        assert receiver.quarantined == 1 and len(rpool.free) == BLOCKS - 3
        while receiver.quarantined:
            receiver.wait(0.01)
            receiver.poll()
        assert rpool.all_free
        remote = rpool.allocate(2)
        receiver.expect("s", remote)
        sender.start("s", receiver.endpoint, spool.allocate(2), remote)
        sender.send_layers("s", 0, 1)
        while receiver.layers_ready("s") == 0:
            sender.poll()
            receiver.poll()
        sender.abort("s", "prefill failed")
        _, got = pump(sender, receiver, 0, want_got=1)
        assert got[0].reason == "aborted by sender: prefill failed" and receiver.quarantined == 0
        assert rpool.all_free and spool.all_free
    finally:
        sender.close()
        receiver.close()
        shm.close()
