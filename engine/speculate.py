"""Prompt-lookup speculation: guessing a sequence's next tokens from its own history, and what
speculation gains (``SpeculationGain``). No torch here.

A sequence that ends with tokens it has seen before (a text being edited, quoted, summarised, code
being rewritten) often goes on as it did then. ``propose`` finds the latest earlier place where the
sequence's last ``n`` tokens occur (``n`` from ``MAX_NGRAM`` down to ``MIN_NGRAM``) and proposes the
tokens that followed there. One model step then checks every proposed token at once (the
scheduler's chunk holds the last token and the proposal; ``engine/stepper.py`` keeps the proposed
tokens the model itself picks, and the one after them). Greedy output is unchanged by this: a token
is kept only where it is the model's own choice, and each position's logits are the same in a chunk
as in a decode step (``docs/engine.md``, batch invariance). A ``Proposer`` is what the scheduler
asks: ``PromptLookup`` here, or a draft model (``engine/draft.py``); ``Speculation`` is how the
scheduler asks it (how many tokens, and what a check's outcome changes).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdfabric.engine.block_pool import BlockTables
    from pdfabric.engine.sequence import Sequence as Seq

MAX_NGRAM, MIN_NGRAM = 4, 2
# The most decode steps a sequence whose draft keeps missing waits before it drafts again.
MAX_SPECULATE_WAIT = 31

# What the scheduler asks a proposer for: a decoding sequence, its block table (grown to hold its
# next token and k more) and k, the most tokens to propose after its next one.
Wanted = tuple["Seq", tuple[int, ...], int]


class Proposer(Protocol):
    """Guesses the next tokens of the sequences about to decode, all at once; each guess at most k
    tokens long (shorter, or empty, where it has none). ``runs_model``: guessing costs model steps
    (a draft model), so a sequence whose guesses keep missing stops asking for a while (the
    scheduler's back-off); a guess that costs next to nothing (prompt lookup) is always asked for."""

    runs_model: bool

    def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]: ...


class PromptLookup:
    """The ``ngram`` proposer: ``propose`` over each sequence's own tokens."""

    runs_model = False

    def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
        return [propose(seq.token_slice(0, seq.num_tokens), k) for seq, _, k in wanted]


