"""One model step for the chunks a worker core scheduled: run the model, sample. Shared by all workers.

This is the seam between a worker's core (scheduling, blocks, messages; ``pdfabric.worker.core``) and its
model: the core asks for a step's samples and is told how long the step took. The simulator puts its
profile's step time in the same place.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pdfabric.engine.block_pool import BlockTables
from pdfabric.engine.chunk import Chunk, Pick
from pdfabric.engine.grammar import Grammars
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.engine.sampler import History, sample, score
from pdfabric.engine.sequence import Sequence

log = logging.getLogger("pdfabric.engine.stepper")


class Stepper:
    def __init__(self, runner: ModelRunner, grammars: Grammars | None = None) -> None:
        """``grammars``: the model's grammar engine, for requests with ``SamplingParams.grammar``
        (None: such a request runs unconstrained, and that is logged)."""
        self.runner = runner
        self.grammars = grammars
        self._warned = False  # that this worker cannot mask structured requests

    def run(
        self, chunks: list[Chunk], tables: BlockTables, after_layer: Callable[[int], None] | None = None
    ) -> list[Pick | list[Pick]]:
        """Runs the chunks (writing their KV into the cache); one (token, logprob, top log-probabilities)
        per chunk with ``sample``, in order, and for a chunk with a proposal the list of the proposed
        tokens the model picks itself followed by the token after them (``verify``).
        ``after_layer(i)``: called as each layer finishes (layer-wise KV push)."""
        entries = [_entry(c, tables) for c in chunks]
        # A mask depends only on the tokens so far: computed before the step.
        sampled = [c for c in chunks if c.sample and not c.proposal]
        masks = self._masks([c.seq for c in sampled])
        logits, hidden = self.runner.run(entries, after_layer)
        _pool(chunks, entries, hidden)
        rows: list[int] = []  # the sampling row of each chunk with ``sample``
        checks: list[torch.Tensor] = []  # each proposal chunk's rows: its last token's and the proposal's
        row = 0
        for chunk, entry in zip(chunks, entries, strict=True):
            if chunk.proposal:  # the rows of its last token and of each proposed token
                row += len(entry.token_ids)
                checks.append(logits[row - 1 - len(chunk.proposal) : row])
                continue
            if entry.all_logits:
                _score_prompt(chunk, logits[row : row + len(entry.token_ids)])
                row += len(entry.token_ids)
            elif entry.needs_logits:
                row += 1
            if chunk.sample:
                rows.append(row - 1)
        indices = [c.seq.params.output_offset + len(c.seq.output_ids) for c in sampled]
        histories = [history(c.seq) if c.seq.params.changes_logits else None for c in sampled]
        picks = iter(sample(logits[rows], [c.seq.params for c in sampled], indices, histories, masks))
        proposing = [c for c in chunks if c.proposal]
        verified = iter(
            verify(c, rows, self._masks_ahead(c)) for c, rows in zip(proposing, checks, strict=True)
        )
        out: list[Pick | list[Pick]] = []
        for chunk in chunks:
            if chunk.proposal:
                out.append(next(verified))
            elif chunk.sample:
                p = next(picks)
                out.append((p.token_id, p.logprob, p.top_logprobs))
        return out

    def _masks_ahead(self, chunk: Chunk) -> torch.Tensor | None:
        if not chunk.seq.params.grammar or not self._has_grammars():
            return None
        return self.grammars.masks_ahead(chunk.seq, chunk.proposal)  # type: ignore[union-attr]

    def _masks(self, seqs: list[Sequence]) -> torch.Tensor | None:
        if not any(seq.params.grammar for seq in seqs) or not self._has_grammars():
            return None
        return self.grammars.masks(seqs)  # type: ignore[union-attr]

    def _has_grammars(self) -> bool:
        """Whether structured requests can be masked here; a worker whose model directory has no
        ``tokenizer.json`` serves them unconstrained (logged once) rather than failing every request
        it holds."""
        if self.grammars is None and not self._warned:
            log.error("this model has no tokenizer.json, so structured outputs are not constrained here")
            self._warned = True
        return self.grammars is not None


def verify(chunk: Chunk, logits: torch.Tensor, masks: torch.Tensor | None = None) -> list[Pick]:
    """A decode chunk with a proposal: ``logits`` has a row for its last token and one for each
    proposed token (``masks``: the grammar's for each, ``Grammars.masks_ahead``). Each row is sampled
    as decoding would sample that position (greedy, or the seeded draw of that output index, with the
    penalties of the history before it); the proposed tokens drawn themselves are kept, in order, with
    the draw after the last one kept. That is what decoding one token at a time gives, token for
    token, since each row's logits are the same in a chunk as in a decode step; a seeded proposal is
    kept with the probability the model gives it, as rejection sampling would keep it."""
    seq = chunk.seq
    params = seq.params
    index = params.output_offset + len(seq.output_ids)
    histories = None
    if params.changes_logits:
        stop_ids = params.stop_ids(seq.eos_token_ids)
        histories = [
            History(seq.prompt_ids, [*seq.output_ids, *chunk.proposal[:i]], stop_ids)
            for i in range(len(logits))
        ]
    indices = list(range(index, index + len(logits)))
    picked = sample(logits, [params] * len(logits), indices, histories, masks)
    out: list[Pick] = []
    for p, proposed in zip(picked, (*chunk.proposal, None), strict=True):
        out.append((p.token_id, p.logprob, p.top_logprobs))
        if p.token_id != proposed:
            break
    return out


def _pool(chunks: list[Chunk], entries: list[StepEntry], hidden: torch.Tensor) -> None:
    """Keeps each embedding input's hidden rows that its pooling reads (``hidden``: the step's
    ``[T, hidden]``, the entries' tokens end to end); an input whose last chunk this is gets its
    vector (``Sequence.embedding``). A chunk that starts the prompt again (its blocks were taken
    back and it restarts) drops the rows kept before."""
    at = 0
    for chunk, entry in zip(chunks, entries, strict=True):
        rows = hidden[at : at + len(entry.token_ids)]  # [tokens, hidden]
        at += len(entry.token_ids)
        seq = chunk.seq
        if not seq.pooling:
            continue
        if chunk.start == 0:
            seq.pooled.clear()
        if seq.pooling == "mean" or (seq.pooling == "cls" and chunk.start == 0):
            seq.pooled.append((rows if seq.pooling == "mean" else rows[:1]).clone())
        if chunk.last:
            seq.embedding = pooled_vector(seq.pooled, rows[-1:], seq.pooling, seq.normalize)
            seq.pooled.clear()


def pooled_vector(kept: list, last: torch.Tensor, mode: str, normalize: bool) -> bytes:
    """One input's vector as float32 little-endian bytes: the mean of the ``kept`` rows, the first of
    them (``cls``) or the ``last`` row, computed in float32 and scaled to unit length if asked (a zero
    vector stays zero)."""
    if mode == "last":
        vector = last[0].float()
    else:
        rows = torch.cat(kept).float()  # [tokens | 1, hidden]
        vector = rows.mean(0) if mode == "mean" else rows[0]
    if normalize:
        vector = vector / vector.norm().clamp_min(1e-12)
    return vector.cpu().numpy().astype("<f4").tobytes()


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
        token_ids=seq.token_slice(chunk.start, chunk.stop) + chunk.proposal,
        num_cached=chunk.start,
        block_table=tuple(tables.table(seq.request_id)),
        needs_logits=chunk.sample,
        all_logits=_scores_prompt(chunk) or bool(chunk.proposal),
    )


def _scores_prompt(chunk: Chunk) -> bool:
    """Whether the chunk's rows score prompt tokens not scored yet (``SamplingParams.prompt_logprobs``)."""
    seq = chunk.seq
    left = len(seq.prompt_ids) - 1 - len(seq.prompt_logprobs)  # prompt tokens still to score
    return seq.params.prompt_logprobs and left > 0 and chunk.start < len(seq.prompt_ids) - 1
