"""Files for ``/v1/files``: what tenants upload (a batch's input) and what batches write (their output
and errors), kept in a directory so that they outlive the router.

Each file is two entries in ``DIR/files``: ``ID.data`` (its bytes) and ``ID.json`` (its OpenAI file
object and its tenant). The object is written last, under a temporary name renamed into place, so a
router killed mid-upload leaves no file that can be listed; a batch's output grows in its ``.data``
while the batch runs and is listed once the batch ends. A file belongs to the tenant that made it:
another tenant gets a 404 for it, as for a file that does not exist.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdfabric.router.errors import ApiError

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
    def __init__(self, root: Path) -> None:
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def new_id() -> str:
        return f"file-{secrets.token_hex(12)}"

    def data_path(self, file_id: str) -> Path:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise ApiError(404, f"no file {file_id!r}", kind="not_found_error")
        return self.dir / f"{file_id}.data"

    def create(self, tenant: str, filename: str, purpose: str, data: bytes) -> FileObject:
        file_id = self.new_id()
        write_atomic(self.data_path(file_id), data)
        return self.publish(tenant, file_id, filename, purpose)

    def publish(self, tenant: str, file_id: str, filename: str, purpose: str) -> FileObject:
        """Lists a file whose bytes are in place (an upload, or a batch's output once it ended)."""
        path = self.data_path(file_id)
        if not path.exists():
            path.touch()
        obj = FileObject(file_id, path.stat().st_size, int(time.time()), filename, purpose)
        record = json.dumps({"tenant": tenant, "file": obj.public(), "created_ns": time.time_ns()}).encode()
        write_atomic(self.dir / f"{file_id}.json", record)
        return obj

    def get(self, tenant: str, file_id: str) -> FileObject:
        """The tenant's file; a 404 for one that does not exist, is not listed yet, or is another's."""
        meta = self.data_path(file_id).with_suffix(".json")
        try:
            record = json.loads(meta.read_text())
        except (OSError, ValueError):
            raise ApiError(404, f"no file {file_id!r}", kind="not_found_error") from None
        if record.get("tenant") != tenant:
            raise ApiError(404, f"no file {file_id!r}", kind="not_found_error")
        return FileObject(**record["file"])

    def content(self, tenant: str, file_id: str) -> bytes:
        self.get(tenant, file_id)
        return self.data_path(file_id).read_bytes()

    def list(self, tenant: str, purpose: str | None = None) -> list[FileObject]:
        found = []
        for meta in self.dir.glob("file-*.json"):
            try:
                record = json.loads(meta.read_text())
            except (OSError, ValueError):
                continue
            if record.get("tenant") == tenant and purpose in (None, record["file"]["purpose"]):
                found.append((record.get("created_ns", 0), FileObject(**record["file"])))
        found.sort(key=lambda x: (x[0], x[1].id), reverse=True)  # newest first
        return [f for _, f in found]

    def delete(self, tenant: str, file_id: str) -> None:
        self.get(tenant, file_id)
        path = self.data_path(file_id)
        path.with_suffix(".json").unlink(missing_ok=True)
        path.unlink(missing_ok=True)
