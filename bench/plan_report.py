"""What ``pdfabric plan`` prints and writes: the candidates' table and headline, the chosen
deployment as JSON (``plan_summary``) and as a deployment config (``deployment_toml``), and the
``--out`` folder (``plan.json``, ``plan.toml``, ``attainment_vs_rate.png``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdfabric.bench.planner import Plan, PlanSettings
from pdfabric.config import ServeConfig
from pdfabric.profile_file import ProfileFile

PLOTTED = 4  # candidates drawn in attainment_vs_rate.png


def plan_summary(plan: Plan, settings: PlanSettings, profiles: list[ProfileFile]) -> dict[str, Any]:
    """The chosen deployment as ``--json`` prints it (counts, caps, goodput, attainment, latencies),
    and the candidates whose goodput could not be bounded, each with its lower bound."""
    unbounded = [{"name": ev.candidate.name, "lower_bound_rps": ev.result.lower_bound}
                 for ev in plan.evaluations if not ev.result.bounded and ev.result.trials]  # fmt: skip
    common = {"rate_rps": plan.rate, "headline": headline(plan, settings), "unbounded": unbounded,
              "notes": plan.notes}  # fmt: skip
    if plan.best is None:
        return {"prefill": None, "decode": None, "colocated": None, "goodput_rps": None, "attainment": None,
                "max_running": None, "chunk_tokens": None, "workers": None, **common}  # fmt: skip
    return {**plan.best.to_json(settings.slo), **common}


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(plan: Plan, settings: PlanSettings) -> str:
    """Every candidate, one line each; the chosen one marked ``*``."""
    where = "at the rate asked" if plan.rate is not None else "at its goodput"
    lines = [f"SLO: TTFT <= {settings.slo.ttft_ms:g} ms, ITL ({settings.slo.itl_stat}) <= "
             f"{settings.slo.itl_ms:g} ms for {settings.search.target:.0%} of requests; attainment and p90s "
             f"{where}",
             f"  {'candidate':<20} {'workers':>7} {'goodput':>9} {'per worker':>10} {'attain':>7} "
             f"{'TTFT p90':>9} {'ITL p90':>8}"]  # fmt: skip
    for ev in plan.evaluations:
        st = ev.stats(settings.slo)
        mark = "*" if ev is plan.best else " "
        lines.append(
            f"{mark} {ev.candidate.name:<20} {ev.candidate.workers:>7} {ev.bounded_or_lower:>9} "
            f"{_num(ev.goodput_per_worker, '10.3g')} {_num(st['attainment'], '7.1%')} "
            f"{_num(st['ttft_p90_ms'], '9.1f')} {_num(st['itl_p90_ms'], '8.2f')}"
        )
    return "\n".join(lines)


def headline(plan: Plan, settings: PlanSettings) -> str:
    if plan.best is None:
        if any(not ev.result.bounded and ev.result.trials for ev in plan.evaluations):
            return ("no goodput: the rate could not be bounded: no candidate missed the target at any rate "
                    "tried, even with the workload grown (see the notes)")  # fmt: skip
        return "no candidate met the attainment target at any rate tried (loosen the SLO or add workers)"
    b, c = plan.best, plan.best.candidate
    shape = f"{c.colocated} colocated" if c.colocated else f"{c.prefill} prefill + {c.decode} decode"
    shape += " worker" if c.workers == 1 else " workers"
    rate = f" at {plan.rate:g} req/s" if plan.rate is not None else ""
    return (
        f"best{rate}: {shape}, max_running {c.max_running}, max_batch_tokens {c.chunk_tokens}: "
        f"goodput {_num(b.goodput, '.3g')} req/s ({_num(b.goodput_per_worker, '.3g')} per worker)"
    )


def deployment_toml(serve: ServeConfig, header: str = "") -> str:
    """``serve`` as a deployment config ``load_serve_config`` reads back: ``[serve]`` (model, dtype,
    counts), ``[worker]``, one ``[[workers]]`` per group and the ``[routing]`` budgets."""
    from dataclasses import fields

    from pdfabric.worker_config import WorkerConfig

    def value(v: Any) -> str:
        return json.dumps(v) if isinstance(v, str) else repr(v)

    w = serve.worker
    keys = ("block_size", "num_blocks", "kv_memory_mb", "max_batch_tokens", "max_running", "threads",
            "device", "profile_seconds", "quantization", "kv_cache_dtype")  # fmt: skip
    defaults = {f.name: f.default for f in fields(WorkerConfig)}
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    lines += ["[serve]", f"model = {value(serve.model)}"]
    if serve.dtype:
        lines.append(f"dtype = {value(serve.dtype)}")
    lines += [f"{k} = {getattr(serve, k)}" for k in ("prefill", "decode", "colocated")]
    lines += ["", "[worker]"]
    lines += [f"{k} = {value(getattr(w, k))}" for k in keys if k in ("max_batch_tokens", "max_running",
              "kv_memory_mb", "block_size") or getattr(w, k) != defaults[k]]  # fmt: skip
    for g in serve.groups:
        lines += ["", "[[workers]]", f"kind = {value(g.kind)}", f"count = {g.count}"]
        own = [k for k in keys if getattr(g.worker, k) != getattr(w, k)]
        lines += [f"{k} = {value(getattr(g.worker, k))}" for k in own]
    r = serve.routing
    lines += ["", "[routing]", f"ttft_ms = {r.ttft_ms!r}", f"itl_ms = {r.itl_ms!r}"]
    return "\n".join(lines) + "\n"


def write_outputs(
    out: Path,
    plan: Plan,
    settings: PlanSettings,
    profiles: list[ProfileFile],
    args: argparse.Namespace,
    workload: dict[str, Any],
    chosen: dict[str, Any],
) -> None:
    """``plan.json``, ``plan.toml`` (when a candidate was chosen) and ``attainment_vs_rate.png``."""
    from pdfabric.bench import plots
    from pdfabric.bench.planner import deployment

    out.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "plan",
        "mode": "workers" if plan.rate is None else "rate",
        "workers": args.workers,
        "rate_rps": plan.rate,
        "slo": settings.slo.to_json(),
        "target": settings.search.target,
        "workload": workload,
        "profiles": [
            {
                "path": str(path),
                "role": p.role,
                "model": p.model,
                "device": p.device,
                "device_name": p.device_name,
                "threads": p.threads,
                "weights": p.weights,
                "kv_cache_dtype": p.kv_cache_dtype,
            }
            for path, p in zip(args.profile, profiles, strict=True)
        ],  # fmt: skip
        "chosen": chosen,
        "candidates": [ev.to_json(settings.slo) for ev in plan.evaluations],
        "notes": plan.notes,
    }
    (out / "plan.json").write_text(json.dumps(report, indent=2) + "\n")
    if plan.best is not None:
        serve = deployment(plan.best.candidate, profiles, settings)
        header = f"Chosen by `pdfabric plan` (every candidate: plan.json).\n{headline(plan, settings)}"
        (out / "plan.toml").write_text(deployment_toml(serve, header))
    searched = [ev for ev in plan.evaluations if len(ev.result.trials) > 1 or plan.rate is None]
    top = sorted(searched, key=lambda e: -(e.goodput or 0.0))[:PLOTTED]
    curves = {ev.candidate.name: ev.result.trials for ev in top}
    marks = {ev.candidate.name: ev.goodput for ev in top}
    title = "simulated SLO attainment vs rate"
    plots.attainment_curves(curves, out / "attainment_vs_rate.png", settings.search.target,
                            "request rate (req/s)", title, marks)  # fmt: skip
