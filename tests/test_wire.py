from __future__ import annotations

import re

import msgpack
import pytest

from pdfabric.control import Generate, Heartbeat, StepOutputs, TokenDelta
from pdfabric.profile import WorkerProfile
from pdfabric.sampling_params import SamplingParams
from pdfabric.wire import MAX_FRAME_BYTES, WireError, decode, encode


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


def _frame(*values: object) -> bytes:
    return msgpack.packb(list(values), use_bin_type=True)


PROFILE = [[0.01, 1e-4, 1e-8], [0.005, 1e-4, 1e-7], 3, 4, 0.1]
REGISTER = [1, "decode-0", "decode", "default", "tiny", 512, 16, 64, "tcp://h:1", 7, 8, 64, 100, PROFILE]


@pytest.mark.parametrize(
    "values, says",
    [
        (REGISTER[:1] + [123] + REGISTER[2:], "Register.worker_id: expected str, got int"),
        (REGISTER[:13] + [None], "Register.profile"),  # a nested message that is not one
        (REGISTER[:13] + [[[0.01, 1e-4], *PROFILE[1:]]], "Register.profile: WorkerProfile.prefill"),
        (REGISTER[:6] + [True] + REGISTER[7:], "Register.block_size: expected int, got bool"),
        (REGISTER[:7] + [-5] + REGISTER[8:], "num_blocks must be at least 1"),
        (REGISTER[:2] + ["router"] + REGISTER[3:], "a kind in"),
        (REGISTER[:5], "Register"),  # fields missing
        (REGISTER + ["h", "m@v", "int4", 4, 1 << 20, "int8", "s", 9, "extra"], "at most"),  # a field too many
        ([999, 1, 2], "unknown message tag"),
        ([True, 1], "unknown message tag"),
    ],
)
def test_a_frame_that_does_not_fit_its_message_is_refused_naming_the_field(values: list, says: str) -> None:
    with pytest.raises(WireError, match=re.escape(says)):
        decode(_frame(*values))


def test_a_float_field_takes_an_integer_and_arrays_come_back_as_tuples() -> None:
    msg = decode(_frame(*REGISTER[:13], [[0, 1, 2], [0, 1, 2], 3, 4, 0]))
    assert msg.profile.prefill == (0.0, 1.0, 2.0) and isinstance(msg.profile.fit_error, float)


def test_frames_that_are_not_messages_are_refused() -> None:
    unhashable = msgpack.packb([{"a": 1}, 2])  # a map where the tag goes
    for raw in (b"", b"\xc1", msgpack.packb({"a": 1}), msgpack.packb(5), b"\x91" * 100_000, unhashable):
        with pytest.raises(WireError):
            decode(raw)
    with pytest.raises(WireError, match="frame"):
        decode(b"\x00" * (MAX_FRAME_BYTES + 1))
