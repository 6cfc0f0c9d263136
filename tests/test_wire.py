from __future__ import annotations

import pytest

from pdfabric.control import Generate, Heartbeat, StepOutputs, TokenDelta
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.wire import WireError, decode, encode


def test_round_trip_with_nested_messages() -> None:
    msgs = [
        Generate("r1", (1, 2, 3), SamplingParams(max_tokens=5, temperature=0.5, stop_token_ids=(7,)), (2,)),
        StepOutputs("w", (TokenDelta("a", 0, (1,), (-0.5,)), TokenDelta("b", 3, (), (), "error", "boom"))),
        Heartbeat(
            "w",
            10,
            2,
            1,
            50,
            64,
            3.5,
            700,
            1e9,
            WorkerProfile((0.01, 1e-4, 1e-8), (0.005, 1e-4, 1e-7), 3, 4, 0.1),
        ),
    ]
    for msg in msgs:
        assert decode(encode(msg)) == msg


def test_garbage_is_a_wire_error() -> None:
    for frame in (
        b"",
        b"\x93\x01",
        encode(Heartbeat("w", 0, 0, 0, 0, 0, 0.0, 0, 0.0, WorkerProfile()))[:-3],
        b"\x92\xcd\xff\xff\x01",
    ):
        with pytest.raises(WireError):
            decode(frame)


def test_unregistered_type_is_refused() -> None:
    with pytest.raises(TypeError):
        encode(SamplingParams())
