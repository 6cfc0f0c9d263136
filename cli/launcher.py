"""``pdfabric serve``: the router in this process, each worker in a process of its own.

Start-up: bind the control socket, start the workers with its address, wait until every worker has
registered (or fail, showing why), then open the HTTP port. While serving, a worker process that
exits is reported to the dispatcher at once, so its requests fail over to other workers instead of
waiting for heartbeats to time out, and it is started again after a backoff (``supervisor.py``); it
registers under its old id and serves again. A worker that keeps exiting is left down (a circuit
breaker) and listed under ``down`` in ``/health``. Ctrl-C or SIGTERM first drains the router: new
requests get 503 while those in flight finish, for at most ``shutdown_drain_s`` (a second signal cuts
it short); then it stops the HTTP site, tells its workers to shut down, and kills any that do not
within a few seconds. Workers that joined from elsewhere stay, and register with the next router.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import time

from pdfabric.cli import ray_launch
from pdfabric.cli.supervisor import StartupError, Workers, local_starter
from pdfabric.cluster_secret import ClusterSecret
from pdfabric.config import ServeConfig, load_serve_config
from pdfabric.worker_config import (
    AUTO_KV_MIN_MB,
    AUTO_KV_TOKENS,
    DRAFT_CACHES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SPECULATIVE,
    worker_default,
)

log = logging.getLogger("pdfabric.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = worker_default
    parser.add_argument("--config", help="TOML deployment config (see configs/); the flags below override it")
    parser.add_argument(
        "--model",
        help="model directory, GGUF file or preset: tiny, cpu-small, smollm2-135m "
        f"(default {ServeConfig.model})",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--prefill", type=int, help="prefill workers")
    parser.add_argument("--decode", type=int, help="decode workers")
    parser.add_argument("--colocated", type=int, help="colocated workers (prefill and decode in one)")
    parser.add_argument("--host", help=f"HTTP address (default {ServeConfig.host})")
    parser.add_argument("--port", type=int, help=f"HTTP port (default {ServeConfig.port}; 0: a free one)")
    parser.add_argument("--control-port", type=int, help="router control port workers join (default: free)")
    parser.add_argument(
        "--kv-memory-mb",
        type=int,
        help=f"KV MB per worker (default 0: room for --max-running sequences of {AUTO_KV_TOKENS} tokens of "
        f"the model, at least {AUTO_KV_MIN_MB} MB)",
    )
    parser.add_argument(
        "--memory-mb",
        type=int,
        help="MB per worker for the weights (as held: --quantization) and the KV cache together; the KV "
        "cache gets what the weights leave (unless --kv-memory-mb or --num-blocks is given)",
    )
    parser.add_argument("--num-blocks", type=int, help="KV blocks per worker (overrides --kv-memory-mb)")
    parser.add_argument("--block-size", type=int, help=f"tokens per KV block (default {w('block_size')})")
    parser.add_argument(
        "--max-batch-tokens", type=int, help=f"tokens per worker step (default {w('max_batch_tokens')})"
    )
    parser.add_argument(
        "--max-running", type=int, help=f"sequences decoding at once per worker (default {w('max_running')})"
    )
    parser.add_argument(
        "--profile-seconds",
        type=float,
        help=f"start-up profiling time per worker, s (default {w('profile_seconds'):g})",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="how workers hold the linear layers' weights, weight-only: int8 (a scale per output; CPUs), "
        "int4 (groups of 32 inputs), gguf (a GGUF model's own Q3_K/Q4/Q5/Q6_K/Q8_0 blocks), or none "
        "(default: the model's dtype); w8a8 and w4a8 (CPUs): int8 or int4 weights times activations "
        "quantized in groups of 32, for prompts and large batches",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="what workers store a KV-cache row as: auto (the model's dtype, the default) or int8 (int8 "
        "values and a float32 scale per token and kv head: half the KV memory and half the bytes decode "
        "attention reads; bfloat16 models on CPUs with AVX512-BF16 and AVX512-VNNI)",
    )
    parser.add_argument(
        "--kv-store-ram-mb",
        type=int,
        help="the host KV store's RAM tier, MiB (default 0: off): blocks a worker's pool evicts are kept "
        "in shared memory for every worker on the host, and across restarts (docs/kvtransfer.md)",
    )
    parser.add_argument("--kv-store-disk-dir", help="the host KV store's disk tier: its directory")
    parser.add_argument(
        "--kv-store-disk-mb", type=int, help="the disk tier's size, MiB (with --kv-store-disk-dir)"
    )
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE,
        help="speculative decoding on decode and colocated workers: ngram proposes tokens from each "
        "sequence's own history, draft drafts them with a cheaper model (--draft-model, default the "
        "model itself in int4), checked in one step (default off; [worker] speculative_k, "
        "speculative_below tune it)",
    )
    parser.add_argument(
        "--draft-model",
        help="the draft model's directory or preset for --speculative draft (default: the model itself)",
    )
    parser.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        help="how the draft model holds its weights (default int4)",
    )
    parser.add_argument(
        "--draft-layers",
        type=int,
        help="keep only the draft's first N decoder layers (default 0: all), for checkpoints trained to "
        "exit early",
    )
    parser.add_argument(
        "--draft-cache",
        choices=DRAFT_CACHES,
        help="auto (default): the draft reads the served model's KV cache where its layers have that "
        "layout, else computes into a cache of its own; own: always its own (a draft of other weights)",
    )
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model)")
    parser.add_argument(
        "--routing-policy",
        choices=("budget", "round_robin", "least_loaded"),
        help="how the router picks routes (default: the config's [routing] policy, else budget)",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="auto",
        metavar="ADDRESS",
        dest="ray_address",
        help="start each worker on a Ray cluster (needs pdfabric[ray]): ADDRESS is the head's HOST:PORT; "
        "without it, the cluster this host is part of (see docs/scale-out.md)",
    )
    parser.add_argument("--ready-timeout", type=float, default=120.0, help="seconds to wait for workers")
    parser.add_argument(
        "--log-level", default="WARNING", help="router and worker log level (default WARNING)"
    )
    parser.add_argument(
        "--once",
        metavar="PROMPT",
        help="start, stream the answer to PROMPT to stdout through the HTTP API, then stop (a chat "
        "completion with PROMPT as the user's message when the model has a chat template)",
    )
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of the --once request")


# The flags that override the config's [serve] and [worker] keys (and routing_policy, ray_address)
OVERRIDES = (
    "model", "dtype", "prefill", "decode", "colocated", "host", "port", "control_port", "kv_memory_mb",
    "memory_mb", "num_blocks", "block_size", "max_batch_tokens", "max_running", "served_model_name",
    "profile_seconds", "quantization", "kv_cache_dtype", "kv_store_ram_mb", "kv_store_disk_dir",
    "kv_store_disk_mb", "speculative", "draft_model", "draft_quantization", "draft_layers", "draft_cache",
    "routing_policy",
    "ray_address",
)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    overrides = {k: getattr(args, k) for k in OVERRIDES}
    try:
        cfg = load_serve_config(args.config, overrides)
    except (ValueError, OSError) as exc:
        print(f"pdfabric serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        return asyncio.run(serve(cfg, args.ready_timeout, args.log_level, args.once, args.max_tokens))
    except StartupError as exc:
        print(f"pdfabric serve: error: {exc}", file=sys.stderr)
        return 1


def cluster_secret(cfg: ServeConfig) -> ClusterSecret:
    """The deployment's cluster secret: ``[serve] cluster_secret_file``, else ``PDFABRIC_CLUSTER_SECRET``,
    else a random one for this run (then only the workers this launcher starts can join)."""
    if cfg.cluster_secret_file:
        return ClusterSecret.load(cfg.cluster_secret_file)
    return ClusterSecret.from_env() or ClusterSecret.generate()


async def serve(
    cfg: ServeConfig, ready_timeout: float, log_level: str, once: str | None, max_tokens: int
) -> int:
    from aiohttp import web

    from pdfabric.router.dispatch.dispatcher import Dispatcher
    from pdfabric.router.front.app import build_app
    from pdfabric.router.front.batch_api import RUNNER
    from pdfabric.router.platform import catalog as catalog_
    from pdfabric.router.platform.admin import LIFECYCLE

    # Builds each preset once, before the workers, and loads each checkpoint's tokenizer.
    catalog = await asyncio.to_thread(catalog_.from_config, cfg, time.monotonic())
    address = f"tcp://{cfg.ray.control_host or cfg.host}:{cfg.control_port}"
    secret = cluster_secret(cfg)
    dispatcher = Dispatcher(
        address,
        cfg.worker_timeout_s,
        admission=cfg.routing,
        predictor=cfg.predictor,
        max_failovers=cfg.max_failovers,
        secret=secret,
        embeddings=cfg.embeddings,
    )
    await dispatcher.start()
    runner: web.AppRunner | None = None
    workers = Workers(dispatcher.address, local_starter(cfg, log_level, secret))
    try:
        if cfg.ray.enabled:
            ray_launch.connect(cfg)  # in the main thread, where Ray sets its signal handlers
            workers.starter = ray_launch.ray_starter(cfg, log_level, secret)
            workers.join = ray_launch.join_address(dispatcher.address)
        workers.start(cfg.launch_plan())
        await workers.wait_ready(dispatcher, ready_timeout)
        app = build_app(cfg, dispatcher, catalog, workers)
        runner = web.AppRunner(app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        port = runner.addresses[0][1]
        url = f"http://{cfg.host}:{port}"
        local = f"http://127.0.0.1:{port}" if cfg.host in ("0.0.0.0", "::", "") else url
        await app[RUNNER].start(local)  # batch jobs (those of a router before this one too)
        print(f"ready: {url}", flush=True)
        names = ", ".join(repr(n) for n in catalog.names())
        print(
            f"pdfabric: serving {names} on {url} ({cfg.count('prefill')} prefill, "
            f"{cfg.count('decode')} decode, {cfg.count('colocated')} colocated workers"
            f"{' on Ray' if cfg.ray.enabled else ''})",
            file=sys.stderr,
            flush=True,
        )
        tasks = [asyncio.create_task(workers.monitor(dispatcher))]
        if cfg.autoscale.enabled:
            tasks.append(asyncio.create_task(_autoscaler(cfg, app, dispatcher, workers).run()))
        try:
            if once is not None:
                first = next(iter(catalog.models.values()))
                chat = next(iter(first.versions.values())).tokenizer.chat_template is not None
                return await _stream_once(url, first.name, once, max_tokens, chat)
            again = await _until_signal()
            await _drain_requests(app[LIFECYCLE], dispatcher, cfg.shutdown_drain_s, again)
            return 0
        finally:
            for task in tasks:
                task.cancel()
    finally:
        if runner is not None:
            await runner.cleanup()
        await dispatcher.close(shutdown=workers.ids())
        await asyncio.to_thread(workers.stop_all)
        if cfg.ray.enabled:
            ray_launch.disconnect()


def _autoscaler(cfg: ServeConfig, app, dispatcher, workers: Workers):  # noqa: ANN001, ANN202
    from pdfabric.cli.autoscale import Autoscaler
    from pdfabric.router.front.keys import METRICS, OBSERVED
    from pdfabric.router.platform.admin import AUDIT

    audit = app[AUDIT]
    on_event = lambda action, target, details: audit.write("router", action, target, 0, details)  # noqa: E731
    return Autoscaler(cfg, dispatcher, workers, app[OBSERVED], app[METRICS].registry, on_event)


async def _until_signal() -> asyncio.Event:
    """Waits for SIGINT or SIGTERM; returns an event that the next one sets."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    stop.clear()
    return stop


