"""The worker-facing KV link: blocks arrive bit-identical in the reserved blocks, and every failure
ends the transfer on both sides with a reason."""

from __future__ import annotations

import time

import pytest
import torch

from pdfabric.kvtransfer.link import KVReceiver, KVSender, TransferResult

LAYERS, BLOCK, HEADS, DIM = 3, 4, 2, 8


def _caches(num_blocks: int, dtype: torch.dtype, fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(num_blocks)
    shape = (2, num_blocks, BLOCK, HEADS, DIM)
    return [
        torch.randn(shape, generator=g).to(dtype) if fill else torch.zeros(shape, dtype=dtype)
        for _ in range(LAYERS)
    ]


def _wait(poll, deadline_s: float = 5.0) -> list[TransferResult]:  # noqa: ANN001
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        got = poll()
        if got:
            return got
        time.sleep(0.002)
    raise AssertionError("nothing happened before the deadline")


@pytest.fixture
def pair():  # noqa: ANN201
    def make(dtype: torch.dtype = torch.float32, timeout_s: float = 30.0) -> tuple[KVSender, KVReceiver]:
        sender = KVSender(_caches(300, dtype, fill=True), BLOCK, timeout_s=timeout_s)
        receiver = KVReceiver(_caches(300, dtype, fill=False), BLOCK, "127.0.0.1", timeout_s=timeout_s)
        made.append((sender, receiver))
        return sender, receiver

    made: list[tuple[KVSender, KVReceiver]] = []
    yield make
    for sender, receiver in made:
        sender.close()
        receiver.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [1, 7, 150])
def test_round_trip_is_bit_identical(pair, dtype: torch.dtype, n: int) -> None:  # noqa: ANN001
    sender, receiver = pair(dtype)
    src = tuple(range(0, 2 * n, 2))  # scattered source blocks
    dst = tuple(range(299, 299 - n, -1))  # reversed destination blocks
    receiver.expect("r", dst)
    sender.start("r", receiver.endpoint, src, dst, first_token=42, first_logprob=-0.5)
    got = _wait(receiver.poll)
    assert got[0].ok and got[0].first_token == 42 and got[0].first_logprob == -0.5
    assert _wait(sender.poll)[0].ok and not sender.busy and not receiver.busy
    for s_cache, r_cache in zip(sender.kv_caches, receiver.kv_caches, strict=True):
        assert torch.equal(r_cache[:, list(dst)], s_cache[:, list(src)])
        untouched = [b for b in range(300) if b not in set(dst)]
        assert not r_cache[:, untouched].any()


def test_unknown_request_fails_the_sender(pair) -> None:  # noqa: ANN001
    sender, receiver = pair()
    sender.start("nobody", receiver.endpoint, (0,), (5,), 1, 0.0)
    for _ in range(100):
        receiver.poll()
        got = sender.poll()
        if got:
            break
        time.sleep(0.005)
    assert not got[0].ok and "unknown request" in got[0].reason


def test_wrong_destination_fails_both_sides(pair) -> None:  # noqa: ANN001
    sender, receiver = pair()
    receiver.expect("r", (5, 6))
    sender.start("r", receiver.endpoint, (0, 1), (6, 5), 1, 0.0)
    got = _wait(receiver.poll)
    assert not got[0].ok and "reservation" in got[0].reason
    assert not _wait(sender.poll)[0].ok
    assert not any(c.any() for c in receiver.kv_caches)


def test_dtype_mismatch_is_refused(pair) -> None:  # noqa: ANN001
    sender, _ = pair(torch.float32)
    _, receiver = pair(torch.bfloat16)
    receiver.expect("r", (5,))
    sender.start("r", receiver.endpoint, (0,), (5,), 1, 0.0)
    got = _wait(receiver.poll)
    assert not got[0].ok and "dtype" in got[0].reason


def test_block_count_mismatch_fails_at_start(pair) -> None:  # noqa: ANN001
    sender, receiver = pair()
    sender.start("r", receiver.endpoint, (0, 1, 2), (5,), 1, 0.0)
    got = sender.poll()
    assert not got[0].ok and "reserved" in got[0].reason


def test_timeouts_on_both_sides(pair) -> None:  # noqa: ANN001
    sender, receiver = pair(timeout_s=0.2)
    receiver.expect("late", (1,))
    got = _wait(receiver.poll)
    assert not got[0].ok and "no KV arrived" in got[0].reason
    sender.start("lost", "tcp://127.0.0.1:9", (0,), (1,), 1, 0.0)  # nobody listens there
    got = _wait(sender.poll)
    assert not got[0].ok and "acknowledgement" in got[0].reason


def test_abort_forgets_the_transfer(pair) -> None:  # noqa: ANN001
    sender, receiver = pair()
    receiver.expect("r", (3,))
    receiver.abort("r", "client gone")
    assert not receiver.busy
    sender.start("r", receiver.endpoint, (0,), (3,), 1, 0.0)
    sender.abort("r", "client gone")
    assert not sender.busy
    time.sleep(0.05)
    assert receiver.poll() == [] and sender.poll() == []
    assert not any(c.any() for c in receiver.kv_caches)
