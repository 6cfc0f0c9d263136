"""Turns a batch's last-token logits into next tokens: greedy, temperature, top-k, top-p, seeded."""

from __future__ import annotations

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


@dataclass(frozen=True)
class Sampled:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()


def sample(logits: torch.Tensor, params: list[SamplingParams], indices: list[int]) -> list[Sampled]:
    """One token per row of ``logits`` ``[S, vocab]`` (float32); ``indices[s]`` is the output index of
    the token being sampled for row ``s`` (0 for the first token after the prompt)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [S, vocab]
    out: list[Sampled] = []
    for row, (p, index) in enumerate(zip(params, indices, strict=True)):
        token = int(logits[row].argmax()) if p.greedy else _sample_row(logits[row], p, index)
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            values, ids = logprobs[row].topk(p.logprobs)
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        out.append(Sampled(token, float(logprobs[row, token]), top))
    return out


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
    gen = torch.Generator().manual_seed(step_seed(p.seed, index))
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a cumsum search.
    noise = torch.empty(probs.shape).exponential_(generator=gen).to(probs.device)
    return int((probs / noise).argmax())
