"""``pdfabric bench compare``: the same workload against several deployments, one after another, and
one side-by-side report.

Deployments are given as ``--deployment NAME=TARGET``, run one after another in the order given:

- ``NAME=http://HOST:PORT``: any OpenAI-compatible server that is already running (a pdfabric router,
  vLLM, ...);
- ``NAME=path/to/config.toml`` or ``NAME=serve:FLAGS``: a pdfabric deployment that compare starts
  itself (``pdfabric serve --config FILE`` or ``pdfabric serve FLAGS`` on a free loopback port), runs
  the workload against, and stops before the next one starts, so that deployments never share the
  machine (see ``bench/deploy.py``).

``--mode replay`` (default) replays the workload once per deployment; ``--mode goodput`` runs the
goodput search per deployment.

Outputs in ``--out``: one folder per deployment (the files ``bench replay`` or ``bench goodput`` would
write) and, for the comparison, ``report.json``, ``summary.md``, ``ttft_cdf.png``, ``itl_cdf.png`` and
``slo_scale.png`` (replay mode) or ``attainment_vs_rate.png`` and ``goodput.png`` (goodput mode).
A started deployment's folder also holds ``server.log``, the server's and its workers' output.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdfabric.bench.deploy import DeployError, client_for, parse_deployments
from pdfabric.bench.goodput_cmd import add_search_arguments
from pdfabric.bench.options import add_client_arguments, add_slo_arguments, add_workload_arguments

if TYPE_CHECKING:
    from pdfabric.bench.client import ClientConfig
    from pdfabric.bench.goodput import SearchConfig
    from pdfabric.bench.metrics import SLO
    from pdfabric.bench.prompts import PromptConfig
    from pdfabric.bench.records import RequestRecord
    from pdfabric.bench.workload import Workload

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--deployment", action="append", required=True, metavar="NAME=TARGET",
                        help="a deployment to compare (repeat the flag); TARGET is a running server's base "
                             "URL, a pdfabric config .toml, or serve:FLAGS (both started and stopped here)")
    parser.add_argument("--deployment-model", action="append", default=[], metavar="NAME=MODEL",
                        help="model name for one deployment, when it differs from --model (or, for a "
                             "started deployment, from the name it announces)")
    parser.add_argument("--mode", choices=("replay", "goodput"), default="replay",
                        help="replay the workload once, or search each deployment's goodput")
    parser.add_argument("--start-timeout", type=float, default=180.0, metavar="S",
                        help="seconds a started deployment may take to become ready (default 180)")
    parser.add_argument("--stop-grace", type=float, default=15.0, metavar="S",
                        help="seconds between SIGTERM and SIGKILL when stopping a started deployment "
                             "(default 15)")
    add_workload_arguments(parser)
    add_client_arguments(parser, url=False)
    add_slo_arguments(parser)
    add_search_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the report files")


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench.goodput_cmd import default_bracket, search_config
    from pdfabric.bench.options import (
        client_from_args,
        fail,
        prompt_config,
        slo_from_args,
        workload_from_args,
    )

    try:
        deployments = parse_deployments(args.deployment, args.deployment_model, args.model)
        workload = workload_from_args(args)
        slo = slo_from_args(args)
        for d in deployments:
            if d.url is not None:
                client_from_args(args, d.url, d.model)  # checks the client options before anything runs
        plan = _Plan(workload, slo, prompt_config(args), *search_config(args),
                     default_bracket(workload, args) if args.mode == "goodput" else (0.0, 0.0))
    except ValueError as exc:
        return fail(str(exc))
    out = Path(args.out)
    results: dict[str, dict[str, Any]] = {}
    ok_records: dict[str, list[RequestRecord]] = {}
    interrupted = False
    failed: dict[str, str] = {}
    for dep in deployments:
        try:
            with client_for(args, dep, out / dep.name) as (client, described):
                results[dep.name], ok_records[dep.name], interrupted = _run_one(
                    args, plan, dep.name, client, described, out / dep.name)
        except DeployError as exc:
            print(f"error: deployment {dep.name}: {exc}", file=sys.stderr)
            failed[dep.name] = str(exc).splitlines()[0]
            break
        except KeyboardInterrupt:
            interrupted = True
        if interrupted:
            print(f"interrupted during {dep.name}: the comparison is partial", file=sys.stderr)
            break
    report = comparison_report(results, args.mode, slo.to_json(), args.target, workload.describe(),
                               interrupted, failed)
    _write_comparison(out, report, results, ok_records, slo, args.target)
    print((out / "summary.md").read_text())
    return 130 if interrupted else 1 if failed else 0


@dataclass(frozen=True)
class _Plan:
    workload: Workload
    slo: SLO
    prompts: PromptConfig
    rates: list[float] | None
    search: SearchConfig
    lo_hi: tuple[float, float]


def _run_one(
    args: argparse.Namespace, plan: _Plan, name: str, client: ClientConfig, deployment: dict[str, Any],
    out: Path,
) -> tuple[dict[str, Any], list[RequestRecord], bool]:
    """Replay or search one deployment into ``out``; (its report, its ok records, interrupted?)."""
    from pdfabric.bench.client import replay
    from pdfabric.bench.goodput_cmd import search, search_report, summary_md
    from pdfabric.bench.options import client_meta, run_with_sigint
    from pdfabric.bench.progress import Progress
    from pdfabric.bench.prompts import PromptBuilder
    from pdfabric.bench.records import OK
    from pdfabric.bench.report import build_report, write_json, write_run

    meta = {"command": f"compare/{args.mode}", "label": name, "target": client_meta(client),
            "deployment": deployment, "workload": plan.workload.describe(),
            "prompts": plan.prompts.describe()}
    progress = not args.no_progress
    if args.mode == "replay":
        bar = Progress(len(plan.workload), name, enabled=progress)
        builder = PromptBuilder(plan.prompts)
        res = run_with_sigint(lambda stop: replay(plan.workload, client, builder, stop, bar))
        rep = build_report(res.records, plan.slo, target=args.target, not_sent=res.not_sent, meta=meta,
                           stopped=res.stopped, warnings=res.warnings)
        write_run(out, res.records, rep, plan.slo, name)
        return rep, [r for r in res.records if r.status == OK], res.stopped == "interrupted"
    sr = run_with_sigint(lambda stop: search(plan.workload, client, plan.prompts, plan.slo, plan.rates,
                                             plan.lo_hi, plan.search, out, stop, progress, name))
    rep = search_report(sr, plan.slo, meta)
    write_json(out / "report.json", rep)
    (out / "summary.md").write_text(summary_md(rep, name))
    g = sr.result.goodput
    ok = [r for r in sr.trials[g][1] if r.status == OK] if g is not None else []
    return rep, ok, sr.stopped == "interrupted"


def _write_comparison(
    out: Path,
    report: dict[str, Any],
    results: dict[str, dict[str, Any]],
    ok_records: dict[str, list[RequestRecord]],
    slo: SLO,
    target: float,
) -> None:
    from pdfabric.bench import plots
    from pdfabric.bench.report import write_json

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    (out / "summary.md").write_text(comparison_md(report))
    plots.cdf({n: [r.ttft_ms for r in v if r.ttft_ms is not None] for n, v in ok_records.items()},
              out / "ttft_cdf.png", "TTFT", "time to first token (ms)", slo.ttft_ms)
    plots.cdf({n: [g for r in v for g in r.itl_ms] for n, v in ok_records.items()},
              out / "itl_cdf.png", "inter-token latency", "inter-token gap (ms)", slo.itl_ms)
    if report["mode"] == "replay":
        curves = {n: [(p["scale"], p["attainment"]) for p in r["slo_scale"]["points"]]
                  for n, r in results.items()}
        plots.attainment_curves(curves, out / "slo_scale.png", target, "SLO scale (both SLOs times x)",
                                "attainment vs SLO scale")
        return
    curves = {n: [(t["rate"], t["attainment"] or 0.0) for t in r["trials"]] for n, r in results.items()}
    marks = {n: r["goodput_rps"] for n, r in results.items()}
    plots.attainment_curves(curves, out / "attainment_vs_rate.png", target, "request rate (req/s)",
                            "SLO attainment vs rate", marks)
    plots.goodput_bars(marks, out / "goodput.png", target)


def comparison_report(
    results: dict[str, dict[str, Any]],
    mode: str,
    slo: dict[str, Any],
    target: float,
    workload: dict[str, Any],
    interrupted: bool,
    failed: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The side-by-side ``report.json``: per deployment, its headline numbers and its folder."""
    keys = ("requests", "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "throughput", "attainment")
    deps: dict[str, Any] = {}
    for name, rep in results.items():
        row: dict[str, Any] = {"dir": name, "target": rep["target"], "deployment": rep.get("deployment")}
        if mode == "replay":
            row.update({k: rep[k] for k in keys})
            row["min_slo_scale"] = rep["slo_scale"]["min_scale_for_target"]
        else:
            row["goodput"] = rep["goodput"]
            row["goodput_rps"] = rep["goodput_rps"]
            row["at_goodput"] = rep["at_goodput"]
        row["warnings"] = rep["warnings"]
        deps[name] = row
    return {"command": "compare", "mode": mode, "slo": slo, "attainment_target": target,
            "workload": workload, "deployments": deps, "failed": failed or {},
            "partial": interrupted or bool(failed)}


def comparison_md(report: dict[str, Any]) -> str:
    slo = report["slo"]
    lines = [
        f"# compare ({report['mode']})",
        "",
        f"SLO: TTFT <= {slo['ttft_ms']:g} ms and ITL ({slo['itl_stat']}) <= {slo['itl_ms']:g} ms; "
        f"target {report['attainment_target']:.0%}. Workload: {report['workload']['requests']} requests, "
        f"{report['workload']['mean_rate']} req/s.",
        "",
    ]
    if report["mode"] == "replay":
        lines += ["| deployment | ok / sent | rejected | TTFT p50 / p90 / p99 | ITL p50 / p90 / p99 "
                  "| attainment | out tok/s |", "|---|---:|---:|---:|---:|---:|---:|"]
        for name, d in report["deployments"].items():
            t, i, q = d["ttft_ms"], d["itl_ms"], d["requests"]
            att = "-" if d["attainment"] is None else f"{d['attainment']:.1%}"
            lines.append(f"| {name} | {q['ok']} / {q['total']} | {q['rejected']} | {t['p50']} / {t['p90']} / "
                         f"{t['p99']} | {i['p50']} / {i['p90']} / {i['p99']} | {att} | "
                         f"{d['throughput']['output_tokens_per_s']} |")
    else:
        lines += ["| deployment | goodput (req/s) | interpolated | first failing rate | trials |",
                  "|---|---:|---:|---:|---:|"]
        for name, d in report["deployments"].items():
            g = d["goodput"]
            bounded = g.get("bounded", True)
            rate = g["goodput_rps"] if bounded else f"not bounded (>= {g.get('lower_bound_rps')})"
            lines.append(f"| {name} | {rate} | {g['goodput_interpolated_rps']} | "
                         f"{g['first_failing_rps']} | {len(g['trials'])} |")
    lines.append("")
    lines.append("Latencies in ms. Per-deployment details are in each deployment's folder.")
    lines += ["", "Deployments:", ""] + [f"- {name}: {_describe_target(d)}"
                                         for name, d in report["deployments"].items()]
    for name, why in report["failed"].items():
        lines += ["", f"**{name} failed**: {why}"]
    if report["partial"]:
        why = "a deployment failed." if report["failed"] else "interrupted."
        lines += ["", f"**Partial comparison**: {why}"]
    return "\n".join(lines) + "\n"


def _describe_target(row: dict[str, Any]) -> str:
    dep = row.get("deployment") or {}
    if dep.get("kind") != "started":
        return f"`{row['target']['url']}` (running server)"
    what = [f"config `{dep['config']}`"] if dep.get("config") else []
    what += [f"flags `{' '.join(dep['flags'])}`"] if dep.get("flags") else []
    return f"{', '.join(what)}, started by compare (served at {dep['url']}, ready after {dep['startup_s']}s)"
