"""The router's own life: stopping drains the requests in flight first; a router that restarts gets
back the workers that joined it from elsewhere (they reconnect, drop what the old router had them
doing, register again and serve token-exact; none of their blocks stays taken)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import pytest

from pdfabric.cluster_secret import ENV
from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import free_port, get_json, serve_process, wait_blocks_free, wait_healthy


@contextlib.contextmanager
def joined_worker(control: str, worker_id: str) -> Iterator[subprocess.Popen[bytes]]:
    """A colocated worker started on its own (``pdfabric worker --join``); stopped with SIGTERM (it
    drains and exits), killed if it does not."""
    cmd = [
        sys.executable, "-m", "pdfabric.cli", "worker", "--kind", "colocated", "--join", control,
        "--worker-id", worker_id, "--model", "tiny", "--num-blocks", "256", "--threads", "1",
        "--profile-seconds", "0.5", "--log-level", "WARNING",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _stream_some(url: str, body: dict, tokens: int) -> int:
    """Opens a stream and returns once ``tokens`` tokens came (the request goes on at the worker)."""
    got = 0
    body = {"model": "tiny", "stream": True, "return_token_ids": True, **body}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                got += sum(len(c["token_ids"]) for c in json.loads(line[6:])["choices"])
                if got >= tokens:
                    return got
    return got


async def _complete(url: str, body: dict) -> list[int]:
    body = {"model": "tiny", "return_token_ids": True, **body}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        return (await r.json())["choices"][0]["token_ids"]


def test_workers_reregister_with_a_restarted_router_and_serve_token_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The deployment's secret, which the router (both runs) and the worker started on its own share.
    monkeypatch.setenv(ENV, "a secret the router and the joined worker share")
    control_port, http_port = free_port(), free_port()
    control = f"tcp://127.0.0.1:{control_port}"
    flags = ("--model", "tiny", "--colocated", "0", "--control-port", str(control_port))
    prompt = [11] * 40
    want = ReferenceEngine("tiny").generate(prompt, SamplingParams(24, ignore_eos=True)).token_ids
    greedy = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    with joined_worker(control, "joined-0") as worker:
        with serve_process(*flags, port=http_port) as (router, url):
            wait_healthy(url, router)
            [info] = get_json(url + "/health")[1]["workers"]
            assert (info["id"], info["pid"]) == ("joined-0", worker.pid)
            assert asyncio.run(asyncio.wait_for(_complete(url, greedy), 60)) == want
            long = {"prompt": [5] * 30, "max_tokens": 4000, "ignore_eos": True, "temperature": 0}
            asyncio.run(asyncio.wait_for(_stream_some(url, long, 4), 60))  # the stream keeps running
            os.kill(router.pid, signal.SIGKILL)  # the router dies; the worker still decodes that stream
            router.wait(timeout=10)
        assert worker.poll() is None, "a joined worker must outlive its router"
        with serve_process(*flags, port=http_port) as (router, url):
            wait_healthy(url, router, timeout=60)
            [info] = get_json(url + "/health")[1]["workers"]
            assert (info["id"], info["pid"]) == ("joined-0", worker.pid)  # the same process, registered again
            wait_blocks_free(url)  # the stream the old router lost was dropped at the worker
            assert asyncio.run(asyncio.wait_for(_complete(url, greedy), 60)) == want
            # A router stopped on purpose leaves joined workers running too.
            router.send_signal(signal.SIGTERM)
            assert router.wait(timeout=20) == 0
        time.sleep(0.5)
        assert worker.poll() is None


def test_stopping_the_server_lets_streams_in_flight_finish_and_refuses_new_requests() -> None:
    prompt, n = [13] * 20, 3000  # long enough to be still running while the test looks around
    with serve_process("--model", "tiny", "--colocated", "1", "--num-blocks", "256") as (router, url):
        wait_healthy(url, router)

        async def run() -> tuple[list[int], str | None, int, int]:
            ids: list[int] = []
            finish = None
            body = {"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                    "ignore_eos": True, "stream": True, "return_token_ids": True}  # fmt: skip
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    for choice in data["choices"]:
                        ids += choice["token_ids"]
                        finish = choice["finish_reason"] or finish
                    if len(ids) == 5:  # the server is told to stop mid-stream
                        router.send_signal(signal.SIGTERM)
                        await asyncio.sleep(0.3)
                        new = {"model": "tiny", "prompt": "x", "max_tokens": 2}
                        async with s.post(url + "/v1/completions", json=new) as refused:
                            status = refused.status
                        async with s.get(url + "/health") as health:
                            health_status = health.status
            return ids, finish, status, health_status

        ids, finish, status, health_status = asyncio.run(asyncio.wait_for(run(), 120))
        assert (status, health_status) == (503, 503)
        assert len(ids) == n and finish == "length"  # the stream in flight ran to its end
        assert router.wait(timeout=30) == 0
