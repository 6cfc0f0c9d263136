"""``pdfabric worker``: one prefill, decode or colocated worker joining a router."""

from __future__ import annotations

import argparse
import logging
import sys

from pdfabric.config import WorkerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", required=True, choices=("prefill", "decode", "colocated"))
    parser.add_argument("--join", required=True, help="the router's control address, tcp://HOST:PORT")
    parser.add_argument("--model", default="tiny", help="model directory or preset (default tiny)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--pool", default="default", help="the pool this worker joins")
    parser.add_argument("--worker-id", default="", help="default: KIND-PID")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=0, help="KV blocks (0: from --kv-memory-mb)")
    parser.add_argument("--kv-memory-mb", type=int, default=256, help="KV-cache memory budget")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step")
    parser.add_argument("--max-running", type=int, default=64, help="sequences decoding at once")
    parser.add_argument(
        "--kv-host", default="127.0.0.1", help="address a decode worker binds its KV endpoint on"
    )
    parser.add_argument(
        "--kv-transport",
        default="auto",
        choices=("auto", "zmq", "shm", "dist"),
        help="how KV moves to decode workers (auto: shm on one host, zmq across hosts, dist when set up)",
    )
    parser.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    parser.add_argument("--log-level", default="INFO", help="log level (default INFO)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    parser.add_argument(
        "--profile-seconds",
        type=float,
        default=5.0,
        help="start-up profiling budget in seconds (0: none; default 5)",
    )


def build(cfg: WorkerConfig, parent_pid: int = 0):  # noqa: ANN201 - a Worker subclass
    if cfg.kind == "colocated":
        from pdfabric.decode.colocated import ColocatedWorker

        return ColocatedWorker(cfg, parent_pid)
    if cfg.kind == "decode":
        from pdfabric.decode.worker import DecodeWorker

        return DecodeWorker(cfg, parent_pid)
    from pdfabric.prefill.worker import PrefillWorker

    return PrefillWorker(cfg, parent_pid)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = WorkerConfig(
            kind=args.kind,
            join=args.join,
            model=args.model,
            dtype=args.dtype,
            pool=args.pool,
            worker_id=args.worker_id,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            kv_memory_mb=args.kv_memory_mb,
            max_batch_tokens=args.max_batch_tokens,
            max_running=args.max_running,
            kv_host=args.kv_host,
            profile_seconds=args.profile_seconds,
            threads=args.threads,
            device=args.device,
            kv_transport=args.kv_transport,
        )
    except ValueError as exc:
        print(f"pdfabric worker: error: {exc}", file=sys.stderr)
        return 2
    build(cfg, args.parent_pid).serve_forever()
    return 0
