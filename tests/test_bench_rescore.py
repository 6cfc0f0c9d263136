"""``bench rescore``: saved goodput trials judged again under another SLO."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pdfabric.bench.metrics import SLO
from pdfabric.bench.records import OK, RequestRecord, write_jsonl
from pdfabric.bench.rescore_cmd import _goodput_text, find_searches, rescore


def _trial(root: Path, rate: float, ttft_ms: float, gaps: list[float], n: int = 60) -> None:
    out = root / "trials" / f"rate-{rate:g}"
    out.mkdir(parents=True)
    tokens, e2e = len(gaps) + 1, ttft_ms + sum(gaps)
    records = [
        RequestRecord(i, i / rate, i / rate, 8, tokens, OK, ttft_ms=ttft_ms, e2e_ms=e2e, output_tokens=tokens,
                      itl_ms=list(gaps))
        for i in range(n)
    ]  # fmt: skip
    write_jsonl(records, out / "requests.jsonl")


def _search(root: Path) -> Path:
    # Mean gap 50 ms everywhere; one stall of 300 ms from 1 req/s on; TTFT grows with the rate.
    _trial(root, 0.5, 200, [50.0] * 4)
    _trial(root, 1, 400, [10.0, 10.0, 300.0, 10.0, 10.0])  # mean 68 ms, max 300 ms
    _trial(root, 2, 900, [10.0, 10.0, 300.0, 10.0, 10.0])
    _trial(root, 4, 3000, [50.0] * 4)
    return root


def test_one_search_answers_a_mean_and_a_no_stall_slo(tmp_path: Path) -> None:
    search = _search(tmp_path / "colocated")
    mean = rescore(search, SLO(1000, 100, "mean"), 0.9)
    assert [t["attainment"] for t in mean["trials"]] == [1.0, 1.0, 1.0, 0.0]
    assert mean["goodput_rps"] == 2 and mean["first_failing_rps"] == 4 and not mean["at_least"]
    no_stall = rescore(search, SLO(2000, 200, "max"), 0.9)
    assert no_stall["goodput_rps"] == 0.5 and no_stall["first_failing_rps"] == 1
    loose = rescore(search, SLO(5000, 400, "max"), 0.9)
    # Never failed: no goodput, at least the top rate.
    assert loose["goodput_rps"] is None and loose["lower_bound_rps"] == 4 and loose["at_least"]
    assert not loose["bounded"] and _goodput_text(loose) == ">= 4"
    strict = rescore(search, SLO(100, 100, "max"), 0.9)
    assert strict["goodput_rps"] is None and _goodput_text(strict) == "< 0.5"


def test_searches_are_found_per_deployment(tmp_path: Path) -> None:
    _search(tmp_path / "cmp" / "vllm")
    _search(tmp_path / "cmp" / "pdfabric-1p1d")
    assert sorted(find_searches(tmp_path / "cmp")) == ["pdfabric-1p1d", "vllm"]
    assert list(find_searches(tmp_path / "cmp" / "vllm")) == ["vllm"]


def test_command_prints_and_writes_json(tmp_path: Path) -> None:
    _search(tmp_path / "cmp" / "a")
    out = tmp_path / "r.json"
    slo = ["--ttft-slo-ms", "2000", "--itl-slo-ms", "200", "--itl-stat", "max"]
    base = [sys.executable, "-m", "pdfabric.cli", "bench", "rescore"]
    cmd = [*base, str(tmp_path / "cmp"), *slo, "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "0.5" in done.stdout and "max ITL <= 200 ms" in done.stdout
    assert json.loads(out.read_text())["searches"]["a"]["goodput_rps"] == 0.5
    (tmp_path / "empty").mkdir()
    empty = subprocess.run(
        [*base, str(tmp_path / "empty")], capture_output=True, text=True, timeout=60, check=False
    )
    assert empty.returncode == 2 and "no trials" in empty.stderr
