"""Speculation with a draft model: a cheaper model guesses a sequence's next tokens, greedily, and one
step of the served model checks them (``[worker] speculative = "draft"``).

The draft is a checkpoint with the served model's tokenizer and KV layout (layers, KV heads, head
size, dtype): the served model itself in a cheaper weight format (the default, ``draft_quantization
= "int4"``), a fine-tune of the same base, or either cut to its first layers (``draft_layers``,
``truncated``; it reads the served model's first layers' caches). It attends over the served
model's own KV cache, the same tensors: a decoding sequence's context is cached there up to its
last token, so the draft needs no prompt of its own computed (not when a prefill worker handed the
prompt over, not after a failover or a preemption), no memory for a cache and no bookkeeping of
what it holds. It writes its keys and values only at the positions it drafts, from the sequence's
last token on; the served model's check of the proposal, in the same step, writes its own over
them, and nothing reads a position before the served model has written it. Every proposing
sequence drafts in the same steps, so several sequences cost one draft step a token.

The output is the served model's own: a proposed token is kept only where the served model picks it
itself (``engine/stepper.py``), so a draft changes speed, never tokens.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.engine.speculate import Wanted

if TYPE_CHECKING:
    from pdfabric.engine.model import LlamaForCausalLM


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


class DraftModel:
    """A ``Proposer`` (``engine/speculate.py``) that drafts with ``runner``'s model over ``served``'s KV
    cache (whatever tensors ``served`` holds when it drafts: a decode worker moves them into shared
    memory after start-up; a draft of fewer layers over its first layers'). ``ValueError`` unless
    each of the draft's layers has the cache layout of the served model's layer of the same index."""

    def __init__(self, runner: ModelRunner, served: ModelRunner) -> None:
        mine, theirs = runner.kv_caches, served.kv_caches

        def layout(caches: list[torch.Tensor]) -> tuple:  # all but the number of blocks
            return tuple((c.shape[0], *c.shape[2:], c.dtype, c.device) for c in caches)

        if layout(mine) != layout(theirs)[: len(mine)] or runner.kv_tiled != served.kv_tiled:
            raise ValueError(
                "a draft model must have the served model's KV layout (layers, KV heads, head size, dtype)"
            )
        if runner.block_size != served.block_size:
            raise ValueError("a draft model must have the served model's block size")
        self.runner = runner
        self.served = served
        self._over: list[torch.Tensor] | None = None  # the served caches it drafts over
        self.steps = 0  # draft model steps run

    def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
        if self._over is not self.served.kv_caches:
            self._over = self.served.kv_caches
            self.runner.kv_caches = self._over[: len(self.runner.kv_caches)]
        first = []
        for seq, table, _ in wanted:
            if seq.num_cached != seq.num_tokens - 1:
                raise ValueError(f"{seq.request_id}: a draft proposes for decoding sequences only")
            first.append(StepEntry(seq.token_slice(seq.num_cached, seq.num_tokens), seq.num_cached, table))
        proposals = [[token] for token in self._greedy(first)]
        for i in range(1, max(k for _, _, k in wanted)):  # the i-th proposed token goes in at L + i - 1
            live = [j for j, (_, _, k) in enumerate(wanted) if k > i]
            step = []
            for j in live:
                seq, table, _ = wanted[j]
                step.append(StepEntry((proposals[j][-1],), seq.num_tokens + i - 1, table))
            for j, token in zip(live, self._greedy(step), strict=True):
                proposals[j].append(token)
        return [tuple(p) for p in proposals]

    def _greedy(self, entries: list[StepEntry]) -> list[int]:
        self.steps += 1
        with torch.inference_mode():
            logits = self.runner.step(entries)  # [len(entries), vocab]
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
