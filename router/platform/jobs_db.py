"""The database behind ``/v1/files`` and ``/v1/batches``: one SQLite file (the standard library's
``sqlite3``), ``DIR/jobs.sqlite3``, that outlives the router.

Tables:
- ``files``: each listed file's OpenAI object and tenant; an upload's bytes lie beside the database in
  ``DIR/files/ID.data`` (written and flushed before its row is inserted), a batch's output or error
  file is its batch's answers (``batch_id``, ``ok``);
- ``batches``: each batch's OpenAI object (``request_counts`` included) and tenant;
- ``answers``: one row per answered line of a batch (``custom_id`` unique within it), in the order the
  answers came (``rowid``).

Every change is one transaction, committed to disk before the call returns (write-ahead log,
``synchronous = FULL``): a line's answer and its batch's counts are written together, so a router
killed at any point restarts with each line either answered once or not at all. One connection, used
from the router's event loop only.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, object TEXT NOT NULL, created_ns INTEGER NOT NULL,
    batch_id TEXT, ok INTEGER
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, object TEXT NOT NULL, created_ns INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS answers (
    batch_id TEXT NOT NULL, custom_id TEXT NOT NULL, ok INTEGER NOT NULL, line TEXT NOT NULL,
    PRIMARY KEY (batch_id, custom_id)
);
"""


def open_jobs_db(root: Path) -> sqlite3.Connection:
    """The database in ``root`` (created with its tables if new)."""
    root.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(root / "jobs.sqlite3", isolation_level=None)  # transactions are explicit
    db.execute("PRAGMA journal_mode = WAL")
    db.execute("PRAGMA synchronous = FULL")
    db.executescript(SCHEMA)
    return db


class Transaction:
    """``with Transaction(db):`` runs the block's statements as one transaction (rolled back if the
    block raises)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> sqlite3.Connection:
        self.db.execute("BEGIN IMMEDIATE")
        return self.db

    def __exit__(self, kind: object, *_: object) -> None:
        self.db.execute("COMMIT" if kind is None else "ROLLBACK")
