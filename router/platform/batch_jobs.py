"""Batch jobs for ``/v1/batches``: a tenant's file of requests, run in the background at the lowest
priority, with one output line per request, kept across router restarts.

A batch's life (OpenAI's states):
1. ``create``: the input file (the tenant's, purpose ``batch``) is checked line by line (JSON with a
   unique ``custom_id``, ``method`` POST, ``url`` the batch's endpoint, a ``body`` object that does not
   stream): a bad line is a 400 naming it; a good file makes the batch ``in_progress``;
2. the runner (``batch_runner.py``) sends its lines through the router's own API as the batch's
   tenant, in the batch class, and records each answer as it comes (``answer``);
3. ``completed`` when every line has its answer (``finalizing`` meanwhile), or ``cancelled`` after
   ``cancel`` (``cancelling`` while lines in flight end), or ``expired`` past its completion window:
   the output and error files are listed then (``finish``).

Everything lives in the jobs database (``jobs_db.py``): the batch object, rewritten on each change,
and each answer with its batch's counts in one transaction. A router that restarts reads them back and
resumes each unfinished batch from the lines that have no answer yet: no line is lost or answered
twice (a line running when the router died runs again, and its first answer is the one kept).
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from dataclasses import dataclass
from typing import Any

from pdfabric.router.errors import ApiError, bad
from pdfabric.router.platform.files import FileStore
from pdfabric.router.platform.jobs_db import Transaction

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings")
WINDOW_S = 24 * 3600  # "24h", the only completion window
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


@dataclass(frozen=True)
class Line:
    custom_id: str
    body: dict[str, Any]


def parse_lines(data: bytes, endpoint: str) -> list[Line]:
    """The input file's requests; a 400 naming the first bad line."""
    lines: list[Line] = []
    seen: set[str] = set()
    for n, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        where = f"input file line {n}"
        try:
            item = json.loads(raw)
        except ValueError:
            raise bad(f"{where} is not JSON", "input_file_id") from None
        if not isinstance(item, dict):
            raise bad(f"{where} must be a JSON object", "input_file_id")
        cid, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
        if not isinstance(cid, str) or not cid or cid in seen:
            raise bad(f"{where}: custom_id must be a unique non-empty string, got {cid!r}", "input_file_id")
        if method != "POST" or url != endpoint:
            raise bad(
                f"{where}: method must be POST and url {endpoint!r}, got {method!r} {url!r}", "input_file_id"
            )
        if not isinstance(body, dict) or body.get("stream") is True:
            raise bad(f"{where}: body must be a JSON object that does not stream", "input_file_id")
        seen.add(cid)
        lines.append(Line(cid, body))
    if not lines:
        raise bad("the input file holds no request", "input_file_id")
    return lines


