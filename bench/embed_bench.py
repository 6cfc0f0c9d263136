"""``pdfabric bench embeddings``: ``/v1/embeddings`` at saturation beside the engine's own prefill rate
for the same tokens, and latency under Poisson load beside the budget its batches were given.

One run, in this order on one machine:
1. the engine alone (the model loaded in this process, no server): batches of ``--batch`` inputs of
   ``--input-tokens`` tokens, prefilled as one flat batch and pooled, the median of a few; its tokens
   per second are the bar the server is held to;
2. a server (``--target``: ``serve:FLAGS`` started here on loopback, or a running one's URL): at
   saturation (``--clients`` closed-loop clients, one input per request) its inputs and tokens per
   second; then, for each ``--rates`` level, open-loop Poisson arrivals for ``--duration-s``: latency
   p50 / p99, the share within the budget (sent as each request's ``slo.ttft_ms``), and the mean batch
   size the router formed (from ``/metrics``).

Inputs are random token ids (no tokenizer in the way), so every request costs the same. Prints a table
and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from pathlib import Path
from typing import Any

from pdfabric.bench.deploy import serving
from pdfabric.bench.floors import cpu_name
from pdfabric.bench.options import served_model
from pdfabric.bench.progress import Progress

DEFAULT_TARGET = "serve:--model smollm2-135m --colocated 1 --prefill 0 --decode 0"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model (preset, directory or GGUF file)")
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help="serve:FLAGS to start a deployment here, or a running server's URL (default: smollm2-135m on "
        "one colocated worker)",
    )
    parser.add_argument("--input-tokens", type=int, default=128, help="tokens per input (default 128)")
    parser.add_argument("--batch", type=int, default=16, help="inputs per engine batch (default 16)")
    parser.add_argument(
        "--clients", type=int, default=32, help="closed-loop clients at saturation (default 32)"
    )
    parser.add_argument(
        "--rates",
        default="0.5,0.8",
        help="Poisson load levels as fractions of the saturated rate (default 0.5,0.8)",
    )
    parser.add_argument("--duration-s", type=float, default=20.0, help="seconds per load level (default 20)")
    parser.add_argument(
        "--budget-ms", type=float, default=500.0, help="each request's latency budget (default 500)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    if args.input_tokens < 1 or args.batch < 1 or args.clients < 1 or args.duration_s <= 0:
        print("--input-tokens, --batch, --clients and --duration-s must be positive", file=sys.stderr)
        return 2
    fractions = [float(r) for r in args.rates.split(",") if r.strip()]
    engine, vocab = engine_rate(args.model, args.input_tokens, args.batch)
    print(
        f"engine: {engine['tokens_per_s']:.0f} tokens/s ({args.batch} x {args.input_tokens} tokens a batch)"
    )
    rng = random.Random(args.seed)
    with serving(args.target, args.json.parent if args.json else None, "embed-bench-server.log") as url:
        result = asyncio.run(_measure(url, served_model(url), args, fractions, vocab, rng))
    report = {
        "cpu": cpu_name(), "model": args.model, "target": args.target, "input_tokens": args.input_tokens,
        "budget_ms": args.budget_ms, "engine": engine, **result,
    }  # fmt: skip
    report["saturation"]["of_engine"] = report["saturation"]["tokens_per_s"] / engine["tokens_per_s"]
    _print(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def engine_rate(model: str, input_tokens: int, batch: int) -> tuple[dict[str, Any], int]:
    """The engine's prefill-and-pool rate for ``batch`` inputs of ``input_tokens`` (median of 5 after a
    warm-up), and the model's vocabulary size; the model is freed afterwards."""
    import gc

    import torch

    from pdfabric.engine.generate import ReferenceEngine
    from pdfabric.engine.runner import StepEntry
    from pdfabric.engine.stepper import pooled_vector

    blocks = batch * (input_tokens // 16 + 1)
    ref = ReferenceEngine(model, num_blocks=blocks, block_size=16)
    vocab = ref.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = [tuple(torch.randint(0, vocab, (input_tokens,), generator=g).tolist()) for _ in range(batch)]
    per = input_tokens // 16 + 1
    entries = [
        StepEntry(r, 0, tuple(range(i * per, (i + 1) * per)), needs_logits=False) for i, r in enumerate(rows)
    ]
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        _, hidden = ref.runner.run(entries)
        for i in range(batch):
            pooled_vector([], hidden[(i + 1) * input_tokens - 1 : (i + 1) * input_tokens], "last", True)
        times.append(time.perf_counter() - t0)
    median = sorted(times[1:])[len(times[1:]) // 2]
    del ref, entries
    gc.collect()
    return {"batch_seconds": median, "tokens_per_s": batch * input_tokens / median}, vocab


async def _measure(
    url: str, model: str, args: argparse.Namespace, fractions: list[float], vocab: int, rng: random.Random
) -> dict[str, Any]:
    import aiohttp

    def body() -> dict[str, Any]:
        ids = [rng.randrange(vocab) for _ in range(args.input_tokens)]
        return {"model": model, "input": ids, "slo": {"ttft_ms": args.budget_ms}}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        await _post(http, url, body())  # warm-up
        before = await _batches(http, url)
        sat = await _closed_loop(http, url, body, args.clients, args.duration_s, args.quiet)
        sat.update(_batch_delta(before, await _batches(http, url)))
        sat["tokens_per_s"] = sat["inputs_per_s"] * args.input_tokens
        levels = []
        for fraction in fractions:
            rate = fraction * sat["inputs_per_s"]
            before = await _batches(http, url)
            level = await _poisson(http, url, body, rate, args.duration_s, args.budget_ms, rng, args.quiet)
            level.update(_batch_delta(before, await _batches(http, url)), fraction=fraction)
            levels.append(level)
    return {"saturation": sat, "poisson": levels}


async def _post(http: Any, url: str, body: dict[str, Any]) -> tuple[int, float]:
    t0 = time.perf_counter()
    async with http.post(url + "/v1/embeddings", json=body) as r:
        await r.read()
        return r.status, time.perf_counter() - t0


async def _closed_loop(
    http: Any, url: str, body: Any, clients: int, duration_s: float, quiet: bool
) -> dict[str, Any]:
    end = time.perf_counter() + duration_s
    done: list[float] = []
    errors = 0
    progress = Progress(0, "saturation", enabled=not quiet)
    start = time.perf_counter()

    async def client() -> None:
        nonlocal errors
        while time.perf_counter() < end:
            status, seconds = await _post(http, url, body())
            if status == 200:
                done.append(seconds)
            else:
                errors += 1
            progress.update(len(done) + errors, len(done), {"errors": errors}, time.perf_counter() - start)

    await asyncio.gather(*(client() for _ in range(clients)))
    progress.close()
    elapsed = time.perf_counter() - start
    return {"clients": clients, "inputs": len(done), "errors": errors, "inputs_per_s": len(done) / elapsed,
            **_latency(done)}  # fmt: skip


async def _poisson(
    http: Any, url: str, body: Any, rate: float, duration_s: float, budget_ms: float, rng: random.Random,
    quiet: bool,
) -> dict[str, Any]:  # fmt: skip
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            break
        arrivals.append(t)
    progress = Progress(len(arrivals), f"{rate:.1f}/s", enabled=not quiet)
    start = time.perf_counter()
    results: list[tuple[int, float]] = []

    async def one(at: float) -> None:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        results.append(await _post(http, url, body()))
        ok = sum(1 for s, _ in results if s == 200)
        progress.update(len(results), ok, {"errors": len(results) - ok}, time.perf_counter() - start)

    await asyncio.gather(*(one(a) for a in arrivals))
    progress.close()
    ok = [s for status, s in results if status == 200]
    within = sum(1 for s in ok if s * 1e3 <= budget_ms) / len(results) if results else 0.0
    return {"rate": rate, "sent": len(results), "errors": len(results) - len(ok), "within_budget": within,
            **_latency(ok)}  # fmt: skip


def _latency(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"p50_ms": 0.0, "p99_ms": 0.0}
    s = sorted(seconds)
    return {"p50_ms": s[len(s) // 2] * 1e3, "p99_ms": s[min(len(s) - 1, int(len(s) * 0.99))] * 1e3}


_BATCH = re.compile(r'^pdfabric_embedding_batch_inputs_(sum|count)\{trigger="(\w+)"\} ([0-9.e+]+)$', re.M)


async def _batches(http: Any, url: str) -> dict[tuple[str, str], float]:
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return {(trigger, kind): float(v) for kind, trigger, v in _BATCH.findall(text)}


def _batch_delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict[str, Any]:
    """The batches formed between two scrapes: how many, their mean size, and by what trigger."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    count = sum(v for (_, kind), v in delta.items() if kind == "count")
    inputs = sum(v for (_, kind), v in delta.items() if kind == "sum")
    by = {t: int(v) for (t, kind), v in delta.items() if kind == "count" and v}
    return {"batches": int(count), "mean_batch": inputs / count if count else 0.0, "triggers": by}


def _print(r: dict[str, Any]) -> None:
    s = r["saturation"]
    budget = f"budget {r['budget_ms']:g} ms"
    print(f"cpu: {r['cpu']}; model {r['model']}; {r['input_tokens']} tokens an input; {budget}")
    print(
        "| load | inputs/s | tokens/s | of engine | p50 ms | p99 ms | within budget | mean batch | triggers |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    print(
        f"| saturated, {s['clients']} clients | {s['inputs_per_s']:.1f} | {s['tokens_per_s']:.0f} | "
        f"{s['of_engine']:.2f} | {s['p50_ms']:.0f} | {s['p99_ms']:.0f} | | {s['mean_batch']:.1f} | "
        f"{s['triggers']} |"
    )
    for p in r["poisson"]:
        print(
            f"| Poisson {p['rate']:.1f}/s ({p['fraction']:g} of saturated) | | | | {p['p50_ms']:.0f} | "
            f"{p['p99_ms']:.0f} | {p['within_budget']:.1%} | {p['mean_batch']:.1f} | {p['triggers']} |"
        )
