"""`pdfabric bench engine` end to end on the tiny model: a run, its floors, its table and its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_engine_reports_both_phases_against_their_floors(tmp_path: Path) -> None:
    linears = "onednn"  # the comparison kernel: the default one runs in every other engine test
    out = tmp_path / "engine.json"
    done = subprocess.run(
        [
            sys.executable, "-m", "pdfabric.cli", "bench", "engine", "--model", "tiny",
            "--prefill-tokens", "16,48", "--batch-sizes", "1,3", "--context", "40", "--repeats", "1",
            "--linears", linears, "--op-profile", "3", "--grammar", "--sampling", "--json", str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"linears {linears}, decoder ops" in done.stdout  # oneDNN's linears are no C kernel of ours
    r = json.loads(out.read_text())
    assert r["linears"] == linears and r["decoder"] == "ops"
    assert r["read_bytes_per_s"] > 0 and r["gemm_flops"] > 0
    assert [p["tokens"] for p in r["prefill"]] == [16, 48]
    assert [d["batch"] for d in r["decode"]] == [1, 3]
    assert all(d["floor_seconds"] > 0 and d["ratio_to_floor"] > 0 for d in r["decode"])
    assert set(r["op_profile"]) == {"prefill 48 tokens", "decode batch 1", "decode batch 3"}
    # structured output: each batch's masks and masked sampling, as a share of its step
    assert [g["batch"] for g in r["grammar"]] == [1, 3] and "structured output" in done.stdout
    assert all(g["mask_seconds"] > 0 and g["share_of_step"] > 0 for g in r["grammar"])
    # the sampler on each batch's logits, per mode
    assert [c["batch"] for c in r["sampling"]] == [1, 3] and "sampling one step's rows" in done.stdout
    modes = {"greedy", "temperature", "top-p 0.95", "top-k 50"}
    assert all(set(c["seconds"]) == modes and c["seconds"]["greedy"] > 0 for c in r["sampling"])


def test_bench_names_the_linear_kernels_the_runner_knows() -> None:
    """The bench spells the kinds out so that its --help imports no torch; they must stay the same."""
    from pdfabric.bench.engine_bench import LINEAR_KINDS as bench_kinds
    from pdfabric.kernels.linear_cpu import LINEAR_KINDS

    assert bench_kinds == LINEAR_KINDS
