"""The OpenAI request fields beyond the basics, colocated and disaggregated: penalties, logit_bias,
min_tokens, top_k and logprobs give the single-process reference's tokens (and log-probabilities);
fields the server does not implement are a 400 naming them, never ignored."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import post_json, running_fabric, sse_chunks

DEPLOYMENTS = {
    "colocated": ("--colocated", "1", "--prefill", "0", "--decode", "0"),
    "disaggregated": ("--prefill", "1", "--decode", "1"),
}
PROMPT = [5, 17, 99, 3, 42, 42, 8, 150, 61, 7, 7, 7, 200, 33]
LOGPROB_TOLERANCE = 1e-4  # float32 model; the same kernels in every deployment


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def fabric(request: pytest.FixtureRequest) -> Iterator[str]:
    with running_fabric("--model", "tiny", "--num-blocks", "128", *DEPLOYMENTS[request.param]) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


post = post_json


def complete(url: str, **fields: object) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    status, data = post(url + "/v1/completions", {**body, "return_token_ids": True, **fields})
    assert status == 200, data
    return data["choices"][0]


SAMPLING_CASES = {
    "penalties": {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    "repetition": {"repetition_penalty": 1.6},
    "logit_bias": {"logit_bias": {"65": 6.0, "66": 4.0}},
    "sampled": {"temperature": 0.9, "seed": 11, "top_k": 20, "presence_penalty": 0.5, "user": "u-1"},
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_fields_match_the_reference(fabric: str, reference: ReferenceEngine, case: str) -> None:
    fields = SAMPLING_CASES[case]
    got = complete(fabric, **fields)["token_ids"]
    params = {k: v for k, v in fields.items() if k != "user"}
    if "logit_bias" in params:
        params["logit_bias"] = tuple((int(k), float(v)) for k, v in params["logit_bias"].items())
    expected = reference.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True, **params))
    assert got == expected.token_ids
    plain = {"temperature": fields.get("temperature", 0), "seed": fields.get("seed", 0)}
    assert got != complete(fabric, **plain)["token_ids"], "the field changed nothing"


def test_min_tokens_holds_back_stop_tokens(fabric: str, reference: ReferenceEngine) -> None:
    first = complete(fabric)["token_ids"][0]
    stopped = complete(fabric, stop_token_ids=[first])
    assert stopped["token_ids"] == [first] and stopped["finish_reason"] == "stop"
    held = complete(fabric, stop_token_ids=[first], min_tokens=6)["token_ids"]
    assert len(held) >= 6 and first not in held[:6]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(first,), min_tokens=6)
    assert held == reference.generate(PROMPT, params).token_ids


def test_completion_logprobs_streamed_and_not(fabric: str, reference: ReferenceEngine) -> None:
    choice = complete(fabric, logprobs=3)
    block = choice["logprobs"]
    expected = reference.generate(PROMPT, SamplingParams(max_tokens=24, ignore_eos=True))
    assert choice["token_ids"] == expected.token_ids
    assert block["token_logprobs"] == pytest.approx(expected.logprobs, abs=LOGPROB_TOLERANCE)
    assert len(block["tokens"]) == len(block["top_logprobs"]) == len(block["text_offset"]) == 24
    for token, value, top in zip(
        block["tokens"], block["token_logprobs"], block["top_logprobs"], strict=True
    ):
        assert 1 <= len(top) <= 3  # distinct token texts may decode alike
        assert max(top.values()) == pytest.approx(value, abs=LOGPROB_TOLERANCE)  # greedy: the best one
        assert token in top
    assert block["text_offset"] == sorted(block["text_offset"]) and block["text_offset"][0] == 0

    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    chunks = sse_chunks(fabric + "/v1/completions", {**body, "logprobs": 3})
    streamed = [
        v
        for c in chunks
        if c["choices"][0]["logprobs"]
        for v in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed == pytest.approx(block["token_logprobs"], abs=LOGPROB_TOLERANCE)
    offsets = [
        o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == block["text_offset"]


def test_echo_puts_the_prompt_and_its_scores_first(fabric: str, reference: ReferenceEngine) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    plain = post(fabric + "/v1/completions", body)[1]["choices"][0]
    echoed = post(fabric + "/v1/completions", {**body, "echo": True})[1]["choices"][0]
    prompt_text = reference.tokenizer.decode(PROMPT, skip_special_tokens=False)
    assert echoed["text"] == prompt_text + plain["text"] and echoed["logprobs"] is None
    text_prompt = post(fabric + "/v1/completions", {**body, "prompt": "hello there", "echo": True})[1]
    assert text_prompt["choices"][0]["text"].startswith("hello there")
    # Scored: the prompt's tokens first (the first without a score), then the output's.
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=True)
    expected = reference.generate(PROMPT, params)
    for n in (1, 2):
        status, data = post(fabric + "/v1/completions", {**body, "echo": True, "logprobs": 2, "n": n})
        assert status == 200, data
        for choice in data["choices"]:
            block = choice["logprobs"]
            assert len(block["tokens"]) == len(PROMPT) + 6
            assert block["token_logprobs"][0] is None and block["top_logprobs"][0] is None
            want = [lp for lp, _ in expected.prompt_logprobs] + expected.logprobs
            assert block["token_logprobs"][1:] == pytest.approx(want, abs=LOGPROB_TOLERANCE)
            assert all(len(top) <= 2 for top in block["top_logprobs"][1:])
            assert block["text_offset"][0] == 0 and block["text_offset"] == sorted(block["text_offset"])
    chunks = sse_chunks(fabric + "/v1/completions", {**body, "echo": True, "logprobs": 2})
    streamed = [
        v
        for c in chunks
        if c["choices"][0]["logprobs"]
        for v in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert streamed[0] is None and streamed[1:] == pytest.approx(want, abs=LOGPROB_TOLERANCE)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == prompt_text + plain["text"]


def test_chat_logprobs_and_top_logprobs(fabric: str) -> None:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 8,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    status, data = post(fabric + "/v1/chat/completions", body)
    assert status == 200, data
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == data["usage"]["completion_tokens"] == 8
    for entry in content:
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"], abs=LOGPROB_TOLERANCE)
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
        assert bytes(entry["bytes"]).decode() == entry["token"]
    chunks = sse_chunks(fabric + "/v1/chat/completions", body)
    streamed = [
        e["logprob"]
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert streamed == pytest.approx([e["logprob"] for e in content], abs=LOGPROB_TOLERANCE)
    without = post(fabric + "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})[1]
    assert without["choices"][0]["logprobs"] is None


_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _NAMED(name: str) -> dict:  # noqa: N802 - reads as a constant in the table below
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
        ("/v1/completions", {"n": 2, "best_of": 1}, "best_of"),
        ("/v1/completions", {"n": 0}, "n"),
        ("/v1/completions", {"n": 129}, "n"),
        ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
        ("/v1/completions", {"prompt": ["a", 5]}, "prompt"),
        ("/v1/chat/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "!"}, "suffix"),
        ("/v1/completions", {"response_format": {"type": "xml"}}, "response_format"),
        ("/v1/completions", {"response_format": {"type": "regex", "regex": "(a"}}, "response_format"),
        (
            "/v1/completions",
            {"response_format": {"type": "grammar", "grammar": "start: <|nope|>"}},
            "response_format",
        ),
        (
            "/v1/completions",
            {"response_format": {"type": "grammar", "grammar": "start: <[99999]>"}},
            "response_format",
        ),
        ("/v1/completions", {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ("/v1/completions", {"tools": [_TOOL]}, "tools"),
        ("/v1/completions", {"speculative": {"k": 33}}, "speculative"),
        ("/v1/completions", {"speculative": "yes"}, "speculative"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        ("/v1/completions", {"logprobs": True}, "logprobs"),
        ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"+5": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {" 5": 1}}, "logit_bias"),
        ("/v1/completions", {"best_of": 21, "n": 21}, "best_of"),
        ("/v1/completions", {"n": 1.5}, "n"),
        ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/v1/completions", {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ("/v1/completions", {"top_k": -2}, "top_k"),
        ("/v1/chat/completions", {"tools": []}, "tools"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [_TOOL], "tool_choice": _NAMED("zz")}, "tool_choice"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ("/v1/chat/completions", {"tools": [_TOOL, _TOOL]}, "tools"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}, "tools": [_TOOL]},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "grammar", "grammar": "start: x"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
        ("/v1/chat/completions", {"echo": True}, "echo"),
    ],
)
def test_fields_not_implemented_are_a_400_naming_them(
    fabric: str, path: str, fields: dict, param: str
) -> None:
    base = {"model": "tiny", "max_tokens": 4}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    status, data = post(fabric + path, {**base, **fields})
    assert status == 400, data
    assert data["error"]["param"] == param and param in data["error"]["message"]


def test_integers_written_with_a_zero_fraction_are_integers(fabric: str) -> None:
    plain = complete(fabric)
    same = complete(fabric, max_tokens=24.0, n=1.0, prompt=[float(t) for t in PROMPT], stop_token_ids=[0.0])
    assert same["token_ids"] == plain["token_ids"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/admin/models/tiny/weights"])
def test_a_body_nested_past_the_parser_is_a_400(fabric: str, path: str) -> None:
    for body in (
        b"[" * 100_000 + b"]" * 100_000,  # past the parser's own recursion limit
        b'{"model": "tiny", "prompt": "hi", "metadata": ' + b"[" * 40 + b"]" * 40 + b"}",  # past the bound
    ):
        req = urllib.request.Request(fabric + path, body, {"Content-Type": "application/json"}, method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        assert caught.value.code == 400
        assert "nests" in json.loads(caught.value.read())["error"]["message"]


def test_fields_without_effect_on_the_output_are_accepted(fabric: str) -> None:
    plain = complete(fabric)
    same = complete(
        fabric, user="u-7", metadata={"k": "v"}, store=False, echo=False, best_of=1, logprobs=None
    )
    assert same["token_ids"] == plain["token_ids"] and same["logprobs"] is None
