"""``pdfabric bench goodput``: find the highest request rate at which the target fraction of requests
meets both SLOs (DistServe's goodput), by replaying the same workload at several rates.

Each trial replays the scaled workload squeezed or stretched to one mean rate; its files go to
``--out/trials/rate-R/``. The search is a sweep over ``--rates`` (refined by bisection between the
last passing and first failing rate while ``--max-trials`` allows) or, without ``--rates``, a
bisection that starts from ``--rate-lo`` / ``--rate-hi``. A trial that meets the SLO without loading
the server (its requests stopped arriving long before the server was done with them) is replayed
with the workload repeated, up to ``--max-growth`` copies, until it misses the SLO or loads the
server; a search in which no rate missed the SLO reports no goodput, only the rate it is at least.
Top-level outputs: ``report.json``, ``summary.md``, ``attainment_vs_rate.png`` and TTFT / ITL CDFs
of every trial.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdfabric.bench.goodput import SearchConfig
from pdfabric.bench.options import add_client_arguments, add_slo_arguments, add_workload_arguments

if TYPE_CHECKING:
    import asyncio

    from pdfabric.bench.client import ClientConfig
    from pdfabric.bench.goodput import GoodputResult
    from pdfabric.bench.metrics import SLO
    from pdfabric.bench.prompts import PromptConfig
    from pdfabric.bench.records import RequestRecord
    from pdfabric.bench.workload import Workload


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("rate search")
    g.add_argument("--rates", help="rates to sweep, req/s (then bisected between pass and fail)")
    g.add_argument("--rate-lo", type=float, help="bisection start, req/s (default: the workload's rate)")
    g.add_argument("--rate-hi", type=float, help="bisection start, req/s (default: twice --rate-lo)")
    g.add_argument("--max-trials", type=int, default=8, help="most replays in the search (default 8)")
    g.add_argument("--rel-tol", type=float, default=0.05,
                   help="stop bisecting when hi/lo - 1 is below this (default 0.05)")
    add_growth_argument(g)


def add_growth_argument(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--max-growth", type=int, default=SearchConfig.max_growth, metavar="K",
                   help="a trial that meets the SLO without loading the deployment is replayed with the "
                        f"workload repeated, up to K copies (default {SearchConfig.max_growth}; 1: never)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_client_arguments(parser)
    add_slo_arguments(parser)
    add_search_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the report files")
    parser.add_argument("--label", help="name shown in the summary and plots (default: the model)")


class _Interrupted(Exception):
    pass


@dataclass
class SearchRun:
    """A finished (or interrupted) goodput search: the result and every trial's report and records."""

    result: GoodputResult
    trials: dict[float, tuple[dict[str, Any], list[RequestRecord]]] = field(default_factory=dict)
    stopped: str | None = None
    warnings: list[str] = field(default_factory=list)


def search_config(args: argparse.Namespace) -> tuple[list[float] | None, SearchConfig]:
    """The sweep rates (if any) and the search settings from the flags; raises ``ValueError``."""
    rates = None
    if args.rates:
        try:
            rates = sorted({float(x) for x in args.rates.split(",") if x.strip()})
        except ValueError:
            raise ValueError(f"--rates must be comma-separated numbers, got {args.rates!r}") from None
        if not rates or rates[0] <= 0:
            raise ValueError("--rates must hold rates > 0")
    return rates, SearchConfig(args.target, args.rel_tol, args.max_trials, args.max_growth)


async def search(
    base: Workload,
    client: ClientConfig,
    prompts: PromptConfig,
    slo: SLO,
    rates: list[float] | None,
    lo_hi: tuple[float, float],
    cfg: SearchConfig,
    out: Path,
    stop: asyncio.Event,
    progress: bool,
    label: str | None = None,
) -> SearchRun:
    """Run the search, writing each trial into ``out/trials/rate-R``; ``label`` names it on stderr."""
    from pdfabric.bench.client import replay
    from pdfabric.bench.goodput import GoodputResult, Trial, find_goodput, grown, settle
    from pdfabric.bench.options import client_meta
    from pdfabric.bench.progress import Progress
    from pdfabric.bench.prompts import PromptBuilder
    from pdfabric.bench.report import build_report, write_run

    builder = PromptBuilder(prompts)
    label = label or client.model
    run = SearchRun(result=GoodputResult(target=cfg.target))

    async def measure(rate: float, copies: int) -> Trial:
        if stop.is_set():
            raise _Interrupted
        w = base.repeated(copies).with_rate(rate)
        bar = Progress(len(w), f"{label} @ {rate:g} req/s", enabled=progress)
        res = await replay(w, client, builder, stop, bar)
        if res.stopped == "interrupted":
            raise _Interrupted
        meta = {"command": "goodput trial", "target": client_meta(client), "workload": w.describe(),
                "prompts": prompts.describe()}
        report = build_report(res.records, slo, target=cfg.target, not_sent=res.not_sent, meta=meta,
                              stopped=res.stopped, warnings=res.warnings)
        write_run(out / "trials" / f"rate-{rate:g}", res.records, report, slo, f"{rate:g} req/s",
                  with_plots=False)
        run.trials[rate] = (report, res.records)
        run.warnings += [f"at {rate:g} req/s: {w}" for w in report["warnings"]]
        trial = Trial.of(res.records, slo)
        loaded = "" if trial.loaded else " (did not load the server)"
        print(f"{label} @ {rate:g} req/s, {len(w)} requests: attainment {trial.attainment:.1%}{loaded}",
              file=sys.stderr)  # fmt: skip
        return trial

    async def recorded(rate: float) -> Trial:
        trial = await grow(rate)
        run.result.record(rate, trial)
        return trial

    grow = grown(measure, cfg)
    try:
        await find_goodput(recorded, rates, lo_hi, cfg)
    except _Interrupted:
        run.stopped = "interrupted"
    settle(run.result)
    return run


