"""``pdfabric plan``: the prefill:decode split and batch caps that serve a workload best, by simulation.

Reads profile files (``pdfabric profile``), one per worker kind or one for all, and a workload (the
``bench replay`` workload and scaling flags). With ``--workers W`` it reports the candidate of W
workers with the highest simulated goodput; with ``--rate R`` the fewest workers whose best
candidate meets the attainment target at R req/s. A trial that meets the target without loading a
candidate is simulated again with the workload repeated (up to ``--max-growth`` copies); a candidate
that never misses the target has no goodput, only a lower bound, and is not chosen. Writes, with
``--out DIR``: ``plan.json`` (every candidate), ``plan.toml`` (the chosen deployment, for ``pdfabric
serve --config``) and ``attainment_vs_rate.png`` (the best few candidates). With ``--json`` the one
JSON document on standard output is the chosen deployment; progress and notes go to standard error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pdfabric.bench.goodput_cmd import add_growth_argument
from pdfabric.bench.metrics import ITL_STATS
from pdfabric.bench.options import add_workload_arguments
from pdfabric.worker_config import worker_default

if TYPE_CHECKING:
    from pdfabric.bench.planner import Evaluation, PlanSettings
    from pdfabric.profile_file import ProfileFile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--profile",
        action="append",
        required=True,
        metavar="FILE",
        help="a profile file from `pdfabric profile` (repeat: one per role, e.g. a prefill "
        "profile from one machine and a decode profile from another)",
    )
    add_workload_arguments(parser)
    for action in parser._actions:  # the workload's --rate is also what --rate mode plans for
        if action.dest == "rate":
            action.help = (
                "plan for this rate, req/s: the fewest workers that serve it (instead of "
                "--workers); with --trace synthetic also the generator's mean rate"
            )
            action.metavar = "R"
    g = parser.add_argument_group("SLO")
    g.add_argument(
        "--slo-ttft-ms", "--ttft-slo-ms", dest="ttft_slo_ms", type=float, required=True, help="TTFT SLO in ms"
    )
    g.add_argument(
        "--slo-itl-ms", "--itl-slo-ms", dest="itl_slo_ms", type=float, required=True, help="ITL SLO in ms"
    )
    g.add_argument(
        "--itl-stat",
        choices=ITL_STATS,
        default="mean",
        help="per-request ITL statistic judged against the ITL SLO (default mean = TPOT)",
    )
    g.add_argument(
        "--attainment",
        "--target",
        dest="target",
        type=float,
        default=0.9,
        help="fraction of requests that must meet both SLOs (default 0.9)",
    )
    m = parser.add_argument_group("what to plan (one of)")
    m.add_argument(
        "--workers",
        type=int,
        metavar="W",
        help="the best deployment of W workers; or give --rate R (a workload flag above) for the "
        "fewest workers that serve R req/s",
    )
    m.add_argument(
        "--max-workers", type=int, default=16, help="with --rate: the largest worker count tried (default 16)"
    )
    c = parser.add_argument_group("candidates")
    c.add_argument(
        "--max-running",
        metavar="LIST",
        help="decode batch caps to try, e.g. 8,16,32,64 (default: 8, 16, ... up to the profile's)",
    )
    c.add_argument(
        "--chunk-tokens",
        metavar="LIST",
        help="prefill chunk budgets (max_batch_tokens) to try (default: the profile's)",
    )
    c.add_argument(
        "--kinds",
        choices=("all", "disaggregated", "colocated"),
        default="all",
        help="candidate shapes: prefill+decode splits, colocated, or both (default all)",
    )
    kv_mb = worker_default("kv_memory_mb")
    c.add_argument("--kv-memory-mb", type=int, default=kv_mb,
                   help=f"KV MB per worker (default {kv_mb}: sized by the model, as pdfabric serve does)")
    c.add_argument("--transport", help="KV transport whose measured rate to use (default: zmq-tcp, what "
                   "workers use, when every profile measured it, else each profile's fastest)")
    s = parser.add_argument_group("rate search (per candidate)")
    s.add_argument("--rates", help="rates to sweep, req/s (then bisected); default: bisect from an estimate")
    s.add_argument("--max-trials", type=int, default=16, help="most simulations per search (default 16)")
    s.add_argument(
        "--rel-tol",
        type=float,
        default=0.05,
        help="stop bisecting when hi/lo - 1 is below this (default 0.05)",
    )
    add_growth_argument(s)
    parser.add_argument("--out", metavar="DIR", help="write plan.json, plan.toml and attainment_vs_rate.png")
    parser.add_argument(
        "--json", action="store_true", help="print the chosen deployment as one JSON document (notes: stderr)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def _ints(text: str | None, flag: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must hold integers >= 1, got {text!r}")
    return values


def settings_from_args(args: argparse.Namespace) -> PlanSettings:
    """The planner's settings from the flags; ``ValueError`` naming the flag."""
    from pdfabric.bench.goodput import SearchConfig
    from pdfabric.bench.goodput_cmd import search_config
    from pdfabric.bench.metrics import SLO
    from pdfabric.bench.plan_space import PlanSettings

    if not 0 < args.target <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {args.target}")
    for flag, value in (("--slo-ttft-ms", args.ttft_slo_ms), ("--slo-itl-ms", args.itl_slo_ms)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0, got {value}")
    if args.kv_memory_mb < 0:
        raise ValueError(f"--kv-memory-mb must be >= 0 (0: auto), got {args.kv_memory_mb}")
    rates, search = search_config(args)
    return PlanSettings(
        slo=SLO(args.ttft_slo_ms, args.itl_slo_ms, args.itl_stat),
        search=SearchConfig(search.target, search.rel_tol, search.max_trials, search.max_growth),
        rates=tuple(rates or ()),
        max_running=_ints(args.max_running, "--max-running"),
        chunk_tokens=_ints(args.chunk_tokens, "--chunk-tokens"),
        kv_memory_mb=args.kv_memory_mb,
        transport=args.transport,
        colocated=args.kinds in ("all", "colocated"),
        disaggregated=args.kinds in ("all", "disaggregated"),
    )


def load_profiles(paths: list[str], transport: str | None) -> list[ProfileFile]:
    from pdfabric.bench.plan_space import check_profiles
    from pdfabric.profile_file import ProfileFile

    profiles = [ProfileFile.load(p) for p in paths]
    check_profiles(profiles)
    if transport is not None:
        for path, p in zip(paths, profiles, strict=True):
            if transport not in p.kv_bytes_per_s:
                measured = ", ".join(sorted(p.kv_bytes_per_s)) or "none"
                raise ValueError(f"--transport {transport}: not measured in {path} (measured: {measured})")
    return profiles


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench.options import fail, workload_from_args
    from pdfabric.bench.planner import plan_for_rate, plan_for_workers
    from pdfabric.bench.progress import Progress
    from pdfabric.bench.sim_deploy import default_transport

    if (args.workers is None) == (args.rate is None):
        both = " (not both)" if args.workers is not None else ""
        return fail(
            f"give --workers W (the best deployment of W workers) or --rate R (the fewest workers "
            f"that serve R req/s){both}"
        )
    if args.workers is not None and args.workers < 1:
        return fail(f"--workers must be >= 1, got {args.workers}")
    if args.workers is not None and args.trace == "synthetic":
        args.rate = 1.0  # the generator needs a rate; every trial rescales the workload anyway
    try:
        settings = settings_from_args(args)
        profiles = load_profiles(args.profile, args.transport)
        if settings.transport is None:
            settings = replace(settings, transport=default_transport(profiles))
        workload = workload_from_args(args)
        if not 0 < workload.mean_rate() < float("inf"):
            raise ValueError("the workload needs at least two distinct arrival times to be rescaled")
    except ValueError as exc:
        return fail(str(exc))
    bar: Progress | None = None
    started = time.monotonic()

    def on_done(ev: Evaluation, done: int, total: int) -> None:
        nonlocal bar
        if done == 1 or bar is None:
            bar = Progress(total, f"plan: {ev.candidate.workers} workers", enabled=not args.no_progress)
        bar.update(done, done, {}, time.monotonic() - started)
        if done == total:
            bar.close()

    try:
        if args.workers is not None:
            plan = plan_for_workers(args.workers, workload, profiles, settings, on_done=on_done)
        else:
            plan = plan_for_rate(args.rate, workload, profiles, settings, args.max_workers, on_done=on_done)
    except ValueError as exc:
        return fail(str(exc))
    from pdfabric.bench.plan_report import headline, plan_summary, table, write_outputs

    chosen = plan_summary(plan, settings, profiles)
    if args.json:
        print(json.dumps(chosen, indent=2))
        for note in plan.notes:
            print(f"note: {note}", file=sys.stderr)
    else:
        print(table(plan, settings))
        for note in plan.notes:
            print(f"note: {note}")
        print(headline(plan, settings))
    if args.out:
        write_outputs(Path(args.out), plan, settings, profiles, args, workload.describe(), chosen)
        if not args.json:
            print(f"plan written to {args.out}/ (plan.json, plan.toml, attainment_vs_rate.png)")
    return 0 if plan.best is not None else 1
