"""Serving on a local Ray cluster of three nodes (``ray.cluster_utils.Cluster``: a head and two more
raylets on this machine, each with resources of its own): the prefill worker is placed on the node
with the prefill resource, the two decode workers on the two nodes with a decode resource; output is
token-exact against the single-process reference; a worker killed mid-stream fails over and Ray
places its replacement. Losing a whole node is the slow case."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from pdfabric.engine.generate import ReferenceEngine
from pdfabric.sampling_params import SamplingParams
from tests.fabric import get_json, metric_values, running_fabric, wait_blocks_free
from tests.test_autoscale_e2e import CONFIG as SCALE
from tests.test_autoscale_e2e import decisions, load_step, serving, worker_ids

cluster_utils = pytest.importorskip("ray.cluster_utils", reason="needs pdfabric[ray]")

NODE = {"num_cpus": 1, "object_store_memory": 80 * 2**20}
CONFIG = """
[serve]
model = "tiny"
prefill = 1
decode = 2

[worker]
num_blocks = 256
profile_seconds = 1

[ray.resources.prefill]
CPU = 1
pdfabric-prefill = 1

[ray.resources.decode]
CPU = 1
pdfabric-decode = 1
"""


class Nodes:
    def __init__(self) -> None:
        head = {**NODE, "resources": {"pdfabric-prefill": 1}, "include_dashboard": False}
        self.cluster = cluster_utils.Cluster(initialize_head=True, connect=False, head_node_args=head)
        self.decode = [self.cluster.add_node(**NODE, resources={"pdfabric-decode": 1}) for _ in range(2)]

    def raylet(self, node) -> int:  # noqa: ANN001
        return node.all_processes["raylet"][0].process.pid


@pytest.fixture(scope="module")
def nodes() -> Iterator[Nodes]:
    n = Nodes()
    try:
        yield n
    finally:
        n.cluster.shutdown()


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine("tiny")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _raylet_of(pid: int) -> int:
    """The raylet a worker runs under: its parent is its actor, the actor's parent that raylet."""
    return _parent(_parent(pid))


def _workers(url: str) -> dict[str, dict]:
    return {w["id"]: w for w in get_json(url + "/health")[1]["workers"]}


async def _stream(url: str, body: dict, started: asyncio.Event | None = None) -> list[int]:
    ids: list[int] = []
    body = {"model": "tiny", "stream": True, "return_token_ids": True, **body}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                ids += [t for c in data["choices"] for t in c["token_ids"]]
                if started is not None and len(ids) >= 2:
                    started.set()
    return ids


def _expected(reference: ReferenceEngine, body: dict) -> list[int]:
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=0.0, ignore_eos=True)
    return list(reference.generate(body["prompt"], params).token_ids)


