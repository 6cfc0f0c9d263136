"""Reading a request body: JSON, bounded in depth, every failure a 400 that says what is wrong."""

from __future__ import annotations

import pytest

from pdfabric.router.errors import ApiError
from pdfabric.router.json_body import MAX_JSON_DEPTH, parse_json_body


def _nested(depth: int) -> bytes:
    """An object whose ``metadata`` holds arrays nested so that the whole body is ``depth`` deep."""
    inner = depth - 1
    return b'{"model": "tiny", "metadata": ' + b"[" * inner + b"]" * inner + b"}"


def test_a_body_at_the_depth_bound_is_read() -> None:
    assert parse_json_body(_nested(MAX_JSON_DEPTH))["model"] == "tiny"


@pytest.mark.parametrize(
    "raw",
    [
        _nested(MAX_JSON_DEPTH + 1),
        b"[" * 100_000 + b"]" * 100_000,  # past Python's parser's recursion limit
        b'{"a": ' + b'{"b": ' * 5_000 + b"1" + b"}" * 5_001,
    ],
    ids=["one-past-the-bound", "arrays-past-the-parser", "objects-past-the-parser"],
)
def test_a_body_nested_too_deep_is_a_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400 and f"more than {MAX_JSON_DEPTH} deep" in caught.value.message


@pytest.mark.parametrize("raw", [b"", b"{", b'{"a": 1,}', b"\xff\xfe{}", b'{"a": "\xed\xa0\x80"}'])
def test_a_body_that_is_not_json_is_a_400(raw: bytes) -> None:
    with pytest.raises(ApiError) as caught:
        parse_json_body(raw)
    assert caught.value.status == 400 and "not valid JSON" in caught.value.message


def test_a_wide_body_is_read() -> None:
    assert len(parse_json_body(b"[" + b",".join([b"[1]"] * 100_000) + b"]")) == 100_000


def test_fields_without_effect_still_have_their_types() -> None:
    """``metadata``, ``store`` and ``service_tier`` change nothing, but a value of another type than
    the API documents is refused like any other field's."""
    from pdfabric.router.front.openai_api import parse_request

    base = {"model": "m", "prompt": "hi"}
    for name, value in (("service_tier", [True, False]), ("store", "yes"), ("metadata", [1])):
        with pytest.raises(ApiError) as err:
            parse_request({**base, name: value}, False, ("m",), 100)
        assert err.value.status == 400 and err.value.param == name
    ok = {**base, "service_tier": "auto", "store": False, "metadata": {"a": "b"}}
    assert parse_request(ok, False, ("m",), 100).model == "m"
    assert parse_request({**base, "service_tier": None}, False, ("m",), 100).model == "m"


def test_tool_calls_are_checked_on_any_message_and_kept_on_an_assistants() -> None:
    """The schema describes ``tool_calls`` on every message: a malformed one (an empty function name)
    is a 400 whatever the role; a well-formed one on another role than the assistant's is ignored."""
    from pdfabric.router.front.inputs import messages

    call = {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    empty = {"type": "function", "function": {"name": "", "arguments": "{}"}}
    for role in ("user", "assistant", "tool"):
        with pytest.raises(ApiError) as err:
            messages({"messages": [{"role": role, "content": "x", "tool_calls": [empty]}]})
        assert err.value.status == 400 and err.value.param == "messages[0].tool_calls"
    got = messages({"messages": [{"role": "user", "content": "x", "tool_calls": [call]},
                                 {"role": "assistant", "content": None, "tool_calls": [call]}]})  # fmt: skip
    assert "tool_calls" not in got[0] and got[1]["tool_calls"] == (("f", "{}"),)
