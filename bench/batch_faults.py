"""``pdfabric bench batch-faults``: a batch job run to its end through a kill -9 of a worker and of the
router.

One deployment started here (``--target serve:FLAGS``; it keeps its batches in its ``[batches] dir``,
by default the cache's ``batches`` folder, which the restarted router reads back). In this order:
1. a batch of ``--batch-lines`` short chat requests (as ``bench batch-impact``'s) is created;
2. once a third of its lines are answered, the worker holding the most requests is killed (SIGKILL)
   and the launcher restarts it;
3. once two thirds are answered, the router is killed (SIGKILL; its workers exit with it);
4. the same deployment starts again and finishes the batch.

It reports the lines answered 2xx, answered with an error, missing and answered more than once (the
last two must be 0), when each fault came and how long the batch took. Prints a table and writes JSON
(``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from pdfabric.bench.batch_impact import start_batch
from pdfabric.bench.deploy import SERVE_PREFIX, ServerSpec, started
from pdfabric.bench.floors import cpu_name
from pdfabric.bench.options import served_model
from pdfabric.bench.progress import Progress

ENDED = ("completed", "failed", "expired", "cancelled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default="serve:--model smollm2-135m --colocated 1 --prefill 0 --decode 0",
        help="serve:FLAGS of the deployment to start (default: smollm2-135m on one colocated worker)",
    )
    parser.add_argument("--batch-lines", type=int, default=2000, help="the batch's requests (default 2000)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="give up on the batch after this")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    if not args.target.startswith(SERVE_PREFIX):
        print("--target must be serve:FLAGS: the bench kills and restarts the deployment", file=sys.stderr)
        return 2
    if args.batch_lines < 3 or args.max_tokens < 1 or args.timeout_s <= 0:
        print("--batch-lines must be at least 3, --max-tokens and --timeout-s positive", file=sys.stderr)
        return 2
    spec = ServerSpec.parse(args.target)
    logs = args.json.parent if args.json else Path(tempfile.gettempdir())
    progress = Progress(args.batch_lines, "batch lines", enabled=not args.quiet)
    events: list[dict[str, Any]] = []
    with started(spec, logs / "batch-faults-server.log") as server:
        url, model = server.url, served_model(server.url)
        batch_id = asyncio.run(_create(url, model, args))
        t0 = time.monotonic()
        deadline = t0 + args.timeout_s
        answered = _await(url, batch_id, args.batch_lines // 3, deadline, progress, t0)
        victim = max(_get(url, "/health")["workers"], key=lambda w: w["requests"])
        os.kill(victim["pid"], signal.SIGKILL)
        events.append(
            {"fault": f"worker {victim['id']} killed", "answered": answered, "at_s": time.monotonic() - t0}
        )
        answered = _await(url, batch_id, 2 * args.batch_lines // 3, deadline, progress, t0)
        os.kill(server.pid, signal.SIGKILL)  # the router; leaving the block stops what is left of its group
        events.append({"fault": "router killed", "answered": answered, "at_s": time.monotonic() - t0})
    with started(spec, logs / "batch-faults-server-2.log") as server:
        url = server.url
        events.append(
            {"fault": "router started again", "startup_s": server.startup_s, "at_s": time.monotonic() - t0}
        )
        _await(url, batch_id, args.batch_lines, deadline, progress, t0)
        batch = _get(url, f"/v1/batches/{batch_id}")
        elapsed = time.monotonic() - t0
        ok = _lines(url, batch["output_file_id"])
        errors = _lines(url, batch["error_file_id"])
    progress.close()
    seen = Counter(line["custom_id"] for line in ok + errors)
    report = {
        "cpu": cpu_name(),
        "target": args.target,
        "model": model,
        "batch_id": batch_id,
        "status": batch["status"],
        "lines": args.batch_lines,
        "answered_ok": len(ok),
        "answered_error": len(errors),
        "missing": args.batch_lines - len(seen),
        "answered_twice": sum(1 for n in seen.values() if n > 1),
        "request_counts": batch["request_counts"],
        "elapsed_s": elapsed,
        "events": events,
    }
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if report["missing"] == 0 and report["answered_twice"] == 0 else 1


async def _create(url: str, model: str, args: argparse.Namespace) -> str:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        return await start_batch(http, url, model, args)


def _get(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=60) as r:
        return json.loads(r.read())


def _lines(url: str, file_id: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"{url}/v1/files/{file_id}/content", timeout=300) as r:
        return [json.loads(raw) for raw in r.read().splitlines() if raw.strip()]


def _await(url: str, batch_id: str, lines: int, deadline: float, progress: Progress, t0: float) -> int:
    """Waits until ``lines`` of the batch are answered (or it ended); how many are."""
    while True:
        batch = _get(url, f"/v1/batches/{batch_id}")
        counts = batch["request_counts"]
        answered = counts["completed"] + counts["failed"]
        progress.update(answered, answered, {"errors": counts["failed"]}, time.monotonic() - t0)
        if answered >= lines or batch["status"] in ENDED:
            return answered
        if time.monotonic() > deadline:
            raise SystemExit(f"batch {batch_id}: {answered} of its lines answered when --timeout-s ran out")
        time.sleep(0.2)


def _print(r: dict[str, Any]) -> None:
    took = f"{r['status']} in {r['elapsed_s']:.0f} s"
    print(f"cpu: {r['cpu']}; {r['target']}; a batch of {r['lines']} lines, {took}")
    print("| event | lines answered then | at (s) |")
    print("|---|---:|---:|")
    for e in r["events"]:
        print(f"| {e['fault']} | {e.get('answered', '')} | {e['at_s']:.1f} |")
    print(
        f"answered 2xx: {r['answered_ok']}, with an error: {r['answered_error']}, missing: {r['missing']}, "
        f"answered twice: {r['answered_twice']}"
    )
