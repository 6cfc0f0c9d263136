"""What the batch-invariance tests share (``test_batch_invariance.py``, on CPUs and CUDA):
disjoint block tables in scattered order, random prompts of a vocabulary, chunked prefills."""

from __future__ import annotations

import random

import torch

from pdfabric.engine.runner import ModelRunner, StepEntry


class Tables:
    """Hands out disjoint block tables (a sequence's own ``seq_blocks`` blocks of a ``pool``), in
    scattered order like a pool's."""

    def __init__(self, pool: int, seq_blocks: int) -> None:
        self.free = list(range(pool))
        self.seq_blocks = seq_blocks
        random.Random(3).shuffle(self.free)

    def take(self) -> tuple[int, ...]:
        table, self.free = self.free[: self.seq_blocks], self.free[self.seq_blocks :]
        return tuple(table)


def prompts(count: int, seed: int = 0, step: int = 29, longest: int = 140) -> list[tuple[int, ...]]:
    """``count`` random prompts of SmolLM2's vocabulary, ``23 + step * i % longest`` tokens long."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [23 + step * i % longest for i in range(count)]
    return [tuple(torch.randint(0, 49152, (n,), generator=gen).tolist()) for n in lengths]


def prefill(
    runner: ModelRunner, prompt: tuple[int, ...], table: tuple[int, ...], chunks: list[int]
) -> torch.Tensor:
    """Prefills ``prompt`` in chunks of the given sizes (the last takes the rest); its last logits."""
    done = 0
    for size in chunks:
        runner.step([StepEntry(prompt[done : done + size], done, table, needs_logits=False)])
        done += size
    return runner.step([StepEntry(prompt[done:], done, table)])[0]
