"""Frames thrown at a live router's control socket: random bytes, random msgpack under every message
tag, and valid messages with one field changed. The router neither crashes nor wedges: afterwards it
is healthy, serves a greedy request with the same tokens as before, and every worker's blocks are
back in its pool.

The stranger holds the cluster secret, so its frames reach the decoder: what a peer without it gets
(nothing) is ``test_cluster_secret.py``'s. What a frame that decodes as a well-formed message can do
(register, report) is the subject of authentication, not of decoding: the base messages here name a
worker of another model so that none of them is routed to."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq
from hypothesis import HealthCheck, given, settings

from pdfabric.cluster_secret import ENV, ClusterSecret
from pdfabric.control import Embedded, EmbedResult, Heartbeat, Register, StepOutputs, TokenDelta
from pdfabric.profile import WorkerProfile
from tests.fabric import free_port, get_json, post_json, running_fabric
from tests.wire_fuzz import frames

PROFILE = WorkerProfile((0.01, 1e-4, 1e-8), (0.005, 1e-4, 1e-7), 3, 4, 0.1)
BASES = [  # valid messages from a stranger that serves no model the test asks for
    Register(
        "fuzz-0", "decode", "default", "not-served", 512, 16, 64, "tcp://127.0.0.1:9", 1, 8, 64, 0, PROFILE
    ),
    Heartbeat("fuzz-0", 0, 0, 0, 64, 64, 1.0, 0, 1e9, PROFILE),
    StepOutputs("fuzz-0", (TokenDelta("cmpl-fuzz", 0, (5,), (-0.1,)),)),
    Embedded("fuzz-0", (EmbedResult("emb-fuzz-0", b"\0" * 8, 0.01),)),
]
GREEDY = {
    "model": "tiny",
    "prompt": [5, 17, 99, 3, 42],
    "max_tokens": 12,
    "temperature": 0,
    "ignore_eos": True,
}

SECRET = ClusterSecret("the fuzzed fabric's cluster secret")


@pytest.fixture(scope="module")
def fabric() -> Iterator[tuple[str, int]]:
    control = free_port()
    flags = ("--model", "tiny", "--num-blocks", "64", "--prefill", "1", "--decode", "1")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV, SECRET.text)
        with running_fabric(*flags, "--control-port", str(control)) as url:
            yield url, control


@pytest.fixture(scope="module")
def stranger(fabric: tuple[str, int]) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 10_000)  # a send that cannot leave fails the test instead of hanging
    SECRET.connect(sock)
    sock.connect(f"tcp://127.0.0.1:{fabric[1]}")
    yield sock
    sock.close()
    ctx.term()


@pytest.fixture(scope="module")
def before(fabric: tuple[str, int]) -> list[int]:
    status, data = post_json(fabric[0] + "/v1/completions", {**GREEDY, "return_token_ids": True})
    assert status == 200, data
    return data["choices"][0]["token_ids"]


@settings(max_examples=400, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(frame=frames(BASES))
def test_frames_thrown_at_the_control_socket(stranger: zmq.Socket, before: list[int], frame: bytes) -> None:
    stranger.send(frame)


def test_the_router_still_serves_the_same_tokens_and_no_block_is_lost(
    fabric: tuple[str, int], before: list[int]
) -> None:
    url = fabric[0]
    time.sleep(0.5)  # the last frames are handled
    assert get_json(url + "/health")[0] == 200
    status, data = post_json(url + "/v1/completions", {**GREEDY, "return_token_ids": True})
    assert status == 200, data
    assert data["choices"][0]["token_ids"] == before
    deadline = time.monotonic() + 10
    while True:
        workers = [w for w in get_json(url + "/health")[1]["workers"] if w["model"] == "tiny"]
        if all(w["free_blocks"] == w["total_blocks"] for w in workers) or time.monotonic() > deadline:
            break
        time.sleep(0.2)  # free blocks are reported with the next heartbeat
    assert len(workers) == 2 and all(w["free_blocks"] == w["total_blocks"] for w in workers), workers
