"""Speculation with a draft model: a cheaper model guesses a sequence's next tokens, greedily, and one
step of the served model checks them (``[worker] speculative = "draft"``).

The draft is a checkpoint with the served model's tokenizer. One with its KV layout (layers, KV
heads, head size, dtype): the served model itself in a cheaper weight format (the default,
``draft_quantization = "int4"``), a fine-tune of the same base, or either cut to its first layers
(``draft_layers``, ``truncated``; it reads the served model's first layers' caches), attends over
the served model's own KV cache, the same tensors: a decoding sequence's context is cached there up
to its last token, so the draft needs no prompt of its own computed (not when a prefill worker
handed the prompt over, not after a failover or a preemption), no memory for a cache and no
bookkeeping of what it holds. It writes its keys and values only at the positions it drafts, from
the sequence's last token on; the served model's check of the proposal, in the same step, writes its
own over them, and nothing reads a position before the served model has written it. Every proposing
sequence drafts in the same steps, so several sequences cost one draft step a token.

A draft of another layout (a smaller model of the family: other heads, other widths, another dtype),
or one told to (``draft_cache = "own"``: other weights), holds a cache of its own (``own_cache``),
as many blocks as the served model's, and computes each sequence's tokens into it itself, on the
worker: the prompt the first time the sequence drafts (at most ``CATCH_UP_TOKENS`` of it a step, so
a long prompt delays no step by more than that, while the others catch up on their few kept tokens
as usual), then what the served model kept of each proposal. What a sequence holds there is checked
against its tokens before each draft (a rejected proposal's positions are recomputed). When blocks
run short, a sequence takes those of the sequences that drafted least recently (a finished
sequence's come back at once), or proposes nothing this step.

The output is the served model's own: a proposed token is kept only where the served model picks it
itself (``engine/stepper.py``), so a draft changes speed, never tokens.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdfabric.engine.block_pool import blocks_for
from pdfabric.engine.kv_cache import kv_bytes_per_token
from pdfabric.engine.runner import DECODER_CHUNK_TOKENS, ModelRunner, StepEntry
from pdfabric.engine.sequence import SeqState, Sequence
from pdfabric.engine.speculate import Wanted

if TYPE_CHECKING:
    from pdfabric.engine.model import LlamaForCausalLM
    from pdfabric.worker_config import WorkerConfig

log = logging.getLogger("pdfabric.engine.draft")

# A draft with a cache of its own computes at most this many of its sequences' tokens it lacks
# (prompts, mostly) in one scheduling pass; a sequence still catching up proposes nothing meanwhile.
CATCH_UP_TOKENS = 512


def truncated(model: LlamaForCausalLM, layers: int) -> LlamaForCausalLM:
    """``model`` cut to its first ``layers`` decoder layers, then its final norm and head, in place
    (before its runner packs it): a draft that costs about that share of the model's step."""
    if not 1 <= layers <= model.config.num_layers:
        raise ValueError(
            f"draft_layers must be in [1, {model.config.num_layers}] for this model, got {layers}"
        )
    model.config = dataclasses.replace(model.config, num_layers=layers)
    model.model.layers = nn.ModuleList(list(model.model.layers)[:layers])
    return model


def shares_layout(runner: ModelRunner, served: ModelRunner) -> bool:
    """Whether each of ``runner``'s layers has the KV cache layout of ``served``'s layer of the same
    index (heads, head size, dtype, tiling, block size): the draft can then read the served caches."""

    def layout(caches: list[torch.Tensor]) -> tuple:  # all but the number of blocks
        return tuple((c.shape[0], *c.shape[2:], c.dtype, c.device) for c in caches)

    mine, theirs = runner.kv_caches, served.kv_caches
    return (
        len(mine) <= len(theirs)
        and layout(mine) == layout(theirs)[: len(mine)]
        and runner.kv_tiled == served.kv_tiled
        and runner.block_size == served.block_size
    )


@dataclasses.dataclass
class _Held:
    """A sequence's blocks in a draft's own cache, and what they hold: its first ``confirmed`` tokens,
    then the ``drafted`` tokens written after them (proposals, of which the sequence may keep some)."""

    seq: Sequence
    blocks: list[int]
    confirmed: int = 0
    drafted: tuple[int, ...] = ()

    def valid(self) -> int:
        """How many leading positions hold the sequence's own tokens now."""
        stop = min(self.seq.num_tokens, self.confirmed + len(self.drafted))
        kept, same = self.seq.token_slice(self.confirmed, stop), 0
        while same < len(kept) and kept[same] == self.drafted[same]:
            same += 1
        return self.confirmed + same


