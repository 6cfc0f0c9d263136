"""The fabric end to end: real router and worker processes on loopback, checked token for token
against the single-process reference."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import torch

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import free_port, get_json, metric_values, running_fabric, wait_blocks_free

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


async def _stream(
    url: str, body: dict, headers: dict[str, str] | None = None
) -> tuple[list[int], str, str | None, dict | None]:
    """(token ids, text, finish reason, usage) of one streamed completion."""
    ids, text, finish, usage = [], "", None, None
    body = {"model": "tiny", "stream": True, "return_token_ids": True, **body}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body, headers=headers) as r:
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
    # 16 prompts from 3 to 108 tokens: one block, several blocks, partial last blocks (block size 16).
    prompts = [[5 + i] * (3 + 7 * i) for i in range(16)]
    # The slo extension (budgets no request misses) reports each request's route in its usage.
    extra = {"slo": {"ttft_ms": 600_000, "itl_ms": 600_000}, "stream_options": {"include_usage": True}}
    bodies = [
        {"prompt": p, "max_tokens": 8 + (3 * i) % 20, "temperature": 0, "ignore_eos": True, **extra}
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
    workers = get_json(fabric + "/health")[1]["workers"]
    kinds = {w["kind"] for w in workers}
    for w in workers:  # the profile the router predicts with, refined by the steps just run
        assert w["profile"]["prefill_samples"] + w["profile"]["decode_samples"] > 0, w
    if "prefill" in kinds:  # every request routed to a pair moved its KV from prefill to decode
        # (a decode worker that caches part of a prompt from an earlier test may prefill it itself)
        pairs = sum("->" in usage["pdfabric"]["route"] for *_, usage in results)
        transfers = metric_values(fabric, "pdfabric_kv_transfer_bytes_count")
        assert sum(transfers.values()) >= pairs >= len(bodies) // 2
        # ... over shared memory (one host, caches in host memory; a GPU's caches go over ZeroMQ),
        # and the prefill worker's heartbeats report its rate
        deadline = time.monotonic() + 10
        while True:
            workers = get_json(fabric + "/health")[1]["workers"]
            (pre,) = [w for w in workers if w["kind"] == "prefill"]
            if pre["kv_rates"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        want = {"zmq"} if torch.cuda.is_available() else {"shm"}  # workers take the GPU when there is one
        assert set(pre["kv_rates"]) == want and pre["kv_bytes_per_s"] > 0, pre


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
        "prompt_tokens_details": {"cached_tokens": 0},  # this prompt is new to the workers
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
    completion = client.completions.create(
        model="tiny", prompt="hello", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 4
    chat_chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert chat_chunks[-1].choices[0].finish_reason == "length"
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
        ({"model": "tiny", "prompt": "x", "n": 200}, "n"),
        ({"model": "tiny", "prompt": [1] * 5000}, "prompt"),
        ({"model": "tiny", "prompt": "x", "timeout": 0}, "timeout"),
        ({"model": "tiny", "prompt": "x", "timeout": "soon"}, "timeout"),
        ({"model": "tiny", "prompt": "x", "timeout": 1e9}, "timeout"),
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


def test_a_request_deadline_ends_it_in_time_and_frees_its_blocks(fabric: str) -> None:
    """``timeout`` in the body or ``X-Request-Timeout``: the request ends with an error at its deadline
    (streaming: an error event; otherwise 504), every worker drops it, and it counts as lost."""
    long = {"model": "tiny", "prompt": [3] * 60, "max_tokens": 3000, "ignore_eos": True}

    async def run() -> tuple[str, float, int, dict, int]:
        async with aiohttp.ClientSession() as s:
            start = time.monotonic()
            error = ""
            async with s.post(fabric + "/v1/completions", json={**long, "stream": True, "timeout": 0.5}) as r:
                async for line in r.content:
                    if line.startswith(b'data: {"error"'):
                        error = json.loads(line[6:])["error"]["message"]
            took = time.monotonic() - start
            url = fabric + "/v1/completions"
            async with s.post(url, json=long, headers={"X-Request-Timeout": "0.4"}) as r:
                status, body = r.status, await r.json()
            async with s.post(url, json=long, headers={"X-Request-Timeout": "-1"}) as r:
                bad_header = r.status
        return error, took, status, body, bad_header

    error, took, status, body, bad_header = asyncio.run(asyncio.wait_for(run(), 60))
    assert "deadline (0.5s) passed" in error and took < 5, (error, took)
    assert status == 504 and "deadline (0.4s) passed" in body["error"]["message"]
    assert bad_header == 400
    assert metric_values(fabric, "pdfabric_requests_lost_total").get('{cause="deadline"}', 0) >= 2
    wait_blocks_free(fabric)


def test_an_idempotency_key_replays_a_sampled_completion_computed_once(fabric: str) -> None:
    """Unseeded sampling at temperature 1 draws new tokens (and the response a new id) every time it
    runs, so a retry under the same key that gets the same body, with the generated tokens counted
    once, was replayed, not computed again."""
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 24, "temperature": 1,
            "ignore_eos": True}  # fmt: skip

    async def post(key: str, payload: dict = body) -> tuple[int, bytes, str | None]:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s,
            s.post(fabric + "/v1/completions", json=payload, headers={"Idempotency-Key": key}) as r,
        ):
            return r.status, await r.read(), r.headers.get("Idempotent-Replayed")

    async def twice_at_once(key: str) -> list[tuple[int, bytes, str | None]]:
        return await asyncio.gather(post(key), post(key))

    def total(name: str) -> float:
        return sum(metric_values(fabric, name).values())

    generated, replays = total("pdfabric_generation_tokens_total"), total("pdfabric_idempotent_replays_total")
    key = f"retry-{uuid.uuid4()}"
    status, first, replayed = asyncio.run(post(key))
    assert status == 200 and replayed is None, first
    assert asyncio.run(post(key)) == (200, first, "true")
    assert total("pdfabric_generation_tokens_total") == generated + 24
    # Sent together, one computes and the other waits for its response.
    a, b = asyncio.run(twice_at_once(f"together-{uuid.uuid4()}"))
    assert a[:2] == b[:2] and a[0] == 200 and {a[2], b[2]} == {None, "true"}
    assert json.loads(a[1])["id"] != json.loads(first)["id"]
    assert total("pdfabric_generation_tokens_total") == generated + 48
    assert total("pdfabric_idempotent_replays_total") == replays + 2
    # The key with another body is a 422; an empty or over-long key a 400; both name the header.
    for other_key, payload, want in [(key, {**body, "max_tokens": 5}, 422), ("", body, 400),
                                     ("k" * 256, body, 400)]:  # fmt: skip
        status, data, _ = asyncio.run(post(other_key, payload))
        assert status == want and json.loads(data)["error"]["param"] == "Idempotency-Key", data
    # A stream ignores the header: it is computed, under a key held by another body.
    ids, _, finish, _ = asyncio.run(_stream(fabric, {**body, "max_tokens": 3}, {"Idempotency-Key": key}))
    assert len(ids) == 3 and finish == "length"


def test_a_conversations_next_turn_reuses_cached_kv_token_exact(
    fabric: str, reference: ReferenceEngine
) -> None:
    """Each turn re-sends the turns before it (prompt and answer) plus a new message: its prefix comes
    from the prefix cache (``usage.prompt_tokens_details.cached_tokens``), and the answer is the
    reference's. Disaggregated, the decode worker that served a turn holds its KV: a short new
    message is prefilled there (no KV moves), a long one on the prefill worker, which ships only the
    blocks after the cached prefix."""

    async def complete(prompt: list[int]) -> tuple[list[int], dict]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True, "slo": {}}  # fmt: skip
        async with aiohttp.ClientSession() as s, s.post(fabric + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            data = await r.json()
        return data["choices"][0]["token_ids"], data["usage"]

    def kv_bytes_sent() -> float:  # 0 when colocated: KV never moves
        return sum(metric_values(fabric, "pdfabric_kv_transfer_bytes_sum").values())

    params = SamplingParams(24, ignore_eos=True)
    turn1 = [(5 * i) % 250 + 3 for i in range(70)]
    out1, usage1 = asyncio.run(complete(turn1))
    sent1 = kv_bytes_sent()
    time.sleep(0.6)  # the workers' next heartbeats tell the router what they cached
    turn2 = turn1 + out1 + [4, 5, 6]  # a short new message
    out2, usage2 = asyncio.run(complete(turn2))
    sent2 = kv_bytes_sent() - sent1
    time.sleep(0.6)
    turn3 = turn2 + out2 + [(3 * i) % 240 + 7 for i in range(300)]  # a long one
    out3, usage3 = asyncio.run(complete(turn3))
    sent3 = kv_bytes_sent() - sent1 - sent2
    routes = [u["pdfabric"]["route"] for u in (usage1, usage2, usage3)]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (usage1, usage2, usage3)]
    assert cached[0] == 0 and 64 <= cached[1] < len(turn2)
    if routes[0] == "colocated-0":
        assert routes == ["colocated-0"] * 3 and sent1 == sent2 == sent3 == 0
        assert len(turn2) - 16 <= cached[2] < len(turn2) + len(out2)
    else:
        assert routes == ["prefill-0->decode-0", "decode-0", "prefill-0->decode-0"], routes
        assert sent2 == 0 and 0 < sent3 < sent1 * len(turn3) / len(turn1), (sent1, sent3)
        assert cached[2] == 64  # the prefill worker computes after its own cache: it saw turn 1 only
    assert out1 == reference.generate(turn1, params).token_ids
    assert out2 == reference.generate(turn2, params).token_ids
    assert out3 == reference.generate(turn3, params).token_ids
    deadline = time.monotonic() + 10  # the workers' counts come with their next heartbeats
    while sum(metric_values(fabric, "pdfabric_prefix_cache_hits_total").values()) < 64:
        assert time.monotonic() < deadline, metric_values(fabric, "pdfabric_prefix_cache_hits_total")
        time.sleep(0.1)


def test_each_turn_of_a_conversation_goes_where_its_history_is_cached(reference: ReferenceEngine) -> None:
    """Two colocated workers: the router's view of their prefix caches sends every turn to the worker
    that served the turn before, so each turn finds all of its history cached."""
    with running_fabric("--model", "tiny", "--num-blocks", "256", "--colocated", "2") as url:

        async def complete(prompt: list[int]) -> tuple[list[int], int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 20, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                data = await r.json()
            return data["choices"][0]["token_ids"], data["usage"]["prompt_tokens_details"]["cached_tokens"]

        history, known = [(7 * i) % 200 + 5 for i in range(60)], 0  # known: tokens a worker has seen
        for turn in range(4):
            out, cached = asyncio.run(complete(history))
            assert out == reference.generate(history, SamplingParams(20, ignore_eos=True)).token_ids
            if turn:  # all of the last turn's prompt and answer, but its last token, in full blocks
                assert cached == (known - 1) // 16 * 16, (turn, cached, known)
            known = len(history) + len(out)
            history = history + out + [3, 4]
            time.sleep(0.6)  # the worker's next heartbeat tells the router what it cached


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


@pytest.mark.parametrize(
    "flags, victim",
    [
        (("--colocated", "2"), "colocated-0"),
        (("--prefill", "1", "--decode", "2"), "decode-0"),
        (("--prefill", "2", "--decode", "1"), "prefill-0"),
    ],
)
def test_a_worker_killed_mid_stream_fails_over_token_exact(
    flags: tuple[str, ...], victim: str, reference: ReferenceEngine
) -> None:
    """kill -9 of a worker while 8 streams (greedy and seeded) run: every stream goes on elsewhere and
    ends exactly as the single-process reference, and no block stays taken on the survivors."""
    bodies = [
        {"prompt": [7 + i] * (5 + 9 * i), "max_tokens": 160, "ignore_eos": True, "temperature": 0.0}
        if i % 2 == 0
        else {"prompt": [7 + i] * (5 + 9 * i), "max_tokens": 160, "ignore_eos": True,
              "temperature": 0.8, "top_p": 0.95, "seed": 100 + i}
        for i in range(8)
    ]  # fmt: skip
    kind = victim.rsplit("-", 1)[0]
    with running_fabric("--model", "tiny", "--num-blocks", "256", *flags) as url:
        started = [asyncio.Event() for _ in bodies]

        async def one(i: int) -> list[int]:
            ids: list[int] = []
            body = {"model": "tiny", "stream": True, "return_token_ids": True, **bodies[i]}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    for choice in data["choices"]:
                        ids += choice["token_ids"]
                    if len(ids) >= 2:
                        started[i].set()
            return ids

        async def run_all() -> list[list[int]]:
            tasks = [asyncio.create_task(one(i)) for i in range(len(bodies))]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            # Of the victim's kind, the worker holding the most streams: where the router placed them
            # depends on the load each reported, and a worker holding none would test nothing.
            nonlocal victim, pid
            workers = [w for w in get_json(url + "/health")[1]["workers"] if w["kind"] == kind]
            chosen = max(workers, key=lambda w: (w["requests"], w["id"] == victim))
            victim, pid = chosen["id"], chosen["pid"]
            os.kill(pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        pid = 0
        results = asyncio.run(run_all())
        for body, ids in zip(bodies, results, strict=True):
            params = SamplingParams(
                max_tokens=160, ignore_eos=True, temperature=body["temperature"],
                top_p=body.get("top_p", 1.0), seed=body.get("seed", 0),
            )  # fmt: skip
            assert ids == reference.generate(body["prompt"], params).token_ids
        failovers = metric_values(url, "pdfabric_failovers_total")
        if kind != "prefill":  # a prefill worker may have handed every stream off already
            assert sum(failovers.values()) >= 1, failovers
        # The launcher starts the killed worker again; it registers under its old id and serves.
        deadline = time.monotonic() + 60
        while True:
            health = get_json(url + "/health")[1]
            back = [w for w in health["workers"] if w["id"] == victim]
            if back and back[0]["pid"] != pid or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert back and back[0]["pid"] != pid and back[0]["restarts"] == 1 and health["down"] == [], health
        assert metric_values(url, "pdfabric_worker_restarts_total") == {f'{{worker="{victim}"}}': 1.0}
        wait_blocks_free(url)
        prompt = bodies[0]["prompt"]
        greedy = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        again = asyncio.run(_stream(url, greedy))
        assert again[0] == reference.generate(prompt, SamplingParams(16, ignore_eos=True)).token_ids


ADMIN_KEY = "admin-secret"


def _post_status(url: str, headers: dict[str, str] | None = None) -> int:
    req = urllib.request.Request(url, data=b"", method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("how", ["sigterm", "admin"])
def test_a_draining_worker_finishes_its_streams_and_new_requests_go_elsewhere(
    how: str, reference: ReferenceEngine, tmp_path: Path
) -> None:
    """SIGTERM to the worker, or the router's admin endpoint (which needs the admin key when one is
    configured): its streams finish there, token-exact, it exits and is not restarted."""
    config = tmp_path / "admin.toml"
    config.write_text(f'[serve]\nadmin_key_sha256 = "{hashlib.sha256(ADMIN_KEY.encode()).hexdigest()}"\n')
    flags = ("--config", str(config), "--prefill", "1", "--decode", "2", "--num-blocks", "256")
    with running_fabric("--model", "tiny", *flags) as url:
        workers = get_json(url + "/health")[1]["workers"]
        pid = next(w["pid"] for w in workers if w["id"] == "decode-0")
        bodies = [
            {"prompt": [9 + i] * (10 + 5 * i), "max_tokens": 200, "temperature": 0, "ignore_eos": True}
            for i in range(4)
        ]
        drain, key = url + "/admin/workers/decode-0/drain", {"Authorization": f"Bearer {ADMIN_KEY}"}
        if how == "admin":
            assert _post_status(drain) == 401
            assert _post_status(drain, {"Authorization": "Bearer wrong"}) == 401
            assert _post_status(url + "/admin/workers/nobody/drain", key) == 404

        async def run_all() -> list:
            tasks = [asyncio.create_task(_stream(url, b)) for b in bodies]
            await asyncio.sleep(0.3)
            if how == "sigterm":
                os.kill(pid, signal.SIGTERM)
            else:
                assert await asyncio.to_thread(_post_status, drain, key) == 202
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        results = asyncio.run(run_all())
        for body, (ids, _, finish, _) in zip(bodies, results, strict=True):
            want = reference.generate(body["prompt"], SamplingParams(200, ignore_eos=True)).token_ids
            assert ids == want and finish == "length"
        deadline = time.monotonic() + 30
        while True:
            health = get_json(url + "/health")[1]
            if health["down"] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert [d["id"] for d in health["down"]] == ["decode-0"] and "drained" in health["down"][0]["reason"]
        assert "decode-0" not in [w["id"] for w in health["workers"]]  # and it was not restarted
        # Its streams finished there, none had to move; a new request goes to the other decode worker.
        assert sum(metric_values(url, "pdfabric_failovers_total").values()) == 0
        assert asyncio.run(_stream(url, bodies[0]))[0] == results[0][0]
        wait_blocks_free(url)


@pytest.mark.parametrize(
    "flags, victim",
    [(("--colocated", "1"), "colocated-0"), (("--prefill", "1", "--decode", "1"), "decode-0")],
)
def test_worker_death_with_no_worker_left_ends_requests_with_an_error(
    flags: tuple[str, ...], victim: str
) -> None:
    with running_fabric("--model", "tiny", *flags) as url:
        workers = get_json(url + "/health")[1]["workers"]
        pid = next(w["pid"] for w in workers if w["id"] == victim)

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
        assert victim in message and delay < 10
        # The error may come first from the prefill worker, whose KV push to a dead decode worker
        # fails at once; the router drops the worker when its heartbeats stop (worker_timeout_s).
        deadline = time.monotonic() + 15
        while True:
            status, body = get_json(url + "/health")
            if status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert status == 503 and victim not in [w["id"] for w in body["workers"]]

        async def after_death() -> int:  # a non-streaming request now fails fast with a 503
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                return r.status

        assert asyncio.run(asyncio.wait_for(after_death(), 30)) == 503


def test_readme_serve_and_curl_work(tmp_path: Path) -> None:
    """The README's `pdfabric serve` plus its `curl -N` streaming example, as written there."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    curl = re.search(r"^(curl -N .*?)\n(?!\s)", readme, re.S | re.M)
    assert curl is not None, "the README lost its curl example"
    port = free_port()
    command = curl.group(1).replace("\\\n", " ").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    with running_fabric(port=port):  # `pdfabric serve` with its defaults, on a free port
        out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    events = [line for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_forced_zmq_transport_with_chunked_prompts_is_token_exact(
    tmp_path: Path, reference: ReferenceEngine
) -> None:
    """``kv_transport = "zmq"`` and 32-token steps: prompts prefill in several chunks, their layers
    leave over ZeroMQ tcp as the last chunk computes them, and the output is still the reference's."""
    config = tmp_path / "zmq.toml"
    config.write_text('[worker]\nkv_transport = "zmq"\nmax_batch_tokens = 32\n')
    flags = (
        "--config",
        str(config),
        "--model",
        "tiny",
        "--num-blocks",
        "256",
        "--prefill",
        "1",
        "--decode",
        "1",
    )
    bodies = [
        {"prompt": [3 + i] * (5 + 19 * i), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        for i in range(6)
    ]
    with running_fabric(*flags) as url:

        async def run_all() -> list:
            return await asyncio.gather(*(_stream(url, b) for b in bodies))

        for body, (ids, _, finish, _) in zip(bodies, asyncio.run(run_all()), strict=True):
            want = reference.generate(body["prompt"], SamplingParams(max_tokens=6, ignore_eos=True))
            assert ids == want.token_ids and finish == "length"
        wait_blocks_free(url)
        deadline = time.monotonic() + 10
        while True:
            (pre,) = [w for w in get_json(url + "/health")[1]["workers"] if w["kind"] == "prefill"]
            if pre["kv_rates"] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert set(pre["kv_rates"]) == {"zmq"}, pre
