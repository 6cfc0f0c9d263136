"""The pool scaler end to end on the local launcher: a load step on one colocated worker that decodes
two sequences at once makes requests wait in the router's queue, the scaler adds a second worker,
which takes requests; when the load stops the newest worker drains and is retired, not
restarted nor listed as down. Every decision is in the audit log and the metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import aiohttp

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import get_json, metric_values, post_json, running_fabric, wait_blocks_free

CONFIG = """
[serve]
model = "tiny"
colocated = 1
audit_log = "{audit}"

[worker]
num_blocks = 128
max_running = 2
profile_seconds = 1
heartbeat_s = 0.1

[routing]
ttft_ms = 5000
itl_ms = 10000
default_class = "interactive"

[[routing.classes]]
name = "interactive"
max_wait_ms = 5000

[autoscale]
enabled = true
interval_s = 0.25
window_s = 3
min_colocated = 1
max_colocated = 2
up_after_s = 1
down_after_s = 3
cooldown_s = 1
max_queue_ms = 100
"""
PROMPT = [5, 17, 99, 3, 42, 8, 150, 61]


def decisions(url: str) -> dict[str, float]:
    return metric_values(url, "pdfabric_scale_decisions_total")


def worker_ids(url: str) -> list[str]:
    return sorted(w["id"] for w in get_json(url + "/health")[1]["workers"])


def serving(url: str) -> bool:
    """Whether the scaler's second worker has registered and taken requests."""
    queries = metric_values(url, "pdfabric_prefix_cache_queries_total")
    return any('worker="colocated-1"' in k and v > 0 for k, v in queries.items())


async def load_step(url: str, until: float) -> int:
    """Eight clients in a loop, each request 64 tokens, until the scaler's new worker serves (or
    ``until``); returns how many requests were sent."""
    sent = 0
    stop = asyncio.Event()

    async def client(i: int) -> None:
        nonlocal sent
        body = {"model": "tiny", "prompt": [3 + i] * 32, "max_tokens": 64, "ignore_eos": True}
        async with aiohttp.ClientSession() as s:
            while not stop.is_set() and time.monotonic() < until:
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
                    assert r.status in (200, 429), (r.status, await r.text())
                sent += 1

    async def watch() -> None:
        while not stop.is_set() and time.monotonic() < until:
            if await asyncio.to_thread(serving, url):
                stop.set()
            await asyncio.sleep(0.2)

    await asyncio.gather(watch(), *(client(i) for i in range(8)))
    return sent


def test_a_load_step_scales_the_pool_up_and_back_down(tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    path = tmp_path / "scale.toml"
    path.write_text(CONFIG.format(audit=audit))
    with running_fabric("--config", str(path), timeout=30) as url:
        assert worker_ids(url) == ["colocated-0"]
        sent = asyncio.run(load_step(url, time.monotonic() + 60))
        assert serving(url), (sent, decisions(url))
        assert decisions(url) == {'{direction="up",kind="colocated"}': 1.0}, sent
        assert worker_ids(url) == ["colocated-0", "colocated-1"]
        assert metric_values(url, "pdfabric_pool_target_workers") == {'{kind="colocated"}': 2.0}
        # The fabric still answers token-exact.
        expected = ReferenceEngine("tiny").generate(PROMPT, SamplingParams(16, ignore_eos=True)).token_ids
        for _ in range(2):
            status, body = post_json(
                url + "/v1/completions",
                {
                    "model": "tiny",
                    "prompt": PROMPT,
                    "max_tokens": 16,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    "temperature": 0,
                },
            )
            assert status == 200 and body["choices"][0]["token_ids"] == list(expected), body
        # Idle now: after the window forgets the misses and the surplus holds, one worker drains.
        deadline = time.monotonic() + 30
        while worker_ids(url) != ["colocated-0"]:
            assert time.monotonic() < deadline, (worker_ids(url), decisions(url))
            time.sleep(0.2)
        assert decisions(url) == {
            '{direction="up",kind="colocated"}': 1.0,
            '{direction="down",kind="colocated"}': 1.0,
        }
        health = get_json(url + "/health")[1]
        assert health["down"] == [], health
        wait_blocks_free(url)
        time.sleep(1.0)  # the retired worker is not started again
        assert worker_ids(url) == ["colocated-0"]
    entries = [json.loads(line) for line in audit.read_text().splitlines()]
    scale = [
        (e["audit"], e["target"], e["from"], e["to"]) for e in entries if e["audit"].startswith("scale_")
    ]
    assert scale == [("scale_up", "colocated", 1, 2), ("scale_down", "colocated", 2, 1)], entries
    assert all(e["reason"] for e in entries if e["audit"].startswith("scale_"))
