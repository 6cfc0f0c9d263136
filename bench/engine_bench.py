"""``pdfabric bench engine``: prefill throughput and decode step time beside the machine's floors.

Floors are measured in the same run: GEMMs in the model's dtype give the compute rate, a sum over
a large buffer gives the memory's read bandwidth (a large copy's is printed beside it). Both are the
best of several tries (a floor is what the machine can do, and a busy moment only ever makes a try
slower), while the model's own points are medians. Prefill is reported as achieved FLOP/s over the
GEMM rate; a decode step as its time over the time to read what it must read once at that
bandwidth: every weight it multiplies (the head included: a tied head reads the embedding table)
and the batch's KV.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdfabric.bench.floors import copy_rate, cpu_name, gemm_rate, median_time, read_rate
from pdfabric.worker_config import KV_CACHE_DTYPES, QUANTIZATIONS

LINEAR_KINDS = ("invariant", "onednn")  # kernels/linear_cpu.py's, named here so --help imports no torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="model directory, GGUF file or preset (default smollm2-135m: 30 layers, 49,152 tokens)",
    )
    parser.add_argument(
        "--prefill-tokens",
        default="256,512,1024,2048",
        help="comma-separated prompt lengths for prefill (default 256,512,1024,2048)",
    )
    parser.add_argument(
        "--batch-sizes", default="1,2,4,8,16,32", help="comma-separated decode batch sizes (default 1-32)"
    )
    parser.add_argument(
        "--context", type=int, default=512, help="context tokens per decoding sequence (default 512)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype (default: the checkpoint's, float32 on a CPU without native bfloat16)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    parser.add_argument(
        "--linears",
        choices=LINEAR_KINDS,
        default="invariant",
        help="linear-layer kernel on the CPU: invariant (what pdfabric serves: a row's sums in one order "
        "whatever the batch) or onednn (oneDNN's packed GEMM, for comparison)",
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="how the linear layers' weights are held, as a worker's setting: none (the model's dtype), "
        "int8, int4, gguf (weight-only), w8a8 or w4a8 (activations too); the decode floor counts the bytes "
        "actually read",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="what the KV cache stores a row as, as a worker's setting: auto (the model's dtype) or int8 "
        "(a scale per row); the decode floor counts the cache's bytes",
    )
    parser.add_argument(
        "--decoder",
        choices=("c", "ops"),
        default="c",
        help="how decode steps run their layers on the CPU: c (what pdfabric serves: one C call for all "
        "layers, where every kernel of a layer is a C one) or ops (the model's op-by-op forward, for "
        "comparison and a per-op profile)",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repetitions per point (median reported)"
    )
    parser.add_argument(
        "--op-profile",
        type=int,
        default=0,
        metavar="N",
        help="also profile one step of the longest prefill and of the smallest and largest decode "
        "batches with the torch profiler and print the N ops with the most self time",
    )
    parser.add_argument(
        "--grammar",
        action="store_true",
        help="also time structured output at each decode batch: a JSON schema's token masks and the "
        "masked sampling, per step and as a share of the step (bench/grammar_cost.py)",
    )
    parser.add_argument(
        "--sampling",
        action="store_true",
        help="also time the sampler at each decode batch on the step's logits: greedy, temperature, "
        "top-p and top-k rows, per step and as a share of the step (bench/sampling_cost.py)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _progress(msg: str) -> None:
    print(f"\r\033[K{msg}", end="", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    import torch

    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.kv_cache import kv_bytes_per_token
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.runner import ModelRunner, StepEntry
    from pdfabric.kernels import get_backend

    prefill_lens = [int(x) for x in args.prefill_tokens.split(",")]
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(resolve_model(args.model), args.dtype, quantization=args.quantization)
    cfg = model.config
    dtype = model.model.norm.weight.dtype
    # Counted before the runner packs the linear layers (packed weights are buffers, not parameters).
    matmul_params = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embed_tokens" not in name
    )
    embed = model.model.embed_tokens.weight
    head_bytes = embed.numel() * embed.element_size() if cfg.tie_word_embeddings else 0
    weight_bytes = head_bytes + sum(
        p.numel() * p.element_size() for name, p in model.named_parameters() if "embed_tokens" not in name
    )
    block = 16
    per_seq_blocks = -(-max(max(prefill_lens), args.context + 1) // block)
    runner = ModelRunner(
        model, num_blocks=per_seq_blocks * max(batch_sizes) + 1, block_size=block, linears=args.linears,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    if args.quantization != "none":  # what a step reads: the packed weights, and the norms as loaded
        weight_bytes = sum(
            b.numel() * b.element_size() for n, b in model.named_buffers() if n.endswith("packed_weight")
        ) + sum(p.numel() * p.element_size() for n, p in model.named_parameters() if p.dim() < 2)
    if args.decoder == "ops":
        runner.decoder = None

    _progress("floors: GEMM")
    gemm_flops = gemm_rate(dtype, args.repeats)
    _progress("floors: memory")
    copy_bw = copy_rate(args.repeats)
    read_bw = read_rate(args.repeats)

    results: dict[str, object] = {
        "model": str(args.model),
        "dtype": cfg.dtype,
        "threads": torch.get_num_threads(),
        "kernel_backend": get_backend(),
        "linears": args.linears,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "decoder": "c" if runner.decoder is not None else "ops",
        "cpu": cpu_name(),
        "gemm_flops": gemm_flops,
        "copy_bytes_per_s": copy_bw,
        "read_bytes_per_s": read_bw,
        "weight_bytes": weight_bytes,
        "prefill": [],
        "decode": [],
    }
    token = (1,)
    for length in prefill_lens:
        _progress(f"prefill {length} tokens")
        entry = StepEntry(token * length, 0, tuple(range(-(-length // block))))
        t = median_time(lambda e=entry: runner.step([e]), args.repeats)
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
    batches = {}
    for bs in batch_sizes:
        _progress(f"decode batch {bs}")
        entries = []
        for s in range(bs):
            table = tuple(range(s * per_seq_blocks, (s + 1) * per_seq_blocks))
            runner.step([StepEntry(token * args.context, 0, table, needs_logits=False)])
            entries.append(StepEntry(token, args.context, table))
        batches[bs] = entries
        t = median_time(lambda es=entries: runner.step(es), args.repeats)
        kv_bytes = bs * (args.context + 1) * kv_bytes_per_token(cfg, args.kv_cache_dtype)
        floor = (weight_bytes + kv_bytes) / read_bw
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
    if args.grammar:
        from pdfabric.bench.grammar_cost import grammar_cost

        results["grammar"] = []
        for d in results["decode"]:
            _progress(f"grammar masks, batch {d['batch']}")
            cost = grammar_cost(resolve_model(args.model), cfg.vocab_size, runner.step(batches[d["batch"]]))
            cost["share_of_step"] = (cost["mask_seconds"] + cost["sample_extra_seconds"]) / d["seconds"]
            results["grammar"].append(cost)
    if args.sampling:
        from pdfabric.bench.sampling_cost import sampling_cost

        results["sampling"] = []
        for d in results["decode"]:
            _progress(f"sampling, batch {d['batch']}")
            cost = sampling_cost(runner.step(batches[d["batch"]]), args.repeats)
            cost["share_of_step"] = {m: s / d["seconds"] for m, s in cost["seconds"].items()}
            results["sampling"].append(cost)
    if args.op_profile:
        _progress("op profile")
        prefill = StepEntry(token * prefill_lens[-1], 0, tuple(range(-(-prefill_lens[-1] // block))))
        results["op_profile"] = {
            f"prefill {prefill_lens[-1]} tokens": _op_profile(runner, [prefill], args.op_profile)
        }
        for bs in sorted({min(batch_sizes), max(batch_sizes)}):
            results["op_profile"][f"decode batch {bs}"] = _op_profile(runner, batches[bs], args.op_profile)
    _progress("")
    _print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def _op_profile(runner: object, entries: list, top: int, steps: int = 3) -> list[dict]:
    """The ``top`` ops by self CPU time over ``steps`` runs of one step, per step, with their share."""
    from torch.profiler import ProfilerActivity, profile

    runner.step(entries)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.step(entries)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [
        {
            "op": e.key,
            "ms_per_step": e.self_cpu_time_total / 1e3 / steps,
            "calls_per_step": e.count / steps,
            "share": e.self_cpu_time_total / total,
        }
        for e in events[:top]
    ]


def _print_table(r: dict) -> None:
    print(
        f"model {r['model']} ({r['dtype']}), {r['threads']} threads, kernels {r['kernel_backend']}, "
        f"linears {r['linears']}, decoder {r.get('decoder', 'ops')}, "
        f"quantization {r.get('quantization', 'none')}"
    )
    print(f"cpu: {r['cpu']}")
    print(
        f"floors: GEMM {r['gemm_flops'] / 1e9:.1f} GFLOP/s, read {r['read_bytes_per_s'] / 1e9:.1f} GB/s "
        f"(copy {r['copy_bytes_per_s'] / 1e9:.1f} GB/s read+write), weights read per step "
        f"{r['weight_bytes'] / 2**20:.0f} MiB"
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
    if r.get("grammar"):
        g = r["grammar"][0]
        once, cold, cached = g["tokenizer_seconds"], g["compile_seconds"], g["cached_compile_seconds"]
        print(
            f"\nstructured output, a JSON schema (bench/grammar_cost.py): tokenizer {once * 1e3:.0f} ms "
            f"once, compile {cold * 1e3:.1f} ms, cached {cached * 1e3:.2f} ms"
        )
        print(f"{'decode batch':>14} {'masks ms':>9} {'sample ms':>10} {'of step':>8}")
        for g in r["grammar"]:
            print(
                f"{g['batch']:>14} {g['mask_seconds'] * 1e3:>9.3f} {g['sample_extra_seconds'] * 1e3:>10.3f} "
                f"{g['share_of_step']:>8.1%}"
            )
    if r.get("sampling"):
        modes = list(r["sampling"][0]["seconds"])
        print("\nsampling one step's rows, ms (share of the decode step; bench/sampling_cost.py)")
        print(f"{'decode batch':>14} " + " ".join(f"{m:>20}" for m in modes))
        for c in r["sampling"]:
            cells = [f"{c['seconds'][m] * 1e3:.2f} ({c['share_of_step'][m]:.0%})" for m in modes]
            print(f"{c['batch']:>14} " + " ".join(f"{cell:>20}" for cell in cells))
    for step, ops in r.get("op_profile", {}).items():
        print(f"\n{step}: ops by self CPU time (torch profiler, per step)")
        print(f"{'op':<48} {'ms':>8} {'calls':>7} {'share':>6}")
        for o in ops:
            print(
                f"{o['op'][:48]:<48} {o['ms_per_step']:>8.2f} {o['calls_per_step']:>7.0f} {o['share']:>6.1%}"
            )
