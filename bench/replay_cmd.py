"""``pdfabric bench replay``: replay one workload open-loop against one OpenAI-compatible server.

Writes ``report.json``, ``requests.jsonl``, ``summary.md`` and plots (TTFT and ITL CDFs, attainment vs
SLO scale) into ``--out``. Exit status 0, 2 for bad input, 130 when stopped by Ctrl-C (after writing
the partial report).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pdfabric.bench.options import add_client_arguments, add_slo_arguments, add_workload_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_client_arguments(parser)
    add_slo_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the report files")
    parser.add_argument("--label", help="name shown in the summary and plots (default: the model)")


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench.client import replay
    from pdfabric.bench.options import (
        client_from_args,
        client_meta,
        fail,
        prompt_config,
        run_with_sigint,
        slo_from_args,
        workload_from_args,
    )
    from pdfabric.bench.progress import Progress
    from pdfabric.bench.prompts import PromptBuilder
    from pdfabric.bench.report import build_report, write_run

    try:
        workload = workload_from_args(args)
        slo = slo_from_args(args)
        client = client_from_args(args, args.url)
        prompts = prompt_config(args)
    except ValueError as exc:
        return fail(str(exc))
    label = args.label or client.model
    progress = Progress(len(workload), "replay", enabled=not args.no_progress)
    builder = PromptBuilder(prompts)
    result = run_with_sigint(lambda stop: replay(workload, client, builder, stop, progress))
    meta = {
        "command": "replay",
        "target": client_meta(client),
        "workload": workload.describe(),
        "prompts": prompts.describe(),
        "wall_s": round(result.wall_s, 3),
    }
    report = build_report(result.records, slo, target=args.target, not_sent=result.not_sent, meta=meta,
                          stopped=result.stopped, warnings=result.warnings)
    out = Path(args.out)
    write_run(out, result.records, report, slo, label)
    print_brief(report, out)
    return 130 if result.stopped == "interrupted" else 0


def print_brief(report: dict[str, Any], out: Path) -> None:
    """A few lines on stdout; warnings on stderr."""
    req, ttft, itl = report["requests"], report["ttft_ms"], report["itl_ms"]
    att = report["attainment"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.1f}"

    print(f"requests: {req['total']} sent, {req['ok']} ok, {req['rejected']} rejected, {req['error']} error, "
          f"{req['timeout']} timeout, {req['cancelled']} cancelled, {req['not_sent']} not sent")
    print(f"TTFT ms p50/p90/p99: {ms(ttft['p50'])} / {ms(ttft['p90'])} / {ms(ttft['p99'])}")
    print(f"ITL  ms p50/p90/p99: {ms(itl['p50'])} / {ms(itl['p90'])} / {ms(itl['p99'])}")
    print(f"attainment: {'-' if att is None else f'{att:.1%}'}   report: {out}")
    for w in report.get("warnings", []):
        print(f"warning: {w}", file=sys.stderr)
