"""Per-request sampling parameters, validated once and then passed around unchanged, and the other outputs
of a request whose prompt is computed once (no torch here: the protocol carries both)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. Sampling is keyed by ``seed`` and the token's index in the
    output, not by a generator's state, so the same seed gives the same output on any worker, in any
    batch, and across the prefill/decode hand-over. ``output_offset`` is how many output tokens a
    request already produced elsewhere before it was resumed here (its prompt then ends with them):
    token ``i`` of this run is output token ``output_offset + i``, so a request moved to another worker
    mid-stream samples exactly what it would have sampled where it started. ``choice`` is which of a
    request's ``n`` outputs this is: each choice samples from its own seed stream (choice 0 from
    ``seed`` itself), so choice ``i`` of a request is the same wherever and beside whatever it runs.
    ``prompt_logprobs``: the worker that computes the prompt also scores each prompt token after the
    first (its log-probability given the tokens before it, and the ``logprobs`` likeliest there); such
    a prompt is computed whole, never taken from the prefix cache.

    ``token_logprob``: compute each picked token's log-probability (its row's log-normaliser, a pass
    over the vocabulary: 3.4 ms a step for 96 rows of SmolLM2's 49,152 logits on two cores); the
    router asks for it only where a response returns log-probabilities or ``best_of`` ranks outputs
    by them. Without it (and ``logprobs`` 0) a token's log-probability is reported as 0.0.

    ``priority``: its admission class's priority (``[routing]`` classes); a worker's queue of prompts
    to prefill takes a higher one before a lower one (first come, first served among equals), so an
    online request does not wait behind a batch job's lines that reached the worker first. It never
    changes the output.

    ``background``: its class is a background one (``[routing]`` classes, e.g. a batch job's lines): a
    worker prefills its prompt only in steps where no foreground sequence decodes, in as many tokens
    of such a step as fit in ``[worker] background_step_ms``, so that foreground tokens never wait for
    its chunks and a foreground prompt arriving waits for a short step. It never changes the output.

    ``speculative_k``: the most tokens speculative decoding may propose for it a step, below the
    worker's own setting (-1: the worker's; 0: none); it never changes the output, only how fast it
    comes (``engine/speculate.py``).

    ``grammar``: the output must follow it (a grammar built and checked by ``pdfabric.structure``;
    "" none); tokens it does not allow next are never picked, and a finished structure allows only
    end-of-sequence.

    Before a token is picked, its row of logits is changed, in this order: tokens outside the
    ``grammar`` are removed; ``logit_bias`` is added
    (token id, value); ``repetition_penalty`` divides the positive logits of tokens seen in the prompt
    or output and multiplies the negative ones; ``frequency_penalty`` is subtracted once per earlier
    output of a token and ``presence_penalty`` once for any; while fewer than ``min_tokens`` were
    output (counted from the request's first output token, ``output_offset`` included),
    end-of-sequence and ``stop_token_ids`` cannot be picked. Returned log-probabilities are the
    model's own, before these changes.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0  # how many top log-probabilities to return per token (0: none)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0
    output_offset: int = 0  # output tokens produced before this run (a resumed request)
    choice: int = 0  # which of the request's outputs (its seed stream)
    prompt_logprobs: bool = False  # also each prompt token's log-probability (and ``logprobs`` top ones)
    grammar: str = ""  # what the output must follow (``pdfabric.structure``); "" none
    speculative_k: int = -1  # speculative decoding: most proposed tokens a step (-1: the worker's; 0: off)
    token_logprob: bool = True  # compute each picked token's log-probability (see above)
    priority: int = 0  # its class's: a worker prefills waiting prompts of higher priority first
    background: bool = False  # its class's: a worker prefills its prompt in short chunks (see above)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.output_offset < 0:
            raise ValueError(f"output_offset must be >= 0, got {self.output_offset}")
        if self.choice < 0:
            raise ValueError(f"choice must be >= 0, got {self.choice}")
        if not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if not -1 <= self.speculative_k <= 32:
            raise ValueError(f"speculative_k must be in [-1, 32], got {self.speculative_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Every token that ends the output: ``stop_token_ids``, and the model's eos unless ignored."""
        return frozenset(self.stop_token_ids) | (frozenset() if self.ignore_eos else frozenset(eos_token_ids))

    @property
    def changes_logits(self) -> bool:
        """Whether any bias, penalty or ``min_tokens`` changes the logits before a token is picked."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )


@dataclass(frozen=True)
class Branch:
    """Another output of a request whose prompt is computed once (``n`` > 1): output ``choice``,
    continuing the request's own prompt with ``output``, the tokens it already produced (empty for a
    new request; a resumed one's earlier output). Its sequence shares the prompt's full blocks with the
    request's sequence and computes only its own tail (``Scheduler``)."""

    choice: int
    output: tuple[int, ...] = ()
