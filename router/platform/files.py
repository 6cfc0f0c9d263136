"""Files for ``/v1/files``: what tenants upload (a batch's input) and what batches write (their output
and errors), kept so that they outlive the router.

A file is a row of the jobs database (``jobs_db.py``: its OpenAI object and tenant). An upload's bytes
lie in ``DIR/files/ID.data``, written and flushed to disk before the row is inserted, so a router
killed mid-upload leaves no file that can be listed (only bytes without a row, removed at the next
start). A batch's output and error files are listed once the batch ends, and their content is the
batch's answers as the database holds them. A file belongs to the tenant that made it: another tenant
gets a 404 for it, as for a file that does not exist.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import sqlite3
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdfabric.router.errors import ApiError
from pdfabric.router.platform.jobs_db import Transaction

log = logging.getLogger("pdfabric.router.files")

PURPOSES = ("batch", "batch_output")  # what a tenant uploads, what a batch writes


@dataclass(frozen=True)
class FileObject:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"

    def public(self) -> dict[str, object]:
        return asdict(self)


def write_atomic(path: Path, data: bytes) -> None:
    """Writes ``data`` under a temporary name, flushed to disk, and renames it over ``path``."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class FileStore:
    def __init__(self, db: sqlite3.Connection, root: Path) -> None:
        self.db = db
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        listed = {row[0] for row in db.execute("SELECT id FROM files")}
        for path in self.dir.glob("*.data"):  # the bytes of an upload killed before its row: never listed
            if path.stem not in listed and not path.with_suffix(".json").exists():
                path.unlink(missing_ok=True)
        for path in self.dir.glob(".file-*.tmp"):  # one killed while it was written
            path.unlink(missing_ok=True)
        if any(self.dir.glob("file-*.json")):
            log.warning(
                "%s holds files kept by an earlier pdfabric (one JSON file each): they are not listed",
                self.dir,
            )

    @staticmethod
    def new_id() -> str:
        return f"file-{secrets.token_hex(12)}"

    def data_path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise ApiError(404, f"no file {file_id!r}", kind="not_found_error")
        return self.dir / f"{file_id}.data"

    def stored_bytes(self, tenant: str) -> int:
        """The bytes of the tenant's listed files (uploads, and its ended batches' answers)."""
        rows = self.db.execute("SELECT object FROM files WHERE tenant = ?", (tenant,))
        return sum(json.loads(obj)["bytes"] for (obj,) in rows)

    def create(self, tenant: str, filename: str, purpose: str, data: bytes, limit: int = 0) -> FileObject:
        """An upload: its bytes, then its row; a 413 when the tenant's files would pass ``limit``
        bytes in all (0: no limit)."""
        if limit:
            held = self.stored_bytes(tenant)
            if held + len(data) > limit:
                raise ApiError(
                    413,
                    f"the tenant's files take {held / 2**20:.1f} MB; with this one they would pass its "
                    f"limit of {limit // 2**20} MB ([batches] tenant_storage_mb): delete files it no "
                    "longer needs",
                    "file",
                )
        file_id = self.new_id()
        write_atomic(self.data_path(file_id), data)
        obj = FileObject(file_id, len(data), int(time.time()), filename, purpose)
        with Transaction(self.db) as db:
            db.execute(
                "INSERT INTO files (id, tenant, object, created_ns) VALUES (?, ?, ?, ?)",
                (file_id, tenant, json.dumps(obj.public()), time.time_ns()),
            )
        return obj

    def publish_answers(
        self, db: sqlite3.Connection, tenant: str, file_id: str, batch_id: str, ok: bool
    ) -> None:
        """Lists a batch's output (``ok``) or error file, inside the caller's transaction ``db``."""
        size = db.execute(
            "SELECT COALESCE(SUM(LENGTH(CAST(line AS BLOB)) + 1), 0) FROM answers"
            " WHERE batch_id = ? AND ok = ?",
            (batch_id, int(ok)),
        ).fetchone()[0]
        name = f"{batch_id}_{'output' if ok else 'errors'}.jsonl"
        obj = FileObject(file_id, size, int(time.time()), name, "batch_output")
        db.execute(
            "INSERT OR REPLACE INTO files (id, tenant, object, created_ns, batch_id, ok)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (file_id, tenant, json.dumps(obj.public()), time.time_ns(), batch_id, int(ok)),
        )

    def get(self, tenant: str, file_id: str) -> FileObject:
        """The tenant's file; a 404 for one that does not exist, is not listed yet, or is another's."""
        return self._row(tenant, file_id)[0]

    def _row(self, tenant: str, file_id: str) -> tuple[FileObject, str | None, int | None]:
        """The tenant's file and, for a batch's output or error file, the batch and which (``ok``)."""
        row = self.db.execute(
            "SELECT tenant, object, batch_id, ok FROM files WHERE id = ?", (file_id,)
        ).fetchone()
        if row is None or row[0] != tenant:
            raise ApiError(404, f"no file {file_id!r}", kind="not_found_error")
        return FileObject(**json.loads(row[1])), row[2], row[3]

    def content(self, tenant: str, file_id: str) -> bytes:
        _, batch_id, ok = self._row(tenant, file_id)
        if batch_id is None:
            return self.data_path(file_id).read_bytes()
        rows = self.db.execute(
            "SELECT line FROM answers WHERE batch_id = ? AND ok = ? ORDER BY rowid", (batch_id, ok)
        )
        return b"".join(line.encode() + b"\n" for (line,) in rows)

    def list(self, tenant: str, purpose: str | None = None) -> list[FileObject]:
        """The tenant's files, newest first."""
        rows = self.db.execute(
            "SELECT object FROM files WHERE tenant = ? ORDER BY created_ns DESC, id DESC", (tenant,)
        )
        found = [FileObject(**json.loads(obj)) for (obj,) in rows]
        return [f for f in found if purpose in (None, f.purpose)]

    def delete(self, tenant: str, file_id: str) -> None:
        """Forgets the file and frees its bytes (a batch's answers of that file too)."""
        _, batch_id, ok = self._row(tenant, file_id)
        with Transaction(self.db) as db:
            db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            if batch_id is not None:
                db.execute("DELETE FROM answers WHERE batch_id = ? AND ok = ?", (batch_id, ok))
        self.data_path(file_id).unlink(missing_ok=True)
