"""``pdfabric bench transfer`` end to end on tiny sizes: a table, and JSON with the promised fields."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdfabric.bench import transfer


def test_bench_transfer_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    out = tmp_path / "transfer.json"
    args = parser.parse_args(
        ["--sizes", "64K,128K", "--prompts", "", "--transports", "zmq-tcp,shm", "--repeats", "1"]
        + ["--prefill-ms", "0", "--checksum", "--no-progress", "--json", str(out)]
    )
    assert transfer.run(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["transport"], r["bytes"]) for r in rows] == [
        ("zmq-tcp", 65536),
        ("zmq-tcp", 131072),
        ("shm", 65536),
        ("shm", 131072),
    ]
    for r in rows:
        assert (
            r["gbps"] > 0
            and r["memcpy_gbps"] > 0
            and r["ratio"] == pytest.approx(r["gbps"] / r["memcpy_gbps"])
        )
    assert "memcpy" in capsys.readouterr().out


def test_bench_transfer_rejects_unknown_transport() -> None:
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    assert transfer.run(parser.parse_args(["--transports", "rdma"])) == 2
