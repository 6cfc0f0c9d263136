"""KV transfer bandwidth per transport beside a one-core memcpy of the same bytes, measured in one run.

The receiver runs in a second (spawned) process, the sender in this one; both use one torch thread.
A transfer is timed from ``start()`` to the receiver's acknowledgement (every layer written into the
reserved blocks), so latency includes the control round trip. Payload rows use a 4-layer layout with
64 KiB per block (all layers, keys and values); prompt rows use the ``cpu-small`` layout (12 layers,
8 KV heads, head_dim 64, bfloat16, block size 16: 24576 bytes per token). Blocks are contiguous on
both sides. The layer-wise row spins one core for ``prefill_ms / layers`` per layer (a stand-in for
the model), sends each layer when it is "computed", and reports how much later than the compute
alone the last acknowledgement came.

The ``tcp-raw`` row is no pdfabric transport: the same bytes over one plain TCP socket pair on the
same loopback (``sendall`` of one contiguous buffer, ``recv_into`` the destination tensor, a one-byte
acknowledgement), the ceiling that ``zmq-tcp`` is compared with. When both rows are asked for,
their repeats alternate in one loop, so that a change in the machine's load hits both alike.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdfabric.bench.transfer_sender import (
    CPU_SMALL,
    CPU_SMALL_PARAMS,
    LAYERWISE_TOKENS,
    PAYLOAD,
    RAW,
    TRANSPORTS,
    bench_session,
    gemm_flops,
)


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(text[:-1]) * units[text[-1]]) if text[-1:] in units else int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes", default="64K,256K,1M,4M,8M,16M,64M,256M", help="payload sizes (multiples of 64K)"
    )
    parser.add_argument(
        "--prompts", default="512,2048,8192", help="cpu-small prompt lengths in tokens ('' for none)"
    )
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help=f"subset of {','.join(TRANSPORTS)}"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per row (median reported)")
    parser.add_argument("--checksum", action="store_true", help="send and verify crc32 per frame")
    parser.add_argument(
        "--prefill-ms",
        type=float,
        default=None,
        help="prefill time of a 2048-token cpu-small prompt for the layer-wise row "
        "(default: estimated from this machine's one-thread float32 GEMM rate; 0 skips the row)",
    )
    parser.add_argument("--json", type=str, default=None, help="write the results here as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def run(args: argparse.Namespace) -> int:
    import torch

    from pdfabric.bench.progress import Progress

    torch.set_num_threads(1)
    kinds = [k for k in args.transports.split(",") if k]
    bad = [k for k in kinds if k not in TRANSPORTS]
    if bad or args.repeats < 1:
        print(f"bench transfer: unknown transports {bad} or repeats < 1", file=sys.stderr)
        return 2
    try:
        payloads = [(s, _size(s) // (64 << 10), PAYLOAD) for s in args.sizes.split(",") if s]
        prompts = [(f"cpu-small {p} tok", int(p) // 16, CPU_SMALL) for p in args.prompts.split(",") if p]
    except (ValueError, IndexError):
        print("bench transfer: bad --sizes or --prompts", file=sys.stderr)
        return 2
    rows = payloads + prompts
    if any(n < 1 for _, n, _ in rows):
        print("bench transfer: sizes must be >= 64K and prompts >= 16 tokens", file=sys.stderr)
        return 2
    prefill_ms = args.prefill_ms
    if prefill_ms is None:
        prefill_ms = 2 * CPU_SMALL_PARAMS * LAYERWISE_TOKENS / gemm_flops(torch) * 1e3
    progress = Progress(len(kinds) * len(rows), "transfer", enabled=not args.no_progress)
    try:
        paired = RAW in kinds and "zmq-tcp" in kinds  # tcp-raw is then timed beside zmq-tcp
        with bench_session(kinds, args.repeats, args.checksum, progress) as bench:
            for kind in kinds:
                if kind == RAW and paired:
                    continue
                for dims in (PAYLOAD, CPU_SMALL):
                    mine = [(label, n) for label, n, d in rows if d == dims]
                    if mine:
                        layerwise_ms = prefill_ms if dims == CPU_SMALL else 0.0
                        bench.measure(kind, dims, mine, layerwise_ms, raw_beside=paired and kind == "zmq-tcp")
    finally:
        progress.close()
    results = sorted(bench.results, key=lambda r: TRANSPORTS.index(r["transport"]))  # stable: rows in order
    layerwise = bench.layerwise
    _print(results, layerwise, prefill_ms)
    if args.json:
        with open(args.json, "w") as f:
            meta = {
                "threads": 1,
                "checksum": args.checksum,
                "repeats": args.repeats,
                "prefill_ms": prefill_ms,
            }
            json.dump({"results": results, "layerwise": layerwise, "meta": meta}, f, indent=2)
    return 0


def _print(results: list[dict[str, Any]], layerwise: list[dict[str, Any]], prefill_ms: float) -> None:
    print(f"{'transport':<9} {'payload':<18} {'MiB':>8} {'p50 ms':>9} {'GB/s':>7} {'memcpy':>7} {'ratio':>6}")
    for r in results:
        print(
            f"{r['transport']:<9} {r['payload']:<18} {r['bytes'] / 2**20:>8.2f} {r['latency_ms']:>9.2f} "
            f"{r['gbps']:>7.2f} {r['memcpy_gbps']:>7.2f} {r['ratio']:>6.2f}"
        )
    raw = {r["payload"]: r["gbps"] for r in results if r["transport"] == RAW}
    against = [
        (r["payload"], r["gbps"] / raw[r["payload"]])
        for r in results
        if r["transport"] == "zmq-tcp" and r["payload"] in raw
    ]
    if against:
        print(
            "\nzmq-tcp / tcp-raw (same loopback, same run): " + ", ".join(f"{p} {x:.2f}" for p, x in against)
        )
    if layerwise:
        print(f"\nlayer-wise, cpu-small 2048-token prompt, prefill stand-in {prefill_ms:.0f} ms:")
        for r in layerwise:
            print(
                f"  {r['transport']:<9} layer-wise +{r['layerwise_overhead'] * 100:.2f}% "
                f"({r['layerwise_total_ms']:.0f} ms)   whole +{r['whole_overhead'] * 100:.2f}% "
                f"({r['whole_total_ms']:.0f} ms)"
            )
