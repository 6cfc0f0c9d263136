"""Structured outputs and tool calls through a running fabric, colocated and disaggregated: outputs
follow their schema, equal the single-process reference token for token, and survive a decode
worker killed mid-structure."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import Iterator

import aiohttp
import pytest

from pdfabric import structure
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import get_json, metric_values, post_json, running_fabric, sse_chunks, wait_blocks_free

DEPLOYMENTS = {
    "colocated": ("--colocated", "1"),
    "disaggregated": ("--prefill", "1", "--decode", "1"),
}
NUMBERS = {
    "type": "json_schema",
    "json_schema": {
        "name": "numbers",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "label": {"enum": ["low", "high"]},
                "values": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 999},
                    "minItems": 24,
                    "maxItems": 24,
                },
            },
            "required": ["label", "values"],
            "additionalProperties": False,
        },
    },
}
CITY = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def fabric(request: pytest.FixtureRequest) -> Iterator[str]:
    with running_fabric("--model", "tiny", "--num-blocks", "256", *DEPLOYMENTS[request.param]) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


def valid_numbers(text: str) -> bool:
    data = json.loads(text)
    values = data["values"]
    return (
        set(data) == {"label", "values"} and data["label"] in ("low", "high") and len(values) == 24
        and all(isinstance(v, int) and 0 <= v <= 999 for v in values)
    )  # fmt: skip


def reference_ids(reference: ReferenceEngine, prompt: list[int], body: dict, max_tokens: int) -> list[int]:
    grammar = structure.response_format_grammar(body["response_format"])
    params = SamplingParams(
        max_tokens=max_tokens, temperature=body.get("temperature", 1.0), seed=body.get("seed", 0),
        top_p=body.get("top_p", 1.0), grammar=grammar, choice=body.get("_choice", 0),
    )  # fmt: skip
    return reference.generate(prompt, params).token_ids


def test_outputs_follow_their_schema_and_equal_the_reference(fabric: str, reference: ReferenceEngine) -> None:
    prompt = reference.tokenizer.encode("Some numbers:", add_special_tokens=True)
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 7}):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "response_format": NUMBERS,
                "return_token_ids": True, "n": 2, **sampling}  # fmt: skip
        status, data = post_json(fabric + "/v1/completions", body)
        assert status == 200, data
        for choice in data["choices"]:
            assert choice["finish_reason"] == "stop" and valid_numbers(choice["text"]), choice
            want = reference_ids(reference, prompt, {**body, "_choice": choice["index"]}, 200)
            assert choice["token_ids"] == want
    wait_blocks_free(fabric)


def test_logprobs_and_a_cached_prefix_leave_a_structured_output_as_it_was(
    fabric: str, reference: ReferenceEngine
) -> None:
    """The log-probabilities are the model's own (before the mask), and the same request again, its
    prompt now in the prefix cache, gives the same tokens."""
    prompt = reference.tokenizer.encode("Numbers again, " * 6, add_special_tokens=True)  # several blocks
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "response_format": NUMBERS,
            "return_token_ids": True, "temperature": 0, "logprobs": 2}  # fmt: skip
    params = SamplingParams(max_tokens=200, grammar=structure.response_format_grammar(NUMBERS))
    want = reference.generate(prompt, params)
    for attempt in range(2):
        status, data = post_json(fabric + "/v1/completions", body)
        assert status == 200, data
        choice = data["choices"][0]
        assert choice["token_ids"] == want.token_ids and valid_numbers(choice["text"])
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
        if attempt:
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, data["usage"]


def test_a_structure_cut_by_max_tokens_ends_with_length(fabric: str) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 10, "response_format": NUMBERS, "temperature": 0}
    status, data = post_json(fabric + "/v1/completions", body)
    assert status == 200 and data["choices"][0]["finish_reason"] == "length", data
    assert data["choices"][0]["text"].startswith('{"label": ')


def test_tool_calls_come_in_openais_shapes(fabric: str) -> None:
    messages = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"model": "tiny", "messages": messages, "tools": [CITY], "tool_choice": named, "max_tokens": 120,
            "temperature": 0}  # fmt: skip
    status, data = post_json(fabric + "/v1/chat/completions", body)
    assert status == 200, data
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    assert args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7
    # streamed: the call's id, type and name first, then its arguments; the same call as above
    chunks = sse_chunks(fabric + "/v1/chat/completions", body)
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas[0]["id"] and deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["function"].get("arguments", "") for d in deltas) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any(c["choices"][0]["delta"].get("content") for c in chunks)
    # the call and its result in the conversation: the next turn is served
    follow = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": '{"sky": "clear"}'},
    ]
    status, data = post_json(
        fabric + "/v1/chat/completions", {**body, "messages": follow, "tool_choice": "none"}
    )
    assert status == 200 and data["choices"][0]["finish_reason"] in ("stop", "length"), data
    assert "tool_calls" not in data["choices"][0]["message"]


@pytest.mark.parametrize("victim_kind", ["decode"])
def test_a_decode_worker_killed_mid_structure_fails_over_token_exact(
    victim_kind: str, reference: ReferenceEngine
) -> None:
    """kill -9 of the decode worker holding the most streams while 6 structured streams (greedy and
    seeded) run: every stream goes on elsewhere, its grammar state rebuilt from the tokens streamed,
    and ends valid and exactly as the single-process reference."""
    prompts = [reference.tokenizer.encode(f"numbers {i}:", add_special_tokens=True) for i in range(6)]
    bodies = [
        {"prompt": p, "max_tokens": 200, "response_format": NUMBERS, "temperature": 0.0}
        if i % 2 == 0
        else {"prompt": p, "max_tokens": 200, "response_format": NUMBERS, "temperature": 0.8, "seed": 40 + i}
        for i, p in enumerate(prompts)
    ]
    bodies[-1]["n"] = 2  # two outputs of one prompt, each moved from where it stood
    with running_fabric("--model", "tiny", "--num-blocks", "256", "--prefill", "1", "--decode", "2") as url:
        started = [asyncio.Event() for _ in bodies]

        async def one(i: int) -> list[tuple[list[int], str]]:
            outputs: list[tuple[list[int], str]] = [([], "") for _ in range(bodies[i].get("n", 1))]
            body = {"model": "tiny", "stream": True, "return_token_ids": True, **bodies[i]}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    for choice in data["choices"]:
                        ids, text = outputs[choice["index"]]
                        outputs[choice["index"]] = (ids + choice["token_ids"], text + choice["text"])
                    if min(len(ids) for ids, _ in outputs) >= 12:  # inside the structure
                        started[i].set()
            return outputs

        async def run_all() -> list[list[tuple[list[int], str]]]:
            tasks = [asyncio.create_task(one(i)) for i in range(len(bodies))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            workers = [w for w in get_json(url + "/health")[1]["workers"] if w["kind"] == victim_kind]
            os.kill(max(workers, key=lambda w: w["requests"])["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        results = asyncio.run(run_all())
        for body, outputs in zip(bodies, results, strict=True):
            for choice, (ids, text) in enumerate(outputs):
                assert valid_numbers(text), text
                assert ids == reference_ids(reference, body["prompt"], {**body, "_choice": choice}, 200)
        assert sum(metric_values(url, "pdfabric_failovers_total").values()) >= 1
