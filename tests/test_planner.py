"""The planner on hand-built profiles: no processes, no real profiling.

Workloads whose cost is mostly prefill must get more prefill workers and workloads whose cost is
mostly decode more decode workers; ``--rate`` finds the fewest workers; the chosen deployment's TOML
loads; bad input is a clear error. The search logic is also checked against a stand-in simulator
whose capacity is known exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdfabric.bench.goodput import SearchConfig
from pdfabric.bench.metrics import SLO
from pdfabric.bench.plan_report import deployment_toml
from pdfabric.bench.planner import (
    Candidate,
    PlanSettings,
    candidates,
    deployment,
    plan_for_rate,
    plan_for_workers,
)
from pdfabric.bench.records import OK, RequestRecord
from pdfabric.bench.workload import Request, Workload
from pdfabric.cli.main import main
from pdfabric.config import ServeConfig, load_serve_config
from pdfabric.profile import WorkerProfile
from pdfabric.profile_file import ProfileFile

MS = 1e-3


def profile(role: str = "any", threads: int = 0, **kw: object) -> ProfileFile:
    """A made-up worker: prefill 0.1 ms/token, decode step 5 ms + 0.2 ms per sequence."""
    fields = dict(
        model="tiny",
        profile=WorkerProfile((1 * MS, 0.1 * MS, 0.0), (5 * MS, 0.2 * MS, 0.0), 50, 50, 0.02),
        kv_bytes_per_token=512,
        block_size=16,
        max_batch_tokens=512,
        max_running=64,
        role=role,
        threads=threads,
        dtype="float32",
        kv_bytes_per_s={"zmq-tcp": 1e9},
    )
    fields.update(kw)
    return ProfileFile(**fields)  # type: ignore[arg-type]


def workload(n: int, input_len: int, output_len: int, rate: float = 1.0) -> Workload:
    reqs = tuple(Request(i, i / rate, input_len, output_len) for i in range(n))
    return Workload("test", reqs)


def settings(**kw: object) -> PlanSettings:
    base = dict(slo=SLO(ttft_ms=1000, itl_ms=50), search=SearchConfig(0.9, 0.1, 12), max_running=(32,))
    base.update(kw)
    return PlanSettings(**base)  # type: ignore[arg-type]


# --- a stand-in simulator with a known capacity ------------------------------------------------


def capacity(serve: ServeConfig) -> float:
    """Requests/s the stand-in serves: 2 per prefill worker, 1 per decode, 1.2 per colocated."""
    if serve.count("colocated"):
        return 1.2 * serve.count("colocated")
    return min(2.0 * serve.count("prefill"), 1.0 * serve.count("decode"))


def fake_simulate(serve: ServeConfig, w: Workload) -> list[RequestRecord]:
    """Every request meets the SLO when the rate is within capacity, none does above it."""
    ttft = 10.0 if w.mean_rate() <= capacity(serve) * (1 + 1e-9) else 1e6
    return [
        RequestRecord(r.index, r.arrival_s, r.arrival_s, r.input_len, r.output_len, OK, ttft_ms=ttft,
                      e2e_ms=ttft + 10.0 * r.output_len, output_tokens=r.output_len,
                      itl_ms=[10.0] * (r.output_len - 1))
        for r in w.requests
    ]  # fmt: skip


def test_candidates_cover_every_split_and_colocated() -> None:
    cands = candidates(4, [profile()], settings(max_running=(16, 32)))
    shapes = {(c.prefill, c.decode, c.colocated) for c in cands}
    assert shapes == {(1, 3, 0), (2, 2, 0), (3, 1, 0), (0, 0, 4)}
    assert {c.max_running for c in cands} == {16, 32} and len(cands) == 8
    # Role-tagged profiles without a colocated or "any" one: splits only.
    split_only = candidates(3, [profile("prefill"), profile("decode")], settings())
    assert {(c.prefill, c.decode, c.colocated) for c in split_only} == {(1, 2, 0), (2, 1, 0)}


def test_caps_stay_within_the_measured_limits() -> None:
    small = profile(max_running=24)
    cands = candidates(2, [small], settings(max_running=()))
    assert sorted({c.max_running for c in cands}) == [8, 16, 24]
    with pytest.raises(
        ValueError, match="--max-running: no cap within the profiles' measured batch limit 24"
    ):
        candidates(2, [small], settings(max_running=(32, 64)))
    with pytest.raises(ValueError, match="--chunk-tokens: no budget within"):
        candidates(2, [small], settings(max_running=(8,), chunk_tokens=(1024,)))


def test_search_finds_the_known_best_split_with_a_stand_in() -> None:
    plan = plan_for_workers(6, workload(40, 128, 16), [profile()], settings(), simulate=fake_simulate)
    best = plan.best
    assert best is not None
    # capacity: min(2p, d) is highest at p=2, d=4 (4 req/s); colocated x6 gives 7.2 req/s.
    assert (best.candidate.colocated, best.goodput is not None) == (6, True)
    assert best.goodput is not None and 7.2 / 1.1 <= best.goodput <= 7.2 * (1 + 1e-9)
    splits = {
        (e.candidate.prefill, e.candidate.decode): e.goodput for e in plan.evaluations if e.candidate.prefill
    }
    assert max(splits, key=lambda k: splits[k] or 0) == (2, 4)
    assert all(e.goodput is None or e.goodput <= capacity(deployment(e.candidate, [profile()], settings()))
               for e in plan.evaluations)  # fmt: skip


def test_rate_mode_returns_the_fewest_workers_with_a_stand_in() -> None:
    s = settings(colocated=False)
    plan = plan_for_rate(2.5, workload(40, 128, 16), [profile()], s, max_workers=8, simulate=fake_simulate)
    assert plan.best is not None
    # min(2p, d) >= 2.5 first at p=2, d=3 (W=5); W=4's best (p=1 or 2) reaches only 2.
    assert (plan.best.candidate.prefill, plan.best.candidate.decode) == (2, 3)
    assert max(e.candidate.workers for e in plan.evaluations) == 5
    hopeless = plan_for_rate(
        100.0, workload(40, 128, 16), [profile()], s, max_workers=3, simulate=fake_simulate
    )
    assert hopeless.best is None and "no deployment of up to 3 workers" in hopeless.notes[-1]


# --- the real simulator ----------------------------------------------------------------------


def heavy_prefill() -> ProfileFile:
    """Prefill dominates: 1 ms per prompt token; decode steps are cheap."""
    return profile(profile=WorkerProfile((1 * MS, 1 * MS, 0.0), (2 * MS, 0.05 * MS, 0.0), 50, 50, 0.0))


def test_prefill_heavy_workload_gets_more_prefill_workers() -> None:
    w = workload(60, 512, 4)  # long prompts, four tokens each
    plan = plan_for_workers(4, w, [heavy_prefill()], settings(colocated=False, slo=SLO(3000, 200)))
    assert plan.best is not None
    assert plan.best.candidate.prefill > plan.best.candidate.decode


def test_decode_heavy_workload_gets_more_decode_workers() -> None:
    # Decode steps cost 20 ms + 2 ms per sequence; prompts are short and answers long.
    slow_decode = profile(
        profile=WorkerProfile((1 * MS, 0.01 * MS, 0.0), (20 * MS, 2 * MS, 0.0), 50, 50, 0.0)
    )
    w = workload(60, 32, 96)
    plan = plan_for_workers(
        4, w, [slow_decode], settings(colocated=False, slo=SLO(2000, 60), max_running=(16,))
    )
    assert plan.best is not None
    assert plan.best.candidate.decode > plan.best.candidate.prefill


def test_role_profiles_from_different_machines_are_used_per_kind() -> None:
    # The prefill-heavy workload again, but prefill runs on a machine 100x faster at it and decode on
    # one with slow steps: now decode is the bottleneck and gets the workers.
    fast_prefill = profile("prefill", profile=WorkerProfile((1 * MS, 0.01 * MS, 0.0), (0, 0, 0), 50, 0, 0.0))
    slow_decode = profile("decode", profile=WorkerProfile((0, 0, 0), (20 * MS, 2 * MS, 0.0), 0, 50, 0.0))
    s = settings(slo=SLO(3000, 200), max_running=(16,))
    plan = plan_for_workers(4, workload(60, 512, 4), [fast_prefill, slow_decode], s)
    assert plan.best is not None and plan.best.candidate.colocated == 0  # no colocated profile
    assert plan.best.candidate.decode > plan.best.candidate.prefill


def test_rate_mode_with_the_simulator_takes_the_fewest_workers() -> None:
    w = workload(60, 512, 4)
    s = settings(colocated=False, slo=SLO(3000, 200))
    at_two = plan_for_workers(2, w, [heavy_prefill()], s)
    assert at_two.best is not None and at_two.best.goodput is not None
    rate = at_two.best.goodput * 1.6  # beyond two workers, within reach of more
    plan = plan_for_rate(rate, w, [heavy_prefill()], s, max_workers=6)
    assert plan.best is not None
    assert plan.best.candidate.workers > 2
    fewer = [e for e in plan.evaluations if e.candidate.workers < plan.best.candidate.workers]
    assert fewer and all((e.stats(s.slo)["attainment"] or 0) < 0.9 for e in fewer)


# --- the written deployment ------------------------------------------------------------------


def test_written_toml_loads(tmp_path: Path) -> None:
    s = settings()
    serve = deployment(Candidate(2, 3, 0, 32, 256), [profile(threads=1)], s)
    path = tmp_path / "plan.toml"
    path.write_text(deployment_toml(serve, "a header\nof two lines"))
    back = load_serve_config(path, {})
    assert (back.count("prefill"), back.count("decode"), back.count("colocated")) == (2, 3, 0)
    assert back.worker.max_running == 32 and back.worker.max_batch_tokens == 256 and back.worker.threads == 1
    assert back.routing.ttft_ms == 1000 and back.routing.itl_ms == 50 and back.model == "tiny"
    assert [w.kind for _, w in back.launch_plan()] == [w.kind for _, w in serve.launch_plan()]


def test_heterogeneous_threads_become_worker_groups(tmp_path: Path) -> None:
    profiles = [profile("prefill", threads=4), profile("decode", threads=1)]
    serve = deployment(Candidate(1, 2, 0, 16, 512), profiles, settings())
    path = tmp_path / "plan.toml"
    path.write_text(deployment_toml(serve))
    back = load_serve_config(path, {})
    assert [(w.kind, w.threads, w.max_running) for _, w in back.launch_plan()] == [
        ("prefill", 4, 16), ("decode", 1, 16), ("decode", 1, 16)
    ]  # fmt: skip


def test_each_kind_runs_the_weight_format_it_was_profiled_in(tmp_path: Path) -> None:
    same = deployment(Candidate(1, 2, 0, 16, 512), [profile(weights="int4")], settings())
    assert same.worker.quantization == "int4" and not same.groups
    profiles = [profile("prefill", threads=1), profile("decode", threads=1, weights="int4")]
    serve = deployment(Candidate(1, 2, 0, 16, 512), profiles, settings())
    path = tmp_path / "plan.toml"
    path.write_text(deployment_toml(serve))
    back = load_serve_config(path, {})
    assert [(w.kind, w.quantization) for _, w in back.launch_plan()] == [
        ("prefill", "none"), ("decode", "int4"), ("decode", "int4")
    ]  # fmt: skip


# --- the command -----------------------------------------------------------------------------


def test_plan_command_writes_a_loadable_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = tmp_path / "p.json"
    heavy_prefill().save(prof)
    out = tmp_path / "plan"
    argv = ["plan", "--profile", str(prof), "--trace", "synthetic", "--num-requests", "40",
            "--input-len", "512", "--output-len", "4", "--slo-ttft-ms", "3000", "--slo-itl-ms", "200",
            "--workers", "3", "--max-running", "16", "--max-trials", "10", "--out", str(out), "--json",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    chosen = json.loads(capsys.readouterr().out)
    assert chosen["prefill"] + chosen["decode"] + chosen["colocated"] == 3 and chosen["goodput_rps"] > 0
    assert {"attainment", "max_running", "chunk_tokens", "goodput_per_worker"} <= set(chosen)
    report = json.loads((out / "plan.json").read_text())
    assert len(report["candidates"]) == 3 and report["chosen"]["name"] == chosen["name"]
    cfg = load_serve_config(out / "plan.toml", {})
    assert cfg.count("prefill") == chosen["prefill"] and cfg.worker.max_running == 16
    assert (out / "attainment_vs_rate.png").stat().st_size > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        ([], "give --workers W"),
        (["--workers", "2", "--rate", "3"], "not both"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--workers", "2", "--attainment", "1.5"], "--attainment must be in (0, 1]"),
        (["--workers", "2", "--max-running", "8,x"], "--max-running must be comma-separated integers"),
        (["--workers", "2", "--transport", "dist"], "--transport dist: not measured"),
        (["--workers", "2", "--slo-itl-ms", "-1"], "--slo-itl-ms must be > 0"),
    ],
)
def test_bad_arguments(
    tmp_path: Path, flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prof = tmp_path / "p.json"
    profile().save(prof)
    argv = ["plan", "--profile", str(prof), "--trace", "synthetic", "--num-requests", "10",
            "--slo-ttft-ms", "1000", "--slo-itl-ms", "50", *flags]  # fmt: skip
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_profiles_of_different_models_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    profile("prefill").save(a)
    profile("decode", model="cpu-small").save(b)
    argv = ["plan", "--profile", str(a), "--profile", str(b), "--trace", "synthetic", "--slo-ttft-ms", "1000",
            "--slo-itl-ms", "50", "--workers", "2"]  # fmt: skip
    assert main(argv) == 2
    assert "the profiles disagree on model" in capsys.readouterr().err
