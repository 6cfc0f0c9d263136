"""A goodput is only reported from trials that loaded the deployment and only below a rate that
missed the target: a workload too small to load a deployment is grown (repeated) until a trial
misses the target, and a search that never misses says plainly that the rate could not be bounded."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from pdfabric.bench.goodput import GoodputResult, SearchConfig, Trial, find_goodput, grown, settle
from pdfabric.bench.metrics import SLO
from pdfabric.bench.planner import PlanSettings, plan_for_workers
from pdfabric.bench.records import OK, REJECTED, RequestRecord
from pdfabric.bench.workload import Request, Workload
from pdfabric.cli.main import main
from pdfabric.config import ServeConfig
from pdfabric.profile import WorkerProfile
from pdfabric.profile_file import ProfileFile

SLO_ = SLO(ttft_ms=500, itl_ms=50)


def workload(n: int, rate: float = 1.0) -> Workload:
    return Workload("test", tuple(Request(i, i / rate, 100, 4) for i in range(n)))


def queue_simulate(capacity: float, slots: int = 1):
    """A deployment that serves ``capacity`` requests/s through ``slots`` parallel servers (each request
    takes slots / capacity seconds), first come first served: a burst of up to ``slots`` requests is
    absorbed at any rate, a longer overload queues without bound."""
    service = slots / capacity

    def simulate(serve: ServeConfig | None, w: Workload) -> list[RequestRecord]:
        free = [0.0] * slots
        out = []
        for r in w.requests:
            k = min(range(slots), key=free.__getitem__)
            start = max(r.arrival_s, free[k])
            free[k] = start + service
            ttft = (start - r.arrival_s) * 1e3 + 1.0
            e2e, n = (free[k] - r.arrival_s) * 1e3, r.output_len
            out.append(RequestRecord(r.index, r.arrival_s, r.arrival_s, r.input_len, n, OK, ttft_ms=ttft,
                                     e2e_ms=e2e, output_tokens=n, itl_ms=[1.0] * (n - 1)))  # fmt: skip
        return out

    return simulate


def test_a_trial_loads_the_deployment_when_arrivals_outlast_its_tail() -> None:
    sim = queue_simulate(capacity=10.0, slots=4)
    slow = Trial.of(sim(None, workload(40, rate=5.0)), SLO_)  # 7.8 s of arrivals, done 0.4 s after
    assert slow.attainment == 1.0 and slow.loaded and slow.requests == 40
    burst = Trial.of(sim(None, workload(4, rate=1000.0)), SLO_)  # absorbed whole: proves nothing
    assert burst.attainment == 1.0 and not burst.loaded
    rejected = [RequestRecord(0, 0.0, 0.0, 1, 1, REJECTED), RequestRecord(1, 1.0, 1.0, 1, 1, REJECTED)]
    assert Trial.of(rejected, SLO_) == Trial(0.0, 1.0, 0.0, 2)


def test_repeating_a_workload_keeps_its_rate_and_shape() -> None:
    w = Workload("w", (Request(0, 0.0, 10, 2), Request(1, 1.0, 20, 3), Request(2, 3.0, 30, 4)))
    r = w.repeated(3)
    assert len(r) == 9 and r.mean_rate() == pytest.approx(w.mean_rate())
    assert [q.arrival_s for q in r.requests[:6]] == [0.0, 1.0, 3.0, 4.5, 5.5, 7.5]  # a mean gap (1.5) apart
    assert [q.index for q in r.requests] == list(range(9))
    assert [q.input_len for q in r.requests] == [10, 20, 30] * 3 and r.scaling["repeated"] == 3
    assert w.repeated(1) is w
    with pytest.raises(ValueError, match="copies"):
        w.repeated(0)


def search(sim, base: Workload, cfg: SearchConfig, lo_hi: tuple[float, float]) -> GoodputResult:  # noqa: ANN001
    async def run(rate: float, copies: int) -> Trial:
        return Trial.of(sim(None, base.repeated(copies).with_rate(rate)), SLO_)

    return settle(asyncio.run(find_goodput(grown(run, cfg), None, lo_hi, cfg)))


def test_growth_bounds_the_rate_a_small_workload_could_not() -> None:
    """16 requests on 16 parallel slots of 10 req/s in all: absorbed whole at any rate, so without
    growth every rate passes; grown, the search misses above 10 req/s and settles just below."""
    sim, base = queue_simulate(capacity=10.0, slots=16), workload(16)
    unbounded = search(sim, base, SearchConfig(0.9, 0.05, 12, max_growth=1), (5.0, 10.0))
    assert unbounded.goodput is None and not unbounded.bounded and unbounded.unloaded
    assert "not bounded" in unbounded.describe() and unbounded.to_json()["goodput_rps"] is None
    res = search(sim, base, SearchConfig(0.9, 0.05, 12, max_growth=64), (5.0, 10.0))
    assert res.bounded and res.goodput is not None and 10.0 / 1.3 <= res.goodput <= 10.0 * 1.06
    assert res.first_fail is not None and res.first_fail > res.goodput
    assert max(res.requests.values()) > len(base)  # it had to grow
    assert all(rate not in res.unloaded for rate, att in res.trials if rate <= res.goodput)


def test_an_unloaded_pass_is_neither_pass_nor_failure() -> None:
    res = GoodputResult(target=0.9)
    assert res.record(1.0, Trial(1.0, 10.0, 1.0, 50))
    assert not res.record(2.0, Trial(1.0, 1.0, 2.0, 50))  # met the target, but unloaded
    settle(res)
    assert res.goodput is None and res.lower_bound == 1.0 and not res.bounded and res.unloaded == [2.0]
    res.record(4.0, 0.5)  # a plain float is a loaded trial
    settle(res)
    assert res.goodput == 1.0 and res.first_fail == 4.0
    assert [t["loaded"] for t in res.to_json()["trials"]] == [True, False, True]


# --- the planner ---------------------------------------------------------------------------------


def _profile() -> ProfileFile:
    ms = 1e-3
    return ProfileFile(model="tiny", profile=WorkerProfile((1 * ms, 0.1 * ms, 0.0), (5 * ms, 0.2 * ms, 0.0),
                       50, 50, 0.02), kv_bytes_per_token=512, block_size=16, max_batch_tokens=512,
                       max_running=64, role="any", threads=0, dtype="float32",
                       kv_bytes_per_s={"zmq-tcp": 1e9})  # fmt: skip


def test_the_planner_never_reports_a_goodput_it_could_not_bound() -> None:
    settings = PlanSettings(slo=SLO_, search=SearchConfig(0.9, 0.1, 10, max_growth=1), max_running=(16,),
                            disaggregated=False)  # fmt: skip
    sim = queue_simulate(capacity=10.0, slots=16)
    plan = plan_for_workers(2, workload(16), [_profile()], settings, simulate=lambda s, w: sim(s, w))
    assert plan.best is None and all(e.goodput is None for e in plan.evaluations)
    assert any("could not be bounded" in n and "--max-growth" in n for n in plan.notes)
    grown_settings = PlanSettings(slo=SLO_, search=SearchConfig(0.9, 0.1, 10, max_growth=64),
                                  max_running=(16,), disaggregated=False)  # fmt: skip
    plan = plan_for_workers(2, workload(16), [_profile()], grown_settings, simulate=lambda s, w: sim(s, w))
    assert plan.best is not None and plan.best.goodput is not None and plan.best.goodput <= 10.0 * 1.1


def test_plan_json_is_one_document_on_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run whose rate cannot be bounded (five requests, no growth, a loose SLO) prints one JSON
    document saying so, with its notes on stderr."""
    prof = tmp_path / "p.json"
    _profile().save(prof)
    argv = ["plan", "--profile", str(prof), "--trace", "synthetic", "--num-requests", "5",
            "--input-len", "64", "--output-len", "4", "--slo-ttft-ms", "60000", "--slo-itl-ms", "5000",
            "--workers", "1", "--max-running", "16", "--max-trials", "4", "--max-growth", "1",
            "--json"]  # fmt: skip
    assert main(argv) == 1
    captured = capsys.readouterr()
    chosen = json.loads(captured.out)  # the whole of stdout is one document
    assert chosen["goodput_rps"] is None and "could not be bounded" in chosen["headline"]
    assert chosen["unbounded"] and chosen["unbounded"][0]["name"].startswith("1C")
    assert "note:" in captured.err and "note:" not in captured.out


def test_a_goodput_report_says_plainly_when_the_rate_is_not_bounded() -> None:
    from pdfabric.bench.goodput_cmd import SearchRun, search_report, summary_md

    res = GoodputResult(target=0.9)
    res.record(2.0, Trial(1.0, 50.0, 0.5, 100))
    res.record(4.0, Trial(0.95, 25.0, 0.6, 400))
    run = SearchRun(result=settle(res))
    report = search_report(run, SLO_, {"command": "goodput"})
    assert report["goodput_rps"] is None and report["goodput"]["lower_bound_rps"] == 4.0
    assert not report["goodput"]["bounded"] and report["goodput"]["trials"][1]["requests"] == 400
    text = summary_md(report, "x")
    assert "not bounded" in text and "at least 4 req/s" in text
    assert "not bounded" in res.describe() and "400 requests" in res.describe()
