"""Wire messages, block reservations, frame packing and checksums: fast unit tests."""

from __future__ import annotations

import msgpack
import pytest
import torch

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.frames import (
    copy_blocks,
    crc32,
    crc32_blocks,
    layout_of,
    pack_layer,
    runs,
    torch_dtype,
    unpack_layer,
)
from pdfabric.kvtransfer.messages import Ack, Hello, KVAbort, KVChunk, KVLayout, PeerInfo
from pdfabric.kvtransfer.reservations import BlockReservations
from pdfabric.wire import decode, encode
from tests.kvtransfer_helpers import FakePool, make_caches

LAYOUT = KVLayout(2, 16, 8, 64, "bfloat16", 2)


@pytest.mark.parametrize(
    "msg",
    [
        Hello("p0"),
        PeerInfo("shm", LAYOUT, 100, ("/dev/shm/a", "/dev/shm/b")),
        PeerInfo("dist", LAYOUT, 5, rank=1),
        PeerInfo("zmq", KVLayout(2, 16, 8, 64, "bfloat16", 2, tiled=True), 5),
        KVChunk("r1", 0, 0, 2, (3, 4, 9), "bfloat16", 16384, (1, 2, 3, 4), meta={"first_token": 7}),
        Ack("r1", True),
        Ack("r1", False, "unknown request"),
        KVAbort("r1", "client gone"),
    ],
)
def test_messages_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        encode(Ack("r", True))[:-1],
        msgpack.packb([999, "r"]),  # unknown tag
        msgpack.packb(["Ack", {"request_id": "r", "ok": True}]),  # the old codec's shape
        msgpack.packb([43, "r", True, "", "one field too many"]),
        msgpack.packb([43, 1, True]),  # request id not a string
        msgpack.packb([43, "r", 1]),  # ok not a bool
        msgpack.packb([42, "r", 0, 0, 1, [1, True], "bfloat16", 64]),  # a bool among the block ids
        msgpack.packb([41, "zmq", [2, 16, 8, 64, "bfloat16", 0], 5]),  # a layout refused by its checks
    ],
)
def test_malformed_messages_raise_value_error(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode(raw)


def test_layout_bytes_match_cpu_small() -> None:
    layout = KVLayout(12, 16, 8, 64, "bfloat16", 2)
    assert layout.transfer_bytes(1) == 16 * 24576  # 24576 bytes per token
    with pytest.raises(ValueError):
        KVLayout(0, 16, 8, 64, "bfloat16", 2)


def test_reservations_release_once_and_hand_over() -> None:
    pool = FakePool(10)
    res = pool.reservations()
    a, b = pool.allocate(3), pool.allocate(2)
    res.reserve("a", a)
    res.reserve("b", b)
    assert res.owns("a", a) and not res.owns("a", b) and not res.owns("zz", a)
    with pytest.raises(ValueError):
        res.reserve("c", (a[0],))
    with pytest.raises(ValueError):
        res.reserve("a", (9,))
    assert res.release("a") == a
    assert res.release("a") == ()  # second release is a no-op, not a double free
    assert res.hand_over("b") == b and len(res) == 0 and res.held_blocks == 0
    assert len(pool.free) == 10 - len(b)  # handed-over blocks are not freed


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="transport"):
        TransferConfig(transport="rdma")
    with pytest.raises(ValueError, match="timeout_s"):
        TransferConfig(timeout_s=0)


def test_runs_and_dtypes() -> None:
    assert runs((3, 4, 5, 9, 10, 2)) == [(3, 3), (9, 2), (2, 1)]
    assert torch_dtype("bfloat16") is torch.bfloat16
    for bad in ("nope", "Tensor", "__class__"):
        with pytest.raises(ValueError):
            torch_dtype(bad)


@pytest.mark.parametrize("blocks", [(5,), (2, 3, 4), (7, 1, 4, 0)])
def test_pack_unpack_and_crc_agree(blocks: tuple[int, ...]) -> None:
    src = make_caches(1, 8, torch.bfloat16)[0]
    dst = torch.zeros_like(src)
    keys, values = pack_layer(src, blocks)
    assert keys.is_contiguous() and keys.shape == (len(blocks), 4, 2, 8)
    assert crc32(keys) == crc32_blocks(src, 0, blocks) and crc32(values) == crc32_blocks(src, 1, blocks)
    dst_blocks = tuple(reversed(range(len(blocks))))
    unpack_layer(dst, dst_blocks, keys, values)
    assert torch.equal(dst[:, list(dst_blocks)].view(torch.int16), src[:, list(blocks)].view(torch.int16))


@pytest.mark.parametrize("pairs", [((0, 1, 2), (5, 6, 7)), ((0, 2, 4, 6), (1, 3, 5, 7)), ((3,), (0,))])
def test_copy_blocks(pairs: tuple[tuple[int, ...], tuple[int, ...]]) -> None:
    src_blocks, dst_blocks = pairs
    src = make_caches(1, 8, torch.float16)[0]
    dst = torch.zeros_like(src)
    copy_blocks(src, src_blocks, dst, dst_blocks)
    assert torch.equal(dst[:, list(dst_blocks)], src[:, list(src_blocks)])
    untouched = [b for b in range(8) if b not in dst_blocks]
    assert not dst[:, untouched].any()


def test_layout_of_rejects_mixed_layers() -> None:
    caches = make_caches(2, 4, torch.float32)
    assert layout_of(caches).dtype == "float32"
    with pytest.raises(ValueError):
        layout_of([caches[0], caches[1].to(torch.float16)])
    with pytest.raises(ValueError):
        layout_of([torch.zeros(3, 4)])


def test_reservations_without_callback() -> None:
    res = BlockReservations()
    res.reserve("x", (1, 2))
    assert "x" in res and res.release("x") == (1, 2)


def test_reading_reservations_share_blocks_writing_ones_do_not() -> None:
    """A prefill worker may ship one cached prefix block to two decode workers at once; a decode
    worker's blocks each receive one transfer."""
    reads = BlockReservations(exclusive=False)
    reads.reserve("a", (1, 2, 3))
    reads.reserve("b", (1, 2, 9))
    assert reads.held_blocks == 4
    assert reads.release("a") == (1, 2, 3) and reads.held_blocks == 3 and reads.owns("b", (1, 2, 9))
    assert reads.hand_over("b") == (1, 2, 9) and reads.held_blocks == 0
    writes = BlockReservations()
    writes.reserve("a", (1, 2))
    with pytest.raises(ValueError, match="already held by 'a'"):
        writes.reserve("b", (2, 3))


def test_bookkeeping_modules_do_not_import_torch() -> None:
    """Block managers and schedulers may use these without pulling in torch."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import pdfabric.kv_config, pdfabric.kvtransfer.messages\n"
        "import pdfabric.kvtransfer.reservations, pdfabric.kvtransfer.state\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
