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
from pathlib import Path

import pytest

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
