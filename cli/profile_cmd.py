"""``pdfabric profile``: measure one worker's latency profile and KV transfer rates into a profile file.

The run, in order:

1. build a worker exactly as ``pdfabric worker`` does (``Worker``: model, dtype, device, threads, KV
   cache, limits), without joining any router;
2. time the points of ``profiling_plan`` (more of them than a worker's start-up does) within
   ``--seconds``, cheapest first, and fit the ``WorkerProfile`` with the worker's own builder;
3. time KV transfers of this model's block layout over each of ``--transports`` for a few prompt
   sizes (the sending side in this process, the receiver in a spawned one, as ``bench transfer``);
4. write a ``ProfileFile`` (``pdfabric.profile_file``) and print a summary, or the file with ``--json``.

The planner (``pdfabric plan``) and the simulator read the file.

``--from-server URL|FILE`` measures nothing: it saves the profiles a running deployment's workers
refined while serving (the router's ``/health``, or a saved copy such as the ``health.json`` that
``bench compare`` writes), one file per worker, with the worker's kind as its role.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdfabric.control import KINDS
from pdfabric.profile_file import ANY
from pdfabric.worker_config import KV_CACHE_DTYPES, QUANTIZATIONS, worker_default

if TYPE_CHECKING:
    from pdfabric.engine.profiler import ProfilingRun
    from pdfabric.profile_file import ProfileFile

DEFAULT_TRANSPORTS = "zmq-tcp,shm"  # what prefill and decode workers use across hosts and on one host
TRANSFER_PROMPTS = (128, 512, 2048)  # prompt lengths (tokens) whose KV is timed, capped by the model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = worker_default  # the worker settings measured default to what a worker runs with
    parser.add_argument(
        "--model", default=w("model"), help=f"model dir, GGUF file or preset (default {w('model')})"
    )
    parser.add_argument(
        "--out", default="profile.json", metavar="FILE", help="profile file to write (default profile.json)"
    )
    parser.add_argument(
        "--role",
        choices=(ANY, *KINDS),
        default=ANY,
        help="worker kind the profile stands for: prefill measures prefill steps only, "
        "decode decode steps only, any and colocated both (default any)",
    )
    parser.add_argument(
        "--seconds", type=float, default=60.0, help="time budget for the step measurements (default 60)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads, as a worker's --threads: give the share of the cores each "
        "worker will get (0: torch's default, all cores)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    held = (("quantization", QUANTIZATIONS, "linear weights"), ("kv_cache_dtype", KV_CACHE_DTYPES, "KV rows"))
    for name, choices, what in held:  # a worker's settings of those names, recorded in the profile
        text = f"how the {what} are held, as a worker's {name} (recorded in the profile)"
        parser.add_argument("--" + name.replace("_", "-"), choices=choices, default=w(name), help=text)
    parser.add_argument("--device", default=w("device"), help="auto (cuda when present), cpu, cuda or cuda:N")
    parser.add_argument(
        "--max-batch-tokens",
        type=int,
        default=w("max_batch_tokens"),
        help=f"largest prefill chunk (tokens per step) to measure (default {w('max_batch_tokens')})",
    )
    parser.add_argument(
        "--max-running",
        type=int,
        default=w("max_running"),
        help=f"largest decode batch to measure (default {w('max_running')})",
    )
    sizes = (("kv_memory_mb", "KV-cache budget, MB (0: auto)"), ("block_size", "tokens per KV block"))
    for name, text in sizes:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=w(name), help=f"{text} (default {w(name)})")
    parser.add_argument(
        "--points",
        type=int,
        default=24,
        help="step shapes per kind in the plan (default 24; a worker's start-up uses 12)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per shape (default 3)")
    parser.add_argument(
        "--transports",
        default=DEFAULT_TRANSPORTS,
        help="comma-separated KV transports to time: zmq-tcp, zmq-ipc, shm, dist "
        f"('' for none; default {DEFAULT_TRANSPORTS})",
    )
    parser.add_argument(
        "--transfer-repeats",
        type=int,
        default=3,
        help="timed transfers per prompt size and transport (default 3)",
    )
    parser.add_argument(
        "--from-server",
        metavar="URL|FILE",
        help="measure nothing: save the live profiles of a running deployment's workers (its router's "
        "URL, or a saved /health answer) as --out DIR/WORKER.json, one per worker",
    )
    parser.add_argument("--json", action="store_true", help="print the profile file instead of a summary")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench.options import fail

    if args.from_server:
        try:
            saved = save_live_profiles(args.from_server, Path(args.out))
        except ValueError as exc:
            return fail(str(exc))
        for path, pf in saved:
            print(summary(pf))
            print(f"wrote {path}")
        return 0
    try:
        transports = _check_args(args)
    except ValueError as exc:
        return fail(str(exc))
    try:
        pf, measured = profile(args, transports)
    except ValueError as exc:
        return fail(str(exc))
    pf.save(args.out)
    if args.json:
        print(json.dumps(pf.to_json(), indent=2))
    else:
        print(summary(pf, measured))
        print(f"wrote {args.out}")
    return 0


def _check_args(args: argparse.Namespace) -> list[str]:
    """The transports to time; ``ValueError`` naming the flag for bad values."""
    from pdfabric.bench.transfer_sender import RAW, TRANSPORTS

    known = [t for t in TRANSPORTS if t != RAW]  # the raw socket row is a ceiling, not a KV transport

    if not (math.isfinite(args.seconds) and args.seconds > 0):
        raise ValueError(f"--seconds must be > 0, got {args.seconds}")
    if args.kv_memory_mb < 0:
        raise ValueError(f"--kv-memory-mb must be >= 0 (0: auto), got {args.kv_memory_mb}")
    for flag in (
        "max_batch_tokens",
        "max_running",
        "block_size",
        "points",
        "repeats",
        "transfer_repeats",
    ):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.threads < 0:
        raise ValueError(f"--threads must be >= 0, got {args.threads}")
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in known]
    if bad:
        raise ValueError(f"--transports: unknown {', '.join(bad)} (known: {', '.join(known)})")
    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a directory; give a file name")
    return transports


def profile(args: argparse.Namespace, transports: list[str]) -> tuple[ProfileFile, ProfilingRun]:
    """Builds the worker, times its steps and the KV transfers; the profile file and what was covered."""
    import torch

    from pdfabric.bench.progress import Progress
    from pdfabric.engine.profiler import run_plan
    from pdfabric.profile import profiling_plan
    from pdfabric.profile_file import ProfileFile
    from pdfabric.worker.loop import build_engine
    from pdfabric.worker_config import WorkerConfig

    cfg = WorkerConfig(
        kind=args.role if args.role != ANY else "colocated",
        join="",  # joins no router
        model=args.model, dtype=args.dtype, block_size=args.block_size, kv_memory_mb=args.kv_memory_mb,
        max_batch_tokens=args.max_batch_tokens, max_running=args.max_running, device=args.device,
        threads=args.threads, profile_seconds=args.seconds, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    started = time.perf_counter()
    engine = build_engine(cfg)
    runner, builder = engine.runner, engine.profile
    kv_tokens = engine.spec.num_blocks * cfg.block_size
    plan = profiling_plan(
        cfg.max_batch_tokens,
        cfg.max_running,
        engine.spec.max_model_len,
        kv_tokens,
        points_per_kind=args.points,
        repeats=args.repeats,
    )
    if args.role == "prefill":
        plan = type(plan)(plan.prefill, (), plan.repeats)
    elif args.role == "decode":
        plan = type(plan)((), plan.decode, plan.repeats)
    bar = Progress(len(plan.prefill) + len(plan.decode), "profile", enabled=not args.no_progress)
    started_plan = time.perf_counter()
    try:
        measured = run_plan(
            runner, plan, builder, args.seconds,
            lambda done, _: bar.update(done, done, {}, time.perf_counter() - started_plan),
        )  # fmt: skip
    finally:
        bar.close()
    if measured.steps == 0:
        raise ValueError(f"no step was timed within --seconds {args.seconds:g}; give it more time")
    fitted = builder.profile(force=True)
    mcfg = runner.config
    fits = min(engine.spec.max_model_len, kv_tokens)
    sizes = [t for t in TRANSFER_PROMPTS if t <= fits] or [cfg.block_size]
    rates = measure_kv_rates(
        mcfg, cfg.block_size, sizes, transports, args.transfer_repeats, not args.no_progress
    )
    device = str(runner.device)
    pf = ProfileFile(
        model=args.model,
        profile=fitted,
        kv_bytes_per_token=engine.spec.kv_bytes_per_token,
        block_size=cfg.block_size,
        max_batch_tokens=measured.max_prefill_tokens or cfg.max_batch_tokens,
        max_running=measured.max_batch or cfg.max_running,
        max_model_len=engine.spec.max_model_len,
        role=args.role,
        device=runner.device.type,
        device_name=_device_name(device),
        threads=torch.get_num_threads() if runner.device.type == "cpu" else 0,
        dtype=mcfg.dtype,
        weights=cfg.quantization,
        kv_cache_dtype=cfg.kv_cache_dtype,
        weight_bytes=runner.weight_bytes,
        kv_bytes_per_s=rates,
        seconds=round(time.perf_counter() - started, 3),
        steps=measured.steps,
    )
    return pf, measured


def measure_kv_rates(
    mcfg: Any,
    block_size: int,
    prompt_tokens: list[int],
    transports: list[str],
    repeats: int,
    progress: bool,
) -> dict[str, float]:
    """Bytes/s of KV transfers of this model's layout over each transport: the bytes of the prompts
    (``prompt_tokens``) divided by their median transfer times, start to acknowledgement, summed.

    Uses ``bench transfer``'s sender and receiver process; its caches are bfloat16, so a float32
    model's layout is timed with twice the head dimension (the same bytes per token)."""
    if not transports:
        return {}
    from pdfabric.bench.progress import Progress
    from pdfabric.bench.transfer_sender import bench_session

    itemsize = 4 if mcfg.dtype == "float32" else 2
    dims = (mcfg.num_layers, block_size, mcfg.num_kv_heads, mcfg.head_dim * itemsize // 2)
    rows = [(f"{t} tok", -(-t // block_size)) for t in prompt_tokens]
    bar = Progress(len(transports) * len(rows), "transfer", enabled=progress)
    try:
        with bench_session(transports, repeats, False, bar) as bench:
            for kind in transports:
                bench.measure(kind, dims, rows, 0.0)
    finally:
        bar.close()
    rates: dict[str, float] = {}
    for kind in transports:
        mine = [r for r in bench.results if r["transport"] == kind]
        nbytes = sum(r["bytes"] for r in mine)
        seconds = sum(r["latency_ms"] for r in mine) / 1e3
        rates[kind] = nbytes / seconds
    return rates


def save_live_profiles(source: str, out_dir: Path) -> list[tuple[Path, ProfileFile]]:
    """Reads ``/health`` from a router URL or a saved file and writes one profile file per worker."""
    import urllib.error
    import urllib.request

    try:
        if source.startswith(("http://", "https://")):
            with urllib.request.urlopen(source.rstrip("/") + "/health", timeout=10) as r:
                health = json.loads(r.read())
        else:
            health = json.loads(Path(source).read_text())
    except (OSError, urllib.error.URLError, json.JSONDecodeError) as exc:
        raise ValueError(f"--from-server {source}: {exc}") from None
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir} must be a directory with --from-server")
    out_dir.mkdir(parents=True, exist_ok=True)
    from pdfabric.profile_file import live_profiles

    saved = []
    for worker_id, pf in live_profiles(health).items():
        path = out_dir / f"{worker_id}.json"
        pf.save(path)
        saved.append((path, pf))
    return saved


def _device_name(device: str) -> str:
    """The GPU's name, or the CPU's model name from /proc/cpuinfo."""
    import platform

    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary(pf: ProfileFile, measured: ProfilingRun | None = None) -> str:
    """The profile's description (``ProfileFile.describe``), and a note when ``--seconds`` ran out."""
    lines = [pf.describe()]
    if measured is not None and not measured.complete:
        lines.append(
            f"  note: --seconds ran out after {measured.points} of {measured.total} shapes; the limits "
            "above are the largest measured (raise --seconds to cover the rest)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    from pdfabric.cli.main import main

    sys.exit(main(["profile", *sys.argv[1:]]))