def search_report(run: SearchRun, slo: SLO, meta: dict[str, Any]) -> dict[str, Any]:
    """The top-level ``report.json`` of a goodput search."""
    trials = []
    for rate in sorted(run.trials):
        rep = run.trials[rate][0]
        trials.append({"rate": rate, "dir": f"trials/rate-{rate:g}", "attainment": rep["attainment"],
                       "requests": rep["requests"], "ttft_ms": rep["ttft_ms"], "itl_ms": rep["itl_ms"],
                       "throughput": rep["throughput"]})
    g = run.result.goodput
    at = run.trials[g][0] if g is not None else None
    keys = ("requests", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "attainment", "throughput")
    return {
        **meta,
        "slo": slo.to_json(),
        "goodput": run.result.to_json(),
        "goodput_rps": g,
        "at_goodput": {k: at[k] for k in keys} if at else None,
        "trials": trials,
        "stopped": run.stopped,
        "partial": run.stopped is not None,
        "warnings": run.warnings,
    }


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench import plots
    from pdfabric.bench.options import (
        client_from_args,
        client_meta,
        fail,
        prompt_config,
        run_with_sigint,
        slo_from_args,
        workload_from_args,
    )
    from pdfabric.bench.records import OK
    from pdfabric.bench.report import write_json

    try:
        base = workload_from_args(args)
        slo = slo_from_args(args)
        client = client_from_args(args, args.url)
        prompts = prompt_config(args)
        rates, cfg = search_config(args)
        lo_hi = default_bracket(base, args)
    except ValueError as exc:
        return fail(str(exc))
    out = Path(args.out)
    label = args.label or client.model
    sr = run_with_sigint(lambda stop: search(base, client, prompts, slo, rates, lo_hi, cfg, out, stop,
                                             not args.no_progress, label))
    meta = {"command": "goodput", "label": label, "target": client_meta(client), "workload": base.describe(),
            "prompts": prompts.describe()}
    report = search_report(sr, slo, meta)
    write_json(out / "report.json", report)
    (out / "summary.md").write_text(summary_md(report, label))
    plots.attainment_curves({label: sr.result.trials}, out / "attainment_vs_rate.png", cfg.target,
                            "request rate (req/s)", "SLO attainment vs rate", {label: sr.result.goodput})
    by_rate = {f"{r:g} req/s": [x for x in recs if x.status == OK]
               for r, (_, recs) in sorted(sr.trials.items())}
    plots.cdf({k: [x.ttft_ms for x in v if x.ttft_ms is not None] for k, v in by_rate.items()},
              out / "ttft_cdf.png", "TTFT by rate", "time to first token (ms)", slo.ttft_ms)
    plots.cdf({k: [g for x in v for g in x.itl_ms] for k, v in by_rate.items()},
              out / "itl_cdf.png", "inter-token latency by rate", "inter-token gap (ms)", slo.itl_ms)
    g = report["goodput"]
    interpolated = f" (interpolated {g['goodput_interpolated_rps']})" if g["goodput_rps"] is not None else ""
    print(f"goodput: {sr.result.describe()}{interpolated}, report: {out}")
    for w in report["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    return 130 if sr.stopped == "interrupted" else 0


def default_bracket(base: Workload, args: argparse.Namespace) -> tuple[float, float]:
    rate = base.mean_rate()
    if not 0 < rate < float("inf"):
        raise ValueError("the rate search needs a workload with at least two distinct arrival times")
    lo = args.rate_lo if args.rate_lo is not None else rate
    hi = args.rate_hi if args.rate_hi is not None else 2 * lo
    if not 0 < lo < hi:
        raise ValueError(f"need 0 < --rate-lo < --rate-hi, got {lo} and {hi}")
    return lo, hi


def rps(x: float | None) -> str:
    return "none" if x is None else f"{x:g} req/s"


def summary_md(report: dict[str, Any], label: str) -> str:
    g = report["goodput"]
    slo = report["slo"]
    lines = [
        f"# goodput: {label}",
        "",
        f"- SLO: TTFT <= {slo['ttft_ms']:g} ms and ITL ({slo['itl_stat']}) <= {slo['itl_ms']:g} ms; "
        f"target {g['target']:.0%} of requests",
        f"- goodput: **{rps(g['goodput_rps'])}** "
        f"(highest passing rate measured; interpolated {g['goodput_interpolated_rps']}; "
        f"first failing rate {g['first_failing_rps']})"
        if g.get("bounded", True) else
        f"- goodput: **not bounded**: no rate tried missed the target (it is at least "
        f"{rps(g.get('lower_bound_rps'))}); replay more requests or allow more growth (--max-growth)",
        "",
        "| rate (req/s) | attainment | ok / sent | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for t in report["trials"]:
        att = "-" if t["attainment"] is None else f"{t['attainment']:.1%}"
        ttft, itl = t["ttft_ms"], t["itl_ms"]
        lines.append(f"| {t['rate']:g} | {att} | {t['requests']['ok']} / {t['requests']['total']} | "
                     f"{ttft['p50']} / {ttft['p99']} | {itl['p50']} / {itl['p99']} |")
    if report.get("stopped"):
        lines += ["", f"**Partial search**: stopped early ({report['stopped']})."]
    if report.get("warnings"):
        lines += ["", "## warnings", *[f"- {w}" for w in report["warnings"]]]
    return "\n".join(lines) + "\n"
