"""``/v1/files`` and ``/v1/batches`` on a live fabric: a batch of completions, chat and embeddings lines
answers each line as the same request sent online would be answered, keeps tenants apart, can be
cancelled, and survives a kill -9 of its router: the restarted router finishes it with every line
answered exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.fabric import get_json, post_json, running_fabric, serve_process, wait_healthy

FLAGS = ("--model", "tiny", "--num-blocks", "64", "--colocated", "1", "--prefill", "0", "--decode", "0")


def _upload(url: str, data: bytes, purpose: str = "batch", tenant: str = "default") -> tuple[int, dict]:
    boundary = uuid.uuid4().hex
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        + data
        + f"\r\n--{boundary}--\r\n".encode()
    )
    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", "X-Tenant": tenant}
    req = urllib.request.Request(url + "/v1/files", body, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _lines(n: int, endpoint: str = "/v1/completions", max_tokens: int = 8) -> bytes:
    out = []
    for i in range(n):
        if endpoint == "/v1/completions":
            body = {"model": "tiny", "prompt": f"line {i}", "max_tokens": max_tokens, "temperature": 0}
        elif endpoint == "/v1/chat/completions":
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 4,
                "temperature": 0,
            }
        else:
            body = {"model": "tiny", "input": f"text {i}"}
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": endpoint, "body": body})
    return "\n".join(json.dumps(x) for x in out).encode() + b"\n"


def _wait(
    url: str, batch_id: str, states: tuple[str, ...], timeout: float = 120.0, tenant: str = "default"
) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status, batch = get_json(f"{url}/v1/batches/{batch_id}", headers={"X-Tenant": tenant})
        assert status == 200, batch
        if batch["status"] in states:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def _content(url: str, file_id: str, tenant: str = "default") -> list[dict]:
    req = urllib.request.Request(f"{url}/v1/files/{file_id}/content", headers={"X-Tenant": tenant})
    with urllib.request.urlopen(req, timeout=10) as r:
        return [json.loads(line) for line in r.read().splitlines() if line.strip()]


def _create(url: str, data: bytes, endpoint: str, tenant: str = "default") -> dict:
    status, f = _upload(url, data, tenant=tenant)
    assert status == 200 and f["purpose"] == "batch" and f["bytes"] == len(data), f
    status, batch = post_json(
        url + "/v1/batches",
        {"input_file_id": f["id"], "endpoint": endpoint, "completion_window": "24h", "metadata": {"k": "v"}},
        headers={"X-Tenant": tenant},
    )
    assert status == 200, batch
    assert batch["object"] == "batch" and batch["request_counts"]["total"] == data.count(b"\n")
    return batch


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> str:
    config = tmp_path_factory.mktemp("batches") / "serve.toml"
    config.write_text(f'[batches]\ndir = "{config.parent / "data"}"\n')
    with running_fabric(*FLAGS, "--config", str(config)) as url:
        yield url


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions", "/v1/embeddings"])
def test_each_line_gets_what_the_same_request_gets_online(fabric: str, endpoint: str) -> None:
    data = _lines(6, endpoint)
    batch = _create(fabric, data, endpoint)
    done = _wait(fabric, batch["id"], ("completed", "failed"))
    assert done["status"] == "completed" and done["request_counts"] == {
        "total": 6,
        "completed": 6,
        "failed": 0,
    }
    out = _content(fabric, done["output_file_id"])
    assert sorted(o["custom_id"] for o in out) == [f"req-{i}" for i in range(6)]
    assert _content(fabric, done["error_file_id"]) == []
    bodies = {json.loads(x)["custom_id"]: json.loads(x)["body"] for x in data.splitlines()}
    for o in out:
        assert o["response"]["status_code"] == 200 and o["error"] is None
        status, online = post_json(fabric + endpoint, bodies[o["custom_id"]])
        assert status == 200
        got = o["response"]["body"]
        if endpoint == "/v1/embeddings":
            assert got["data"] == online["data"]
        else:
            key = "text" if endpoint == "/v1/completions" else "message"
            assert got["choices"][0][key] == online["choices"][0][key]
    status, listed = get_json(fabric + "/v1/files?purpose=batch_output")
    assert status == 200 and done["output_file_id"] in {f["id"] for f in listed["data"]}


def test_bad_files_and_other_tenants_are_refused(fabric: str) -> None:
    status, f = _upload(fabric, b'{"custom_id": "a", "method": "POST", "url": "/v1/completions"}\n')
    assert status == 200
    status, err = post_json(
        fabric + "/v1/batches",
        {"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "24h"},
    )
    assert status == 400 and "line 1" in err["error"]["message"], err
    for body, param in (
        ({"input_file_id": f["id"], "endpoint": "/v1/edits", "completion_window": "24h"}, "endpoint"),
        (
            {"input_file_id": f["id"], "endpoint": "/v1/completions", "completion_window": "1h"},
            "completion_window",
        ),
        ({"input_file_id": "file-nope", "endpoint": "/v1/completions", "completion_window": "24h"}, None),
    ):
        status, err = post_json(fabric + "/v1/batches", body)
        assert status in (400, 404) and (param is None or err["error"]["param"] == param), err
    assert _upload(fabric, b"x", purpose="fine-tune")[0] == 400
    batch = _create(fabric, _lines(2), "/v1/completions", tenant="alice")
    assert get_json(f"{fabric}/v1/batches/{batch['id']}")[0] == 404  # another tenant's
    assert get_json(f"{fabric}/v1/files/{batch['input_file_id']}")[0] == 404
    _wait(fabric, batch["id"], ("completed",), tenant="alice")


def test_a_cancelled_batch_stops_sending_lines(fabric: str) -> None:
    batch = _create(fabric, _lines(200, max_tokens=64), "/v1/completions")
    status, cancelling = post_json(f"{fabric}/v1/batches/{batch['id']}/cancel", {})
    assert status == 200 and cancelling["status"] in ("cancelling", "cancelled")
    done = _wait(fabric, batch["id"], ("cancelled",))
    counts = done["request_counts"]
    assert counts["completed"] + counts["failed"] < 200
    assert len(_content(fabric, done["output_file_id"])) == counts["completed"]


def test_a_batch_survives_a_kill_of_its_router(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(f'[batches]\ndir = "{tmp_path / "data"}"\nmax_in_flight = 2\n')
    n = 40
    with serve_process(*FLAGS, "--config", str(config)) as (proc, url):
        wait_healthy(url, proc)
        batch = _create(url, _lines(n, max_tokens=24), "/v1/completions")
        deadline = time.monotonic() + 60
        while get_json(f"{url}/v1/batches/{batch['id']}")[1]["request_counts"]["completed"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # the router only: its workers see it gone and exit
        proc.wait()
    with running_fabric(*FLAGS, "--config", str(config)) as url:
        done = _wait(url, batch["id"], ("completed",), timeout=180)
        assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
        out = _content(url, done["output_file_id"])
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))  # each once
        assert all(o["response"]["status_code"] == 200 for o in out)


def test_a_batch_loses_no_line_when_a_worker_is_killed(tmp_path: Path) -> None:
    """Two colocated workers; one is killed (SIGKILL) while the batch runs: its lines fail over (or are
    sent again), the launcher restarts it, and every line ends answered 200, once."""
    config = tmp_path / "serve.toml"
    config.write_text(f'[batches]\ndir = "{tmp_path / "data"}"\n')
    n = 60
    flags = ("--model", "tiny", "--num-blocks", "64", "--colocated", "2", "--prefill", "0", "--decode", "0")
    with running_fabric(*flags, "--config", str(config)) as url:
        batch = _create(url, _lines(n, max_tokens=48), "/v1/completions")
        deadline = time.monotonic() + 60
        while get_json(f"{url}/v1/batches/{batch['id']}")[1]["request_counts"]["completed"] < 5:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        workers = get_json(url + "/health")[1]["workers"]
        victim = max(workers, key=lambda w: w["requests"])
        os.kill(victim["pid"], signal.SIGKILL)
        done = _wait(url, batch["id"], ("completed",), timeout=180)
        assert done["request_counts"] == {"total": n, "completed": n, "failed": 0}
        out = _content(url, done["output_file_id"])
        assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(n))
        assert all(o["response"]["status_code"] == 200 for o in out)


def test_files_are_listed_read_and_deleted_and_batches_paged(fabric: str) -> None:
    data = _lines(1)
    status, f = _upload(fabric, data, tenant="carol")
    assert status == 200
    listed = get_json(fabric + "/v1/files?purpose=batch", headers={"X-Tenant": "carol"})[1]["data"]
    assert [x["id"] for x in listed] == [f["id"]]
    assert _content(fabric, f["id"], tenant="carol") == [json.loads(data)]
    ids = [_create(fabric, data, "/v1/completions", tenant="carol")["id"] for _ in range(3)]
    first = get_json(fabric + "/v1/batches?limit=2", headers={"X-Tenant": "carol"})[1]
    assert first["has_more"] and [b["id"] for b in first["data"]] == ids[::-1][:2]
    rest = get_json(f"{fabric}/v1/batches?limit=2&after={first['last_id']}", headers={"X-Tenant": "carol"})[1]
    assert [b["id"] for b in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert get_json(fabric + "/v1/batches?limit=0", headers={"X-Tenant": "carol"})[0] == 400
    req = urllib.request.Request(
        f"{fabric}/v1/files/{f['id']}", headers={"X-Tenant": "carol"}, method="DELETE"
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read()) == {"id": f["id"], "object": "file", "deleted": True}
    assert get_json(f"{fabric}/v1/files/{f['id']}", headers={"X-Tenant": "carol"})[0] == 404
    for batch_id in ids:
        _wait(fabric, batch_id, ("completed",), tenant="carol")  # their lines were read at creation


def test_the_openai_sdk_runs_a_batch_and_embeds(fabric: str, tmp_path: Path) -> None:
    """The official client, as users run it: embeddings (it asks for base64 and decodes), a file
    upload, a batch, its status and its output."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=fabric + "/v1", api_key="unused")
    emb = client.embeddings.create(model="tiny", input=["hello", "world"])
    assert [d.index for d in emb.data] == [0, 1] and len(emb.data[0].embedding) > 8
    assert emb.usage.prompt_tokens == emb.usage.total_tokens > 0
    path = tmp_path / "in.jsonl"
    path.write_bytes(_lines(3))
    f = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    done = _wait(fabric, batch.id, ("completed",))
    assert (
        client.batches.retrieve(batch.id).request_counts.completed == 3 == done["request_counts"]["completed"]
    )
    lines = client.files.content(done["output_file_id"]).text.splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in lines) == ["req-0", "req-1", "req-2"]
    assert batch.id in {b.id for b in client.batches.list()}


def test_bench_batch_faults_finishes_a_batch_through_both_kills(tmp_path: Path) -> None:
    """``pdfabric bench batch-faults``: a worker and then the router killed (SIGKILL) mid-batch, the
    deployment started again: every line answered once."""
    from pdfabric.cli import main as cli

    config = tmp_path / "serve.toml"
    config.write_text(f'[batches]\ndir = "{tmp_path / "data"}"\nmax_in_flight = 2\n')
    target = f"serve:--model tiny --num-blocks 64 --colocated 1 --prefill 0 --decode 0 --config {config}"
    out = tmp_path / "faults.json"
    argv = ["bench", "batch-faults", "--target", target, "--batch-lines", "30", "--max-tokens", "16"]
    assert cli.main([*argv, "--json", str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    assert report["status"] == "completed" and report["answered_ok"] == 30
    assert report["missing"] == report["answered_twice"] == report["answered_error"] == 0
    assert [e["fault"] for e in report["events"]] == [
        "worker colocated-0 killed",
        "router killed",
        "router started again",
    ]
