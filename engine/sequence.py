"""A request as a worker sees it: token ids, sampling parameters, cache progress and state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace

from pdfabric.sampling_params import Branch, SamplingParams

TopLogprobs = tuple[tuple[int, float], ...]  # the most likely (token id, log-probability) pairs, best first


class SeqState(enum.Enum):
    WAITING = "waiting"  # has tokens without KV: a prompt to prefill, or a preempted sequence to recompute
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved; a prefill worker is pushing the prompt's KV
    RUNNING = "running"  # decoding one token per step
    HANDOFF = "handoff"  # prefill done; blocks held until the KV has been shipped
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)  # per output token, when params.logprobs
    # Per prompt token after the first, when params.prompt_logprobs: (log-probability, top ones).
    prompt_logprobs: list[tuple[float, TopLogprobs]] = field(default_factory=list)
    num_cached: int = 0  # leading tokens of all_ids whose KV is in the cache
    prefix_hit: int | None = None  # prompt tokens taken from the prefix cache as it was first prefilled
    from_cache: int = 0  # tokens of its table taken from the prefix cache, not computed, since attached
    block_hashes: list[bytes] = field(default_factory=list)  # prefix hashes of its full blocks so far
    recorded: int = 0  # leading blocks of its table that are in the prefix cache
    state: SeqState = SeqState.WAITING
    finish_reason: str | None = None
    branches: tuple[Branch, ...] = ()  # the request's other outputs, started once its prompt is computed
    group: str = ""  # a branch's: the request id of the sequence it branched from ("": none)
    grammar_state: object | None = None  # with params.grammar: its matcher (engine/grammar.py)
    step_tokens: int = 1  # output tokens its last step added (more than one: a proposal was kept)
    speculate_k: int = 0  # how many tokens to propose next (0: the worker's most; engine/speculate.py)
    proposed: int = 0  # tokens proposed for it so far
    speculate_misses: int = 0  # checks in a row that kept none of their proposal
    speculate_wait: int = 0  # decode steps to go before it proposes again (after misses)
    accepted: int = 0  # of those, kept
    # An embedding input (``engine/pooling.py``): its prompt is computed and pooled, nothing sampled.
    pooling: str = ""  # "last", "mean" or "cls" ("": a generation request)
    normalize: bool = False  # the pooled vector is scaled to unit length
    pooled: list[object] = field(default_factory=list)  # the stepper's hidden rows so far (its own type)
    embedding: bytes = b""  # the pooled vector (float32, little-endian), once its prompt is done
    compute_s: float = 0.0  # the time of the steps that ran it

    @property
    def reply_id(self) -> str:
        """The request id its token deltas carry (a branch's request's)."""
        return self.group or self.request_id

    @property
    def runs_whole(self) -> bool:
        """Whether every prompt token must be computed here (no prefix cache hit): a scored prompt,
        or an embedding pooled from every token (mean) or from the first (cls)."""
        return self.params.prompt_logprobs or self.pooling in ("mean", "cls")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, stop: int) -> tuple[int, ...]:
        """Tokens ``start:stop`` of prompt followed by output, without building the whole list."""
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        head = self.prompt_ids[start:] if start < p else ()
        return head + tuple(self.output_ids[max(0, start - p) : stop - p])

    def finish_reason_after(self, token_id: int, max_model_len: int) -> str | None:
        """Why the sequence ends after appending ``token_id`` (already appended), if it does."""
        if token_id in self.params.stop_token_ids or (
            not self.params.ignore_eos and token_id in self.eos_token_ids
        ):
            return "stop"
        if len(self.output_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
            return "length"
        return None


def branch_id(request_id: str, choice: int) -> str:
    """The id of a request's branch for output ``choice`` (its deltas carry the request's id)."""
    return f"{request_id}#{choice}"


def branch_params(seq: Sequence, branch: Branch) -> SamplingParams:
    """A branch's sampling parameters: the request's, for output ``branch.choice``, after the branch's
    earlier output, with the same bound on the whole output. ``ValueError`` if none is left."""
    total = seq.params.max_tokens + seq.params.output_offset
    return replace(
        seq.params,
        choice=branch.choice,
        output_offset=len(branch.output),
        max_tokens=total - len(branch.output),
        prompt_logprobs=False,  # the request's own sequence scores the prompt
    )
