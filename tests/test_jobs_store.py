"""The jobs database behind ``/v1/files`` and ``/v1/batches`` (``router/platform``): a line's answer and
its batch's counts are written together and once, everything reads back after a reopen (a restarted
router), and an upload cut short is never listed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdfabric.router.errors import ApiError
from pdfabric.router.platform.batch_jobs import BatchStore
from pdfabric.router.platform.files import FileStore
from pdfabric.router.platform.jobs_db import Transaction, open_jobs_db


def _stores(root: Path) -> BatchStore:
    db = open_jobs_db(root)
    return BatchStore(db, FileStore(db, root))


def _input(n: int) -> bytes:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": {"prompt": str(i)}}
        for i in range(n)
    ]
    return "\n".join(json.dumps(x) for x in lines).encode() + b"\n"


def _batch(store: BatchStore, n: int) -> dict:
    f = store.files.create("acme", "in.jsonl", "batch", _input(n))
    return store.create(
        "acme", {"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h"}
    )


def test_answers_count_once_and_read_back_after_a_reopen(tmp_path: Path) -> None:
    store = _stores(tmp_path)
    batch = _batch(store, 3)
    store.answer(batch["id"], "r0", True, {"custom_id": "r0", "n": 1})
    store.answer(batch["id"], "r0", True, {"custom_id": "r0", "n": 2})  # run again after a crash: kept once
    store.answer(batch["id"], "r2", False, {"custom_id": "r2"})
    assert batch["request_counts"] == {"total": 3, "completed": 1, "failed": 1}

    again = _stores(tmp_path)  # a restarted router
    assert again.active() == [batch["id"]]
    assert again.get("acme", batch["id"])["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    assert again.answered(batch["id"]) == {"r0", "r2"}
    again.answer(batch["id"], "r1", True, {"custom_id": "r1"})
    again.finish(batch["id"], status="completed")
    done = again.get("acme", batch["id"])
    assert done["status"] == "completed" and again.active() == []
    out = again.files.content("acme", done["output_file_id"])
    assert [json.loads(x) for x in out.splitlines()] == [{"custom_id": "r0", "n": 1}, {"custom_id": "r1"}]
    assert again.files.get("acme", done["output_file_id"]).bytes == len(out)
    assert json.loads(again.files.content("acme", done["error_file_id"])) == {"custom_id": "r2"}
    with pytest.raises(ApiError):
        again.files.content("other", done["output_file_id"])  # another tenant's
    again.files.delete("acme", done["output_file_id"])
    assert again.answered(batch["id"]) == {"r2"}


def test_a_failed_transaction_changes_nothing(tmp_path: Path) -> None:
    store = _stores(tmp_path)
    batch = _batch(store, 2)
    with pytest.raises(RuntimeError), Transaction(store.db) as db:
        db.execute("INSERT INTO answers VALUES (?, 'r0', 1, '{}')", (batch["id"],))
        raise RuntimeError("killed halfway")
    assert store.answered(batch["id"]) == set()


def test_an_upload_without_its_row_is_never_listed_and_is_removed(tmp_path: Path) -> None:
    store = _stores(tmp_path)
    kept = store.files.create("acme", "a.jsonl", "batch", _input(1))
    (tmp_path / "files" / "file-0123456789abcdef01234567.data").write_bytes(b"cut short")  # no row
    again = _stores(tmp_path)
    assert [f.id for f in again.files.list("acme")] == [kept.id]
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [f"{kept.id}.data"]


def test_a_tenant_s_uploads_stay_within_its_storage_limit(tmp_path: Path) -> None:
    store = _stores(tmp_path)
    data = _input(3)
    limit = 2 * len(data) + 10
    first = store.files.create("acme", "a.jsonl", "batch", data, limit)
    store.files.create("acme", "b.jsonl", "batch", data, limit)
    with pytest.raises(ApiError) as refused:
        store.files.create("acme", "c.jsonl", "batch", data, limit)
    assert refused.value.status == 413 and "tenant_storage_mb" in str(refused.value)
    store.files.create("other", "c.jsonl", "batch", data, limit)  # another tenant's share is its own
    store.files.delete("acme", first.id)
    store.files.create("acme", "c.jsonl", "batch", data, limit)  # room again
    assert store.files.stored_bytes("acme") == 2 * len(data)
