"""Frames thrown at a decode worker's KV endpoint inside a running fabric, while users' requests
stream through it: random bytes, random msgpack under every message tag, and valid KV messages with
one field changed, from a peer that holds the cluster secret (one without it is refused before
decoding: ``test_cluster_secret.py``). The fabric neither crashes nor wedges: every stream is
token-exact against the single-process reference, and every worker's blocks are back in its pool.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import aiohttp
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdfabric.cluster_secret import ENV, ClusterSecret
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.kvtransfer.messages import Ack, Hello, KVAbort, KVChunk, KVLayout, PeerInfo
from pdfabric.sampling_params import SamplingParams
from tests.fabric import get_json, metric_values, running_fabric, wait_blocks_free
from tests.wire_fuzz import KINDS, frames

SECRET = ClusterSecret("the KV-fuzzed fabric's cluster secret")
BASES = [  # valid KV messages; the requests they name are the fabric's own ("cmpl-...") or strangers'
    Hello("fuzzer"),
    KVChunk("cmpl-0", 0, 0, 2, (3, 4), "float32", 4096, ()),
    KVChunk("stranger", 1, 1, 2, (0,), "float32", 2048, (1, 2)),
    Ack("cmpl-1", True),
    KVAbort("cmpl-2", "gone"),
    PeerInfo("zmq", KVLayout(2, 16, 2, 32, "float32", 2), 64),
]


@st.composite
def messages(draw: st.DrawFn) -> list[bytes]:
    """One ZeroMQ message: a head frame, then 0-3 tensor-like frames."""
    head = draw(frames(BASES, (*KINDS, "valid")))
    sizes = draw(st.lists(st.sampled_from([0, 1, 2048, 4096]), max_size=3))
    return [head, *(bytes(draw(st.binary(min_size=n, max_size=n))) for n in sizes)]


@pytest.fixture(scope="module")
def fabric() -> Iterator[str]:
    flags = ("--model", "tiny", "--num-blocks", "128", "--prefill", "1", "--decode", "1")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV, SECRET.text)
        with running_fabric(*flags) as url:
            yield url


@pytest.fixture(scope="module")
def kv_socket(fabric: str) -> Iterator[zmq.Socket]:
    (decode,) = [w for w in get_json(fabric + "/health")[1]["workers"] if w["kind"] == "decode"]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a send that cannot leave fails the test instead of hanging
    SECRET.connect(sock)
    sock.connect(decode["kv_endpoint"])
    yield sock
    sock.close(linger=0)


@pytest.fixture(scope="module")
def streams(fabric: str) -> Iterator[list]:
    """Sixteen greedy streams, running in a thread while the fuzz runs (each its own length)."""
    bodies = [{"model": "tiny", "prompt": [9 + i] * (20 + 9 * i), "max_tokens": 40 + 5 * i, "temperature": 0,
               "ignore_eos": True, "return_token_ids": True} for i in range(16)]  # fmt: skip
    results: list = []

    async def one(session: aiohttp.ClientSession, body: dict, delay: float) -> list[int]:
        await asyncio.sleep(delay)
        async with session.post(fabric + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["token_ids"]

    async def all_of_them() -> None:
        async with aiohttp.ClientSession() as session:
            results.extend(await asyncio.gather(*(one(session, b, 0.2 * i) for i, b in enumerate(bodies))))

    thread = threading.Thread(target=lambda: asyncio.run(all_of_them()))
    thread.start()
    yield [bodies, results, thread]
    thread.join(timeout=120)


@settings(max_examples=300, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(msg=messages())
def test_frames_thrown_at_a_live_kv_endpoint(kv_socket: zmq.Socket, streams: list, msg: list[bytes]) -> None:
    kv_socket.send_multipart(msg)
    while kv_socket.poll(0):  # drop the endpoint's answers
        kv_socket.recv_multipart()
    time.sleep(0.005)


def test_every_stream_is_token_exact_and_no_block_is_lost(fabric: str, streams: list) -> None:
    bodies, results, thread = streams
    thread.join(timeout=120)
    assert not thread.is_alive() and len(results) == len(bodies)
    reference = ReferenceEngine("tiny")
    for body, got in zip(bodies, results, strict=True):
        want = reference.generate(body["prompt"], SamplingParams(body["max_tokens"], ignore_eos=True))
        assert got == list(want.token_ids)
    assert get_json(fabric + "/health")[0] == 200
    wait_blocks_free(fabric)


def test_a_stranger_at_the_kv_endpoint_is_refused_and_counted(fabric: str) -> None:
    """A peer without the secret is refused at the handshake, and the decode worker's heartbeats
    carry the count to the router's ``/metrics``."""
    (decode,) = [w for w in get_json(fabric + "/health")[1]["workers"] if w["kind"] == "decode"]
    rogue = zmq.Context.instance().socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(decode["kv_endpoint"])
    try:
        rogue.send_multipart([b"not for you"], zmq.NOBLOCK)
        deadline = time.monotonic() + 10
        mine = f'worker="{decode["id"]}"'
        while True:
            series = metric_values(fabric, "pdfabric_kv_refused_peers_total")
            refused = sum(v for labels, v in series.items() if mine in labels)
            if refused >= 1 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert refused >= 1, series
        assert rogue.poll(0) == 0  # and it was sent nothing
    finally:
        rogue.close(linger=0)
