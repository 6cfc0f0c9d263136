"""``pdfabric bench perplexity``: how well a model, in a given weight format, predicts a held text.

The text is the Python standard library's sources on this machine by default (its ``.py`` files in
name order, read until ``--tokens`` tokens), or a file. It is cut into windows of ``--context`` tokens
that do not overlap; each window is one prefill through the engine's own runner (so the kernels, the
weight format and the dtype are those a worker serves with), and every token after a window's first
(or from ``--score-from`` on) is scored given the tokens before it in the window. Perplexity is exp of
the mean negative log-likelihood over all scored tokens. Comparing formats (``--quantization
none,int8,int4,gguf,w8a8,w4a8``) on the same text and windows tells what a format costs in accuracy; greedy
text is not expected to stay the same. ``--text FILE --score-from 257`` (for 512-token windows)
scores what llama.cpp's ``llama-perplexity -f FILE -c 512`` scores, so the two can be set side by
side on one GGUF file (docs/engine.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from pdfabric.worker_config import KV_CACHE_DTYPES, QUANTIZATIONS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="smollm2-135m", help="model directory, GGUF file or preset (default smollm2-135m)"
    )
    parser.add_argument(
        "--quantization",
        default="none",
        help="comma-separated weight formats to score, each on the same windows: none (the model's dtype), "
        "int8, int4, gguf, w8a8, w4a8 (default none)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma-separated KV-cache row formats to score with each weight format: auto (the model's "
        "dtype), int8 (default auto)",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype")
    parser.add_argument(
        "--text", metavar="FILE", help="a UTF-8 text file (default: the standard library's sources)"
    )
    parser.add_argument(
        "--tokens", type=int, default=32768, help="tokens of text to score at most (default 32768)"
    )
    parser.add_argument("--context", type=int, default=512, help="tokens per window (default 512)")
    parser.add_argument(
        "--score-from",
        type=int,
        default=1,
        metavar="N",
        help="score each window's tokens from its N-th on, the ones before only context (default 1: all "
        "but the first; llama.cpp's llama-perplexity scores from context / 2 + 1)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: all cores)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress line on stderr")


def held_text(path: str | None, limit_chars: int) -> tuple[str, str]:
    """The text to score and where it came from: ``path``, or the standard library's ``.py`` files in
    name order, read until ``limit_chars`` characters."""
    from pathlib import Path

    if path:
        return Path(path).read_text(encoding="utf-8")[:limit_chars], path
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    parts, have = [], 0
    for file in sorted(root.glob("*.py")):
        text = file.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        have += len(text)
        if have >= limit_chars:
            break
    return "".join(parts)[:limit_chars], f"{root}/*.py (name order)"


def score(
    runner: object, windows: list[list[int]], progress: bool, label: str, score_from: int = 1
) -> tuple[float, int]:
    """The summed negative log-likelihood of every window's tokens from its ``score_from``-th on (each
    predicted from the tokens before it), and their count."""
    import torch

    from pdfabric.engine.runner import StepEntry

    nll, count = 0.0, 0
    blocks = -(-max(len(w) for w in windows) // runner.block_size)  # type: ignore[attr-defined]
    for i, window in enumerate(windows):
        entry = StepEntry(tuple(window), 0, tuple(range(blocks)), needs_logits=True, all_logits=True)
        logits = runner.step([entry])  # type: ignore[attr-defined]
        logprobs = torch.log_softmax(logits[score_from - 1 : -1].float(), dim=-1)
        targets = torch.tensor(window[score_from:], dtype=torch.long)
        nll -= float(logprobs.gather(1, targets[:, None]).sum())
        count += len(window) - score_from
        if progress:
            print(f"\r{label}: window {i + 1}/{len(windows)}, perplexity so far {math.exp(nll / count):.3f}",
                  end="", file=sys.stderr, flush=True)  # fmt: skip
    if progress:
        print(file=sys.stderr)
    return nll, count


def run(args: argparse.Namespace) -> int:
    import torch

    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.runner import ModelRunner
    from pdfabric.engine.tokenizer import Tokenizer

    formats = [f.strip() for f in args.quantization.split(",") if f.strip()]
    if not formats or any(f not in QUANTIZATIONS for f in formats):
        error = f"--quantization takes a list of {', '.join(QUANTIZATIONS)}, got {args.quantization!r}"
        print(f"pdfabric bench perplexity: error: {error}", file=sys.stderr)
        return 2
    kv_formats = [f.strip() for f in args.kv_cache_dtype.split(",") if f.strip()]
    if not kv_formats or any(f not in KV_CACHE_DTYPES for f in kv_formats):
        error = f"--kv-cache-dtype takes a list of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}"
        print(f"pdfabric bench perplexity: error: {error}", file=sys.stderr)
        return 2
    if args.context < 2 or args.tokens < args.context or not 1 <= args.score_from < args.context:
        print(
            "pdfabric bench perplexity: error: --context must be >= 2, --tokens >= --context and "
            "--score-from in 1 .. context - 1",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    tokenizer = Tokenizer.from_pretrained(path)
    text, source = held_text(args.text, args.tokens * 8)
    ids = tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
    windows = [ids[i : i + args.context] for i in range(0, len(ids) - args.context + 1, args.context)]
    if not windows:
        print(
            f"pdfabric bench perplexity: error: the text has fewer than {args.context} tokens",
            file=sys.stderr,
        )
        return 2
    results = {"model": str(args.model), "text": source, "tokens": sum(len(w) for w in windows),
               "context": args.context, "score_from": args.score_from, "windows": len(windows),
               "formats": []}  # fmt: skip
    for fmt, kv in ((f, k) for f in formats for k in kv_formats):
        model = load_model(path, args.dtype, quantization=fmt)
        blocks = -(-args.context // 16)
        runner = ModelRunner(model, num_blocks=blocks, block_size=16, quantization=fmt, kv_cache_dtype=kv)
        started = time.perf_counter()
        nll, count = score(runner, windows, not args.no_progress, f"{fmt}/{kv}", args.score_from)
        results["formats"].append({
            "quantization": fmt, "kv_cache_dtype": kv, "dtype": model.config.dtype,
            "perplexity": math.exp(nll / count), "mean_nll": nll / count, "scored_tokens": count,
            "seconds": time.perf_counter() - started,
        })  # fmt: skip
        del runner, model
    base = results["formats"][0]["perplexity"]
    print(f"model {results['model']}, {results['tokens']} tokens of {source} in {len(windows)} windows of "
          f"{args.context}")  # fmt: skip
    print(f"{'weights':>10} {'kv cache':>9} {'dtype':>10} {'perplexity':>11} {'vs first':>9}")
    for r in results["formats"]:
        change = r["perplexity"] / base - 1
        print(
            f"{r['quantization']:>10} {r['kv_cache_dtype']:>9} {r['dtype']:>10} {r['perplexity']:>11.4f} "
            f"{change:>+9.2%}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