class DraftModel:
    """A ``Proposer`` (``engine/speculate.py``) that drafts greedily with ``runner``'s model.

    By default over ``served``'s KV cache (whatever tensors ``served`` holds when it drafts: a decode
    worker moves them into shared memory after start-up; a draft of fewer layers over its first
    layers'): ``ValueError`` unless ``shares_layout``. With ``own_cache``, over ``runner``'s own cache,
    sized with ``resize`` (the worker gives it as many blocks as the served cache)."""

    runs_model = True

    def __init__(self, runner: ModelRunner, served: ModelRunner, own_cache: bool = False) -> None:
        if not own_cache and not shares_layout(runner, served):
            raise ValueError(
                "a draft model must have the served model's KV layout (layers, KV heads, head size, dtype, "
                "block size) to read its cache"
            )
        self.runner = runner
        self.served = served
        self.own_cache = own_cache
        self._over: list[torch.Tensor] | None = None  # the served caches it drafts over
        self._held: OrderedDict[str, _Held] = OrderedDict()  # own cache: least recently drafted first
        self._free = list(range(runner.num_blocks)) if own_cache else []
        self.steps = 0  # draft model steps run
        self.caught_up = 0  # tokens computed into its own cache that it lacked (prompts, kept proposals)
        self.taken = 0  # blocks taken from sequences still decoding, for others

    @property
    def kv_bytes_per_token(self) -> int:
        """What a token takes in the draft's own cache (0: it reads the served model's)."""
        return kv_bytes_per_token(self.runner.config, self.runner.kv_cache_dtype) if self.own_cache else 0

    def resize(self, num_blocks: int) -> None:
        """An own cache of ``num_blocks`` blocks in place of the one it has (before it drafts)."""
        if self.own_cache:
            self.runner.resize_kv(num_blocks)
            self._held.clear()
            self._free = list(range(num_blocks))

    def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
        for seq, _, _ in wanted:
            if seq.num_cached != seq.num_tokens - 1:
                raise ValueError(f"{seq.request_id}: a draft proposes for decoding sequences only")
        try:
            return self._propose(wanted)
        except BaseException:  # its own cache may not hold what _plan noted: forget what these hold
            for seq, _, _ in wanted:
                if seq.request_id in self._held:
                    self._drop(seq.request_id)
            raise

    def _propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
        if self.own_cache:
            plans, filling = self._plan(wanted)
        else:
            if self._over is not self.served.kv_caches:
                self._over = self.served.kv_caches
                self.runner.kv_caches = self._over[: len(self.runner.kv_caches)]
            plans = [StepEntry(seq.token_slice(seq.num_cached, seq.num_tokens), seq.num_cached, table)
                     for seq, table, _ in wanted]  # fmt: skip
            filling = []
        first_of = {j: plan for j, plan in enumerate(plans) if plan is not None}  # the sequences drafting
        if not first_of:
            if filling:
                self._greedy(filling)
            return [() for _ in wanted]
        drafting, first = list(first_of), list(first_of.values())
        proposals = {j: [token] for j, token in zip(drafting, self._greedy(first + filling), strict=True)}
        for i in range(1, max(wanted[j][2] for j in drafting)):  # the i-th token goes in at L + i - 1
            live = [j for j in drafting if wanted[j][2] > i]
            step = [StepEntry((proposals[j][-1],), wanted[j][0].num_tokens + i - 1, first_of[j].block_table)
                    for j in live]  # fmt: skip
            for j, token in zip(live, self._greedy(step), strict=True):
                proposals[j].append(token)
        if self.own_cache:
            for j in drafting:
                held = self._held[wanted[j][0].request_id]
                held.confirmed, held.drafted = wanted[j][0].num_tokens, tuple(proposals[j][:-1])
        return [tuple(proposals.get(j, ())) for j in range(len(wanted))]

    def _plan(self, wanted: list[Wanted]) -> tuple[list[StepEntry | None], list[StepEntry]]:
        """For each wanted sequence, what the first draft step runs in the own cache (the tokens it
        lacks up to its last one, where they start, its blocks) or None where it does not draft now;
        and the entries that only fill the cache (a prompt longer than what is left of this pass's
        ``CATCH_UP_TOKENS``). A sequence that lacks at most ``DECODER_CHUNK_TOKENS`` (what a check
        kept, the usual case) catches up whatever the budget: a long prompt never costs the others
        their proposals."""
        for name in [n for n, held in self._held.items() if held.seq.state is SeqState.FINISHED]:
            self._drop(name)
        budget, plans, filling = CATCH_UP_TOKENS, [], []
        planned: set[str] = set()  # sequences whose blocks this pass's steps use
        runner = self.runner
        limit = min(runner.config.max_position_embeddings, runner.num_blocks * runner.block_size)
        for seq, _, k in wanted:
            name = seq.request_id
            held = self._held.get(name)
            if held is not None and held.seq is not seq:  # another object of that name: start again
                self._drop(name)
                held = None
            end = seq.num_tokens + k - 1  # positions written: its tokens, then all but the last proposal
            if end > limit or not self._grow(seq, held, blocks_for(end, runner.block_size), planned):
                plans.append(None)
                continue
            held = self._held[name]
            self._held.move_to_end(name)  # the most recently drafted
            planned.add(name)
            start = min(held.valid(), seq.num_tokens - 1)
            held.confirmed, held.drafted = start, ()
            lacking = seq.num_tokens - start
            if lacking > budget and lacking > DECODER_CHUNK_TOKENS:
                if budget:  # what fits now, without logits; the rest in the next passes
                    filling.append(StepEntry(seq.token_slice(start, start + budget), start,
                                             tuple(held.blocks), needs_logits=False))  # fmt: skip
                    held.confirmed = start + budget
                    self.caught_up += budget
                    budget = 0
                plans.append(None)
                continue
            budget = max(0, budget - lacking)
            self.caught_up += lacking - 1
            plans.append(StepEntry(seq.token_slice(start, seq.num_tokens), start, tuple(held.blocks)))
        return plans, filling

    def _grow(self, seq: Sequence, held: _Held | None, blocks: int, planned: set[str]) -> bool:
        """Gives ``seq`` (``held``: what it holds, None if nothing) ``blocks`` blocks. Where too
        few are free it takes those of the sequences that drafted least recently, except those already
        planned in this pass, whose steps use theirs; False, taking nothing, if even all of those would
        not be enough."""
        name, need = seq.request_id, blocks - (len(held.blocks) if held is not None else 0)
        if need > len(self._free):
            others = [n for n in self._held if n != name and n not in planned]  # least recent first
            if need > len(self._free) + sum(len(self._held[n].blocks) for n in others):
                return False
            for other in others:
                self.taken += len(self._held[other].blocks)
                self._drop(other)
                if need <= len(self._free):
                    break
        if held is None:
            held = self._held[name] = _Held(seq, [])
        if need > 0:
            held.blocks += self._free[len(self._free) - need :]
            del self._free[len(self._free) - need :]
        return True

    def _drop(self, name: str) -> None:
        self._free += self._held.pop(name).blocks

    def _greedy(self, entries: list[StepEntry]) -> list[int]:
        self.steps += 1
        with torch.inference_mode():
            logits = self.runner.step(entries)  # [entries with needs_logits, vocab]
        return [int(t) for t in logits.argmax(dim=-1).tolist()]


