"""The fabric simulator against queueing results and its own model of the real processes (no processes).

Each test builds a deployment whose step times are known exactly (constant or linear profiles), so
TTFT and ITL follow from the model: D/D/1 and M/D/1 queues, a decode batch, the prefill -> decode hand-
over, admission rejections, block accounting, and the deployments built from the shipped configs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pdfabric.bench.records import OK, REJECTED
from pdfabric.bench.sim_deploy import sim_config
from pdfabric.bench.sim_spec import SimWorker
from pdfabric.bench.simulator import SimConfig, Simulation, simulate
from pdfabric.bench.workload import Request, Workload
from pdfabric.cli import main as cli
from pdfabric.config import load_serve_config
from pdfabric.control import COLOCATED, DECODE, PREFILL
from pdfabric.profile import StepShape, WorkerProfile
from pdfabric.profile_file import ProfileFile
from pdfabric.routing_config import AdmissionConfig
from tests.core_helpers import core_spec

ROOT = Path(__file__).resolve().parent.parent
LOOSE = AdmissionConfig(ttft_ms=3_600_000.0, itl_ms=3_600_000.0)  # no request ever waits or is turned away


def workload(arrivals: list[float], input_len: int, output_len: int) -> Workload:
    reqs = tuple(Request(i, t, input_len, output_len) for i, t in enumerate(arrivals))
    return Workload("test", reqs)


def sim_worker(
    worker_id: str, kind: str, profile: WorkerProfile, kv_bytes_per_s: float = 1e9, **limits: int
) -> SimWorker:
    """A simulated worker with room for every test's prompts and ``CoreSpec``'s other defaults."""
    limits.setdefault("num_blocks", 4096)
    return SimWorker(core_spec(kind, worker_id=worker_id, **limits), profile, kv_bytes_per_s)


def constant(seconds: float) -> WorkerProfile:
    """Every step takes ``seconds``, whatever it runs."""
    return WorkerProfile(prefill=(seconds, 0.0, 0.0), decode=(seconds, 0.0, 0.0))


def test_dd1_every_ttft_is_the_step_time() -> None:
    step, gap = 0.02, 0.05
    worker = sim_worker("c", COLOCATED, constant(step), max_batch_tokens=100)
    records = simulate(SimConfig((worker,)), workload([i * gap for i in range(50)], 100, 1))
    assert [r.status for r in records] == [OK] * 50
    assert [r.index for r in records] == list(range(50))
    for r in records:
        assert r.ttft_ms == pytest.approx(step * 1e3, abs=1e-6)
        assert r.e2e_ms == pytest.approx(step * 1e3, abs=1e-6)
        assert r.output_tokens == 1 and r.itl_ms == [] and r.sent_s == r.scheduled_s


def test_md1_mean_ttft_matches_pollaczek_khinchine() -> None:
    step, rho, n = 0.01, 0.7, 20_000
    rng = random.Random(7)
    t, arrivals = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rho / step)
        arrivals.append(t)
    # One prompt per step; a batch limit the queue never reaches, or the router would hold prompts back.
    worker = sim_worker("c", COLOCATED, constant(step), max_batch_tokens=64, max_running=n)
    records = simulate(SimConfig((worker,), routing=LOOSE), workload(arrivals, 64, 1))
    assert all(r.status == OK for r in records)
    mean = sum(r.ttft_ms for r in records) / n / 1e3
    assert mean == pytest.approx(step + rho * step / (2 * (1 - rho)), rel=0.05)


def test_decode_batch_itl_is_the_profiles_step_time() -> None:
    n, prompt, out = 6, 40, 8
    decode_profile = WorkerProfile(decode=(0.01, 0.002, 1e-5))
    p = sim_worker("p", PREFILL, constant(0.1), max_batch_tokens=n * prompt)
    d = sim_worker("d", DECODE, decode_profile)  # no KV bytes: every prompt's KV arrives at once
    records = simulate(SimConfig((p, d), routing=LOOSE), workload([0.0] * n, prompt, out))
    for r in records:
        assert r.status == OK and r.output_tokens == out
        assert r.ttft_ms == pytest.approx(100.0)  # all prompts in one prefill step
        for j, gap in enumerate(r.itl_ms):  # step j + 1 decodes n sequences of prompt + j + 1 tokens
            assert gap == pytest.approx(decode_profile.decode_step_seconds(n, n * (prompt + j + 1)) * 1e3)


def test_disaggregated_ttft_and_first_gap() -> None:
    prompt, kv, rate = 100, 1000, 1e6
    pre = WorkerProfile(prefill=(0.05, 1e-3, 1e-6))
    dec = WorkerProfile(decode=(0.02, 1e-3, 1e-5))
    p = sim_worker("p", PREFILL, pre, kv_bytes_per_token=kv, kv_bytes_per_s=rate)
    d = sim_worker("d", DECODE, dec, kv_bytes_per_token=kv, kv_bytes_per_s=rate)
    cfg = SimConfig((p, d), routing=LOOSE, overhead_ms=1.5)
    [r] = simulate(cfg, workload([0.0], prompt, 3))
    prefill_ms = pre.step_seconds(StepShape.of([(0, prompt)])) * 1e3
    # The first token leaves the prefill worker as its KV push starts: TTFT has no transfer in it.
    assert r.ttft_ms == pytest.approx(prefill_ms + 1.5)
    # The push moves whole blocks (7 x 16 tokens); the decode worker's first step follows its arrival.
    transfer_ms = 7 * 16 * kv / rate * 1e3
    assert r.itl_ms[0] == pytest.approx(transfer_ms + dec.decode_step_seconds(1, prompt + 1) * 1e3)
    assert r.itl_ms[1] == pytest.approx(dec.decode_step_seconds(1, prompt + 2) * 1e3)
    assert r.e2e_ms == pytest.approx(r.chunk_ms[-1])


def test_reservation_waits_for_the_decode_workers_step() -> None:
    """A busy decode worker answers a reservation only between steps, which delays the prefill."""
    p = sim_worker("p", PREFILL, constant(0.1))
    d = sim_worker("d", DECODE, constant(0.3))
    recs = simulate(
        SimConfig((p, d), routing=LOOSE), Workload("t", (Request(0, 0.0, 16, 50), Request(1, 0.25, 16, 1)))
    )
    # Request 0 decodes from 0.1 s in 0.3 s steps; request 1's reservation waits for the one ending at 0.4 s.
    assert recs[1].ttft_ms == pytest.approx((0.4 + 0.1 - 0.25) * 1e3)


def test_single_token_output_ends_when_the_kv_arrives() -> None:
    p = sim_worker("p", PREFILL, constant(0.1), kv_bytes_per_token=10, kv_bytes_per_s=1e4)
    d = sim_worker("d", DECODE, constant(0.2), kv_bytes_per_token=10)
    [r] = simulate(SimConfig((p, d), routing=LOOSE), workload([0.0], 16, 1))
    assert r.status == OK and r.output_tokens == 1 and r.ttft_ms == pytest.approx(100.0)
    assert r.e2e_ms == pytest.approx(100.0 + 16 * 10 / 1e4 * 1e3)


def test_impossible_ttft_budget_rejects_every_request() -> None:
    worker = sim_worker("c", COLOCATED, constant(0.05))
    cfg = SimConfig((worker,), routing=AdmissionConfig(ttft_ms=1.0))
    records = simulate(cfg, workload([i * 0.1 for i in range(20)], 100, 4))
    assert [r.status for r in records] == [REJECTED] * 20
    assert {r.http_status for r in records} == {429}
    assert all(r.ttft_ms is None and r.output_tokens == 0 for r in records)


@pytest.mark.parametrize("deployment", ["disaggregated", "colocated"])
def test_blocks_never_leak(deployment: str) -> None:
    """A mixed, overloaded workload on small caches (reservations refused, prompts waiting for blocks,
    decodes preempted and recomputed): afterwards every block is free and no sequence is left."""
    prof = WorkerProfile(prefill=(0.01, 1e-4, 1e-8), decode=(0.005, 1e-4, 1e-7))
    if deployment == "disaggregated":
        workers: tuple[SimWorker, ...] = (
            sim_worker("p", PREFILL, prof, num_blocks=40, max_batch_tokens=128, kv_bytes_per_token=100),
            sim_worker("d", DECODE, prof, num_blocks=60, max_running=16, kv_bytes_per_token=100),
        )
    else:
        workers = (sim_worker("c", COLOCATED, prof, num_blocks=60, max_batch_tokens=128, max_running=16),)
    rng = random.Random(3)
    reqs, t = [], 0.0
    for i in range(200):
        t += rng.expovariate(10.0)
        reqs.append(Request(i, t, rng.randint(1, 300), rng.randint(1, 120)))
    sim = Simulation(SimConfig(workers, routing=LOOSE), Workload("mixed", tuple(reqs)))
    records = sim.run()
    assert len(records) == 200 and {r.status for r in records} <= {OK, REJECTED}
    assert sum(r.status == OK for r in records) > 50
    for r in records:
        if r.status == OK:
            assert r.output_tokens == r.output_len
    for worker_id, (free, total) in sim.free_blocks().items():
        assert free == total, worker_id
        assert len(sim.workers[worker_id].scheduler) == 0


def test_simulation_is_deterministic() -> None:
    prof = WorkerProfile(prefill=(0.01, 1e-4, 0.0), decode=(0.005, 1e-4, 1e-7))
    kinds = (("p0", PREFILL), ("p1", PREFILL), ("d0", DECODE))
    workers = tuple(sim_worker(wid, kind, prof) for wid, kind in kinds)
    rng = random.Random(1)
    reqs = tuple(Request(i, i * 0.03, rng.randint(10, 200), rng.randint(1, 20)) for i in range(200))
    first = simulate(SimConfig(workers), Workload("w", reqs))
    assert first == simulate(SimConfig(workers), Workload("w", reqs))


def _profiles() -> list[ProfileFile]:
    prefill = ProfileFile("m", WorkerProfile(prefill=(0.03, 2e-3, 1e-6)), 49152, 16, 256, 32, role=PREFILL,
                          kv_bytes_per_s={"zmq-tcp": 1.2e9, "shm": 5e9})  # fmt: skip
    general = ProfileFile(
        "m", WorkerProfile(decode=(0.04, 1e-3, 1e-6)), 49152, 16, 256, 32, max_model_len=2048
    )
    return [prefill, general]


def test_sim_config_cpu_small_1p1d() -> None:
    serve = load_serve_config(ROOT / "configs" / "cpu-small-1p1d.toml", {})
    cfg = sim_config(serve, _profiles(), transport="zmq-tcp")
    blocks = 1024 * 2**20 // (49152 * 16)
    assert [(w.worker_id, w.kind, w.core.num_blocks) for w in cfg.workers] == [
        ("prefill-0", PREFILL, blocks),
        ("decode-0", DECODE, blocks),
    ]
    p, d = cfg.workers
    assert p.profile == _profiles()[0].profile and d.profile == _profiles()[1].profile
    assert (p.core.config.max_batch_tokens, p.core.config.max_running, p.kv_bytes_per_s) == (256, 32, 1.2e9)
    assert d.kv_bytes_per_s == serve.predictor.default_kv_bytes_per_s  # none measured for it
    assert (p.core.max_model_len, d.core.max_model_len) == (4096, 2048)
    assert sim_config(serve, _profiles()).workers[0].kv_bytes_per_s == 5e9  # the fastest measured
    with pytest.raises(ValueError, match="no profile for decode"):
        sim_config(serve, _profiles()[:1])


def test_sim_config_slo_pools() -> None:
    serve = load_serve_config(ROOT / "configs" / "slo-pools.toml", {})
    cfg = sim_config(serve, _profiles())
    blocks = 128 * 2**20 // (49152 * 16)
    got = [(w.worker_id, w.kind, w.core.config.pool, w.core.config.max_running, w.core.num_blocks)
           for w in cfg.workers]  # fmt: skip
    assert got == [
        ("prefill-0", PREFILL, "default", 64, blocks),
        ("decode-tight-0", DECODE, "tight", 4, blocks),
        ("decode-bulk-0", DECODE, "bulk", 64, blocks),
    ]
    assert cfg.routing == serve.routing and cfg.predictor == serve.predictor
    assert {p.name for p in cfg.routing.pools} == {"tight", "bulk"}


def test_cli_writes_the_bench_report(tmp_path: Path) -> None:
    profile = tmp_path / "any.json"
    ProfileFile("tiny", constant(0.01), 1024, 16, 512, 64, kv_bytes_per_s={"zmq-tcp": 1e9}).save(profile)
    out = tmp_path / "sim"
    config = str(ROOT / "configs" / "default.toml")
    argv = ["bench", "simulate", "--config", config, "--profile", str(profile), "--trace", "synthetic",
            "--rate", "5", "--num-requests", "30", "--input-len", "64", "--output-len", "4",
            "--out", str(out), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    for key in ("requests", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "throughput", "slo", "attainment",
                "slo_scale", "workload", "warnings"):  # fmt: skip
        assert key in report, key
    assert report["simulated"] is True and report["requests"]["ok"] == 30
    assert [w["worker_id"] for w in report["simulator"]["workers"]] == ["prefill-0", "decode-0"]
    assert (out / "requests.jsonl").read_text().count("\n") == 30
    assert "Simulated" in (out / "summary.md").read_text()

    gout = tmp_path / "goodput"
    assert cli.main([*argv[:-3], "--mode", "goodput", "--rates", "5,50", "--max-trials", "3",
                     "--out", str(gout), "--no-progress"]) == 0  # fmt: skip
    greport = json.loads((gout / "report.json").read_text())
    assert greport["simulated"] is True and "goodput_rps" in greport and greport["trials"]
    assert (gout / "trials" / "rate-5" / "report.json").exists()

    # validate against a "measured" run that is this very simulation: every figure must agree
    vout = tmp_path / "validate"
    assert cli.main([*argv[:-3], "--mode", "validate", "--measured", str(gout), "--out", str(vout)]) == 0
    validation = json.loads((vout / "validation.json").read_text())
    assert validation["goodput_rps"]["measured"] == validation["goodput_rps"]["simulated"]
    assert [t["rate"] for t in validation["trials"]] == sorted(t["rate"] for t in greport["trials"])
    for t in validation["trials"]:
        assert t["measured"]["ttft_p90_ms"] == pytest.approx(t["simulated"]["ttft_p90_ms"], abs=1e-3)
        assert t["measured"]["attainment"] == t["simulated"]["attainment"]
    other = [*argv[:-3], "--num-requests", "29", "--mode", "validate", "--measured", str(gout),
             "--out", str(vout)]  # fmt: skip
    assert cli.main(other) == 2  # another workload than the measured one


def test_cli_makes_a_share_of_the_requests_embedding_inputs(tmp_path: Path) -> None:
    profile = tmp_path / "any.json"
    ProfileFile("tiny", constant(0.01), 1024, 16, 512, 64, kv_bytes_per_s={"zmq-tcp": 1e9}).save(profile)
    config = str(ROOT / "configs" / "default.toml")
    argv = ["bench", "simulate", "--config", config, "--profile", str(profile), "--trace", "synthetic",
            "--rate", "5", "--num-requests", "40", "--input-len", "64", "--output-len", "4", "--seed", "3",
            "--embed-share", "0.5", "--out", str(tmp_path / "sim"), "--no-progress"]  # fmt: skip
    assert cli.main(argv) == 0
    report = json.loads((tmp_path / "sim" / "report.json").read_text())
    embeds = report["workload"]["embedding_inputs"]
    assert 10 <= embeds <= 30 and report["requests"]["ok"] == 40
    records = [json.loads(x) for x in (tmp_path / "sim" / "requests.jsonl").read_text().splitlines()]
    assert sum(r["output_tokens"] == 0 for r in records) == embeds  # an embedding input streams no token
    assert cli.main([*argv[:-5], "--embed-share", "1.5", "--out", str(tmp_path / "x"), "--no-progress"]) != 0


def test_prompts_that_share_hash_ids_hit_the_simulated_prefix_cache() -> None:
    """Simulated prompts share tokens exactly as their Mooncake ``hash_ids`` say (and otherwise not at
    all), so the workers' prefix caches save the prefill time they would save for real."""
    per_token = WorkerProfile(prefill=(0.001, 1e-4, 0.0), decode=(0.005, 0.0, 0.0))
    shared = [Request(i, i * 1.0, 1024 + 100, 4, hash_ids=(7, 8, 100 + i)) for i in range(6)]
    unshared = [Request(i, i * 1.0, 1024 + 100, 4) for i in range(6)]
    ttft: dict[tuple[str, bool], list[float]] = {}
    for name, reqs in (("shared", shared), ("unshared", unshared)):
        for caching in (True, False):
            spec = core_spec(COLOCATED, 4096, worker_id="c", prefix_caching=caching)
            worker = SimWorker(spec, per_token, 1e9)
            records = simulate(SimConfig((worker,), LOOSE), Workload(name, tuple(reqs)))
            assert [r.status for r in records] == [OK] * 6
            ttft[(name, caching)] = [r.ttft_ms for r in records]
    # The first request computes everything; each later one only its last 100 tokens.
    assert ttft[("shared", True)][0] == pytest.approx(ttft[("shared", False)][0])
    hit, miss = ttft[("shared", True)][1:], ttft[("shared", False)][1:]
    assert all(a < b / 5 for a, b in zip(hit, miss, strict=True)), (hit, miss)
    assert ttft[("unshared", True)] == pytest.approx(ttft[("unshared", False)])  # nothing to share


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_speculating_worker_gives_several_tokens_a_step_and_the_router_sees_its_speed_up(
    method: str,
) -> None:
    """Proposals of 4 all kept (acceptance 1): each 10 ms step gives a sequence 5 tokens, plus with a
    draft model 4 draft steps of 0.5 x 10 ms first. Every request still gets exactly its tokens."""
    step, out = 0.01, 21
    spec = core_spec(COLOCATED, worker_id="c", num_blocks=4096, speculative=method, speculative_k=4,
                     speculative_below=4)  # fmt: skip
    fast = SimWorker(spec, constant(step), 1e9, acceptance=1.0, draft_ratio=0.5)
    plain = SimWorker(spec, constant(step), 1e9)  # no acceptance: no speculation
    arrivals = [i * 2.0 for i in range(5)]  # one at a time
    sped = simulate(SimConfig((fast,), routing=LOOSE), workload(arrivals, 64, out))
    base = simulate(SimConfig((plain,), routing=LOOSE), workload(arrivals, 64, out))
    assert [r.output_tokens for r in sped] == [r.output_tokens for r in base] == [out] * 5
    per_step = step + (4 * 0.5 * step if method == "draft" else 0.0)  # a check step and its drafting
    for r in sped:
        assert r.e2e_ms - r.ttft_ms == pytest.approx(4 * per_step * 1e3)  # 20 tokens in 4 steps
    for r in base:
        assert r.e2e_ms - r.ttft_ms == pytest.approx(20 * step * 1e3)
    # what the worker measured and reported: 5 tokens in per_step where a plain step gives one in step
    sim = Simulation(SimConfig((fast,), routing=LOOSE), workload(arrivals, 64, out))
    sim.run()
    [info] = sim.registry.workers.values()
    assert info.reg.speculate_below == 4 and info.load.speculation == pytest.approx(5 * step / per_step)


