"""Runs batch jobs (``batch_jobs.py``): each line of each unfinished batch, through the router's own
HTTP API, as the batch's tenant and in the batch class, so that a line is served, limited, counted
and failed over exactly as a client's request would be.

How lines are paced: at most ``[batches] max_in_flight`` lines run at once, over every batch (oldest
batch first), and a line is sent only while no request waits in the router's admission queue; lines
are admitted in the ``[batches] slo_class`` class (the lowest priority by default), so a request of a
higher class that waits goes first. A line answered 429 or 503 (no room now) waits and goes again,
without limit until the batch expires; one answered with another 5xx (or not answered) goes again
up to ``retries`` times; its last answer is then written, to the output file (2xx) or the error file.

Each answer is appended to its file as one JSON line (``{"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}``) and flushed to disk before the line counts as done. A restarted
router reads those files back (``done_ids``): the lines with an answer are not sent again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from pdfabric.router.platform.batch_jobs import BatchStore, Line, parse_lines
from pdfabric.routing_config import BatchJobsConfig

log = logging.getLogger("pdfabric.router.batches")

TOKEN_HEADER = "X-Pdfabric-Batch"  # the runner's own requests: the router's in-memory token
RETRY_S = 0.5  # a refused line's first wait before it goes again (doubling, at most 8 s)


def done_ids(path: Path) -> set[str]:
    """The custom ids answered in an output or error file; a last line cut short by a kill is cut
    off the file (its line runs again)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    return {json.loads(raw)["custom_id"] for raw in data[:end].splitlines() if raw.strip()}


class BatchRunner:
    def __init__(self, store: BatchStore, config: BatchJobsConfig, waiting: Callable[[], int]) -> None:
        """``waiting``: requests waiting in the router's admission queue now (lines wait for none)."""
        self.store = store
        self.config = config
        self.waiting = waiting
        self.token = secrets.token_hex(32)  # in memory only: what lets a request act as a batch's tenant
        self._slots = asyncio.Semaphore(config.max_in_flight)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._url = ""
        self._http: Any = None

    async def start(self, url: str) -> None:
        """Starts running every unfinished batch against the router at ``url``."""
        self._url = url
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        for batch_id in self.store.active():
            self.run(batch_id)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._http is not None:
            await self._http.close()

    def run(self, batch_id: str) -> None:
        if self._http is not None and batch_id not in self._tasks:
            self._tasks[batch_id] = asyncio.create_task(self._run(batch_id))

    async def _run(self, batch_id: str) -> None:
        store = self.store
        batch = store.get(store.tenant_of(batch_id), batch_id)
        tenant = store.tenant_of(batch_id)
        out_path = store.files.data_path(batch["output_file_id"])
        err_path = store.files.data_path(batch["error_file_id"])
        lines = parse_lines(store.files.data_path(batch["input_file_id"]).read_bytes(), batch["endpoint"])
        done_ok, done_err = done_ids(out_path), done_ids(err_path)
        counts = {"total": len(lines), "completed": len(done_ok), "failed": len(done_err)}
        store.update(batch_id, request_counts=counts)
        pending = [line for line in lines if line.custom_id not in done_ok | done_err]
        running: set[asyncio.Task[None]] = set()
        with open(out_path, "ab") as out, open(err_path, "ab") as err:
            for line in pending:
                await self._slots.acquire()
                if batch["status"] == "cancelling" or time.time() > batch["expires_at"]:
                    self._slots.release()
                    break
                task = asyncio.create_task(self._line(batch, tenant, line, out, err, counts))
                running.add(task)
                task.add_done_callback(running.discard)
            await asyncio.gather(*running)
        self._finish(batch_id, batch, tenant)
        self._tasks.pop(batch_id, None)

    async def _line(self, batch: dict, tenant: str, line: Line, out: Any, err: Any, counts: dict) -> None:
        try:
            status, body = await self._send(batch, tenant, line)
        finally:
            self._slots.release()
        answer = {
            "id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": body.get("id", ""), "body": body},
            "error": None if status < 300 else {"code": str(status), "message": _message(body)},
        }  # fmt: skip
        f = out if status < 300 else err
        f.write(json.dumps(answer).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
        counts["completed" if status < 300 else "failed"] += 1
        # in memory only: the answer files are the record (a restart counts them again, ``done_ids``),
        # and the batch's file is written at its next change of state
        batch["request_counts"] = dict(counts)

    async def _send(self, batch: dict, tenant: str, line: Line) -> tuple[int, dict]:
        """The line's last answer: refusals for want of room go again until the batch expires, other
        server errors up to ``retries`` times."""
        headers = {TOKEN_HEADER: self.token, "X-Tenant": tenant}
        wait, failures = RETRY_S, 0
        while True:
            while self.waiting():  # an online request waits for a route: it goes first
                await asyncio.sleep(0.05)
            try:
                async with self._http.post(
                    self._url + batch["endpoint"], json=line.body, headers=headers
                ) as r:
                    status, body = r.status, await _json(r)
            except (TimeoutError, OSError, aiohttp.ClientError) as exc:  # no answer: as a 5xx
                status, body = 599, {"error": {"message": f"the router did not answer: {exc}"}}
            room = status in (429, 503)
            if status < 500 and status != 429:
                return status, body
            if not room:
                failures += 1
                if failures > self.config.retries:
                    return status, body
            if time.time() > batch["expires_at"]:
                return status, body
            await asyncio.sleep(wait)
            wait = min(8.0, wait * 2)

    def _finish(self, batch_id: str, batch: dict, tenant: str) -> None:
        now = int(time.time())
        counts = batch["request_counts"]
        files = self.store.files
        files.publish(tenant, batch["output_file_id"], f"{batch_id}_output.jsonl", "batch_output")
        files.publish(tenant, batch["error_file_id"], f"{batch_id}_errors.jsonl", "batch_output")
        if batch["status"] == "cancelling":
            self.store.update(batch_id, status="cancelled", cancelled_at=now)
        elif counts["completed"] + counts["failed"] < counts["total"]:
            self.store.update(batch_id, status="expired", expired_at=now)
        else:
            self.store.update(batch_id, status="finalizing", finalizing_at=now)
            self.store.update(batch_id, status="completed", completed_at=now)
        log.info("batch %s %s: %s", batch_id, batch["status"], batch["request_counts"])


async def _json(response: Any) -> dict:
    try:
        body = await response.json(content_type=None)
    except ValueError:
        body = {"error": {"message": (await response.text())[:500]}}
    return body if isinstance(body, dict) else {"value": body}


def _message(body: dict) -> str:
    error = body.get("error")
    return str(error.get("message", "")) if isinstance(error, dict) else ""