class BatchStore:
    """The batches of every tenant, as objects in OpenAI's shape, and their answers, in the jobs
    database (``jobs_db.py``)."""

    def __init__(self, db: sqlite3.Connection, files: FileStore) -> None:
        self.db = db
        self.files = files
        self._batches: dict[str, dict[str, Any]] = {}  # id -> {"tenant", "batch", "created_ns"}
        for batch_id, tenant, obj, made in db.execute("SELECT id, tenant, object, created_ns FROM batches"):
            self._batches[batch_id] = {"tenant": tenant, "batch": json.loads(obj), "created_ns": made}

    def create(self, tenant: str, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object")
        for name in body:
            if name not in ("input_file_id", "endpoint", "completion_window", "metadata"):
                raise bad(f"'{name}' is not supported by this server", name)
        endpoint, window = body.get("endpoint"), body.get("completion_window")
        if endpoint not in ENDPOINTS:
            raise bad(f"'endpoint' must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", "endpoint")
        if window != "24h":
            raise bad(f"'completion_window' must be '24h', got {window!r}", "completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
        ):
            raise bad("'metadata' must be an object of strings", "metadata")
        input_id = body.get("input_file_id")
        if not isinstance(input_id, str):
            raise bad("'input_file_id' is required", "input_file_id")
        if self.files.get(tenant, input_id).purpose != "batch":
            raise bad(f"file {input_id!r} was not uploaded with purpose 'batch'", "input_file_id")
        lines = parse_lines(self.files.content(tenant, input_id), endpoint)
        now = int(time.time())
        batch = {
            "id": f"batch_{secrets.token_hex(12)}", "object": "batch", "endpoint": endpoint, "errors": None,
            "input_file_id": input_id, "completion_window": window, "status": "in_progress",
            "output_file_id": self.files.new_id(), "error_file_id": self.files.new_id(), "created_at": now,
            "in_progress_at": now, "expires_at": now + WINDOW_S, "finalizing_at": None, "completed_at": None,
            "failed_at": None, "expired_at": None, "cancelling_at": None, "cancelled_at": None,
            "request_counts": {"total": len(lines), "completed": 0, "failed": 0}, "metadata": metadata,
        }  # fmt: skip
        record = {"tenant": tenant, "batch": batch, "created_ns": time.time_ns()}
        with Transaction(self.db) as db:
            db.execute(
                "INSERT INTO batches (id, tenant, object, created_ns) VALUES (?, ?, ?, ?)",
                (batch["id"], tenant, json.dumps(batch), record["created_ns"]),
            )
        self._batches[batch["id"]] = record
        return batch

    def get(self, tenant: str, batch_id: str) -> dict[str, Any]:
        record = self._batches.get(batch_id)
        if record is None or record["tenant"] != tenant:
            raise ApiError(404, f"no batch {batch_id!r}", kind="not_found_error")
        return record["batch"]

    def tenant_of(self, batch_id: str) -> str:
        return self._batches[batch_id]["tenant"]

    def list(self, tenant: str) -> list[dict[str, Any]]:
        mine = [r for r in self._batches.values() if r["tenant"] == tenant]
        return [r["batch"] for r in sorted(mine, key=_created, reverse=True)]

    def active(self) -> list[str]:
        """The batches to run: unfinished ones, oldest first (those of a restarted router too)."""
        live = [r for r in self._batches.values() if r["batch"]["status"] in ACTIVE]
        return [r["batch"]["id"] for r in sorted(live, key=_created)]

    def cancel(self, tenant: str, batch_id: str) -> dict[str, Any]:
        batch = self.get(tenant, batch_id)
        if batch["status"] in ("validating", "in_progress", "finalizing"):
            self.update(batch_id, status="cancelling", cancelling_at=int(time.time()))
        return batch

    def update(self, batch_id: str, **changes: Any) -> None:
        with Transaction(self.db) as db:
            self._change(db, batch_id, changes)

    def answered(self, batch_id: str) -> set[str]:
        """The custom ids of the batch's lines that have their answer."""
        rows = self.db.execute("SELECT custom_id FROM answers WHERE batch_id = ?", (batch_id,))
        return {cid for (cid,) in rows}

    def answer(self, batch_id: str, custom_id: str, ok: bool, line: dict[str, Any]) -> None:
        """Records a line's answer (``ok``: for the output file, else the error file) and counts it, in
        one transaction; a line answered already keeps its first answer."""
        batch = self._batches[batch_id]["batch"]
        with Transaction(self.db) as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO answers (batch_id, custom_id, ok, line) VALUES (?, ?, ?, ?)",
                (batch_id, custom_id, int(ok), json.dumps(line)),
            )
            if cur.rowcount:
                counts = dict(batch["request_counts"])
                counts["completed" if ok else "failed"] += 1
                self._change(db, batch_id, {"request_counts": counts})

    def finish(self, batch_id: str, **changes: Any) -> None:
        """Ends a batch: lists its output and error files and changes its state, in one transaction."""
        record = self._batches[batch_id]
        batch, tenant = record["batch"], record["tenant"]
        with Transaction(self.db) as db:
            self.files.publish_answers(db, tenant, batch["output_file_id"], batch_id, ok=True)
            self.files.publish_answers(db, tenant, batch["error_file_id"], batch_id, ok=False)
            self._change(db, batch_id, changes)

    def _change(self, db: sqlite3.Connection, batch_id: str, changes: dict[str, Any]) -> None:
        batch = {**self._batches[batch_id]["batch"], **changes}
        db.execute("UPDATE batches SET object = ? WHERE id = ?", (json.dumps(batch), batch_id))
        self._batches[batch_id]["batch"].update(changes)  # once written


def _created(record: dict[str, Any]) -> tuple[int, str]:
    """When a batch was created, to the nanosecond (its ``created_at`` is in seconds)."""
    return record.get("created_ns", record["batch"]["created_at"] * 10**9), record["batch"]["id"]
