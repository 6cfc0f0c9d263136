"""The fabric end to end: real router and worker processes on loopback, checked token for token
against the single-process reference."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.engine.sampling_params import SamplingParams
from tests.fabric import get_json, running_fabric, wait_blocks_free

DEPLOYMENTS = {
    "colocated": ("--colocated", "1"),
    "disaggregated": ("--prefill", "1", "--decode", "1"),
}


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def fabric(request: pytest.FixtureRequest) -> Iterator[str]:
    with running_fabric("--model", "tiny", "--num-blocks", "256", *DEPLOYMENTS[request.param]) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


async def _stream(url: str, body: dict) -> tuple[list[int], str, str | None, dict | None]:
    """(token ids, text, finish reason, usage) of one streamed completion."""
    ids, text, finish, usage = [], "", None, None
    body = {"model": "tiny", "stream": True, "return_token_ids": True, **body}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            assert "error" not in data, data
            if data.get("usage"):
                usage = data["usage"]
            for choice in data["choices"]:
                ids += choice["token_ids"]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return ids, text, finish, usage


def test_concurrent_greedy_requests_match_reference(fabric: str, reference: ReferenceEngine) -> None:
    prompts = [[5 + i] * (3 + 7 * i) for i in range(6)]
    bodies = [
        {"prompt": p, "max_tokens": 8 + 3 * i, "temperature": 0, "ignore_eos": True}
        for i, p in enumerate(prompts)
    ]

    async def run_all() -> list:
        return await asyncio.gather(*(_stream(fabric, b) for b in bodies))

    results = asyncio.run(run_all())
    for body, (ids, text, finish, _) in zip(bodies, results, strict=True):
        want = reference.generate(
            body["prompt"], SamplingParams(max_tokens=body["max_tokens"], ignore_eos=True)
        )
        assert ids == want.token_ids
        assert text == reference.tokenizer.decode(want.token_ids)
        assert finish == "length"
    wait_blocks_free(fabric)


def test_seeded_sampling_is_reproducible(fabric: str, reference: ReferenceEngine) -> None:
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 12,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 1234,
        "ignore_eos": True,
    }
    first = asyncio.run(_stream(fabric, body))[0]
    second = asyncio.run(_stream(fabric, body))[0]
    want = reference.generate(
        reference.tokenizer.encode("Once upon a time"),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True),
    )
    assert first == second == want.token_ids


def test_text_prompt_usage_and_stop_string(fabric: str, reference: ReferenceEngine) -> None:
    prompt = "The quick brown fox"
    ids, text, finish, usage = asyncio.run(
        _stream(
            fabric,
            {
                "prompt": prompt,
                "max_tokens": 20,
                "temperature": 0,
                "ignore_eos": True,
                "stream_options": {"include_usage": True},
            },
        )
    )
    prompt_ids = reference.tokenizer.encode(prompt)
    assert usage == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt_ids) + len(ids),
    }
    stop = text[5:7]
    if stop:  # stop at the first occurrence of a substring the model is known to produce
        _, cut, finish2, _ = asyncio.run(
            _stream(
                fabric,
                {"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stop": [stop]},
            )
        )
        assert finish2 == "stop" and cut == text[: text.index(stop)]


def test_openai_client_chat_and_completions(fabric: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fabric + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.usage.completion_tokens <= 5
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="hello",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage.completion_tokens == 6
    assert [m.id for m in client.models.list()] == ["tiny"]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"model": "nope", "prompt": "x"}, "model"),
        ({"prompt": "x"}, "model"),
        ({"model": "tiny", "prompt": ""}, "prompt"),
        ({"model": "tiny", "prompt": []}, "prompt"),
        ({"model": "tiny", "prompt": 7}, "prompt"),
        ({"model": "tiny", "prompt": [1, 99999]}, "prompt"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**9}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "tiny", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "tiny", "prompt": "x", "n": 2}, "n"),
        ({"model": "tiny", "prompt": [1] * 5000}, "prompt"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(fabric: str, body: dict, field: str) -> None:
    async def post() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.post(fabric + "/v1/completions", json=body) as r:
            return r.status, await r.json()

    status, data = asyncio.run(post())
    assert status == 400, data
    assert data["error"]["param"] == field and field in data["error"]["message"]


def test_malformed_json_and_bad_chat(fabric: str) -> None:
    async def post(path: str, data: bytes) -> tuple[int, dict]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(fabric + path, data=data, headers={"Content-Type": "application/json"}) as r,
        ):
            return r.status, await r.json()

    assert asyncio.run(post("/v1/completions", b"{not json"))[0] == 400
    status, data = asyncio.run(
        post("/v1/chat/completions", json.dumps({"model": "tiny", "messages": []}).encode())
    )
    assert status == 400 and data["error"]["param"] == "messages"


def test_client_disconnect_frees_blocks(fabric: str) -> None:
    async def read_a_little() -> None:
        body = {"model": "tiny", "prompt": [3] * 100, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as s, s.post(fabric + "/v1/completions", json=body) as r:
            assert r.status == 200
            for _ in range(5):
                await r.content.readline()
        # leaving the block closes the connection mid-stream

    asyncio.run(read_a_little())
    wait_blocks_free(fabric)


def test_worker_death_ends_requests_with_an_error() -> None:
    with running_fabric("--model", "tiny", "--colocated", "1") as url:
        pid = get_json(url + "/health")[1]["workers"][0]["pid"]

        async def stream_until_error() -> tuple[str, float]:
            body = {
                "model": "tiny",
                "prompt": [3] * 50,
                "max_tokens": 3000,
                "ignore_eos": True,
                "stream": True,
            }
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                await r.content.readline()
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                async for line in r.content:
                    if line.startswith(b'data: {"error"'):
                        return json.loads(line[6:])["error"]["message"], time.monotonic() - killed
            return "", 0.0

        message, delay = asyncio.run(asyncio.wait_for(stream_until_error(), 30))
        assert "colocated-0" in message and delay < 10
        status, body = get_json(url + "/health")
        assert status == 503 and body["workers"] == []
