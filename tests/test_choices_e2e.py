"""Several outputs per request, colocated and disaggregated: ``n`` (completions and chat), ``best_of``
and lists of prompts give, output by output, the single-process reference's tokens for that output's
seed stream (``SamplingParams.choice``), streamed and not."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from pdfabric.engine.generate import Generation, ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import post_json, running_fabric, sse_chunks

DEPLOYMENTS = {
    "colocated": ("--colocated", "1", "--prefill", "0", "--decode", "0"),
    "disaggregated": ("--prefill", "1", "--decode", "1"),
}
PROMPTS = [[5, 17, 99, 3, 42, 42, 8, 150, 61, 7, 7, 7, 200, 33, 90, 91, 12, 4, 4], [250, 2, 71, 71, 9]]
SAMPLED = {"temperature": 0.9, "seed": 1234, "max_tokens": 10, "ignore_eos": True}
PARAMS = SamplingParams(max_tokens=10, temperature=0.9, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def fabric(request: pytest.FixtureRequest) -> Iterator[str]:
    with running_fabric("--model", "tiny", "--num-blocks", "256", *DEPLOYMENTS[request.param]) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


def expected(reference: ReferenceEngine, prompt: list[int], choice: int, **kw: object) -> Generation:
    return reference.generate(prompt, replace(PARAMS, choice=choice, **kw))


def post(url: str, body: dict) -> dict:
    status, data = post_json(url, {"model": "tiny", "return_token_ids": True, **body})
    assert status == 200, data
    return data


def stream(url: str, body: dict) -> list[dict]:
    return sse_chunks(url, {"model": "tiny", "return_token_ids": True, **body})


def streamed_tokens(chunks: list[dict]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for c in chunks:
        for choice in c["choices"]:
            out.setdefault(choice["index"], []).extend(choice.get("token_ids", []))
    return out


def test_n_gives_each_output_its_own_seed_stream(fabric: str, reference: ReferenceEngine) -> None:
    data = post(fabric + "/v1/completions", {"prompt": PROMPTS[0], "n": 3, **SAMPLED})
    choices = sorted(data["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    want = [expected(reference, PROMPTS[0], i).token_ids for i in range(3)]
    assert [c["token_ids"] for c in choices] == want
    assert len({tuple(w) for w in want}) == 3  # the outputs differ
    assert data["usage"]["completion_tokens"] == 30 and data["usage"]["prompt_tokens"] == len(PROMPTS[0])
    chunks = stream(fabric + "/v1/completions", {"prompt": PROMPTS[0], "n": 3, **SAMPLED})
    assert streamed_tokens(chunks) == dict(enumerate(want))
    finishes = [ch["index"] for c in chunks for ch in c["choices"] if ch["finish_reason"] is not None]
    assert sorted(finishes) == [0, 1, 2]


def test_greedy_outputs_are_all_the_single_output(fabric: str, reference: ReferenceEngine) -> None:
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    one = post(fabric + "/v1/completions", body)["choices"][0]["token_ids"]
    assert one == reference.generate(PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    data = post(fabric + "/v1/completions", {**body, "n": 4})
    assert [c["token_ids"] for c in data["choices"]] == [one] * 4


def test_a_list_of_prompts_with_n_indexes_prompt_then_output(fabric: str, reference: ReferenceEngine) -> None:
    data = post(fabric + "/v1/completions", {"prompt": PROMPTS, "n": 2, **SAMPLED})
    got = {c["index"]: c["token_ids"] for c in data["choices"]}
    want = {p * 2 + i: expected(reference, PROMPTS[p], i).token_ids for p in range(2) for i in range(2)}
    assert got == want
    assert data["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    chunks = stream(fabric + "/v1/completions", {"prompt": PROMPTS, "n": 2, **SAMPLED})
    assert streamed_tokens(chunks) == want


def test_best_of_returns_the_likeliest_outputs(fabric: str, reference: ReferenceEngine) -> None:
    data = post(fabric + "/v1/completions", {"prompt": PROMPTS[0], "best_of": 4, "n": 2, **SAMPLED})
    runs = [expected(reference, PROMPTS[0], i) for i in range(4)]
    ranked = sorted(runs, key=lambda g: -sum(g.logprobs) / len(g.logprobs))
    assert [c["index"] for c in data["choices"]] == [0, 1]
    assert [c["token_ids"] for c in data["choices"]] == [g.token_ids for g in ranked[:2]]
    assert data["usage"]["completion_tokens"] == 40  # every output generated counts


def test_chat_n_with_logprobs(fabric: str, reference: ReferenceEngine) -> None:
    body = {"messages": [{"role": "user", "content": "hello there"}], "n": 2, "logprobs": True, **SAMPLED}
    data = post(fabric + "/v1/chat/completions", body)
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for c in data["choices"]:
        assert len(c["logprobs"]["content"]) == len(c["token_ids"]) == 10
    assert data["choices"][0]["token_ids"] != data["choices"][1]["token_ids"]
    chunks = stream(fabric + "/v1/chat/completions", body)
    assert streamed_tokens(chunks) == {c["index"]: c["token_ids"] for c in data["choices"]}
