"""Kernel speed on a CUDA device: paged attention (decode and prompt), linear layers, KV block pack/unpack.

Decode attention is memory-bound: its floor is reading every cached key and value once. For each
(batch, context) shape the report gives the Triton kernel's time and achieved bandwidth (KV bytes
read / time), the same for torch ``scaled_dot_product_attention`` on KV already gathered into dense
tensors (the gather not timed), the torch reference (gather included), and the device-to-device copy
bandwidth measured in the same run (bytes read + written / time). Prompt attention (fresh prompts,
causal) is reported in TFLOP/s (the causal half counted) against SDPA on dense tensors. The linear
layers compare the batch-invariant Triton matmul with cuBLAS (``F.linear``) at decode and prompt row
counts, in TFLOP/s and GB/s (input, weight and output bytes / time). Quantized linears (weights in
groups of 32 inputs, ``quantized_triton``: 4 bits with offsets as int4/Q4_1, 8 bits as Q8_0) are timed
beside the same bfloat16 layer by both, with the weight bytes each reads. Block gather/scatter are
reported as bytes read + written / time beside the same copy.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

PARTS = ("decode", "prefill", "linear", "quantized", "pack")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="bfloat16")
    parser.add_argument("--shapes", default="1x32768,8x8192,32x4096,64x2048,128x1024,128x4096,256x2048",
                        help="comma-separated BATCHxCONTEXT decode shapes")
    parser.add_argument("--prefill-shapes", default="1x1024,1x4096,8x2048",
                        help="comma-separated SEQSxPROMPT fresh prompt-attention shapes")
    parser.add_argument("--linear-shapes", default="576x960,576x576,576x3072,1536x576,576x49152,4096x14336",
                        help="comma-separated INxOUT linear shapes (default: SmolLM2-135M's and an 8B up "
                        "projection)")
    parser.add_argument("--linear-rows", default="1,8,32,128,512,2048", help="comma-separated row counts")
    parser.add_argument("--pack-blocks", type=int, default=2048, help="blocks per gather/scatter call")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--json", type=str, default=None, help="write the results here as JSON")


def _time_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _copy_bandwidth(torch: Any, nbytes: int = 1 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / _time_ms(lambda: dst.copy_(src)) / 1e6  # GB/s


def _decode_row(torch: Any, args: argparse.Namespace, batch: int, ctx: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from pdfabric.kernels.attention_ref import paged_attention_ref
    from pdfabric.kernels.paged_attention_triton import choose_num_splits, paged_attention_triton
    from pdfabric.kernels.testing import make_batch

    dtype = getattr(torch, args.dtype)
    q, kv, meta = make_batch([1] * batch, [ctx] * batch, args.q_heads, args.kv_heads, args.head_dim,
                             args.block_size, dtype, seed=batch, device="cuda")
    scale = args.head_dim**-0.5
    kv_bytes = 2 * batch * ctx * args.kv_heads * args.head_dim * kv.element_size()
    blocks = meta.block_tables.long()  # [S, n]
    dense = kv[:, blocks].reshape(2, batch, -1, args.kv_heads, args.head_dim)[:, :, :ctx]
    k = dense[0].transpose(1, 2).contiguous()  # [S, Hkv, ctx, D]
    v = dense[1].transpose(1, 2).contiguous()
    qs = q[:, :, None]  # [S, Hq, 1, D]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=True)

    out = paged_attention_triton(q, kv, meta, scale)
    err = (out.float() - sdpa()[:, :, 0].float()).abs().max().item()
    t_tri = _time_ms(lambda: paged_attention_triton(q, kv, meta, scale))
    t_sdpa = _time_ms(sdpa)
    t_ref = _time_ms(lambda: paged_attention_ref(q, kv, meta, scale)) if kv_bytes < (4 << 30) else None
    splits = choose_num_splits(ctx)
    return {
        "batch": batch, "context": ctx, "kv_mb": kv_bytes / 1e6, "splits": splits,
        "triton_us": t_tri * 1e3, "triton_gbs": kv_bytes / t_tri / 1e6,
        "sdpa_us": t_sdpa * 1e3, "sdpa_gbs": kv_bytes / t_sdpa / 1e6,
        "ref_us": None if t_ref is None else t_ref * 1e3, "max_abs_err_vs_sdpa": err,
    }


def _prefill_row(torch: Any, args: argparse.Namespace, seqs: int, length: int) -> dict[str, Any]:
    import torch.nn.functional as F

    from pdfabric.kernels.paged_attention_triton import paged_attention_triton
    from pdfabric.kernels.testing import make_batch

    dtype = getattr(torch, args.dtype)
    q, kv, meta = make_batch([length] * seqs, [length] * seqs, args.q_heads, args.kv_heads, args.head_dim,
                             args.block_size, dtype, seed=seqs, device="cuda")
    scale = args.head_dim**-0.5
    flops = 4 * seqs * args.q_heads * args.head_dim * length * (length + 1) // 2  # QK^T and PV, causal
    blocks = meta.block_tables.long()  # [S, n]
    dense = kv[:, blocks].reshape(2, seqs, -1, args.kv_heads, args.head_dim)[:, :, :length]
    k = dense[0].transpose(1, 2).contiguous()  # [S, Hkv, L, D]
    v = dense[1].transpose(1, 2).contiguous()
    qs = q.view(seqs, length, args.q_heads, args.head_dim).transpose(1, 2)  # [S, Hq, L, D]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(qs, k, v, scale=scale, is_causal=True, enable_gqa=True)

    t_tri = _time_ms(lambda: paged_attention_triton(q, kv, meta, scale))
    t_sdpa = _time_ms(sdpa)
    return {"seqs": seqs, "length": length, "triton_us": t_tri * 1e3, "triton_tflops": flops / t_tri / 1e9,
            "sdpa_us": t_sdpa * 1e3, "sdpa_tflops": flops / t_sdpa / 1e9}


def _linear_rows(torch: Any, args: argparse.Namespace, k: int, n: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from pdfabric.kernels.linear_triton import linear_triton

    dtype = getattr(torch, args.dtype)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(dtype)  # [out, in]
    rows = []
    for m in (int(r) for r in args.linear_rows.split(",")):
        x = torch.randn(m, k, device="cuda").to(dtype)
        moved = (m * k + k * n + m * n) * x.element_size()
        t_tri = _time_ms(lambda x=x: linear_triton(x, w))
        t_cublas = _time_ms(lambda x=x: F.linear(x, w))
        flops = 2 * m * k * n
        rows.append({"in": k, "out": n, "rows": m, "triton_us": t_tri * 1e3, "cublas_us": t_cublas * 1e3,
                     "triton_tflops": flops / t_tri / 1e9, "cublas_tflops": flops / t_cublas / 1e9,
                     "triton_gbs": moved / t_tri / 1e6, "cublas_gbs": moved / t_cublas / 1e6})
    return rows


def _quantized_rows(torch: Any, args: argparse.Namespace, k: int, n: int) -> list[dict[str, Any]]:
    import torch.nn.functional as F

    from pdfabric.kernels.linear_triton import linear_triton
    from pdfabric.kernels.quantized import GroupedWeight, quantize_int4
    from pdfabric.kernels.quantized_triton import TritonGroupedLinear

    dtype = getattr(torch, args.dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)  # [out, in]
    int4 = quantize_int4(w)
    q8 = GroupedWeight(torch.randint(-128, 128, (n, k), dtype=torch.int8).view(torch.uint8),
                       torch.rand(n, k // 32) / (64 * k**0.5), None, 8)  # fmt: skip
    layers = {4: TritonGroupedLinear(int4, None, torch.device("cuda")),
              8: TritonGroupedLinear(q8, None, torch.device("cuda"))}  # fmt: skip
    held = {b: sum(t.numel() * t.element_size() for t in (m.q, m.scales) + ((m.offsets,) if b == 4 else ()))
            for b, m in layers.items()}  # fmt: skip
    w = w.cuda()
    rows = []
    for m in (int(r) for r in args.linear_rows.split(",")):
        x = torch.randn(m, k, device="cuda").to(dtype)
        times = {"bf16_triton": _time_ms(lambda x=x: linear_triton(x, w)),
                 "bf16_cublas": _time_ms(lambda x=x: F.linear(x, w)),
                 "int4": _time_ms(lambda x=x: layers[4](x)),
                 "q8": _time_ms(lambda x=x: layers[8](x))}  # fmt: skip
        row = {"in": k, "out": n, "rows": m, **{f"{name}_us": t * 1e3 for name, t in times.items()}}
        row["bf16_weight_mb"] = w.numel() * w.element_size() / 1e6
        row["int4_weight_mb"], row["q8_weight_mb"] = held[4] / 1e6, held[8] / 1e6
        row["int4_gbs"], row["q8_gbs"] = held[4] / times["int4"] / 1e6, held[8] / times["q8"] / 1e6
        rows.append(row)
    return rows


def _pack_rows(torch: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    from pdfabric.kernels.kv_pack_ref import gather_blocks_ref, scatter_blocks_ref
    from pdfabric.kernels.kv_pack_triton import gather_blocks_triton, scatter_blocks_triton

    dtype = getattr(torch, args.dtype)
    n = args.pack_blocks
    kv = torch.randn(2, 4 * n, args.block_size, args.kv_heads, args.head_dim, device="cuda").to(dtype)
    ids = torch.randperm(4 * n, device="cuda")[:n]
    out = torch.empty((2, n, *kv.shape[2:]), dtype=dtype, device="cuda")
    moved = 2 * out.numel() * out.element_size()  # read + write
    cases = {
        "gather triton": lambda: gather_blocks_triton(kv, ids, out),
        "gather torch": lambda: gather_blocks_ref(kv, ids, out),
        "scatter triton": lambda: scatter_blocks_triton(kv, ids, out),
        "scatter torch": lambda: scatter_blocks_ref(kv, ids, out),
    }
    rows = []
    for name, fn in cases.items():
        t = _time_ms(fn)
        rows.append({"op": name, "blocks": n, "mb": out.numel() * out.element_size() / 1e6,
                     "us": t * 1e3, "gbs": moved / t / 1e6})
    return rows


def _pairs(spec: str) -> list[tuple[int, int]]:
    return [(int(a), int(b)) for a, b in (s.split("x") for s in spec.split(","))]


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench kernels needs a CUDA device")
        return 2
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        print(f"--parts takes {', '.join(PARTS)}; got {args.parts}")
        return 2
    copy_gbs = _copy_bandwidth(torch)
    decode, prefill, linear, quantized, pack = [], [], [], [], []
    if "decode" in parts:
        decode = [_decode_row(torch, args, b, c) for b, c in _pairs(args.shapes)]
    if "prefill" in parts:
        prefill = [_prefill_row(torch, args, s, n) for s, n in _pairs(args.prefill_shapes)]
    if "linear" in parts:
        linear = [r for k, n in _pairs(args.linear_shapes) for r in _linear_rows(torch, args, k, n)]
    if "quantized" in parts:
        shapes = [(k, n) for k, n in _pairs(args.linear_shapes) if k % 32 == 0]
        quantized = [r for k, n in shapes for r in _quantized_rows(torch, args, k, n)]
    if "pack" in parts:
        pack = _pack_rows(torch, args)

    print(f"device: {torch.cuda.get_device_name()}  copy bandwidth (read+write): {copy_gbs:.0f} GB/s")
    heads = f"q_heads={args.q_heads} kv_heads={args.kv_heads} head_dim={args.head_dim}"
    if decode:
        print(f"decode: {heads} block_size={args.block_size} {args.dtype}")
        print(f"{'batch':>5} {'ctx':>6} {'KV MB':>8} {'splits':>6} {'triton us':>10} {'GB/s':>6} "
              f"{'%copy':>6} {'sdpa us':>9} {'GB/s':>6} {'ref us':>9}")
    for r in decode:
        ref = "-" if r["ref_us"] is None else f"{r['ref_us']:.0f}"
        print(f"{r['batch']:>5} {r['context']:>6} {r['kv_mb']:>8.0f} {r['splits']:>6} "
              f"{r['triton_us']:>10.1f} "
              f"{r['triton_gbs']:>6.0f} {100 * r['triton_gbs'] / copy_gbs:>5.0f}% {r['sdpa_us']:>9.1f} "
              f"{r['sdpa_gbs']:>6.0f} {ref:>9}")
    if prefill:
        print(f"prompt attention (fresh prompts, causal): {heads} block_size={args.block_size} {args.dtype}")
        print(f"{'seqs':>5} {'prompt':>6} {'triton us':>10} {'TFLOP/s':>8} {'sdpa us':>9} {'TFLOP/s':>8}")
    for r in prefill:
        print(f"{r['seqs']:>5} {r['length']:>6} {r['triton_us']:>10.1f} {r['triton_tflops']:>8.1f} "
              f"{r['sdpa_us']:>9.1f} {r['sdpa_tflops']:>8.1f}")
    if linear:
        print(f"linear y = x W^T: triton (batch-invariant) vs cublas (F.linear), {args.dtype}")
        print(f"{'in':>5} {'out':>6} {'rows':>5} {'triton us':>10} {'TFLOP/s':>8} {'GB/s':>6} "
              f"{'cublas us':>10} {'TFLOP/s':>8} {'GB/s':>6} {'ratio':>6}")
    for r in linear:
        print(f"{r['in']:>5} {r['out']:>6} {r['rows']:>5} {r['triton_us']:>10.1f} {r['triton_tflops']:>8.1f} "
              f"{r['triton_gbs']:>6.0f} {r['cublas_us']:>10.1f} {r['cublas_tflops']:>8.1f} "
              f"{r['cublas_gbs']:>6.0f} {r['triton_us'] / r['cublas_us']:>6.2f}")
    if quantized:
        print(f"quantized linear (groups of 32 inputs, triton) beside the {args.dtype} layer: us, and GB/s "
              "of the weight bytes each reads")
        print(f"{'in':>5} {'out':>6} {'rows':>5} {'bf16 tri':>9} {'cublas':>8} {'int4':>8} {'GB/s':>6} "
              f"{'q8':>8} {'GB/s':>6} {'cublas/int4':>11}")
    for r in quantized:
        print(f"{r['in']:>5} {r['out']:>6} {r['rows']:>5} {r['bf16_triton_us']:>9.1f} "
              f"{r['bf16_cublas_us']:>8.1f} "
              f"{r['int4_us']:>8.1f} {r['int4_gbs']:>6.0f} {r['q8_us']:>8.1f} {r['q8_gbs']:>6.0f} "
              f"{r['bf16_cublas_us'] / r['int4_us']:>11.2f}")
    if pack:
        print(f"{'op':<15} {'blocks':>6} {'MB':>7} {'us':>8} {'GB/s':>6} {'%copy':>6}")
    for r in pack:
        print(f"{r['op']:<15} {r['blocks']:>6} {r['mb']:>7.0f} {r['us']:>8.1f} {r['gbs']:>6.0f} "
              f"{100 * r['gbs'] / copy_gbs:>5.0f}%")
    if args.json:
        result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "copy_gbs": copy_gbs, "args": vars(args), "decode": decode, "prefill": prefill,
                  "linear": linear, "quantized": quantized, "pack": pack}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
