"""One model step for the chunks a worker core scheduled: run the model, sample. Shared by all workers.

This is the seam between a worker's core (scheduling, blocks, messages; ``pdfabric.core``) and its
model: the core asks for a step's samples and is told how long the step took. The simulator puts its
profile's step time in the same place.
"""

from __future__ import annotations

from collections.abc import Callable

from pdfabric.engine.block_pool import BlockTables
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.engine.sampler import History, sample
from pdfabric.engine.scheduler import Chunk, Pick
from pdfabric.engine.sequence import Sequence


class Stepper:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def run(
        self, chunks: list[Chunk], tables: BlockTables, after_layer: Callable[[int], None] | None = None
    ) -> list[Pick]:
        """Runs the chunks (writing their KV into the cache); one (token, logprob, top log-probabilities)
        per chunk with ``sample``, in order. ``after_layer(i)``: called as each layer finishes (layer-wise
        KV push)."""
        logits = self.runner.step([_entry(c, tables) for c in chunks], after_layer)
        sampled = [c for c in chunks if c.sample]
        indices = [c.seq.params.output_offset + len(c.seq.output_ids) for c in sampled]
        histories = [history(c.seq) if c.seq.params.changes_logits else None for c in sampled]
        picks = sample(logits, [c.seq.params for c in sampled], indices, histories)
        return [(p.token_id, p.logprob, p.top_logprobs) for p in picks]


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
    )
