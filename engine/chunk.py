"""What a scheduler's step runs: chunks of sequences' tokens, the tokens sampled after them, and the
step's shape in the latency profile's terms. No torch here."""

from __future__ import annotations

from dataclasses import dataclass

from pdfabric.engine.sequence import SeqState, Sequence, TopLogprobs
from pdfabric.profile import StepShape

# One sampled token: (token, logprob) or (token, logprob, top log-probabilities).
Pick = tuple[int, float] | tuple[int, float, TopLogprobs]


@dataclass(frozen=True)
class Chunk:
    """Run tokens ``start:stop`` of ``seq`` this step; ``sample`` when they reach its end. A decode
    chunk may carry a ``proposal``: tokens guessed to follow (``engine/speculate.py``), run after
    ``stop`` in the same step and kept as far as the model picks them itself."""

    seq: Sequence
    start: int
    stop: int
    proposal: tuple[int, ...] = ()

    @property
    def last(self) -> bool:
        """Whether the chunk reaches the sequence's end."""
        return self.stop == self.seq.num_tokens

    @property
    def sample(self) -> bool:
        """Whether the step samples a token after the chunk (never for an embedding input)."""
        return self.last and not self.seq.pooling


def step_shape(chunks: list[Chunk]) -> StepShape:
    """What a step runs, in the terms of the latency profile: decode tokens of running sequences
    (by their length after the step) and prefill chunks (cached tokens, new tokens)."""
    # a decode with a proposal runs its tokens as a chunk does
    decoding = [c for c in chunks if c.seq.state is SeqState.RUNNING and not c.proposal]
    prefilling = [
        (c.start, c.stop - c.start + len(c.proposal))
        for c in chunks
        if c.seq.state is not SeqState.RUNNING or c.proposal
    ]
    return StepShape.of(prefilling, [c.stop for c in decoding])


__all__ = ["Chunk", "Pick", "step_shape"]