def build_draft(cfg: WorkerConfig, target: Path, served: ModelRunner) -> DraftModel:
    """The draft model of a worker's ``cfg`` serving ``target`` (``draft_model``, default the served
    model itself, held as ``draft_quantization``, its first ``draft_layers`` decoder layers if set):
    over ``served``'s KV cache where its layers have that cache's layout and ``draft_cache`` is
    auto, else over a cache of its own (one block until ``DraftModel.resize``). A draft whose
    tokenizer is not the served model's is refused (its token ids would mean other text)."""
    from pdfabric.engine.default_model import resolve_model
    from pdfabric.engine.loader import load_model
    from pdfabric.engine.quantized_cache import quantizer_for

    path = resolve_model(cfg.draft_model or cfg.model)
    draft = load_model(path, cfg.dtype, served.device, cfg.draft_quantization)  # on the served model's device
    ours, theirs = (p / "tokenizer.json" for p in (target, path))
    same = (
        ours.read_bytes() == theirs.read_bytes()
        if ours.exists() and theirs.exists()
        else ours.exists() == theirs.exists()
    )
    if draft.config.vocab_size != served.config.vocab_size or not same:
        raise ValueError(f"draft model {path} does not share the served model's tokenizer ({target})")
    if cfg.draft_layers:
        draft = truncated(draft, cfg.draft_layers)
    d, s = draft.config, served.config
    fits = (
        cfg.draft_cache == "auto"
        and (d.num_kv_heads, d.head_dim) == (s.num_kv_heads, s.head_dim)
        and d.num_layers <= s.num_layers
        and draft.model.norm.weight.dtype == served.model.model.norm.weight.dtype
    )
    # one block of its own, until it drafts over the served model's cache (or its own is sized); a
    # cache of its own is held in the draft's dtype
    runner = ModelRunner(
        draft, 1, cfg.block_size, linears=cfg.linears, quantization=cfg.draft_quantization,
        kv_cache_dtype=served.kv_cache_dtype if fits else "auto",
        quantizer=quantizer_for(path, draft, cfg.draft_quantization),
    )  # fmt: skip
    own = cfg.draft_cache == "own" or not shares_layout(runner, served)
    if own:
        log.info("draft model %s drafts over a KV cache of its own (draft_cache %s)", path, cfg.draft_cache)
    return DraftModel(runner, served, own_cache=own)