def test_a_worker_whose_proposals_are_seldom_kept_gets_one_token_a_step_mostly() -> None:
    spec = core_spec(COLOCATED, worker_id="c", num_blocks=4096, speculative="ngram", speculative_k=4,
                     speculative_below=4)  # fmt: skip
    worker = SimWorker(spec, constant(0.01), 1e9, acceptance=0.2)
    records = simulate(SimConfig((worker,), routing=LOOSE), workload([0.0, 5.0], 64, 200))
    assert [r.output_tokens for r in records] == [200, 200]
    for r in records:  # a step keeps 1.25 tokens on average: 0.2 + 0.2^2 + ... beside its own
        assert 0.7 * 200 < len(r.chunk_ms) < 0.9 * 200


def test_embedding_inputs_are_batched_by_the_routers_batcher() -> None:
    """Embedding inputs beside generations: the router's own batcher groups them while the worker is
    busy (an input that finds it idle leaves alone), every input gets its vector at a step's end, the
    generations are served as before and every block is back."""
    step = 0.05
    worker = sim_worker("c", COLOCATED, constant(step), max_batch_tokens=2048)
    reqs = [Request(i, i * 0.004, 32, 1, embed=i % 4 != 0) for i in range(200)]
    sim = Simulation(SimConfig((worker,), routing=LOOSE), Workload("mixed", tuple(reqs)))
    records = sim.run()
    assert [r.status for r in records] == [OK] * 200
    for r, req in zip(records, reqs, strict=True):
        assert r.ttft_ms == r.e2e_ms if req.embed else r.output_tokens == 1
        assert (r.output_tokens == 0) == req.embed
    sizes = [len(b.items) for b in sim.batches]
    assert sum(sizes) == 150 and max(sizes) > 1 and sizes[0] == 1  # the first found the worker idle
    assert {b.trigger for b in sim.batches} <= {"idle", "deadline", "full"}
    assert all(free == total for free, total in sim.free_blocks().values())