def propose(tokens: Sequence[int], k: int) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of ``tokens``' last n-gram (the
    longest n that occurs, from ``MAX_NGRAM`` down to ``MIN_NGRAM``); () when none does."""
    if k < 1 or len(tokens) <= MIN_NGRAM:
        return ()
    raw = array("i", tokens).tobytes()  # 4 bytes a token: a byte search finds n-grams at C speed
    size = len(tokens)
    for n in range(min(MAX_NGRAM, size - 1), MIN_NGRAM - 1, -1):
        pattern = raw[(size - n) * 4 :]
        limit = (size - 1) * 4  # an occurrence ends before the last token: something followed it
        while (at := raw.rfind(pattern, 0, limit)) >= 0:
            if at % 4 == 0:  # on a token boundary, not straddling two tokens' bytes
                start = at // 4 + n
                return tuple(tokens[start : start + k])
            limit = at + 4 * n - 1  # the next match to look at starts before this one
    return ()


class Speculation:
    """The scheduler's side of speculation: how many tokens each decoding sequence asks ``proposer``
    for (at most ``k``, while at most ``below`` sequences decode), the proposals cut to that, and what
    a check's outcome changes (the sequence's next k; after misses of a draft model, a back-off).
    Counts the tokens proposed and kept and the checks."""

    def __init__(
        self, tables: BlockTables, k: int, below: int, max_model_len: int, proposer: Proposer
    ) -> None:
        self.tables = tables
        self.k, self.below, self.max_model_len = k, below, max_model_len
        self.proposer = proposer
        self.proposed_tokens = 0
        self.accepted_tokens = 0  # of those, kept
        self.checks = 0  # decodes that checked a proposal (tokens per check: 1 + accepted / checks)

    def room(self, seq: Seq, budget: int, decoding: int) -> int:
        """How many tokens to ask for after ``seq``'s next one this step, while ``decoding`` sequences
        decode (0 beyond ``below``); its blocks grow to hold them (cut to what the pool, the
        ``budget`` and the sequence's own limits leave)."""
        p = seq.params
        most = self.k if p.speculative_k < 0 else min(self.k, p.speculative_k)
        if not most or decoding > self.below:
            return 0
        if seq.speculate_wait:  # backing off after proposals that kept nothing
            seq.speculate_wait -= 1
            return 0
        limit = min(p.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens) - 1
        left = min(most, budget, limit)
        k = max(0, min(left, seq.speculate_k or self.k))
        # New blocks for a guess only while a free one stays for each decoding sequence: a proposal
        # never makes another sequence give up its blocks.
        spare = max(0, self.tables.pool.num_free - decoding)
        while k and self.tables.extra_blocks(seq.request_id, seq.num_tokens + k) > spare:
            k -= 1
        if k and self.tables.grow(seq.request_id, seq.num_tokens + k) is None:
            k = 0
        return k

    def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]:
        """The proposer's tokens for ``wanted``, each at most its k; the blocks grown for tokens not
        proposed go back."""
        proposals = []
        for (seq, _, k), proposal in zip(wanted, self.proposer.propose(wanted), strict=True):
            proposal = tuple(proposal[:k])
            if len(proposal) < k:
                self.tables.shrink(seq.request_id, seq.num_tokens + len(proposal))
            seq.proposed += len(proposal)
            self.proposed_tokens += len(proposal)
            proposals.append(proposal)
        return proposals

    def checked(self, seq: Seq, proposed: int, kept: int) -> None:
        """A check of ``proposed`` tokens kept ``kept`` of them."""
        seq.accepted += kept
        self.accepted_tokens += kept
        self.checks += 1
        # the next proposal's length follows this one's outcome
        seq.speculate_k = proposed * 2 if kept == proposed else max(1, kept)
        # a draft that keeps missing costs its steps for each token: after n misses in a row the
        # sequence lets 2^(n-1) - 1 of the steps in which it would draft go by before it drafts again
        seq.speculate_misses = 0 if kept else seq.speculate_misses + 1
        if seq.speculate_misses and self.proposer.runs_model:
            seq.speculate_wait = min(MAX_SPECULATE_WAIT, (1 << min(seq.speculate_misses - 1, 8)) - 1)


class SpeculationGain:
    """How much faster a decoding sequence gets its tokens while a worker speculates, measured.

    ``record`` takes each step whose every chunk decoded a running sequence and at least one carried a
    proposal: how many sequences decoded, their context, the tokens they got, and the step's seconds
    (drafting included). ``gain(plain)`` compares the recent ones with what plain decode steps of the
    same shapes would have taken (``plain(batch, context)``, the worker's fitted profile): tokens a
    sequence gets per second speculating over tokens per second decoding plainly. The router divides
    its predicted inter-token latency by it while the worker speculates (``docs/routing.md``).
    """

    def __init__(self, window: int = 64) -> None:
        self._steps: deque[tuple[int, int, int, float]] = deque(maxlen=window)

    def record(self, batch: int, context_tokens: int, tokens: int, seconds: float) -> None:
        if batch > 0 and seconds > 0:
            self._steps.append((batch, context_tokens, tokens, seconds))

    def gain(self, plain: Callable[[int, int], float]) -> float:
        """The recent steps' speed-up over plain decoding; 1.0 before any was recorded."""
        spent = sum(seconds for *_, seconds in self._steps)
        if not spent:
            return 1.0
        # each step gives its sequences tokens / batch tokens each where a plain step would give one
        worth = sum(tokens / batch * plain(batch, context) for batch, context, tokens, _ in self._steps)
        return worth / spent if worth > 0 else 1.0
