"""``pdfabric worker``: one prefill, decode or colocated worker joining a router.

Its settings come whole from one place, read by the loader that reads deployment configs:
``--worker-config JSON`` (what ``pdfabric serve`` passes: every ``WorkerConfig`` field) or
``--config FILE.toml`` (a deployment config's ``[serve]`` model and dtype and its ``[worker]`` table),
else the ``WorkerConfig`` defaults. The other flags override single settings; none has a default of
its own.

It needs the deployment's cluster secret (``--secret-file``, else ``PDFABRIC_CLUSTER_SECRET``; the
launcher sets the variable for the workers it starts): the router's control socket and the decode
workers' KV endpoints take no peer without it.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace

from pdfabric.cluster_secret import ENV, ClusterSecret
from pdfabric.config import load_serve_config
from pdfabric.control import KINDS
from pdfabric.kinds.table import kind
from pdfabric.kv_config import CHOICES as KV_TRANSPORTS
from pdfabric.worker.loop import run_worker
from pdfabric.worker_config import (
    KV_CACHE_DTYPES,
    LINEARS,
    QUANTIZATIONS,
    SPECULATIVE,
    STORE_ADMISSIONS,
    WorkerConfig,
    worker_config_from_json,
    worker_default,
)

DTYPES = ("float32", "bfloat16", "float16")

# Override flags: (WorkerConfig field, type, help); the help quotes the field's default when it has one.
OVERRIDES: tuple[tuple[str, type, str], ...] = (
    ("kind", str, "prefill, decode or colocated (required unless in the config)"),
    ("join", str, "the router's control address, tcp://HOST:PORT (required unless in the config)"),
    ("model", str, "model directory, GGUF file or preset"),
    ("dtype", str, "float32, bfloat16 or float16 (default: the checkpoint's)"),
    ("pool", str, "the pool this worker joins"),
    ("worker_id", str, "its name at the router (default: KIND-PID)"),
    ("block_size", int, "tokens per KV block"),
    ("num_blocks", int, "KV blocks (0: as many as --kv-memory-mb holds)"),
    ("kv_memory_mb", int, "KV-cache memory budget"),
    ("memory_mb", int, "memory for the weights and the KV cache together (KV gets what the weights leave)"),
    ("max_batch_tokens", int, "tokens per step"),
    ("background_step_ms", float, "how long a step may run background requests' prompts (0: no limit)"),
    ("max_running", int, "sequences decoding at once"),
    ("kv_host", str, "address a decode worker binds its KV endpoint on"),
    ("heartbeat_s", float, "seconds between heartbeats to the router"),
    ("drain_timeout_s", float, "on SIGTERM: stop taking requests, exit once idle or after this many seconds"),
    ("threads", int, "torch threads (0: torch's default, all cores)"),
    ("device", str, "auto (cuda when available), cpu, cuda or cuda:N"),
    ("profile_seconds", float, "start-up profiling budget in seconds, 0: none"),
    ("kv_transport", str, "how KV moves to decode workers (auto: shm on one host, zmq across hosts)"),
    ("prefix_caching", bool, "on or off: reuse the KV of prompt prefixes computed before"),
    ("linears", str, "linear-layer kernel: invariant (the same bits in any batch), onednn or cublas"),
    (
        "kv_encryption",
        bool,
        "on or off: encrypt the KV channel (off: authenticated but in the clear, for a "
        "trusted network; the same on every worker)",
    ),
    ("served", str, "the model version it serves, NAME@VERSION, for a router with [[models]]"),
    ("quantization", str, "linear weights: none (the model's dtype), int8, int4, gguf, w8a8 or w4a8"),
    ("kv_cache_dtype", str, "KV-cache rows: auto (the model dtype) or int8 (a scale per row; bf16, CPUs)"),
    ("kv_store_ram_mb", int, "the host KV store's RAM tier, MiB (0: off)"),
    ("kv_store_ram_dir", str, "the RAM tier's directory (default: /dev/shm/pdfabric-kv-store-UID)"),
    ("kv_store_disk_dir", str, "the host KV store's disk tier: its directory"),
    ("kv_store_disk_mb", int, "the disk tier's size, MiB (0: off)"),
    (
        "kv_store_disk_admission",
        str,
        "which blocks the disk tier takes: reused (read back or offered twice) or all",
    ),
    (
        "kv_store_queue_mb",
        int,
        "evicted blocks queued for the host KV store, MiB at most (at least a longest prompt's)",
    ),
    (
        "kv_store_write_through",
        bool,
        "on or off: save a prefix the pool serves again to the host KV store at once, not only when "
        "evicted (the host's other workers read it, a crash keeps it)",
    ),
    (
        "speculative",
        str,
        "speculative decoding on decode and colocated workers: off, ngram (prompt lookup) or draft "
        "(a draft model)",
    ),
    ("draft_model", str, "the draft model's directory or preset (default: the model itself)"),
    ("draft_quantization", str, "how the draft model holds its weights (default int4)"),
    ("draft_layers", int, "keep only the draft's first N decoder layers (0: all)"),
    ("draft_cache", str, "auto (over the served model's KV cache where the layouts match) or own"),
    ("speculative_k", int, "tokens proposed at most per sequence and step"),
    ("speculative_below", int, "speculate only while at most this many sequences decode"),
)
_QUOTED = ("model", "pool", "block_size", "kv_memory_mb", "max_batch_tokens", "background_step_ms",
           "max_running", "kv_host",
           "heartbeat_s", "drain_timeout_s", "device", "profile_seconds", "kv_transport",
           "prefix_caching", "linears", "kv_encryption", "quantization", "kv_cache_dtype", "speculative",
           "speculative_k", "speculative_below", "draft_quantization", "draft_layers",
           "draft_cache")  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--worker-config", metavar="JSON", help="the whole config as one JSON object (pdfabric serve's)"
    )
    source.add_argument(
        "--config", metavar="FILE", help="TOML deployment config: its [serve] model, dtype and [worker] keys"
    )
    o = parser.add_argument_group("overrides (each replaces one setting of the config)")
    for name, type_, text in OVERRIDES:
        default = f" (default {worker_default(name)})" if name in _QUOTED else ""
        flag = "--" + name.replace("_", "-")
        choices = {"kind": KINDS, "dtype": DTYPES, "kv_transport": KV_TRANSPORTS, "linears": LINEARS,
                   "speculative": SPECULATIVE, "quantization": QUANTIZATIONS,
                   "kv_cache_dtype": KV_CACHE_DTYPES, "draft_quantization": QUANTIZATIONS,
                   "kv_store_disk_admission": STORE_ADMISSIONS}  # fmt: skip
        choices = choices.get(name)
        parse = _on_off if type_ is bool else type_
        o.add_argument(flag, type=parse, choices=choices, help=text + default)
    p = parser.add_argument_group("process")
    p.add_argument(
        "--secret-file", metavar="FILE",
        help=f"the cluster secret (default: the {ENV} environment variable); the file must not be "
        "readable by other users",
    )  # fmt: skip
    p.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone (0: never)")
    p.add_argument("--log-level", default="INFO", help="log level (default INFO)")


def _on_off(text: str) -> bool:
    words = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}
    if text.lower() not in words:
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return words[text.lower()]


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config: ``--worker-config`` or ``--config``, then the override flags; ``ValueError``
    naming what is wrong."""
    overrides = {name: v for name, _, _ in OVERRIDES if (v := getattr(args, name)) is not None}
    if args.worker_config is not None:
        base = worker_config_from_json(args.worker_config)
    elif args.config is not None:
        kind = overrides.get("kind", "colocated")  # the [worker] table holds no kind
        base = replace(load_serve_config(args.config, {}).worker, kind=kind)
    else:
        if "kind" not in overrides:
            raise ValueError("give --kind (or a --worker-config that has one)")
        base = WorkerConfig(kind=overrides["kind"])
    cfg = replace(base, **overrides)
    if not cfg.join:
        raise ValueError("give --join tcp://HOST:PORT, the router's control address")
    return cfg


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = config_from_args(args)
        secret = secret_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"pdfabric worker: error: {exc}", file=sys.stderr)
        return 2
    run_worker(cfg, kind(cfg.kind), secret, args.parent_pid)
    return 0


def secret_from_args(args: argparse.Namespace) -> ClusterSecret:
    """The cluster secret from ``--secret-file``, else the environment; ``ValueError`` without one."""
    if args.secret_file:
        return ClusterSecret.load(args.secret_file)
    secret = ClusterSecret.from_env()
    if secret is None:
        raise ValueError(
            f"the cluster secret is needed to join: give --secret-file FILE or set {ENV} (pdfabric "
            "serve sets it for the workers it starts; [serve] cluster_secret_file names the deployment's)"
        )
    return secret
