"""The workers' KV sides over the real kvtransfer state machines: the transport each pair picks,
bit-identical blocks, and blocks given back after an abort."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from pdfabric.decode.kind import ReceiverSide
from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.shm_pool import SharedKVPool
from pdfabric.kvtransfer.state import TransferResult, TransferState
from pdfabric.prefill.kind import SenderSide
from pdfabric.worker.kv import CancelKV, ExpectKV, OpenPush, PushKV, first_token_of

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 32, 4, 2, 8
Made = tuple[SenderSide, ReceiverSide, list[torch.Tensor]]


@pytest.fixture
def sides() -> Iterator:
    made: list = []

    def make(transport: str, quarantine_s: float = 10.0) -> Made:
        g = torch.Generator().manual_seed(0)
        src = [torch.randn(2, BLOCKS, BLOCK, HEADS, DIM, generator=g) for _ in range(LAYERS)]
        pool = SharedKVPool.create(LAYERS, BLOCKS, BLOCK, HEADS, DIM, torch.float32, anonymous=True)
        config = TransferConfig(transport=transport, shm_quarantine_s=quarantine_s)
        recv = ReceiverSide(pool.caches, config, "127.0.0.1", pool, tiled=False)
        send = SenderSide(KVSender(src, TransferConfig(transport=transport)))
        made.append((send, recv, pool))
        return send, recv, src

    yield make
    for send, recv, _ in made:
        send.close()
        recv.close()  # and the pool, which the receiving side owns


def _until(fn, *others: SenderSide | ReceiverSide, timeout: float = 5.0):  # noqa: ANN001, ANN202
    """Polls ``fn`` (and the ``others``, as a worker loop would) until it returns something."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for other in others:
            assert other.poll() == ([], []), "the other side ended something unexpectedly"
        got = fn()
        if got:
            return got
        time.sleep(0.002)
    raise AssertionError("nothing happened before the deadline")


def _ended(side: SenderSide | ReceiverSide) -> list[TransferResult]:
    return side.poll()[0]


@pytest.mark.parametrize(("transport", "used"), [("auto", "shm"), ("zmq", "zmq"), ("shm", "shm")])
def test_push_lands_bit_identical_over_the_pair_transport(sides, transport: str, used: str) -> None:  # noqa: ANN001
    send, recv, src = sides(transport)
    local, remote = (5, 1, 9), (30, 31, 2)
    recv.command(ExpectKV("r", remote))
    top = ((42, -0.25), (7, -1.5))
    send.command(PushKV("r", recv.endpoint, local, remote, 42, -0.25, top))
    (got,) = _until(lambda: _ended(recv), send)
    assert got.ok and first_token_of(got.meta) == (42, -0.25, top) and got.transport == used
    (sent,) = _until(lambda: _ended(send))
    assert sent.ok and sent.transport == used and sent.nbytes == 2 * LAYERS * 3 * BLOCK * HEADS * DIM * 4
    for layer in range(LAYERS):
        assert torch.equal(recv.receiver.caches[layer][:, list(remote)], src[layer][:, list(local)])


def test_receiver_abort_gives_blocks_back_once_the_sender_has_stopped(sides) -> None:  # noqa: ANN001
    send, recv, _ = sides("shm", quarantine_s=30.0)
    recv.command(ExpectKV("r", (0, 1)))
    send.command(PushKV("w", recv.endpoint, (3,), (4,), 1, 0.0))  # opens the connection
    _until(lambda: _ended(send), recv)
    recv.command(CancelKV("r", "client gone"))
    results, released = recv.poll()
    assert [r.request_id for r in results] == ["r"] and released == []  # held: a sender may still write
    send.command(PushKV("r", recv.endpoint, (5, 6), (0, 1), 1, 0.0))  # the sender had not heard yet
    failed: list[TransferResult] = []
    freed: list[str] = []
    end = time.monotonic() + 5
    while not freed and time.monotonic() < end:
        failed += _ended(send)
        freed += recv.poll()[1]
        time.sleep(0.002)
    assert [r.ok for r in failed] == [False] and "already ended" in failed[0].reason
    assert freed == ["r"]  # the sender said it stopped: released long before the quarantine ends


def test_cancel_of_an_unknown_transfer_releases_at_once(sides) -> None:  # noqa: ANN001
    _, recv, _ = sides("auto")
    recv.command(CancelKV("nobody", "gone"))
    assert recv.poll() == ([], ["nobody"])


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_layers_leave_as_the_step_computes_them(sides, transport: str) -> None:  # noqa: ANN001
    send, recv, src = sides(transport)
    local, remote = (0, 1, 2), (7, 8, 9)
    recv.command(ExpectKV("r", remote))
    hook = send.layer_hook((OpenPush("r", recv.endpoint, local, remote),))
    assert hook is not None
    for layer in range(LAYERS):  # the model finishing each layer
        hook(layer)
    landed = lambda: recv.poll() == ([], []) and recv.receiver.layers_ready("r") == LAYERS - 1  # noqa: E731
    _until(landed, send)  # all but the last layer landed, nothing ended
    assert recv.receiver.state("r") is TransferState.TRANSFERRING
    send.command(PushKV("r", recv.endpoint, local, remote, 5, -1.0))  # after the step: the rest
    (got,) = _until(lambda: _ended(recv), send)
    assert got.ok and got.layers == LAYERS and got.meta["first_token"] == 5
    assert _until(lambda: _ended(send))[0].ok
    for layer in range(LAYERS):
        assert torch.equal(recv.receiver.caches[layer][:, list(remote)], src[layer][:, list(local)])


def test_reported_seconds_start_when_the_step_ends(sides) -> None:  # noqa: ANN001
    """Layers shipped during the step are not charged to the link: the transfer's seconds count from
    ``PushKV`` (the step's end), so the step's own compute never lowers the measured KV rate."""
    send, recv, _ = sides("zmq")
    recv.command(ExpectKV("r", (3, 4)))
    hook = send.layer_hook((OpenPush("r", recv.endpoint, (0, 1), (3, 4)),))
    assert hook is not None
    hook(0)
    time.sleep(0.05)  # the rest of the step's compute
    pushed = time.monotonic()
    send.command(PushKV("r", recv.endpoint, (0, 1), (3, 4), 1, 0.0))
    results: list[TransferResult] = []
    end = time.monotonic() + 5
    while not results and time.monotonic() < end:
        recv.poll()
        results = _ended(send)
    assert results and results[0].ok and 0 < results[0].seconds <= time.monotonic() - pushed
