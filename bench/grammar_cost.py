"""What structured output adds to a decode step (``pdfabric bench engine --grammar``): each row's
token mask for a JSON schema (the matcher consuming the row's last token, then computing the mask,
``engine/grammar.py``) and the masked sampling, against the same step without a grammar.

Each of a batch's rows walks through a JSON answer of the schema, starting at a different token, and
starts again (a fresh copy of the cached compiled grammar) when it reaches the end, so the masks are
those of every position of a real answer: keys forced by the schema, free strings, bounded numbers.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["admin", "staff", "guest"]}, "maxItems": 3},
        "score": {"type": ["number", "null"]},
    },
    "required": ["name", "age", "email", "address", "tags", "score"],
    "additionalProperties": False,
}
ANSWER = {
    "name": "Ada Lovelace",
    "age": 36,
    "email": "ada@example.org",
    "address": {"street": "12 St James's Square", "city": "London"},
    "tags": ["admin", "guest"],
    "score": 97.5,
}


def grammar_cost(model_dir: Path, vocab_size: int, logits: object, steps: int = 40) -> dict:
    """For ``logits`` ``[batch, vocab]``: the median seconds per step of the batch's masks and of its
    masked sampling beyond plain sampling, and the schema's compile time (cold, then cached)."""
    import torch

    from pdfabric.engine.grammar import Grammars
    from pdfabric.engine.sampler import sample
    from pdfabric.engine.sequence import Sequence
    from pdfabric.engine.tokenizer import Tokenizer
    from pdfabric.sampling_params import SamplingParams
    from pdfabric.structure import response_format_grammar

    assert isinstance(logits, torch.Tensor)
    batch = logits.shape[0]
    started = time.perf_counter()
    grammars = Grammars.for_model(model_dir, vocab_size)
    grammars.tokenizer  # noqa: B018 - built here, timed apart from the grammar
    tokenizer_s = time.perf_counter() - started
    started = time.perf_counter()
    grammar = response_format_grammar(
        {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    )
    grammars.matcher(grammar)
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    grammars.matcher(grammar)
    cached_s = time.perf_counter() - started

    answer = Tokenizer.from_pretrained(model_dir).encode(json.dumps(ANSWER), add_special_tokens=False)
    params = SamplingParams(grammar=grammar, max_tokens=len(answer) + 1)
    plain = [SamplingParams()] * batch
    rows = [Sequence(f"r{i}", (1,), params) for i in range(batch)]
    at = [(i * 7) % len(answer) for i in range(batch)]  # each row somewhere else in the answer
    for row, start in zip(rows, at, strict=True):
        row.output_ids += answer[:start]
    mask_times, extra_times = [], []
    for _ in range(steps):
        for i, row in enumerate(rows):
            if len(row.output_ids) >= len(answer):
                rows[i] = row = Sequence(f"r{i}", (1,), params)  # a new answer: a fresh matcher
            else:
                row.output_ids.append(answer[len(row.output_ids)])
        started = time.perf_counter()
        masks = grammars.masks(rows)
        mask_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        sample(logits, [row.params for row in rows], [0] * batch, None, masks)
        masked = time.perf_counter() - started
        started = time.perf_counter()
        sample(logits, plain, [0] * batch, None)
        extra_times.append(masked - (time.perf_counter() - started))
    return {
        "batch": batch,
        "mask_seconds": statistics.median(mask_times),
        "sample_extra_seconds": max(0.0, statistics.median(extra_times)),
        "tokenizer_seconds": tokenizer_s,
        "compile_seconds": compile_s,
        "cached_compile_seconds": cached_s,
    }
