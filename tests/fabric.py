"""Starting and stopping a real fabric (router and worker processes) on loopback for tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 5.0, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post_json(
    url: str, body: dict, timeout: float = 120.0, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    """POSTs ``body`` as JSON (with ``headers``); the status and the JSON reply (an error's too)."""
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def sse_chunks(
    url: str, body: dict, timeout: float = 120.0, headers: dict[str, str] | None = None
) -> list[dict]:
    """POSTs ``body`` with ``stream: true``; every server-sent event's JSON before ``[DONE]``."""
    req = urllib.request.Request(
        url,
        json.dumps({**body, "stream": True}).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    chunks = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.status == 200, r.read()
        for line in r:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


@contextlib.contextmanager
def running_fabric(*flags: str, port: int = 0, timeout: float = 120.0) -> Iterator[str]:
    """Starts ``pdfabric serve FLAGS`` on ``port`` (default: a free one); yields its base URL; always
    stops it and its workers."""
    with serve_process(*flags, port=port) as (proc, url):
        wait_healthy(url, proc, timeout)
        yield url


@contextlib.contextmanager
def serve_process(*flags: str, port: int = 0) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Starts ``pdfabric serve FLAGS`` on ``port`` (default: a free one) without waiting for it; yields
    the process and its base URL; always stops it and the workers it started."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "pdfabric.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, env={**os.environ}, start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Workers follow the router; make sure none outlives the test.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Waits until ``url``'s /health says 200; fails if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"pdfabric serve exited with code {proc.returncode} during start-up")
        try:
            if get_json(url + "/health", timeout=1.0)[0] == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("the fabric did not become healthy in time")
        time.sleep(0.1)


def metric_values(url: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric family from the router's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name) :]] = float(value)
    return out


def wait_blocks_free(url: str, timeout: float = 15.0) -> None:
    """Waits until every worker reports all its KV blocks free; fails with the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        free = metric_values(url, "pdfabric_kv_blocks_free")
        total = metric_values(url, "pdfabric_kv_blocks_total")
        if free and free == total:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not all free: free={free} total={total}")
        time.sleep(0.1)
