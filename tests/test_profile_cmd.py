"""``pdfabric profile`` on the tiny model with a short budget: the file it writes is usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdfabric.cli.main import main
from pdfabric.profile_file import ProfileFile


def test_profile_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tiny.json"
    argv = ["profile", "--model", "tiny", "--seconds", "2", "--threads", "1", "--points", "6",
            "--transfer-repeats", "1", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "prefill ms by prompt tokens" in printed and f"wrote {out}" in printed
    pf = ProfileFile.load(out)
    assert pf.model == "tiny" and pf.role == "any" and pf.device == "cpu" and pf.threads == 1
    assert pf.dtype == "float32" and pf.kv_bytes_per_token > 0 and pf.block_size == 16
    assert pf.steps > 0 and pf.seconds > 0
    assert all(c >= 0 for c in (*pf.profile.prefill, *pf.profile.decode))
    assert pf.profile.prefill_samples > 0 and pf.profile.decode_samples > 0
    # Something was learnt: a longer prompt and a bigger batch are predicted to take longer.
    assert pf.profile.prefill_seconds(512, 512) > pf.profile.prefill_seconds(16, 512) > 0
    assert pf.profile.decode_step_seconds(32, 32 * 64) > pf.profile.decode_step_seconds(1, 64) > 0
    assert set(pf.kv_bytes_per_s) == {"zmq-tcp", "shm"} and min(pf.kv_bytes_per_s.values()) > 0


def test_prefill_role_measures_prefill_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "prefill.json"
    argv = ["profile", "--role", "prefill", "--seconds", "1", "--threads", "1", "--points", "3",
            "--transports", "", "--out", str(out), "--json", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    pf = ProfileFile.load(out)
    assert ProfileFile.from_json(printed) == pf
    assert pf.role == "prefill" and pf.profile.decode_samples == 0 and pf.profile.prefill_samples > 0
    assert pf.kv_bytes_per_s == {}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--seconds", "0"], "--seconds must be > 0"),
        (["--transports", "zmq-tcp,carrier-pigeon"], "--transports: unknown carrier-pigeon"),
        (["--max-running", "0"], "--max-running must be at least 1"),
        (["--threads", "-1"], "--threads must be >= 0"),
    ],
)
def test_bad_flags(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["profile", *flags]) == 2
    assert message in capsys.readouterr().err


def test_from_server_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    health = tmp_path / "health.json"
    health.write_text(json.dumps({"status": "ok", "workers": []}))
    assert main(["profile", "--from-server", str(health), "--out", str(tmp_path / "p")]) == 2
    assert "lists no workers" in capsys.readouterr().err
    health.write_text(json.dumps({"workers": [{"id": "decode-0", "kind": "decode"}]}))  # an older router
    assert main(["profile", "--from-server", str(health), "--out", str(tmp_path / "p")]) == 2
    assert "worker decode-0: no profile" in capsys.readouterr().err
    assert main(["profile", "--from-server", str(tmp_path / "missing.json")]) == 2
