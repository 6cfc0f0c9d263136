"""Turns a batch's last-token logits into next tokens: logit bias, penalties and ``min_tokens``, then
greedy or seeded temperature, top-k, top-p sampling."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pdfabric.engine.sampling_params import SamplingParams

_GOLDEN = 0x9E3779B97F4A7C15
_MASK = 2**63 - 1


def step_seed(seed: int, index: int) -> int:
    """The generator seed for output token ``index`` of a request seeded with ``seed``."""
    x = (seed ^ ((index + 1) * _GOLDEN)) & _MASK
    x = ((x ^ (x >> 31)) * 0xBF58476D1CE4E5B9) & _MASK  # splitmix-style finaliser
    return x ^ (x >> 29)


def choice_seed(seed: int, choice: int) -> int:
    """The seed of output ``choice`` of a request seeded with ``seed`` (choice 0: ``seed`` itself)."""
    return seed if choice == 0 else step_seed(seed ^ 0x5EED, -1 - choice)


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class History:
    """The tokens before the one being sampled, for penalties and ``min_tokens``."""

    prompt_ids: Sequence[int]  # as run here: a resumed request's prompt ends with its earlier output
    output_ids: Sequence[int]  # output of this run
    stop_ids: frozenset[int] = frozenset()  # what min_tokens holds back: eos (unless ignored), stop ids


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    indices: list[int],
    histories: Sequence[History | None] | None = None,
) -> list[Sampled]:
    """One token per row of ``logits`` ``[S, vocab]`` (float32); ``indices[s]`` is the output index of
    the token being sampled for row ``s`` (0 for the first token after the prompt). ``histories[s]`` is
    needed for a row whose parameters change its logits (``SamplingParams.changes_logits``)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, vocab]: the model's own, before any change
    out: list[Sampled] = []
    for row, (p, index) in enumerate(zip(params, indices, strict=True)):
        scores = logits[row]
        if p.changes_logits:
            history = histories[row] if histories is not None else None
            if history is None:
                raise ValueError("penalties, logit_bias and min_tokens need the row's token history")
            scores = process_logits(scores, p, index, history)
        token = int(scores.argmax()) if p.greedy else _sample_row(scores, p, index)
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = logprobs[row].topk(p.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(Sampled(token, float(logprobs[row, token]), top))
    return out


def score(
    logits: torch.Tensor, targets: Sequence[int], top_k: int
) -> list[tuple[float, tuple[tuple[int, float], ...]]]:
    """Each target's log-probability under its row of ``logits`` ``[len(targets), vocab]``, with the
    ``top_k`` likeliest (token id, logprob) pairs of that row (prompt scoring)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    out = []
    for row, token in enumerate(targets):
        top: tuple[tuple[int, float], ...] = ()
        if top_k:
            values, ids = logprobs[row].topk(top_k)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        out.append((float(logprobs[row, token]), top))
    return out


def process_logits(logits: torch.Tensor, p: SamplingParams, index: int, history: History) -> torch.Tensor:
    """``logits`` ``[vocab]`` changed by ``p``'s bias, penalties and ``min_tokens`` (a new tensor);
    ``index``: the output index of the token being sampled."""
    scores = logits.clone()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=scores.device)
        bias = torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype, device=scores.device)
        scores.index_add_(0, ids, bias)
    if p.repetition_penalty != 1.0:
        seen = _ids({*history.prompt_ids, *history.output_ids}, scores)
        picked = scores[seen]
        scores[seen] = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
    # Output so far: the earlier output a resumed request's prompt ends with, then this run's.
    prompt = history.prompt_ids
    earlier = prompt[len(prompt) - p.output_offset :] if p.output_offset else ()
    output = [*earlier, *history.output_ids]
    if (p.frequency_penalty or p.presence_penalty) and output:
        ones = torch.ones(len(output), dtype=scores.dtype, device=scores.device)
        counts = torch.zeros_like(scores).index_add_(0, _ids(output, scores), ones)
        scores -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(scores.dtype)
    if index < p.min_tokens and history.stop_ids:
        scores[_ids(history.stop_ids, scores)] = float("-inf")
    return scores


def _ids(ids: Iterable[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=like.device)


def _sample_row(logits: torch.Tensor, p: SamplingParams, index: int) -> int:
    # logits: [vocab] float32
    scaled = logits / p.temperature
    if p.top_k and p.top_k < scaled.numel():
        kth = scaled.topk(p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    # The noise is always drawn on the CPU, so a seed gives the same tokens on CPU and GPU workers.
    gen = torch.Generator().manual_seed(step_seed(choice_seed(p.seed, p.choice), index))
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a cumsum search.
    noise = torch.empty(probs.shape).exponential_(generator=gen).to(probs.device)
    return int((probs / noise).argmax())
