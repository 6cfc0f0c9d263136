"""Fair shares and shed order between tenants with API keys, end to end through HTTP on one small
colocated worker: under overload a weight-3 tenant is admitted three times as often as a weight-1
tenant of the same class, and a full queue sheds the batch class before any interactive request.

The worker takes two sequences at once; two long "hold" requests fill it while a backlog builds up in
the router's queue, then they are cancelled, so the order of admission alone decides what is
asserted, however fast or slow the machine runs. No duration is asserted."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator

import aiohttp
import pytest

from tests.fabric import metric_values, running_fabric, wait_blocks_free


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


KEYS = {"hold": "key-hold", "paid": "key-paid", "other": "key-other", "free": "key-free"}
QUEUE = 8  # the router's wait queue, all tenants

CONFIG = f"""
[serve]
model = "tiny"
colocated = 1

[worker]
kv_memory_mb = 64
max_batch_tokens = 64
max_running = 2
profile_seconds = 1
heartbeat_s = 0.1

[routing]
ttft_ms = 120000
itl_ms = 10000
default_class = "interactive"
mean_remaining_tokens = 8
queue_capacity = {QUEUE}

[[routing.classes]]
name = "interactive"
priority = 10
max_wait_ms = 120000

[[routing.classes]]
name = "batch"
priority = 0
max_wait_ms = 120000

[[routing.tenants]]
name = "hold"
api_keys_sha256 = ["{_sha(KEYS["hold"])}"]

[[routing.tenants]]
name = "paid"
weight = 3
api_keys_sha256 = ["{_sha(KEYS["paid"])}"]

[[routing.tenants]]
name = "other"
weight = 1
api_keys_sha256 = ["{_sha(KEYS["other"])}"]

[[routing.tenants]]
name = "free"
slo_class = "batch"
api_keys_sha256 = ["{_sha(KEYS["free"])}"]
"""


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("fair") / "fair.toml"
    path.write_text(CONFIG)
    with running_fabric("--config", str(path), timeout=25) as url:
        yield url


class Result:
    """One request's end: its HTTP status, its body's error (if any) and, when it was admitted, the
    time its response headers came (the test's monotonic clock): the router writes them once the
    request is admitted, so their order is the order of admission across rounds of the worker."""

    def __init__(self, tenant: str, status: int, admitted: float, error: dict | None = None) -> None:
        self.tenant, self.status, self.admitted, self.error = tenant, status, admitted, error


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    tenant: str,
    i: int,
    max_tokens: int = 64,
    started: asyncio.Event | None = None,
) -> Result:
    """A streamed completion as ``tenant``; ``started`` is set at its first token."""
    body = {
        "model": "tiny",
        "prompt": [5 + i] * 16,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
        admitted = time.monotonic()
        if r.status != 200:
            return Result(tenant, r.status, admitted, (await r.json())["error"])
        async for line in r.content:
            if line.startswith(b"data: {"):
                assert "error" not in json.loads(line[6:]), line
                if started is not None:
                    started.set()
        return Result(tenant, r.status, admitted)


async def _settle(
    url: str, waiting: int, done: int, tasks: list[asyncio.Task], holding: list[asyncio.Task]
) -> None:
    """Until ``waiting`` requests wait in the router's queue and ``done`` of ``tasks`` have ended
    (refused); a task that raised fails the test."""
    while True:
        queued = (await asyncio.to_thread(metric_values, url, "pdfabric_admission_waiting")).get("", 0)
        ended = [t for t in tasks if t.done()]
        for task in ended:
            task.result()
        if queued >= waiting and len(ended) >= done:
            return
        assert not any(t.done() for t in holding), "a hold request ended before the queue was set up"
        await asyncio.sleep(0.01)


async def _overload(url: str, waves: list[tuple[str, int, int, int]]) -> list[Result]:
    """Fills the worker with two hold requests, then sends each wave (tenant, requests, then waiting
    in the queue, then refused in all) once the waves before it have settled, then cancels the holds
    so that the queue drains; returns every wave's results, in order."""
    async with aiohttp.ClientSession() as session:
        started = [asyncio.Event(), asyncio.Event()]
        holding = [
            asyncio.create_task(_one(session, url, "hold", 100 + i, 4000, started=e))
            for i, e in enumerate(started)
        ]
        await asyncio.gather(*(e.wait() for e in started))
        tasks: list[asyncio.Task] = []
        for tenant, count, waiting, refused in waves:
            for _ in range(count):  # spaced, so that they reach the queue in the order of their index
                tasks.append(asyncio.create_task(_one(session, url, tenant, len(tasks))))
                await asyncio.sleep(0.03)
            await _settle(url, waiting, refused, tasks, holding)
        for task in holding:
            task.cancel()
        await asyncio.gather(*holding, return_exceptions=True)
        return list(await asyncio.gather(*tasks))


def test_weights_share_admissions_under_overload(fabric: str) -> None:
    """other (weight 1) queues four interactive requests, then paid (weight 3) four. Start-time fair
    queuing spaces other's by 1 and paid's by 1/3 in virtual time, both from where the queue began, so
    they are admitted other, paid, paid, paid, other, paid, other, other, two at a time as the worker
    frees its places: three of the first four are paid's (first come, first served would admit none of
    them; equal weights, two)."""
    results = asyncio.run(asyncio.wait_for(_overload(fabric, [("other", 4, 4, 0), ("paid", 4, 8, 0)]), 60))
    wait_blocks_free(fabric, timeout=5)
    assert all(r.status == 200 for r in results), [(r.tenant, r.status, r.error) for r in results]
    order = [r.tenant for r in sorted(results, key=lambda r: r.admitted)]
    # Admitted in pairs, one pair per 64-token decode: compare the pairs, not the order within one.
    pairs = [sorted(order[i : i + 2]) for i in range(0, 8, 2)]
    assert pairs == [["other", "paid"], ["paid", "paid"], ["other", "paid"], ["other", "other"]], order


def test_a_full_queue_sheds_the_batch_class_first(fabric: str) -> None:
    """free (batch class) fills the queue; paid's interactive requests then displace free's newest
    waiting ones (429 queue_full with Retry-After) and are all served; a further batch request finds
    nothing below it to displace and is refused at once."""
    results = asyncio.run(
        asyncio.wait_for(
            _overload(fabric, [("free", QUEUE, QUEUE, 0), ("paid", 3, QUEUE, 3), ("free", 1, QUEUE, 4)]), 60
        )
    )
    wait_blocks_free(fabric, timeout=5)
    free, paid, late = results[:QUEUE], results[QUEUE : QUEUE + 3], results[-1]
    assert all(r.status == 200 for r in paid), [(r.status, r.error) for r in paid]
    shed = [r for r in free if r.status != 200]
    assert [r.status for r in shed] == [429] * 3, [(r.status, r.error) for r in free]
    assert all("queue" in r.error["message"] for r in shed), [r.error for r in shed]
    # The newest batch requests went first: the five oldest were all served.
    assert all(r.status == 200 for r in free[:5]), [(r.status, r.error) for r in free]
    assert late.status == 429 and "queue" in late.error["message"], (late.status, late.error)
    # The interactive requests were admitted first, two at a time as the worker freed its places: the
    # first pair is paid's, the second holds paid's third beside free's oldest.
    order = [r.tenant for r in sorted(paid + free[:5], key=lambda r: r.admitted)]
    assert order[:2] == ["paid", "paid"] and sorted(order[2:4]) == ["free", "paid"], order