def _wait_back(url: str, worker_id: str, old_pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = _workers(url).get(worker_id)
        if w is not None and w["pid"] != old_pid:
            return w
        time.sleep(0.2)
    raise AssertionError(f"{worker_id} did not come back within {timeout:.0f}s: {_workers(url)}")


def test_workers_on_three_nodes_serve_token_exact_and_fail_over(
    nodes: Nodes, reference: ReferenceEngine, tmp_path: Path
) -> None:
    path = tmp_path / "ray.toml"
    path.write_text(CONFIG)
    bodies = [{"prompt": [9 + i] * (6 + 7 * i), "max_tokens": 800, "ignore_eos": True, "temperature": 0.0}
              for i in range(6)]  # fmt: skip
    with running_fabric("--config", str(path), "--ray", nodes.cluster.address, timeout=90) as url:
        workers = _workers(url)
        assert sorted(workers) == ["decode-0", "decode-1", "prefill-0"], workers
        # Placed by their resource requests: prefill on the head, one decode worker on each other node.
        assert _raylet_of(workers["prefill-0"]["pid"]) == nodes.raylet(nodes.cluster.head_node)
        decode_raylets = {_raylet_of(workers[w]["pid"]) for w in ("decode-0", "decode-1")}
        assert decode_raylets == {nodes.raylet(n) for n in nodes.decode}

        started = [asyncio.Event() for _ in bodies]
        victim: dict = {}

        async def run_all() -> list[list[int]]:
            tasks = [asyncio.create_task(_stream(url, b, e)) for b, e in zip(bodies, started, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            # The decode worker holding the most streams dies mid-stream (the router may have put
            # them all on one). A first token comes from the prefill worker, which holds the request
            # until its KV has reached a decode worker: wait for a hand-off (the streams are long).
            deadline = time.monotonic() + 30
            while True:
                now = await asyncio.to_thread(_workers, url)
                victim.update(max((now[w] for w in ("decode-0", "decode-1")), key=lambda w: w["requests"]))
                if victim["requests"] >= 1 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            assert victim["requests"] >= 1, now
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        results = asyncio.run(run_all())
        for body, ids in zip(bodies, results, strict=True):
            assert ids == _expected(reference, body)
        assert sum(metric_values(url, "pdfabric_failovers_total").values()) >= 1
        # Its actor reported the exit; a new actor took the node's freed decode resource.
        back = _wait_back(url, victim["id"], victim["pid"], 60)
        assert _raylet_of(back["pid"]) in decode_raylets
        restarts = metric_values(url, "pdfabric_worker_restarts_total")
        assert restarts == {f'{{worker="{victim["id"]}"}}': 1.0}, restarts
        wait_blocks_free(url)
        body = {**bodies[0], "max_tokens": 24}
        assert asyncio.run(_stream(url, body)) == _expected(reference, body)


@pytest.mark.slow
def test_a_lost_node_fails_over_and_its_worker_returns_on_a_new_node(
    nodes: Nodes, reference: ReferenceEngine, tmp_path: Path
) -> None:
    path = tmp_path / "ray.toml"
    path.write_text(CONFIG)
    body = {"prompt": [11] * 20, "max_tokens": 200, "ignore_eos": True, "temperature": 0.0}
    with running_fabric("--config", str(path), "--ray", nodes.cluster.address, timeout=90) as url:
        workers = _workers(url)
        lost = next(n for n in nodes.decode if nodes.raylet(n) == _raylet_of(workers["decode-1"]["pid"]))
        old = workers["decode-1"]["pid"]
        started = [asyncio.Event() for _ in range(4)]

        async def run_all() -> list[list[int]]:
            tasks = [asyncio.create_task(_stream(url, body, e)) for e in started]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
            await asyncio.to_thread(nodes.cluster.remove_node, lost)  # the node goes, with its raylet
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        for ids in asyncio.run(run_all()):
            assert ids == _expected(reference, body)
        # No node has a free decode resource until one joins; then Ray places the worker there.
        nodes.decode.remove(lost)
        nodes.decode.append(nodes.cluster.add_node(**NODE, resources={"pdfabric-decode": 1}))
        back = _wait_back(url, "decode-1", old, 90)
        assert _raylet_of(back["pid"]) == nodes.raylet(nodes.decode[-1])
        wait_blocks_free(url)


def test_a_wildcard_control_address_is_joined_at_this_nodes_ip() -> None:
    from pdfabric.cli.ray_launch import join_address

    assert join_address("tcp://127.0.0.1:5555") == "tcp://127.0.0.1:5555"
    host = join_address("tcp://0.0.0.0:5555").removeprefix("tcp://").rsplit(":", 1)
    assert host[1] == "5555" and host[0] not in ("0.0.0.0", "")


@pytest.mark.slow
def test_the_scaler_adds_and_drains_a_ray_worker(nodes: Nodes, tmp_path: Path) -> None:
    """The load step of ``test_autoscale_e2e`` on the Ray cluster: the scaler's new worker is a Ray
    actor on a node with a free CPU, and its drain gives the CPU back."""
    path = tmp_path / "scale.toml"
    path.write_text(SCALE.format(audit=tmp_path / "audit.jsonl"))
    with running_fabric("--config", str(path), "--ray", nodes.cluster.address, timeout=90) as url:
        sent = asyncio.run(load_step(url, time.monotonic() + 60))
        assert serving(url), (sent, decisions(url))
        workers = _workers(url)
        raylets = {nodes.raylet(nodes.cluster.head_node)} | {nodes.raylet(n) for n in nodes.decode}
        assert {_raylet_of(w["pid"]) for w in workers.values()} <= raylets
        deadline = time.monotonic() + 40
        while worker_ids(url) != ["colocated-0"]:
            assert time.monotonic() < deadline, (worker_ids(url), decisions(url))
            time.sleep(0.2)
        assert set(decisions(url).values()) == {1.0} and len(decisions(url)) == 2
