"""``/v1/embeddings`` on a live fabric: the vectors the single-process reference computes, in OpenAI's
shapes, from prefill workers (disaggregated) and colocated ones; bad requests get a 400 naming the
field; the metrics split each input's time."""

from __future__ import annotations

import base64
import concurrent.futures
from array import array
from collections.abc import Iterator

import pytest

from pdfabric.engine.generate import ReferenceEngine
from tests.fabric import post_json, running_fabric

DEPLOYMENTS = {
    "disaggregated": ("--prefill", "1", "--decode", "1"),
    "colocated": ("--colocated", "1", "--prefill", "0", "--decode", "0"),
}
TEXTS = ["The quick brown fox", "jumps over the lazy dog", "a"]


@pytest.fixture(scope="module", params=list(DEPLOYMENTS))
def fabric(request: pytest.FixtureRequest) -> Iterator[str]:
    with running_fabric("--model", "tiny", "--num-blocks", "64", *DEPLOYMENTS[request.param]) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


def _want(reference: ReferenceEngine, item: str | list[int]) -> list[float]:
    ids = reference.tokenizer.encode(item) if isinstance(item, str) else item
    return reference.embed(list(ids), "last", True)  # tiny declares no pooling: last token, unit length


def test_vectors_equal_the_reference_in_openai_shape(fabric: str, reference: ReferenceEngine) -> None:
    inputs = [*TEXTS, [5, 6, 7, 8]]
    status, body = post_json(fabric + "/v1/embeddings", {"model": "tiny", "input": inputs})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == "tiny"
    assert [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    assert all(d["object"] == "embedding" for d in body["data"])
    for d, item in zip(body["data"], inputs, strict=True):
        assert d["embedding"] == _want(reference, item)
    tokens = sum(len(reference.tokenizer.encode(t)) for t in TEXTS) + 4
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    status, one = post_json(
        fabric + "/v1/embeddings", {"model": "tiny", "input": TEXTS[0], "encoding_format": "base64"}
    )
    assert status == 200, one
    got = array("f", base64.b64decode(one["data"][0]["embedding"])).tolist()
    assert got == _want(reference, TEXTS[0])


def test_concurrent_requests_are_batched_and_each_gets_its_own_vectors(
    fabric: str, reference: ReferenceEngine
) -> None:
    texts = [f"request number {i} says {'hi ' * (i % 5)}" for i in range(24)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(
            pool.map(lambda t: post_json(fabric + "/v1/embeddings", {"model": "tiny", "input": t}), texts)
        )
    for (status, body), text in zip(replies, texts, strict=True):
        assert status == 200, body
        assert body["data"][0]["embedding"] == _want(reference, text)
    status, metrics = _metrics(fabric)
    assert status == 200
    for name in ("batch_wait", "worker_wait", "compute"):
        assert f'pdfabric_embedding_{name}_seconds_count{{model="tiny"}}' in metrics
    assert "pdfabric_embedding_batch_inputs_bucket" in metrics


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "tiny"}, "input"),
        ({"model": "tiny", "input": ""}, "input"),
        ({"model": "tiny", "input": []}, "input"),
        ({"model": "tiny", "input": [1, 99999]}, "input"),
        ({"model": "tiny", "input": "hi", "dimensions": 8}, "dimensions"),
        ({"model": "tiny", "input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"model": "tiny", "input": "hi", "temperature": 1.0}, "temperature"),
        ({"model": "nope", "input": "hi"}, "model"),
        ({"model": "tiny", "input": "x" * 5000}, "input"),
    ],
)
def test_bad_requests_name_the_field(fabric: str, body: dict, param: str) -> None:
    status, reply = post_json(fabric + "/v1/embeddings", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


def _metrics(url: str) -> tuple[int, str]:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.status, r.read().decode()
