"""``pdfabric bench chaos``: replay a workload twice against one pdfabric deployment, first fault-free,
then while workers are killed, and report what the faults cost the requests.

The deployment is a running ``pdfabric serve`` on this host (``--url``), or one this command starts
from ``--config`` and/or ``--serve FLAGS`` and stops at the end (``bench/deploy.py``). Both runs sample
greedily (temperature 0, token ids returned), so each request of the chaos run can be checked token
for token against the baseline. During the chaos run a worker drawn at random (``--seed``) from
``--kinds`` is sent SIGKILL (or SIGTERM with ``--signal term``) every ``--kill-every`` seconds or at
``--kills`` evenly spaced times, and each victim is waited for until it is back (``bench/chaos.py``).

Outputs in ``--out``: ``baseline/`` and ``chaos/`` (the files ``bench replay`` writes, with each
request's output in ``requests.jsonl``), ``report.json`` and ``summary.md`` (the table also printed
on stdout; see ``bench/chaos_report.py`` for its definitions), and for a started deployment
``server.log`` and ``health.json``. Exit status: 0; 1 when a stream had no terminal event or the
deployment did not start; 2 for bad input; 130 when stopped by Ctrl-C (after writing what was measured).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdfabric.bench.deploy import Deployment, ServerSpec
from pdfabric.bench.options import add_client_arguments, add_slo_arguments, add_workload_arguments

if TYPE_CHECKING:
    from pdfabric.bench.chaos import FabricView, KillEvent, KillPlan
    from pdfabric.bench.client import ClientConfig, ReplayResult
    from pdfabric.bench.metrics import SLO
    from pdfabric.bench.prompts import PromptConfig
    from pdfabric.bench.workload import Workload

LOST_TOTAL = "pdfabric_requests_lost_total"  # kept by routers that count lost requests


def add_arguments(parser: argparse.ArgumentParser) -> None:
    t = parser.add_argument_group("deployment (--url, or --config and/or --serve to start one)")
    t.add_argument("--url", help="base URL of a running pdfabric serve whose workers run on this host")
    t.add_argument("--config", metavar="FILE", help="start pdfabric serve --config FILE on a free loopback "
                                                    "port for the two runs, and stop it afterwards")
    t.add_argument("--serve", metavar="FLAGS",
                   help="pdfabric serve flags of the started deployment (after --config's settings), "
                        "e.g. '--prefill 2 --decode 2'")
    t.add_argument("--start-timeout", type=float, default=180.0, metavar="S",
                   help="seconds a started deployment may take to become ready (default 180)")
    t.add_argument("--stop-grace", type=float, default=15.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping it (default 15)")
    c = parser.add_argument_group("chaos (victims are drawn with --seed)")
    when = c.add_mutually_exclusive_group(required=True)
    when.add_argument("--kill-every", type=float, metavar="S",
                      help="kill a worker every S seconds of the chaos run, for as long as it lasts")
    when.add_argument("--kills", type=int, metavar="N",
                      help="kill N workers, evenly spaced over the baseline run's makespan")
    c.add_argument("--kinds", default="prefill,decode,colocated",
                   help="worker kinds that may be killed (default: all); the last worker of a kind is spared")
    c.add_argument("--signal", choices=("kill", "term"), default="kill",
                   help="kill: SIGKILL (default; the launcher restarts the worker); term: SIGTERM (it "
                        "drains and leaves)")
    c.add_argument("--back-timeout", type=float, default=60.0, metavar="S",
                   help="longest wait for a killed worker to be back before the next kill (default 60)")
    add_workload_arguments(parser)
    add_client_arguments(parser, url=False)
    add_slo_arguments(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="directory for the report files")
    parser.add_argument("--label", help="name shown in the summary (default: the model)")


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench.chaos import KillPlan
    from pdfabric.bench.deploy import DeployError, client_for, save_health
    from pdfabric.bench.options import (
        client_from_args,
        client_meta,
        fail,
        prompt_config,
        slo_from_args,
        workload_from_args,
    )

    try:
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        plan = KillPlan(args.kill_every, args.kills, kinds, args.signal, args.back_timeout, args.seed)
        dep = deployment(args)
        args.extra_body = greedy_body(args.extra_body)
        work = _Work(plan, workload_from_args(args), prompt_config(args))
        slo = slo_from_args(args)
        if dep.url is not None:
            client_from_args(args, dep.url, dep.model)  # checks the client options before anything runs
    except ValueError as exc:
        return fail(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        with client_for(args, dep, out) as (client, described):
            client = replace(client, keep_output=True)
            measured = _measure(work, client, not args.no_progress)
            if dep.server is None:
                save_health(client.url, out / "health.json")
    except DeployError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except _NoVictim as exc:
        return fail(str(exc))
    except RuntimeError as exc:  # the router's /metrics could not be read
        print(f"error: {exc}", file=sys.stderr)
        return 1
    meta = {"command": "chaos", "target": client_meta(client), "deployment": described,
            "workload": work.workload.describe(), "prompts": work.prompts.describe(),
            "plan": plan.describe(), "host": measured.host}
    report = _write(out, meta, measured, work.workload, slo, args.target, args.label or client.model)
    if measured.chaos is None or measured.chaos.stopped == "interrupted":
        print("interrupted: the report is partial", file=sys.stderr)
        return 130
    return 1 if report["streams_without_terminal_event"] else 0


def deployment(args: argparse.Namespace) -> Deployment:
    """The deployment the flags name; ``ValueError`` for a bad or missing one (a config is read now)."""
    if args.url:
        if args.config or args.serve:
            raise ValueError("--url names a running server; --config and --serve start one: give one or "
                             "the other")
        return Deployment("chaos", url=args.url.rstrip("/"), model=args.model)
    if not (args.config or args.serve):
        raise ValueError("give --url of a running pdfabric serve, or --config and/or --serve to start one")
    if args.config:
        ServerSpec.parse(args.config)  # reads it, to fail before anything runs
    return Deployment("chaos", server=ServerSpec(args.config, tuple(shlex.split(args.serve or ""))),
                      model=args.model)


def greedy_body(extra: dict[str, Any]) -> dict[str, Any]:
    """The extra request fields with greedy sampling and token ids asked for."""
    if extra.get("temperature", 0) != 0:
        raise ValueError("bench chaos compares each output with the baseline's token for token, so it "
                         "samples greedily: --extra-body must not set a temperature")
    return {**extra, "temperature": 0, "return_token_ids": True}


class _NoVictim(Exception):
    pass


@dataclass(frozen=True)
class _Work:
    plan: KillPlan
    workload: Workload
    prompts: PromptConfig


@dataclass
class _Measured:
    host: str
    baseline: ReplayResult
    chaos: ReplayResult | None  # None: interrupted during the baseline
    kills: list[KillEvent]
    metrics: list[str]  # /metrics before the baseline, after it, after the chaos run


def _measure(work: _Work, client: ClientConfig, progress: bool) -> _Measured:
    from pdfabric.bench.options import run_with_sigint
    from pdfabric.kvtransfer.transport import host_id

    host = host_id()
    return run_with_sigint(lambda stop: _both_runs(work, client, host, stop, progress))


async def _both_runs(
    work: _Work, client: ClientConfig, host: str, stop: asyncio.Event, progress: bool
) -> _Measured:
    """The baseline, then the chaos run with the killer beside it (on the replay's clock)."""
    import aiohttp

    from pdfabric.bench.chaos import LocalFabric, run_kills
    from pdfabric.bench.chaos_report import makespan_s
    from pdfabric.bench.client import replay
    from pdfabric.bench.progress import Progress
    from pdfabric.bench.prompts import PromptBuilder

    builder = PromptBuilder(work.prompts)
    n = len(work.workload)
    async with aiohttp.ClientSession() as session:
        fabric = LocalFabric(session, client.url)
        await _check_victims(fabric, work.plan, host)
        scrapes = [await fabric.metrics()]
        base = await replay(work.workload, client, builder, stop, Progress(n, "baseline", enabled=progress))
        scrapes.append(await fabric.metrics())
        if base.stopped == "interrupted":
            return _Measured(host, base, None, [], scrapes + scrapes[-1:])
        span = makespan_s(base.records) or work.workload.span_s
        bar = Progress(n, "chaos", enabled=progress)
        done, t0 = asyncio.Event(), time.perf_counter() + 0.1
        killer = asyncio.create_task(run_kills(work.plan, fabric, host, t0, span, done, bar.note, stop=stop))
        try:
            res = await replay(work.workload, client, builder, stop, bar, start_at=t0)
        except BaseException:
            killer.cancel()
            raise
        finally:
            done.set()
        kills = await killer
        scrapes.append(await fabric.metrics())
    return _Measured(host, base, res, kills, scrapes)


async def _check_victims(fabric: FabricView, plan: KillPlan, host: str) -> None:
    """Fails early when no worker of the deployment could be killed."""
    import random

    from pdfabric.bench.chaos import pick_victim

    health = await fabric.health()
    workers = health.get("workers", [])
    if pick_victim(workers, plan.kinds, host, random.Random(0)) is None:
        listed = ", ".join(f"{w['id']}@{w.get('host', '?')}" for w in workers) or health.get("error", "none")
        raise _NoVictim(f"no worker can be killed: bench chaos kills workers of kinds {','.join(plan.kinds)} "
                        f"that run on this host ({host}) and spares the last of each kind; the deployment "
                        f"has {listed}")


def _write(out: Path, meta: dict[str, Any], m: _Measured, workload: Workload, slo: SLO, target: float,
           label: str) -> dict[str, Any]:
    """Each run's replay files, then the chaos ``report.json`` and ``summary.md``; prints the table."""
    from pdfabric.bench.chaos import FAILOVERS, counter, delta
    from pdfabric.bench.chaos_report import build_report, summary_md
    from pdfabric.bench.report import build_report as replay_report
    from pdfabric.bench.report import write_json, write_run

    for name, res in (("baseline", m.baseline), ("chaos", m.chaos)):
        if res is None:
            continue
        rep = replay_report(res.records, slo, target=target, not_sent=res.not_sent,
                            meta={**meta, "run": name, "wall_s": round(res.wall_s, 3)},
                            stopped=res.stopped, warnings=res.warnings)
        write_run(out / name, res.records, rep, slo, f"{label} {name}")
    fo = [counter(text, FAILOVERS, "cause") for text in m.metrics]
    lost = [counter(text, LOST_TOTAL) for text in m.metrics]
    server_lost = sum(delta(lost[1], lost[2]).values()) if lost[2] else None
    chaos = m.chaos.records if m.chaos is not None else []
    report = build_report(meta, (m.baseline.records, delta(fo[0], fo[1])), (chaos, delta(fo[1], fo[2])),
                          len(workload), m.kills, meta["plan"]["count"], server_lost)
    write_json(out / "report.json", report)
    summary = summary_md(report, label)
    (out / "summary.md").write_text(summary)
    print(summary, end="")
    return report

