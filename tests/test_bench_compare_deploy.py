"""``pdfabric bench compare`` with deployments it starts and stops itself (``NAME=config.toml`` and
``NAME=serve:FLAGS``): real ``pdfabric serve`` processes with the tiny model on loopback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdfabric.cli import main as cli
from pdfabric.profile_file import ProfileFile

WORKER = "[worker]\nkv_memory_mb = 64\nmax_batch_tokens = 256\nmax_running = 16\n"
WORKLOAD = ["--trace", "synthetic", "--rate", "8", "--num-requests", "8", "--input-len", "16:64",
            "--output-len", "4:12", "--max-run-time", "60", "--ttft-slo-ms", "60000", "--itl-slo-ms", "60000",
            "--no-progress"]


def _config(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'[serve]\nmodel = "tiny"\n{body}\n{WORKER}')
    return path


def _live_group_members(pgid: int) -> list[int]:
    """Pids of processes (zombies aside) still in process group ``pgid``."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def test_compare_starts_and_stops_config_deployments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    x1 = _config(tmp_path, "x1", "colocated = 1")
    x2 = _config(tmp_path, "x2", 'colocated = 2\nserved_model_name = "tiny-x2"')
    out = tmp_path / "cmp"
    rc = cli.main(["bench", "compare", "--deployment", f"x1={x1}", "--deployment", f"x2={x2}", *WORKLOAD,
                   "--out", str(out)])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    deps = report["deployments"]
    assert list(deps) == ["x1", "x2"] and report["partial"] is False and report["failed"] == {}
    for name, served in (("x1", "tiny"), ("x2", "tiny-x2")):
        d = deps[name]
        assert d["requests"]["total"] == 8 and d["requests"]["ok"] == 8, d["requests"]
        assert d["deployment"]["kind"] == "started" and d["deployment"]["served_model"] == served
        assert d["target"]["model"] == served  # the announced name is what the client sent
        for f in ("report.json", "requests.jsonl", "summary.md", "server.log", "health.json"):
            assert (out / name / f).stat().st_size > 0, (name, f)
        health = json.loads((out / name / "health.json").read_text())
        assert all("prefill" in w["profile"] for w in health["workers"]), health
        live = out / name / "profiles"  # the profiles the workers refined while serving, for simulations
        health_file = str(out / name / "health.json")
        assert cli.main(["profile", "--from-server", health_file, "--out", str(live)]) == 0
        saved = [ProfileFile.load(f) for f in sorted(live.glob("*.json"))]
        assert [p.role for p in saved] == ["colocated"] * len(health["workers"])
        assert all(p.model == "tiny" and p.profile.decode_samples > 0 for p in saved), saved
        records = [json.loads(line) for line in (out / name / "requests.jsonl").read_text().splitlines()]
        assert all(r["status"] == "ok" and r["output_tokens"] == r["output_len"] for r in records)
        assert _live_group_members(d["deployment"]["pid"]) == [], name
    assert deps["x1"]["deployment"]["url"] != "" and deps["x1"]["deployment"]["config"] == str(x1)
    for f in ("summary.md", "ttft_cdf.png", "itl_cdf.png", "slo_scale.png"):
        assert (out / f).stat().st_size > 0, f
    summary = capsys.readouterr().out
    assert "| x1 | 8 / 8 |" in summary and "| x2 | 8 / 8 |" in summary


def test_a_server_that_fails_to_start_is_reported_with_its_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ok = _config(tmp_path, "ok", "colocated = 1")
    out = tmp_path / "cmp"
    rc = cli.main(["bench", "compare", "--deployment", "bad=serve:--model no-such-model",
                   "--deployment", f"ok={ok}", *WORKLOAD, "--start-timeout", "60", "--out", str(out)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "deployment bad" in err and "exited with code" in err
    assert "no-such-model" in err  # the server's own error message, from its last output lines
    report = json.loads((out / "report.json").read_text())
    assert list(report["failed"]) == ["bad"] and report["deployments"] == {} and report["partial"] is True
    assert "no-such-model" in (out / "bad" / "server.log").read_text()


@pytest.mark.parametrize(
    ("target", "message"),
    [("missing.toml", "cannot read deployment config"), ("bad.toml", "unknown key"),
     ("serve:", "give the pdfabric serve flags"), ("x.yaml", "neither a URL")],
)
def test_bad_deployments_fail_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, message: str
) -> None:
    (tmp_path / "bad.toml").write_text('[serve]\nmodel = "tiny"\nworkers = 3\n')
    if target.endswith(".toml"):
        target = str(tmp_path / target)
    out = tmp_path / "o"
    rc = cli.main(["bench", "compare", "--deployment", f"a={target}", *WORKLOAD, "--out", str(out)])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_url_deployments_still_need_a_model_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["bench", "compare", "--deployment", "a=http://127.0.0.1:9", *WORKLOAD,
                   "--out", str(tmp_path)])
    assert rc == 2
    assert "give --model" in capsys.readouterr().err
