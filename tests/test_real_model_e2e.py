"""A real model through the whole fabric: SmolLM2-135M-Instruct answers a factual question, the same
answer colocated, disaggregated and in the single-process reference; the README's run command."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from pdfabric import structure
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import running_fabric
from tests.test_gguf import packaged

pytestmark = packaged
MODEL = "smollm2-135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
DEPLOYMENTS = {
    "colocated": ("--colocated", "1", "--prefill", "0", "--decode", "0"),
    "disaggregated": ("--prefill", "1", "--decode", "1"),
}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def fabric(request: pytest.FixtureRequest) -> Iterator[str]:
    with running_fabric("--model", MODEL, "--num-blocks", "128", *DEPLOYMENTS[request.param]) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine(MODEL)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_chat_answers_a_factual_question_like_the_reference(fabric: str, reference: ReferenceEngine) -> None:
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 32,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": True,
    }
    answer = _post(fabric + "/v1/chat/completions", body)
    choice = answer["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop"  # the model ends its turn by itself

    prompt = reference.tokenizer.encode(
        reference.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False
    )
    expected = reference.generate(prompt, SamplingParams(max_tokens=32))
    assert choice["token_ids"] == expected.token_ids
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    # Each token's text, in order, spells the answer (English text: no token splits a character).
    content = choice["logprobs"]["content"]
    assert "".join(e["token"] for e in content[:-1]) == choice["message"]["content"]  # the last: <|im_end|>
    assert [e["logprob"] for e in content] == pytest.approx(expected.logprobs, abs=2e-2)  # bfloat16


def test_a_fabric_serving_the_gguf_files_own_blocks_answers_as_their_reference() -> None:
    """Prefill and decode workers with ``--quantization gguf`` (the file's Q4_1 layers and Q8_0 head
    multiplied as they are): the answer of the single-process reference holding the same blocks."""
    reference = ReferenceEngine(MODEL, quantization="gguf")
    prompt = reference.tokenizer.encode(
        reference.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False
    )
    expected = reference.generate(prompt, SamplingParams(max_tokens=24))
    args = ("--model", MODEL, "--num-blocks", "128", "--quantization", "gguf", *DEPLOYMENTS["disaggregated"])
    with running_fabric(*args) as url:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        choice = _post(url + "/v1/chat/completions", body)["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["token_ids"] == expected.token_ids


def test_a_fabric_with_an_int8_kv_cache_answers_as_its_reference() -> None:
    """Prefill and decode workers with ``--kv-cache-dtype int8`` (rows quantized as they are written,
    blocks handed over as bytes): the answer of the single-process reference over an int8 cache."""
    from pdfabric.kernels.paged_attention_cpu import int8_kv_supported

    if not int8_kv_supported(9, 3, 64, 16):
        pytest.skip("an int8 KV cache needs a CPU with AVX512-BF16")
    reference = ReferenceEngine(MODEL, kv_cache_dtype="int8")
    prompt = reference.tokenizer.encode(
        reference.tokenizer.apply_chat_template(QUESTION), add_special_tokens=False
    )
    expected = reference.generate(prompt, SamplingParams(max_tokens=24))
    deployment = DEPLOYMENTS["disaggregated"]
    args = ("--model", MODEL, "--num-blocks", "128", "--kv-cache-dtype", "int8", *deployment)
    with running_fabric(*args) as url:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 24, "temperature": 0,
                "return_token_ids": True}  # fmt: skip
        choice = _post(url + "/v1/chat/completions", body)["choices"][0]
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            workers = json.loads(response.read())["workers"]
    assert "Paris" in choice["message"]["content"]
    assert choice["token_ids"] == expected.token_ids
    assert [w["kv_cache_dtype"] for w in workers] == ["int8", "int8"]
    assert {w["kv_bytes_per_token"] for w in workers} == {2 * 30 * 3 * (64 + 4)}


def test_readme_run_command_streams_a_sensible_answer() -> None:
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    found = re.search(r"^pdfabric serve --model smollm2-135m --once .*$", readme, re.M)
    assert found is not None, "the README lost its run command"
    args = shlex.split(found.group(0))[1:]  # without the `pdfabric` executable: run it through this python
    out = subprocess.run(
        [sys.executable, "-m", "pdfabric.cli", *args, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=40)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):  # nested objects, an enum, a bounded number, an array, an optional field
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    favourite: Color
    address: Address
    nicknames: list[Annotated[str, Field(max_length=20)]] = Field(max_length=3)
    height_m: float | None = None


class Score(BaseModel):
    subject: str = Field(max_length=30)
    score: float = Field(ge=0, le=100)


class Report(BaseModel):  # an array of objects
    student: str = Field(max_length=40)
    scores: list[Score] = Field(min_length=1, max_length=4)
    passed: bool


@pytest.mark.parametrize(
    "shape, question",
    [
        (Person, "Invent a person who lives in Paris."),
        (Report, "Write a school report for Tom."),
        (Address, "Give the address of the Louvre."),
    ],
)
def test_the_sdks_parse_returns_valid_objects_equal_to_the_reference(
    fabric: str, reference: ReferenceEngine, shape: type[BaseModel], question: str
) -> None:
    """``client.chat.completions.parse`` with a Pydantic model (a strict JSON schema): the answer
    validates, and its tokens are the single-process reference's under the same grammar."""
    import openai
    from openai.lib._pydantic import to_strict_json_schema

    client = openai.OpenAI(base_url=fabric + "/v1", api_key="unused")
    messages = [{"role": "user", "content": question}]
    answer = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=shape, max_tokens=160, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, shape)
    schema = {"name": shape.__name__, "schema": to_strict_json_schema(shape), "strict": True}
    grammar = structure.response_format_grammar({"type": "json_schema", "json_schema": schema})
    prompt = reference.tokenizer.encode(
        reference.tokenizer.apply_chat_template(messages), add_special_tokens=False
    )
    expected = reference.generate(prompt, SamplingParams(max_tokens=160, grammar=grammar))
    assert choice.model_extra["token_ids"] == expected.token_ids


def test_tool_calls_stream_in_the_sdks_shape(fabric: str) -> None:
    import openai

    client = openai.OpenAI(base_url=fabric + "/v1", api_key="unused")
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    }
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=[weather],
        tool_choice="required", parallel_tool_calls=False, max_tokens=80, temperature=0, stream=True,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(
                delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""}
            )
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1, (finish, calls)
    call = calls[0]
    arguments = json.loads(call["arguments"])
    assert call["id"] and call["name"] == "get_weather" and arguments["unit"] in ("celsius", "fahrenheit")
    assert "Paris" in arguments["city"]
