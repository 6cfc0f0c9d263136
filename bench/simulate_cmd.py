"""``pdfabric bench simulate``: replay a workload through a simulated deployment, from measured profiles.

No server runs. ``pdfabric.bench.simulator`` plays the workers of a serve config (``--config``) with the
step times of measured profiles (``--profile``, written by ``pdfabric profile``) behind the router's
own routing and admission code. The workload, scaling and SLO flags are those of ``bench replay``;
``--rate R`` also rescales a trace to a mean rate of R req/s (after scaling), as ``bench goodput``
does for each of its trials.

- ``--mode replay`` (the default) writes what ``bench replay`` writes: ``report.json``,
  ``requests.jsonl``, ``summary.md`` and plots;
- ``--mode goodput`` searches the goodput as ``bench goodput`` does (``--rates`` sweep then bisection,
  or a bisection from ``--rate-lo`` / ``--rate-hi``) and writes what it writes, each trial in
  ``trials/rate-R/``.

Every report says it is simulated: ``"simulated": true``, the simulated deployment under ``simulator``
and a note at the top of ``summary.md``. Exit status 0, or 2 for bad input.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdfabric.bench.goodput_cmd import add_search_arguments
from pdfabric.bench.options import add_slo_arguments, add_workload_arguments

if TYPE_CHECKING:
    from pdfabric.bench.goodput import SearchConfig
    from pdfabric.bench.metrics import SLO
    from pdfabric.bench.sim_spec import SimWorker
    from pdfabric.bench.simulator import SimConfig
    from pdfabric.bench.workload import Workload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        "No server runs: the workers of --config are simulated with the step times of the --profile files "
        "behind the router's own routing and admission code. --rate also applies to a trace: after "
        "scaling, its arrivals are squeezed or stretched to that mean rate. --mode goodput searches the "
        "rate as bench goodput does. Reports are marked as simulated. See docs/bench.md."
    )
    add_workload_arguments(parser)
    rate = next(a for a in parser._actions if a.dest == "rate")  # argparse has no public way to reword
    rate.help = "mean arrival rate, req/s: synthetic arrivals are drawn at it; a trace is rescaled to it"
    add_slo_arguments(parser)
    g = parser.add_argument_group("simulated deployment")
    g.add_argument(
        "--config", required=True, metavar="FILE", help="serve config (TOML) whose workers to simulate"
    )
    g.add_argument(
        "--profile",
        required=True,
        action="append",
        metavar="FILE",
        help="measured profile JSON (pdfabric profile); repeat it for role-tagged profiles",
    )
    g.add_argument(
        "--transport",
        help="KV transport whose measured rate to use (default: shm, "
        "what the workers use, when measured; else the fastest measured)",
    )
    g.add_argument(
        "--routing-policy",
        choices=("budget", "round_robin", "least_loaded"),
        help="the router's routing policy (default: the config's [routing] policy), as serve's flag",
    )
    g.add_argument(
        "--speculative-acceptance",
        type=float,
        default=0.0,
        metavar="P",
        help="workers whose config turns speculation on keep each proposed token with probability P "
        "until one is not (the acceptance rate a worker's metrics report); 0 (default): they run "
        "without speculation",
    )
    g.add_argument(
        "--draft-step-ratio",
        type=float,
        default=0.45,
        metavar="R",
        help="with speculative = draft: one draft step's time over a plain decode step's of the same "
        "batch (default 0.45: SmolLM2 drafting for itself in int4, bfloat16 served, on 2 cores)",
    )
    g.add_argument(
        "--embed-share",
        type=float,
        default=0.0,
        metavar="F",
        help="make this share of the requests (0 to 1, chosen by --seed) embedding inputs: the router's "
        "batcher groups them under the config's [embeddings] and workers compute them beside the "
        "generations; their latency is reported as TTFT (default 0)",
    )
    g.add_argument(
        "--overhead-ms",
        type=float,
        default=0.0,
        help="added to every time the client sees: router, HTTP and network (default 0)",
    )
    parser.add_argument(
        "--mode",
        choices=("replay", "goodput", "validate"),
        default="replay",
        help="one simulated replay (default), a goodput search, or validate: simulate every trial rate "
        "of a measured goodput run (--measured) and compare",
    )
    parser.add_argument(
        "--measured",
        metavar="DIR",
        help="validate: a bench goodput output directory (or one deployment's directory of bench "
        "compare --mode goodput) measured with the same workload flags",
    )
    add_search_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the report files")
    parser.add_argument(
        "--label", help="name shown in the summary and plots (default: the config file's name)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench.goodput_cmd import default_bracket, search_config
    from pdfabric.bench.options import fail, slo_from_args
    from pdfabric.bench.sim_deploy import default_transport, sim_config
    from pdfabric.config import load_serve_config
    from pdfabric.profile_file import ProfileFile

    try:
        workload = workload_at_rate(args)
        slo = slo_from_args(args)
        serve = load_serve_config(args.config, {"routing_policy": args.routing_policy})
        profiles = [ProfileFile.load(p) for p in args.profile]
        transport = args.transport or default_transport(profiles)
        config = sim_config(serve, profiles, transport, args.speculative_acceptance, args.draft_step_ratio)
        config = replace(config, overhead_ms=args.overhead_ms)
        search = search_config(args) if args.mode == "goodput" else None
        lo_hi = default_bracket(workload, args) if search is not None and not search[0] else (0.0, 0.0)
    except (OSError, ValueError) as exc:
        return fail(str(exc))
    label = args.label or Path(args.config).stem
    meta = {
        "command": "simulate",
        "simulated": True,
        "target": {
            "url": "simulated",
            "endpoint": "-",
            "model": serve.model_name,
            "config": args.config,
            "profiles": list(args.profile),
            "transport": transport,
        },
        "simulator": describe(config),
        "workload": workload.describe(),
    }
    out = Path(args.out)
    if args.mode == "validate":
        from pdfabric.bench.sim_validate import validate

        return validate(config, workload, slo, args, meta, out, label)
    if search is None:
        return _replay(config, workload, slo, args, meta, out, label)
    return _goodput(config, workload, slo, search, lo_hi, meta, out, label, not args.no_progress)


def workload_at_rate(args: argparse.Namespace) -> Workload:
    """The scaled workload; a trace with ``--rate`` is then squeezed or stretched to that mean rate."""
    from pdfabric.bench.options import workload_from_args

    workload = workload_from_args(args)
    if args.trace != "synthetic" and args.rate is not None:
        workload = workload.with_rate(args.rate)
    return workload.with_embeddings(getattr(args, "embed_share", 0.0), args.seed)


def describe(config: SimConfig) -> dict[str, Any]:
    """The simulated deployment, for the report."""

    def speculation(w: SimWorker) -> dict[str, float] | None:
        return {"acceptance": w.acceptance, "draft_ratio": w.draft_ratio} if w.speculates else None

    return {
        "workers": [
            {
                **asdict(w.core),
                "profile": asdict(w.profile),
                "kv_bytes_per_s": w.kv_bytes_per_s,
                "speculation": speculation(w),
            }
            for w in config.workers
        ],
        "routing_policy": getattr(config.routing, "policy", "budget"),
        "routing_ttft_ms": config.routing.ttft_ms,
        "routing_itl_ms": config.routing.itl_ms,
        "predictor": asdict(config.predictor),
        "overhead_ms": config.overhead_ms,
    }


def _replay(
    config: SimConfig,
    workload: Workload,
    slo: SLO,
    args: argparse.Namespace,
    meta: dict[str, Any],
    out: Path,
    label: str,
) -> int:
    from pdfabric.bench.replay_cmd import print_brief
    from pdfabric.bench.report import build_report, write_run
    from pdfabric.bench.simulator import simulate

    start = time.perf_counter()
    records = simulate(config, workload, _progress(len(workload), "simulate", not args.no_progress))
    meta = {**meta, "wall_s": round(time.perf_counter() - start, 3)}
    report = build_report(records, slo, target=args.target, not_sent=0, meta=meta)
    write_run(out, records, report, slo, label)
    _mark(out / "summary.md", meta)
    print_brief(report, out)
    return 0


def _goodput(
    config: SimConfig,
    workload: Workload,
    slo: SLO,
    search: tuple[list[float] | None, SearchConfig],
    lo_hi: tuple[float, float],
    meta: dict[str, Any],
    out: Path,
    label: str,
    progress: bool,
) -> int:
    import asyncio

    from pdfabric.bench import plots
    from pdfabric.bench.goodput import Trial, find_goodput, grown
    from pdfabric.bench.goodput_cmd import SearchRun, search_report, summary_md
    from pdfabric.bench.records import OK
    from pdfabric.bench.report import build_report, write_json, write_run
    from pdfabric.bench.simulator import simulate

    rates, cfg = search
    trials: dict[float, tuple[dict[str, Any], list[Any]]] = {}

    async def measure(rate: float, copies: int) -> Trial:
        w = workload.repeated(copies).with_rate(rate)
        start = time.perf_counter()
        records = simulate(config, w, _progress(len(w), f"{label} @ {rate:g} req/s", progress))
        trial_meta = {
            **meta,
            "command": "simulate goodput trial",
            "workload": w.describe(),
            "wall_s": round(time.perf_counter() - start, 3),
        }
        report = build_report(records, slo, target=cfg.target, not_sent=0, meta=trial_meta)
        trial_dir = out / "trials" / f"rate-{rate:g}"
        write_run(trial_dir, records, report, slo, f"{rate:g} req/s", with_plots=False)
        _mark(trial_dir / "summary.md", meta)
        trials[rate] = (report, records)
        trial = Trial.of(records, slo)
        loaded = "" if trial.loaded else " (did not load the deployment)"
        print(f"{label} @ {rate:g} req/s, {len(w)} requests: attainment {trial.attainment:.1%}{loaded}",
              file=sys.stderr)  # fmt: skip
        return trial

    result = asyncio.run(find_goodput(grown(measure, cfg), rates, lo_hi, cfg))
    report = search_report(
        SearchRun(result=result, trials=trials), slo, {**meta, "command": "simulate goodput"}
    )
    write_json(out / "report.json", report)
    (out / "summary.md").write_text(summary_md(report, label))
    _mark(out / "summary.md", meta)
    plots.attainment_curves(
        {label: result.trials},
        out / "attainment_vs_rate.png",
        cfg.target,
        "request rate (req/s)",
        "SLO attainment vs rate (simulated)",
        {label: result.goodput},
    )
    by_rate = {f"{r:g} req/s": [x for x in recs if x.status == OK] for r, (_, recs) in sorted(trials.items())}
    plots.cdf(
        {k: [x.ttft_ms for x in v if x.ttft_ms is not None] for k, v in by_rate.items()},
        out / "ttft_cdf.png",
        "TTFT by rate (simulated)",
        "time to first token (ms)",
        slo.ttft_ms,
    )
    plots.cdf(
        {k: [g for x in v for g in x.itl_ms] for k, v in by_rate.items()},
        out / "itl_cdf.png",
        "inter-token latency by rate (simulated)",
        "inter-token gap (ms)",
        slo.itl_ms,
    )
    g = report["goodput"]
    interpolated = f" (interpolated {g['goodput_interpolated_rps']})" if g["goodput_rps"] is not None else ""
    print(f"simulated goodput: {result.describe()}{interpolated}, report: {out}")
    return 0


def _progress(total: int, label: str, enabled: bool) -> Callable[[int, int], None] | None:
    if not enabled:
        return None
    from pdfabric.bench.progress import Progress

    bar, start = Progress(total, label), time.perf_counter()

    def update(done: int, total: int) -> None:
        bar.update(done, done, {}, time.perf_counter() - start)
        if done == total:
            bar.close()

    return update


def _mark(summary: Path, meta: dict[str, Any]) -> None:
    """Says at the top of a summary that its numbers are simulated, and from what."""
    title, _, rest = summary.read_text().partition("\n")
    target = meta["target"]
    note = (
        f"> **Simulated** by `pdfabric bench simulate`: no server ran. Deployment `{target['config']}`, "
        f"profiles {', '.join(f'`{p}`' for p in target['profiles'])}, KV transport "
        f"{target['transport'] or 'fastest measured'}."
    )
    summary.write_text(title.replace("# ", "# simulated ", 1) + "\n\n" + note + "\n" + rest)
