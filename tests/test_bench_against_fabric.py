"""``pdfabric bench replay`` against a real pdfabric fabric: every request comes back ok, with the
exact number of tokens asked for (the fabric honours ``ignore_eos``), and no KV block leaks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.fabric import metric_values, running_fabric, wait_blocks_free


def _prompt_tokens(url: str) -> float:
    return sum(metric_values(url, "pdfabric_prompt_tokens_total").values())


def test_replay_synthetic_workload(tmp_path: Path) -> None:
    """Token-id prompts, then text prompts: the server sees exactly the asked input lengths."""
    with running_fabric("--model", "tiny", "--colocated", "1") as url:
        for fmt in ("ids", "text"):
            before = _prompt_tokens(url)
            out = tmp_path / fmt
            cmd = [sys.executable, "-m", "pdfabric.cli", "bench", "replay", "--url", url, "--model", "tiny",
                   "--trace", "synthetic", "--rate", "8", "--num-requests", "12", "--input-len", "16:96",
                   "--output-len", "4:24", "--max-run-time", "60", "--no-progress", "--out", str(out),
                   "--prompt-format", fmt, "--tokenizer", "tiny"]
            subprocess.run(cmd, check=True, timeout=120)
            wait_blocks_free(url)
            report = json.loads((out / "report.json").read_text())
            assert report["requests"]["total"] == 12 and report["requests"]["ok"] == 12
            assert report["prompts"]["format"] == fmt
            records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
            assert all(r["output_tokens"] == r["output_len"] for r in records), records[:2]
            assert _prompt_tokens(url) - before == sum(r["input_len"] for r in records)
