"""``pdfabric bench engine``: prefill throughput and decode step time beside the machine's floors.

Floors are measured in the same run: a large GEMM in the model's dtype gives the compute rate, a large
copy gives the memory bandwidth. Prefill is reported as achieved FLOP/s over the GEMM rate; a decode
step as its time over the time to read the weights (and the batch's KV) once at that bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="cpu-small", help="model directory or preset (default cpu-small)")
    parser.add_argument(
        "--prefill-tokens",
        default="32,64,128,256,512,1024",
        help="comma-separated prompt lengths for prefill",
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated decode batch sizes")
    parser.add_argument("--context", type=int, default=256, help="context tokens per decoding sequence")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repetitions per point (median reported)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gemm_rate(dtype: object, repeats: int, n: int = 2048) -> float:
    """FLOP/s of an n x n x n matrix product in ``dtype``."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _median_time(lambda: a @ b, repeats)


def _copy_rate(repeats: int, nbytes: int = 256 * 2**20) -> float:
    """Memory traffic of a large copy, bytes read plus bytes written per second."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src), repeats)


def _progress(msg: str) -> None:
    print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.runner import ModelRunner, StepEntry

    prefill_lens = [int(x) for x in args.prefill_tokens.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    model = load_model(resolve_model(args.model))
    cfg = model.config
    dtype = model.model.norm.weight.dtype
    block = 16
    per_seq_blocks = -(-max(max(prefill_lens), args.context + 1) // block)
    runner = ModelRunner(model, num_blocks=per_seq_blocks * max(batch_sizes) + 1, block_size=block)

    _progress("floors: GEMM")
    gemm_flops = _gemm_rate(dtype, args.repeats)
    _progress("floors: copy")
    copy_bw = _copy_rate(args.repeats)

    matmul_params = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name
    )
    weight_bytes = sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name
    )
    results: dict[str, object] = {
        "model": str(args.model),
        "dtype": cfg.dtype,
        "threads": torch.get_num_threads(),
        "gemm_flops": gemm_flops,
        "copy_bytes_per_s": copy_bw,
        "weight_bytes": weight_bytes,
        "prefill": [],
        "decode": [],
    }
    token = (1,)
    for length in prefill_lens:
        _progress(f"prefill {length} tokens")
        entry = StepEntry(token * length, 0, tuple(range(-(-length // block))))
        t = _median_time(lambda e=entry: runner.step([e]), args.repeats)
        # Matmul FLOPs (2 per parameter per token) plus attention (QK^T and PV, causal half).
        attn = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * length
        flops = 2 * matmul_params * length + attn
        results["prefill"].append(
            {
                "tokens": length,
                "seconds": t,
                "tokens_per_s": length / t,
                "flops_per_s": flops / t,
                "ratio_to_gemm": flops / t / gemm_flops,
            }
        )
    for bs in batch_sizes:
        _progress(f"decode batch {bs}")
        entries = []
        for s in range(bs):
            table = tuple(range(s * per_seq_blocks, (s + 1) * per_seq_blocks))
            runner.step([StepEntry(token * args.context, 0, table, needs_logits=False)])
            entries.append(StepEntry(token, args.context, table))
        t = _median_time(lambda es=entries: runner.step(es), args.repeats)
        kv_bytes = bs * (args.context + 1) * cfg.kv_bytes_per_token
        floor = (weight_bytes + kv_bytes) / copy_bw
        results["decode"].append(
            {
                "batch": bs,
                "context": args.context,
                "seconds": t,
                "floor_seconds": floor,
                "ratio_to_floor": t / floor,
                "tokens_per_s": bs / t,
            }
        )
    _progress("")
    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _print_table(r: dict) -> None:
    print(f"model {r['model']} ({r['dtype']}), {r['threads']} threads")
    print(
        f"floors: GEMM {r['gemm_flops'] / 1e9:.1f} GFLOP/s, copy {r['copy_bytes_per_s'] / 1e9:.2f} GB/s "
        f"(read+write), weights {r['weight_bytes'] / 2**20:.0f} MiB"
    )
    print(f"\n{'prefill tokens':>14} {'ms':>9} {'tok/s':>9} {'GFLOP/s':>9} {'of GEMM':>8}")
    for p in r["prefill"]:
        print(
            f"{p['tokens']:>14} {p['seconds'] * 1e3:>9.1f} {p['tokens_per_s']:>9.0f} "
            f"{p['flops_per_s'] / 1e9:>9.1f} {p['ratio_to_gemm']:>8.0%}"
        )
    print(f"\n{'decode batch':>14} {'ms/step':>9} {'floor ms':>9} {'x floor':>8} {'tok/s':>9}")
    for d in r["decode"]:
        print(
            f"{d['batch']:>14} {d['seconds'] * 1e3:>9.1f} {d['floor_seconds'] * 1e3:>9.1f} "
            f"{d['ratio_to_floor']:>8.2f} {d['tokens_per_s']:>9.0f}"
        )
