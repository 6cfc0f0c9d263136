"""One model step for the chunks a worker core scheduled: run the model, sample. Shared by all workers.

This is the seam between a worker's core (scheduling, blocks, messages; ``pdfabric.worker.core``) and its
model: the core asks for a step's samples and is told how long the step took. The simulator puts its
profile's step time in the same place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdfabric.engine.block_pool import BlockTables
from pdfabric.engine.grammar import Grammars
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.engine.sampler import History, sample, score
from pdfabric.engine.scheduler import Chunk, Pick
from pdfabric.engine.sequence import Sequence


class Stepper:
    def __init__(self, runner: ModelRunner, grammars: Grammars | None = None) -> None:
        """``grammars``: the model's grammar engine, for requests with ``SamplingParams.grammar``
        (None: such a request is an error)."""
        self.runner = runner
        self.grammars = grammars

    def run(
        self, chunks: list[Chunk], tables: BlockTables, after_layer: Callable[[int], None] | None = None
    ) -> list[Pick]:
        """Runs the chunks (writing their KV into the cache); one (token, logprob, top log-probabilities)
        per chunk with ``sample``, in order. ``after_layer(i)``: called as each layer finishes (layer-wise
        KV push)."""
        entries = [_entry(c, tables) for c in chunks]
        # A mask depends only on the tokens so far: computed before the step.
        masks = self._masks([c.seq for c in chunks if c.sample])
        logits = self.runner.step(entries, after_layer)
        rows: list[int] = []  # the sampling row of each chunk with ``sample``
        row = 0
        for chunk, entry in zip(chunks, entries, strict=True):
            if entry.all_logits:
                _score_prompt(chunk, logits[row : row + len(entry.token_ids)])
                row += len(entry.token_ids)
            elif entry.needs_logits:
                row += 1
            if chunk.sample:
                rows.append(row - 1)
        sampled = [c for c in chunks if c.sample]
        indices = [c.seq.params.output_offset + len(c.seq.output_ids) for c in sampled]
        histories = [history(c.seq) if c.seq.params.changes_logits else None for c in sampled]
        picks = sample(logits[rows], [c.seq.params for c in sampled], indices, histories, masks)
        return [(p.token_id, p.logprob, p.top_logprobs) for p in picks]

    def _masks(self, seqs: list[Sequence]) -> torch.Tensor | None:
        if self.grammars is None:
            if any(seq.params.grammar for seq in seqs):
                raise ValueError(
                    "this model has no tokenizer.json, so no grammar engine for structured output"
                )
            return None
        return self.grammars.masks(seqs)


def _score_prompt(chunk: Chunk, logits: torch.Tensor) -> None:
    """Appends to ``seq.prompt_logprobs`` the scores of the prompt tokens that this chunk's rows predict
    (row ``i`` predicts token ``start + i + 1``) and that are not scored yet (a recomputed prompt is
    scored once)."""
    seq = chunk.seq
    first = len(seq.prompt_logprobs) + 1  # the next prompt token to score
    stop = min(chunk.stop, len(seq.prompt_ids) - 1)  # rows up to here predict prompt tokens
    if chunk.start + 1 <= first <= stop:
        rows = logits[first - 1 - chunk.start : stop - chunk.start]
        seq.prompt_logprobs += score(rows, seq.prompt_ids[first : stop + 1], seq.params.logprobs)


def history(seq: Sequence) -> History:
    """What the sampler's penalties and ``min_tokens`` look at for ``seq``'s next token."""
    return History(seq.prompt_ids, seq.output_ids, seq.params.stop_ids(seq.eos_token_ids))


def _entry(chunk: Chunk, tables: BlockTables) -> StepEntry:
    seq = chunk.seq
    return StepEntry(
        token_ids=seq.token_slice(chunk.start, chunk.stop),
        num_cached=chunk.start,
        block_table=tuple(tables.table(seq.request_id)),
        needs_logits=chunk.sample,
        all_logits=_scores_prompt(chunk),
    )


def _scores_prompt(chunk: Chunk) -> bool:
    """Whether the chunk's rows score prompt tokens not scored yet (``SamplingParams.prompt_logprobs``)."""
    seq = chunk.seq
    left = len(seq.prompt_ids) - 1 - len(seq.prompt_logprobs)  # prompt tokens still to score
    return seq.params.prompt_logprobs and left > 0 and chunk.start < len(seq.prompt_ids) - 1
