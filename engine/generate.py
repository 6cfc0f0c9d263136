"""Single-process reference generation through the paged cache, and the ``pdfabric generate`` command.

``ReferenceEngine`` is the oracle for the fabric's token-exactness: one request at a time, the prompt
prefilled (whole or in chunks) into freshly allocated blocks, then one decode step per token, sampled
with the same sampler the workers use.
"""

from __future__ import annotations

import argparse
import json
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path

from pdfabric.engine.block_pool import BlockPool, BlockTables
from pdfabric.sampling_params import SamplingParams
from pdfabric.worker_config import KV_CACHE_DTYPES, QUANTIZATIONS


@dataclass(frozen=True)
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str  # "stop" or "length"
    logprobs: list[float]
    # With ``SamplingParams.prompt_logprobs``: per prompt token after the first, (logprob, top ones).
    prompt_logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = field(default_factory=list)


class ReferenceEngine:
    """Loads a model directory (or preset) and generates for one prompt at a time."""

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: str | None = None,
        num_blocks: int = 512,
        block_size: int = 16,
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``quantization``, ``kv_cache_dtype``: how the linear weights and the KV cache are held, as a
        worker's settings of those names."""
        from pdfabric.engine.default_model import resolve_model
        from pdfabric.engine.loader import load_model
        from pdfabric.engine.quantized_cache import quantizer_for
        from pdfabric.engine.runner import ModelRunner

        self.path = resolve_model(model)
        self.model = load_model(self.path, dtype, quantization=quantization)
        self.config = self.model.config
        self._tokenizer = None
        self._grammars = None
        self.runner = ModelRunner(
            self.model, num_blocks, block_size, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
            quantizer=quantizer_for(self.path, self.model, quantization),
        )  # fmt: skip
        self.tables = BlockTables(BlockPool(num_blocks, block_size))

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer, imported lazily
        """The model's tokenizer, loaded on first use (token-id callers never need one)."""
        if self._tokenizer is None:
            from pdfabric.engine.tokenizer import Tokenizer

            self._tokenizer = Tokenizer.from_pretrained(self.path)
        return self._tokenizer

    @property
    def grammars(self):  # noqa: ANN201 - Grammars, imported lazily
        """The model's grammar engine (``SamplingParams.grammar``), built on first use."""
        if self._grammars is None:
            from pdfabric.engine.grammar import Grammars

            self._grammars = Grammars.for_model(self.path, self.config.vocab_size)
        return self._grammars

    def generate(self, prompt_ids: list[int], params: SamplingParams, chunk_size: int = 0) -> Generation:
        """Generates for ``prompt_ids``; ``chunk_size > 0`` prefills the prompt in chunks of that size."""
        from pdfabric.engine.runner import StepEntry
        from pdfabric.engine.sampler import History, sample, score

        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        limit = self.config.max_position_embeddings
        if len(prompt_ids) >= limit:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in a context of {limit}")
        # ignore_eos needs no tokenizer: checkpoints without tokenizer files still generate.
        stop_ids = params.stop_ids(() if params.ignore_eos else self.tokenizer.eos_token_ids)
        seq = object()
        out: list[int] = []
        structured = None  # the request as a sequence, for its grammar's state
        if params.grammar:
            from pdfabric.engine.sequence import Sequence

            structured = Sequence("reference", tuple(prompt_ids), params, output_ids=out)
        scored: list[tuple[float, tuple[tuple[int, float], ...]]] = []
        logprobs: list[float] = []
        try:
            pending, cached = list(prompt_ids), 0
            step = chunk_size if chunk_size > 0 else len(pending)
            while True:
                chunk = pending[:step] if not out else pending
                if self.tables.grow(seq, cached + len(chunk)) is None:
                    raise RuntimeError("the KV cache is too small for this request")
                last = len(chunk) == len(pending)
                scoring = params.prompt_logprobs and not out  # each row scores the next prompt token
                table = tuple(self.tables.table(seq))
                entry = StepEntry(tuple(chunk), cached, table, needs_logits=last, all_logits=scoring)
                logits = self.runner.step([entry])
                if scoring:
                    targets = prompt_ids[cached + 1 : cached + len(chunk) + 1]
                    scored += score(logits[: len(targets)], targets, params.logprobs)
                    logits = logits[-1:]
                cached += len(chunk)
                pending = pending[len(chunk) :]
                if not last:
                    continue
                history = History(prompt_ids, out, stop_ids)
                masks = self.grammars.masks([structured]) if structured is not None else None
                token = sample(logits, [params], [params.output_offset + len(out)], [history], masks)[0]
                out.append(token.token_id)
                logprobs.append(token.logprob)
                if token.token_id in stop_ids:
                    return Generation(list(prompt_ids), out, "stop", logprobs, scored)
                if len(out) >= params.max_tokens or cached + 1 >= limit:
                    return Generation(list(prompt_ids), out, "length", logprobs, scored)
                pending = [token.token_id]
        finally:
            self.tables.release(seq)

    def embed(self, prompt_ids: list[int], mode: str, normalize: bool) -> list[float]:
        """The pooled embedding of ``prompt_ids`` (``engine/pooling.py``'s ``mode`` and ``normalize``),
        the prompt computed whole into fresh blocks: the oracle for the workers' ``Embed``."""
        from pdfabric.engine.runner import StepEntry
        from pdfabric.engine.stepper import pooled_vector

        if not prompt_ids or len(prompt_ids) > self.config.max_position_embeddings:
            raise ValueError(f"an input of 1 to {self.config.max_position_embeddings} tokens is needed")
        seq = object()
        try:
            if self.tables.grow(seq, len(prompt_ids)) is None:
                raise RuntimeError("the KV cache is too small for this input")
            entry = StepEntry(tuple(prompt_ids), 0, tuple(self.tables.table(seq)), needs_logits=False)
            _, hidden = self.runner.run([entry])  # [tokens, hidden]
            vector = pooled_vector([hidden if mode == "mean" else hidden[:1]], hidden[-1:], mode, normalize)
        finally:
            self.tables.release(seq)
        return array("f", vector).tolist()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="model directory, GGUF file or preset (tiny, cpu-small, smollm2-135m); default tiny",
    )
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (same seed, same output)")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), help="override the checkpoint's dtype"
    )
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="none",
        help="linear weights as a worker's setting",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="KV-cache rows as a worker's setting",
    )
    parser.add_argument(
        "--response-format",
        type=json.loads,
        metavar="JSON",
        help='constrain the output as the API\'s response_format does, e.g. \'{"type": "json_object"}\' '
        "or a json_schema, regex or grammar one (docs/structured-outputs.md)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")


def run(args: argparse.Namespace) -> int:
    from pdfabric.structure import response_format_grammar

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            grammar=response_format_grammar(args.response_format),
        )
        engine = ReferenceEngine(
            args.model, args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype
        )
        if args.chat:  # the template writes its own special tokens
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
            prompt_ids = engine.tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt_ids = engine.tokenizer.encode(args.prompt)
        result = engine.generate(prompt_ids, params)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"pdfabric generate: error: {exc}", file=sys.stderr)
        return 2
    text_out = engine.tokenizer.decode(result.token_ids)
    if args.json:
        print(
            json.dumps(
                {
                    "prompt_token_ids": result.prompt_token_ids,
                    "token_ids": result.token_ids,
                    "text": text_out,
                    "finish_reason": result.finish_reason,
                }
            )
        )
    else:
        print(text_out)
    return 0
