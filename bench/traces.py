"""Loaders for public LLM-inference request traces, turned into ``Workload`` values.

- Azure LLM inference trace 2023 (CSV: ``TIMESTAMP,ContextTokens,GeneratedTokens``; wall-clock
  timestamps with 100 ns resolution).
- Mooncake FAST'25 traces (JSON lines: ``timestamp`` in ms from the trace start, ``input_length``,
  ``output_length``, ``hash_ids`` naming 512-token prefix blocks).

Arrival times are made relative to the first request (the first arrival is at 0 s). Rows are sorted by
time with a stable sort, so requests that share a timestamp keep their file order.
"""

from __future__ import annotations

import calendar
import csv
import json
from datetime import datetime
from pathlib import Path

from pdfabric.bench.workload import Request, Workload

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _azure_seconds(stamp: str) -> float:
    """Seconds since the epoch for ``YYYY-MM-DD HH:MM:SS.fffffff``, read as UTC (no daylight-saving jumps)."""
    whole, _, frac = stamp.strip().partition(".")
    base = datetime.strptime(whole, "%Y-%m-%d %H:%M:%S")
    return calendar.timegm(base.timetuple()) + (float("0." + frac) if frac else 0.0)


def load_azure(path: str | Path) -> Workload:
    """Read an Azure 2023 trace CSV. Rows with a zero length are kept with length 1 (and counted)."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    clamped = 0
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: not an Azure trace CSV, missing columns {missing}")
        for line_no, row in enumerate(reader, start=2):
            try:
                t = _azure_seconds(row["TIMESTAMP"])
                n_in, n_out = int(row["ContextTokens"]), int(row["GeneratedTokens"])
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: bad row {row!r}: {exc}") from None
            if n_in < 1 or n_out < 1:
                clamped += 1
            rows.append((t, max(1, n_in), max(1, n_out)))
    return _workload(path, "azure-2023", rows, [None] * len(rows), clamped)


def load_mooncake(path: str | Path) -> Workload:
    """Read a Mooncake JSON-lines trace; ``hash_ids`` are kept so prompts can share real prefixes."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    hashes: list[tuple[int, ...] | None] = []
    clamped = 0
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                t = float(obj["timestamp"]) / 1000.0
                n_in, n_out = int(obj["input_length"]), int(obj["output_length"])
                ids = obj.get("hash_ids")
                hashes.append(tuple(int(h) for h in ids) if ids is not None else None)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line_no}: bad Mooncake record: {exc}") from None
            if n_in < 1 or n_out < 1:
                clamped += 1
            rows.append((t, max(1, n_in), max(1, n_out)))
    return _workload(path, "mooncake", rows, hashes, clamped)


def load_trace(path: str | Path) -> Workload:
    """Load a trace, choosing the format from the file: ``.csv`` is Azure, ``.jsonl``/``.json`` Mooncake."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"trace file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".csv":
        return load_azure(path)
    if suffix in (".jsonl", ".json"):
        return load_mooncake(path)
    raise ValueError(f"{path}: unknown trace format (expected an Azure .csv or a Mooncake .jsonl)")


def _workload(
    path: Path,
    fmt: str,
    rows: list[tuple[float, int, int]],
    hashes: list[tuple[int, ...] | None],
    clamped: int,
) -> Workload:
    if not rows:
        raise ValueError(f"{path}: trace has no requests")
    order = sorted(range(len(rows)), key=lambda i: rows[i][0])
    t0 = rows[order[0]][0]
    requests = tuple(
        Request(index=k, arrival_s=rows[i][0] - t0, input_len=rows[i][1], output_len=rows[i][2],
                hash_ids=hashes[i])
        for k, i in enumerate(order)
    )
    source = {"kind": "trace", "format": fmt, "file": path.name, "rows": len(rows)}
    if clamped:
        source["zero_length_rows_clamped_to_1"] = clamped
    return Workload(name=path.stem, requests=requests, source=source)
