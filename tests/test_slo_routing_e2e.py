"""Routing by latency budget end to end: real router and worker processes on loopback, deployed from
configs/slo-pools.toml (one prefill worker, a small-batch "tight" decode pool and a cheaper "bulk" one)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.fabric import get_json, metric_values, running_fabric, wait_blocks_free

CONFIG = Path(__file__).parent.parent / "configs" / "slo-pools.toml"
BACKGROUND = 40  # long requests that load the bulk pool


@pytest.fixture(scope="module")
def fabric() -> Iterator[str]:
    with running_fabric("--config", str(CONFIG), "--profile-seconds", "2") as url:
        yield url


async def _post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json={"model": "tiny", **body}, headers=headers or {}) as r,
    ):
        return r.status, dict(r.headers), await r.json()


async def _usage(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    """The ``usage`` of one streamed completion (which asks for it)."""
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}, **body}
    usage = None
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                usage = data.get("usage") or usage
    assert usage is not None
    return usage


def test_impossible_ttft_budget_is_rejected_at_once(fabric: str) -> None:
    start = time.monotonic()
    status, headers, body = asyncio.run(_post(fabric, {"prompt": "hello", "slo": {"ttft_ms": 0.01}}))
    elapsed = time.monotonic() - start
    assert status == 429, body
    assert "ttft_unreachable" in body["error"]["message"] and body["error"]["type"] == "rate_limit_exceeded"
    retry_ms = int(headers["retry-after-ms"])
    assert retry_ms > 0 and int(headers["Retry-After"]) == math.ceil(retry_ms / 1000)
    assert elapsed < 10, elapsed  # turned away on arrival, not after waiting for a route
    rejections = metric_values(fabric, "pdfabric_rejections_total")
    assert rejections.get('{reason="ttft_unreachable"}', 0) >= 1, rejections


@pytest.mark.parametrize(
    ("slo", "param"),
    [
        ({"ttft_ms": "fast"}, "slo.ttft_ms"),
        ({"ttft_ms": -5}, "slo.ttft_ms"),
        ({"itl": 3}, "slo.itl"),
        (7, "slo"),
    ],
)
def test_malformed_slo_is_a_400_naming_the_field(fabric: str, slo: object, param: str) -> None:
    status, _, body = asyncio.run(_post(fabric, {"prompt": "hello", "slo": slo}))
    assert status == 400 and body["error"]["param"] == param, body
    assert param in body["error"]["message"]


def test_tight_itl_lands_in_the_small_batch_pool(fabric: str) -> None:
    """Loose requests take the cheaper bulk pool; once it runs a big batch, a request whose ITL budget
    only a small batch meets goes to the tight pool. The budget is half the ITL the router predicts for
    the loaded bulk pool (and reports in the usage extension), so the outcome hangs on the batch sizes,
    not on how fast this machine is."""

    async def scenario() -> tuple[dict, dict, dict, list[dict]]:
        async with aiohttp.ClientSession() as session:
            idle = await _usage(session, fabric, {"prompt": [7] * 32, "max_tokens": 4, "slo": {}})
            background_body = {
                "model": "tiny", "prompt": [9] * 400, "max_tokens": 3000, "ignore_eos": True,
                "stream": True, "slo": {},
            }  # fmt: skip
            responses = []
            for _ in range(BACKGROUND):  # a big batch on the bulk pool, left running
                r = await session.post(fabric + "/v1/completions", json=background_body)
                assert r.status == 200
                await r.content.readline()
                responses.append(r)
            try:
                loaded = await _usage(session, fabric, {"prompt": [7] * 32, "max_tokens": 4, "slo": {}})
                p_idle = idle["pdfabric"]["predicted"]["itl_ms"]
                p_loaded = loaded["pdfabric"]["predicted"]["itl_ms"]
                assert p_loaded > 3 * p_idle, (p_idle, p_loaded)
                budget = p_loaded / 2  # far below the bulk batch, far above a batch of one
                body = {"prompt": [7] * 32, "max_tokens": 4, "slo": {"itl_ms": budget}}
                tight = await _usage(session, fabric, body)
                workers = get_json(fabric + "/health")[1]["workers"]
            finally:
                for r in responses:
                    r.close()
        return idle, loaded, tight, workers

    idle, loaded, tight, workers = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert idle["pdfabric"]["route"] == "prefill-0->decode-bulk-0"
    assert loaded["pdfabric"]["route"] == "prefill-0->decode-bulk-0"
    held = {w["id"]: w["requests"] for w in workers}
    assert held["decode-bulk-0"] >= BACKGROUND and held["decode-tight-0"] == 0, held
    ext = tight["pdfabric"]
    assert ext["route"] == "prefill-0->decode-tight-0", ext
    assert ext["slo"]["class"] == "interactive" and ext["predicted"]["itl_ms"] <= ext["slo"]["itl_ms"]
    assert set(ext["measured"]) == {"router_wait_ms", "ttft_ms", "itl_ms_mean"}
    assert set(ext["predicted"]) == {"ttft_ms", "itl_ms", "queue_ms", "prefill_ms", "transfer_ms"}
    wait_blocks_free(fabric, timeout=30)
