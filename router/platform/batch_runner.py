"""Runs batch jobs (``batch_jobs.py``): each line of each unfinished batch, through the router's own
HTTP API, as the batch's tenant and in the batch class, so that a line is served, limited, counted
and failed over exactly as a client's request would be.

How lines are paced: at most ``[batches] max_in_flight`` lines run at once, over every batch (oldest
batch first), and a line is sent only while no request waits in the router's admission queue; lines
are admitted in the ``[batches] slo_class`` class (the lowest priority by default), so a request of a
higher class that waits goes first; that class is a background one by default, so admission sends a
line only where it spares the online sequences (``predictor.sparing``). A line answered 429 or 503
(no room now) waits and goes again, without limit until the batch expires; one answered with another
5xx (or not answered) goes again up to ``retries`` times; its last answer is then recorded, for the
output file (2xx) or the error file.

Each answer (``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``) is
committed to the jobs database with its batch's counts before the line counts as done
(``BatchStore.answer``). A restarted router reads them back: the lines with an answer are not sent
again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

import aiohttp

from pdfabric.router.platform.batch_jobs import BatchStore, Line, parse_lines
from pdfabric.routing_config import BatchJobsConfig

log = logging.getLogger("pdfabric.router.batches")

TOKEN_HEADER = "X-Pdfabric-Batch"  # the runner's own requests: the router's in-memory token
RETRY_S = 0.5  # a refused line's first wait before it goes again (doubling, at most 8 s)


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
        tenant = store.tenant_of(batch_id)
        batch = store.get(tenant, batch_id)
        try:
            data = store.files.data_path(batch["input_file_id"]).read_bytes()
        except OSError:  # its input file was deleted before a restarted router read it
            gone = {"code": "input_file_gone", "message": "the input file was deleted"}
            errors = {"object": "list", "data": [gone]}
            store.finish(batch_id, status="failed", failed_at=int(time.time()), errors=errors)
            self._tasks.pop(batch_id, None)
            return
        answered = store.answered(batch_id)
        pending = [line for line in parse_lines(data, batch["endpoint"]) if line.custom_id not in answered]
        running: set[asyncio.Task[None]] = set()
        for line in pending:
            await self._slots.acquire()
            if batch["status"] == "cancelling" or time.time() > batch["expires_at"]:
                self._slots.release()
                break
            task = asyncio.create_task(self._line(batch_id, batch, tenant, line))
            running.add(task)
            task.add_done_callback(running.discard)
        await asyncio.gather(*running)
        self._finish(batch_id)
        self._tasks.pop(batch_id, None)

    async def _line(self, batch_id: str, batch: dict, tenant: str, line: Line) -> None:
        try:
            status, body = await self._send(batch, tenant, line)
        finally:
            self._slots.release()
        answer = {
            "id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id,
            "response": {"status_code": status, "request_id": body.get("id", ""), "body": body},
            "error": None if status < 300 else {"code": str(status), "message": _message(body)},
        }  # fmt: skip
        self.store.answer(batch_id, line.custom_id, status < 300, answer)

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

    def _finish(self, batch_id: str) -> None:
        store, now = self.store, int(time.time())
        batch = store.get(store.tenant_of(batch_id), batch_id)
        counts = batch["request_counts"]
        if batch["status"] == "cancelling":
            store.finish(batch_id, status="cancelled", cancelled_at=now)
        elif counts["completed"] + counts["failed"] < counts["total"]:
            store.finish(batch_id, status="expired", expired_at=now)
        else:
            store.update(batch_id, status="finalizing", finalizing_at=now)
            store.finish(batch_id, status="completed", completed_at=now)
        log.info("batch %s %s: %s", batch_id, batch["status"], counts)


async def _json(response: Any) -> dict:
    try:
        body = await response.json(content_type=None)
    except ValueError:
        body = {"error": {"message": (await response.text())[:500]}}
    return body if isinstance(body, dict) else {"value": body}


def _message(body: dict) -> str:
    error = body.get("error")
    return str(error.get("message", "")) if isinstance(error, dict) else ""
