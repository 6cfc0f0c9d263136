"""``pdfabric bench transfer`` end to end on tiny sizes: a table, and JSON with the promised fields."""

from __future__ import annotations

import argparse
import json
import time
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


def test_bench_transfer_layerwise_row_beside_small_prompts(tmp_path: Path) -> None:
    """The layer-wise row's 2048-token prompt needs more blocks than a 16-token row: the receiver's
    cache is sized for both (it was sized for the rows alone and refused the layer-wise transfer)."""
    parser = argparse.ArgumentParser()
    transfer.add_arguments(parser)
    out = tmp_path / "transfer.json"
    args = parser.parse_args(
        ["--sizes", "", "--prompts", "16", "--transports", "shm", "--repeats", "1", "--prefill-ms", "12"]
        + ["--no-progress", "--json", str(out)]
    )
    assert transfer.run(args) == 0
    (row,) = json.loads(out.read_text())["layerwise"]
    assert row["transport"] == "shm" and row["tokens"] == 2048 and row["layerwise_total_ms"] >= 12


def shm_files() -> set[str]:
    shm = Path("/dev/shm")
    return {p.name for p in shm.glob("pdfabric-kv-*")} if shm.is_dir() else set()


def test_bench_transfer_raises_the_receivers_error() -> None:
    """A request the receiver process refuses comes back as its error, at once, not as a timeout; the
    session, ended without its teardown, leaves no file of the receiver's cache in /dev/shm."""
    from pdfabric.bench.progress import Progress

    before = shm_files()
    with transfer.bench_session(["shm"], 1, False, Progress(1, "t", enabled=False)) as bench:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="block id out of range"):
            bench._call("setup", "shm", False, transfer.PAYLOAD, 2, f"ipc://{bench.tmpdir}/kv.sock")
            bench._call("expect", "r1", (0, 5))
        assert time.monotonic() - started < 30
    assert shm_files() <= before
