"""``pdfabric bench store``: every row measured, the write-back path through full tiers included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pdfabric.bench.store_bench import add_arguments, run


def test_bench_store_measures_each_tier_and_the_write_back_through_full_tiers(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "store.json"
    args = parser.parse_args(["--layouts", "cpu-small", "--blocks", "16", "--repeats", "1",
                              "--ram-dir", str(tmp_path / "ram"), "--disk-dir", str(tmp_path / "disk"),
                              "--json", str(out)])  # fmt: skip
    assert run(args) == 0
    rows = json.loads(out.read_text())["rows"]
    ops = ("memcpy", "file write", "save", "file read", "load")
    want = [(tier, op) for tier in ("ram", "disk") for op in ops]
    want += [("ram>disk", "save, RAM full"), ("ram>disk", "save, both full")]
    assert [(r["tier"], r["op"]) for r in rows] == want
    assert all(r["gb_per_s"] > 0 for r in rows)
    for down in rows[-2:]:
        if sys.platform == "linux":
            assert down["writer_cpu_ms_per_block"] is not None and down["writer_cpu_ms_per_block"] >= 0


@pytest.mark.parametrize("bad", [["--layouts", "gpt-9"], ["--blocks", "0"]])
def test_bench_store_refuses_what_it_cannot_measure(bad: list[str]) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(bad)) == 2