async def _drain_requests(lifecycle, dispatcher, limit_s: float, again: asyncio.Event) -> None:  # noqa: ANN001
    """Stops taking requests (503 from now on) and lets those in flight finish, for at most
    ``limit_s`` or until a second signal; whatever is still running then is cut off."""
    lifecycle.shutting_down = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    if dispatcher.fleet.in_flight:
        print(
            f"pdfabric: stopping: {dispatcher.fleet.in_flight} requests in flight get up to {limit_s:g}s to "
            "finish (signal again to stop now)",
            file=sys.stderr,
            flush=True,
        )
    while dispatcher.fleet.in_flight and loop.time() < deadline and not again.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(again.wait(), min(0.1, max(0.0, deadline - loop.time())))
    if dispatcher.fleet.in_flight:
        log.warning("stopping with %d requests still in flight", dispatcher.fleet.in_flight)


async def _stream_once(url: str, model: str, prompt: str, max_tokens: int, chat: bool) -> int:
    """Streams one answer through the HTTP API, printing text as it arrives: a chat completion of
    ``prompt`` as the user's message when ``chat`` (the model has a chat template), else a completion."""
    import aiohttp

    body: dict[str, object] = {"model": model, "max_tokens": max_tokens, "stream": True, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as resp:
        if resp.status != 200:
            print(f"pdfabric serve: request failed: HTTP {resp.status}: {await resp.text()}", file=sys.stderr)
            return 1
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                print(f"\npdfabric serve: request failed: {data['error']['message']}", file=sys.stderr)
                return 1
            choice = data["choices"][0]
            text = choice["delta"].get("content", "") if chat else choice["text"]
            print(text, end="", flush=True)
    print()
    return 0
