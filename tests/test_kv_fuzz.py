"""Frames thrown at a live KV endpoint: random bytes, random msgpack under every message tag, and valid
KV messages with one field changed (chunks with random tensor frames attached). The receiver neither
crashes nor wedges, writes nothing into any block (a reserved transfer's blocks keep their bytes, the
free ones stay zero), and afterwards lands a real transfer bit for bit with every block back.

Every fuzzed message names a request the receiver does not expect: what a frame for an expected
request does (it fails that transfer cleanly) is tested in ``test_kvtransfer_faults.py``; a well-formed
message from a stranger is the subject of authentication, not of decoding."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfabric.kv_config import TransferConfig
from pdfabric.kvtransfer.messages import Ack, Hello, KVAbort, KVChunk, KVLayout, PeerInfo
from pdfabric.kvtransfer.receiver import KVReceiver
from pdfabric.kvtransfer.sender import KVSender
from pdfabric.kvtransfer.state import TransferState
from tests.kvtransfer_helpers import FakePool, digest, make_caches, pump
from tests.wire_fuzz import KINDS, frames

LAYERS, BLOCKS = 2, 16
CONFIG = TransferConfig(timeout_s=600, idle_timeout_s=600, checksum=True)  # the victim waits out the fuzz
FRAME_BYTES = 4 * 2 * 8 * 2  # one block of one layer's keys: [block_size 4, heads 2, dim 8] bfloat16
BASES = [  # valid messages for requests the receiver does not expect
    Hello("stranger"),
    KVChunk("stranger-1", 0, 0, LAYERS, (3, 4), "bfloat16", 2 * FRAME_BYTES, ()),
    KVChunk("stranger-2", 1, 1, 2, (0,), "bfloat16", FRAME_BYTES, (1, 2)),
    Ack("stranger-3", True),
    KVAbort("stranger-4", "gone"),
    PeerInfo("zmq", KVLayout(LAYERS, 4, 2, 8, "bfloat16", 2), BLOCKS),
]

@st.composite
def messages(draw: st.DrawFn) -> list[bytes]:
    """One ZeroMQ message: a head frame, then 0-4 tensor-like frames."""
    head = draw(frames(BASES, (*KINDS, "valid")))
    sizes = draw(st.lists(st.sampled_from([0, 1, FRAME_BYTES - 1, FRAME_BYTES, 2 * FRAME_BYTES]), max_size=4))
    return [head, *(bytes(draw(st.binary(min_size=n, max_size=n))) for n in sizes)]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[tuple[KVReceiver, FakePool, tuple[int, ...], str, zmq.Socket]]:
    """A receiver expecting one request ("victim") whose blocks hold known bytes, and a raw socket."""
    pool = FakePool(BLOCKS)
    caches = make_caches(LAYERS, BLOCKS, torch.bfloat16, None)
    victim = pool.allocate(3, scattered=True)
    ids = torch.tensor(victim)
    for cache in caches:
        cache.index_copy_(1, ids, torch.full((2, len(victim), 4, 2, 8), 7.0, dtype=torch.bfloat16))
    receiver = KVReceiver(caches, CONFIG, pool.reservations())
    receiver.expect("victim", victim)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.endpoint)
    yield receiver, pool, victim, digest(caches, victim), sock
    sock.close(linger=0)
    receiver.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frames=messages())
def test_fuzzed_frames_touch_no_block(endpoint, frames: list[bytes]) -> None:
    receiver, pool, victim, before, sock = endpoint
    sock.send_multipart(frames)
    end = time.monotonic() + 0.02
    while time.monotonic() < end:  # let the receiver read (and answer) the message
        assert receiver.poll() == []  # no transfer ends: none of these names the victim
    assert receiver.state("victim") is TransferState.WAITING
    assert digest(receiver.caches, victim) == before
    others = tuple(b for b in range(BLOCKS) if b not in victim)
    zeros = make_caches(LAYERS, BLOCKS, torch.bfloat16, None)
    assert digest(receiver.caches, others) == digest(zeros, others)
    while sock.poll(0):  # drop the receiver's answers (acks, peer info) to the stranger
        sock.recv_multipart()


def test_after_the_fuzz_a_real_transfer_lands_bit_for_bit(endpoint) -> None:
    receiver, pool, victim, _, _ = endpoint
    spool = FakePool(BLOCKS)
    src = make_caches(LAYERS, BLOCKS, torch.bfloat16, 11)
    sender = KVSender(src, CONFIG, spool.reservations())
    try:
        local = spool.allocate(len(victim))
        sender.start("victim", receiver.endpoint, local, victim)
        sender.send("victim")
        sent, got = pump(sender, receiver, 1, timeout_s=10)
        assert sent[0].state is TransferState.DONE and got[0].state is TransferState.DONE
        assert digest(receiver.caches, victim) == digest(src, local)
    finally:
        sender.close()
    pool.release("victim", victim)
    assert pool.all_free and spool.all_free
