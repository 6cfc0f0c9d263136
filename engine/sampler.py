"""Turns a batch's last-token logits into next tokens: logit bias, penalties and ``min_tokens``, then
greedy or seeded temperature, top-k, top-p sampling."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pdfabric.kernels.dispatch import argmax_rows, gumbel_argmax, gumbel_top, mask_logits
from pdfabric.sampling_params import SamplingParams

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
    masks: torch.Tensor | None = None,
) -> list[Sampled]:
    """One token per row of ``logits`` ``[S, vocab]`` (float32); ``indices[s]`` is the output index of
    the token being sampled for row ``s`` (0 for the first token after the prompt). ``histories[s]`` is
    needed for a row whose parameters change its logits (``SamplingParams.changes_logits``).
    ``masks``: the tokens each row's grammar allows next (bitmasks, ``engine/grammar.py``; None: any),
    the others removed before any other change; where ``min_tokens`` would then remove every token
    left (a finished structure allows only end-of-sequence), the grammar wins.

    A large vocabulary is read a few times per row, never copied whole: the greedy rows' tokens come
    from one batched argmax, the temperature rows' from two batched Gumbel-max draws (``argmax(logits
    / temperature + noise)``, no softmax; top-k / top-p rows among their candidates: ``gumbel_top``),
    each row's log-probabilities from one log-normaliser (``logsumexp``), top log-probabilities from a
    partial sort."""
    scores = logits
    if masks is not None:
        scores = logits.clone()
        mask_logits(scores, masks)
    if any(p.changes_logits for p in params):
        scores = scores.clone() if masks is None else scores
        for row, (p, index) in enumerate(zip(params, indices, strict=True)):
            if p.changes_logits:
                history = histories[row] if histories is not None else None
                if history is None:
                    raise ValueError("penalties, logit_bias and min_tokens need the row's token history")
                changed = process_logits(scores[row], p, index, history)
                if masks is None or bool(changed.isfinite().any()):
                    scores[row] = changed
    tokens = [0] * len(params)
    greedy = [row for row, p in enumerate(params) if p.greedy]
    if greedy:
        rows = scores if len(greedy) == len(params) else scores[greedy]
        for row, token in zip(greedy, argmax_rows(rows), strict=True):
            tokens[row] = token
    # Temperature rows draw in two batched calls: plain ones over the whole vocabulary, those with
    # top-k or top-p among their candidates.
    vocab = scores.shape[-1]
    for narrow in (False, True):
        drawn_rows = [row for row, p in enumerate(params) if not p.greedy and _narrows(p, vocab) == narrow]
        if not drawn_rows:
            continue
        rows = scores if len(drawn_rows) == len(params) else scores[drawn_rows]
        temps = [params[row].temperature for row in drawn_rows]
        keys = [_key(params[row], indices[row]) for row in drawn_rows]
        if narrow:
            top_ks = [params[row].top_k for row in drawn_rows]
            drawn = gumbel_top(rows, temps, top_ks, [params[row].top_p for row in drawn_rows], keys)
        else:
            drawn = gumbel_argmax(rows, temps, keys)
        for row, token in zip(drawn_rows, drawn, strict=True):
            tokens[row] = token
    # The model's own log-probabilities, before any change: logit minus the row's log-normaliser, for
    # the rows that asked (the normaliser reads the whole row); 0.0 for the others.
    asked = [row for row, p in enumerate(params) if p.token_logprob or p.logprobs]
    logprob = [0.0] * len(params)
    norms = [0.0] * len(params)
    if asked:
        rows = logits if len(asked) == len(params) else logits[asked]
        picked = torch.tensor([tokens[row] for row in asked], dtype=torch.long, device=logits.device)
        chosen = rows.gather(1, picked[:, None])[:, 0].tolist()
        for row, norm, value in zip(asked, torch.logsumexp(rows, dim=-1).tolist(), chosen, strict=True):
            norms[row], logprob[row] = norm, value - norm
    out: list[Sampled] = []
    for row, p in enumerate(params):
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = logits[row].topk(p.logprobs)
            top = tuple(zip(ids.tolist(), (values - norms[row]).tolist(), strict=True))
        out.append(Sampled(tokens[row], logprob[row], top))
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


def _narrows(p: SamplingParams, vocab: int) -> bool:
    """Whether ``p`` keeps fewer candidates than the whole vocabulary (top-k or top-p)."""
    return bool(p.top_k and p.top_k < vocab) or p.top_p < 1.0


def _key(p: SamplingParams, index: int) -> int:
    """The noise key of output token ``index`` of the request (and choice) ``p`` samples for."""
    return step_seed(choice_seed(p.seed, p.choice), index)
