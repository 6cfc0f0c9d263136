"""``pdfabric bench batch-impact``: what a running batch job does to online latency.

One deployment (``--target``: ``serve:FLAGS`` started here, or a running server's URL), three runs of
the same online load (Poisson arrivals of short streamed chat requests, ``--rate`` per second for
``--duration-s``), in this order:
1. online alone;
2. online while a batch of ``--batch-lines`` short chat requests (``/v1/batches``; with
   ``--batch-prompt-words``, each with that much text to read first) runs beside it: the
   batch is created just before the online load starts, and cancelled when it ends;
3. online alone again (the machine's drift between runs 1 and 3 is the noise to read run 2 against).

For each run: TTFT p50 / p99 and mean ITL of the online requests, errors, and (run 2) the batch lines
answered during the run. Prints a table and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from pdfabric.bench.deploy import serving
from pdfabric.bench.floors import cpu_name
from pdfabric.bench.options import served_model
from pdfabric.bench.progress import Progress

TOPICS = ("the sea", "a cat", "rain", "mountains", "coffee", "a city at night", "autumn", "a library")
WORDS = (
    "river stone light window garden letter morning bridge silver quiet paper harbor winter candle".split()
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default="serve:--model smollm2-135m --colocated 1 --prefill 0 --decode 0",
        help="serve:FLAGS to start a deployment here, or a running server's URL (default: smollm2-135m "
        "on one colocated worker)",
    )
    parser.add_argument("--rate", type=float, default=1.0, help="online requests per second (default 1)")
    parser.add_argument("--duration-s", type=float, default=60.0, help="seconds of online load per run")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer, online and batch")
    parser.add_argument("--batch-lines", type=int, default=2000, help="the batch's requests (default 2000)")
    parser.add_argument(
        "--batch-prompt-words",
        type=int,
        default=0,
        help="give each batch line this many words of text to read first (default 0: a short prompt), "
        "to see what long background prompts do to online TTFT",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    if args.rate <= 0 or args.duration_s <= 0 or args.batch_lines < 1 or args.batch_prompt_words < 0:
        print(
            "--rate, --duration-s and --batch-lines must be positive, --batch-prompt-words >= 0",
            file=sys.stderr,
        )
        return 2
    with serving(args.target, args.json.parent if args.json else None, "batch-impact-server.log") as url:
        report = asyncio.run(_runs(url, served_model(url), args))
    report.update(
        cpu=cpu_name(),
        target=args.target,
        rate=args.rate,
        duration_s=args.duration_s,
        batch_prompt_words=args.batch_prompt_words,
    )
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


async def _runs(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as http:
        alone = await _online(http, url, model, args, "online alone")
        batch_id = await start_batch(http, url, model, args)
        beside = await _online(http, url, model, args, "online beside the batch")
        beside["batch"] = await _stop_batch(http, url, batch_id)
        again = await _online(http, url, model, args, "online alone again")
    p99 = (alone["ttft_p99_ms"] + again["ttft_p99_ms"]) / 2
    return {
        "model": model,
        "runs": [alone, beside, again],
        "ttft_p99_change": beside["ttft_p99_ms"] / p99 - 1,
    }


def _chat(model: str, rng: random.Random, max_tokens: int, words: int = 0) -> dict[str, Any]:
    """A short chat request; with ``words``, it first asks to read that many words of filler text."""
    prompt = f"Write a short poem about {rng.choice(TOPICS)}."
    if words:
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        prompt = f"Read this: {text}\n\nNow, never mind it. {prompt}"
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


async def _online(http: Any, url: str, model: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while (t := t + rng.expovariate(args.rate)) < args.duration_s:
        arrivals.append(t)
    bodies = [_chat(model, rng, args.max_tokens) for _ in arrivals]
    progress = Progress(len(arrivals), label, enabled=not args.quiet)
    start = time.perf_counter()
    results: list[tuple[float, float] | None] = []

    async def one(at: float, body: dict[str, Any]) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        results.append(await _stream(http, url, body))
        ok = sum(1 for r in results if r is not None)
        progress.update(len(results), ok, {"errors": len(results) - ok}, time.perf_counter() - start)

    await asyncio.gather(*(one(a, b) for a, b in zip(arrivals, bodies, strict=True)))
    progress.close()
    ok = [r for r in results if r is not None]
    ttft = sorted(r[0] for r in ok)
    itl = [r[1] for r in ok if r[1] > 0]

    def pct(q: float) -> float:
        return ttft[min(len(ttft) - 1, int(len(ttft) * q))] * 1e3 if ttft else 0.0

    return {"label": label, "sent": len(results), "errors": len(results) - len(ok), "ttft_p50_ms": pct(0.5),
            "ttft_p99_ms": pct(0.99), "itl_mean_ms": sum(itl) / len(itl) * 1e3 if itl else 0.0}  # fmt: skip


async def _stream(http: Any, url: str, body: dict[str, Any]) -> tuple[float, float] | None:
    """(TTFT, mean gap between the later content chunks) of one streamed chat request; None on error."""
    t0 = time.perf_counter()
    times: list[float] = []
    async with http.post(url + "/v1/chat/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            await r.read()
            return None
        async for line in r.content:
            if line.startswith(b"data: {") and b'"content"' in line:
                times.append(time.perf_counter())
    if not times:
        return None
    gaps = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return times[0] - t0, gaps


async def start_batch(http: Any, url: str, model: str, args: argparse.Namespace) -> str:
    """Uploads ``--batch-lines`` short chat lines and creates their batch; its id."""
    import aiohttp

    rng = random.Random(args.seed + 1)
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": _chat(model, rng, args.max_tokens, getattr(args, "batch_prompt_words", 0))}
        for i in range(args.batch_lines)
    ]  # fmt: skip
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    data = "\n".join(json.dumps(x) for x in lines).encode()
    form.add_field("file", data, filename="batch.jsonl", content_type="application/jsonl")
    async with http.post(url + "/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    async with http.post(url + "/v1/batches", json=body) as r:
        return (await r.json())["id"]


async def _stop_batch(http: Any, url: str, batch_id: str) -> dict[str, Any]:
    """Cancels the batch; what it had answered by then."""
    async with http.post(f"{url}/v1/batches/{batch_id}/cancel", json={}) as r:
        batch = await r.json()
    for _ in range(600):
        async with http.get(f"{url}/v1/batches/{batch_id}") as r:
            batch = await r.json()
        if batch["status"] in ("cancelled", "completed"):
            break
        await asyncio.sleep(0.1)
    return {"id": batch_id, "status": batch["status"], **batch["request_counts"]}


def _print(r: dict[str, Any]) -> None:
    words = f"; batch prompts of {r['batch_prompt_words']} words" if r.get("batch_prompt_words") else ""
    online = f"online {r['rate']:g} req/s for {r['duration_s']:g} s each run"
    print(f"cpu: {r['cpu']}; {r['target']}; {online}{words}")
    print("| run | sent | errors | TTFT p50 (ms) | TTFT p99 (ms) | mean ITL (ms) | batch lines answered |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for run_ in r["runs"]:
        batch = run_.get("batch")
        answered = f"{batch['completed'] + batch['failed']} of {batch['total']}" if batch else ""
        print(
            f"| {run_['label']} | {run_['sent']} | {run_['errors']} | {run_['ttft_p50_ms']:.0f} | "
            f"{run_['ttft_p99_ms']:.0f} | {run_['itl_mean_ms']:.1f} | {answered} |"
        )
    print(f"TTFT p99 beside the batch against the two runs alone: {r['ttft_p99_change']:+.1%}")
