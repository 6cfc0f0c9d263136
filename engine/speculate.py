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
asks: ``PromptLookup`` here, or a draft model (``engine/draft.py``).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdfabric.engine.sequence import Sequence as Seq

MAX_NGRAM, MIN_NGRAM = 4, 2

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
