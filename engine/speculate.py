"""Prompt-lookup speculation: guessing a sequence's next tokens from its own history. No torch here.

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
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pdfabric.engine.sequence import Sequence as Seq

MAX_NGRAM, MIN_NGRAM = 4, 2

# What the scheduler asks a proposer for: a decoding sequence, its block table (grown to hold its
# next token and k more) and k, the most tokens to propose after its next one.
Wanted = tuple["Seq", tuple[int, ...], int]


class Proposer(Protocol):
    """Guesses the next tokens of the sequences about to decode, all at once; each guess at most k
    tokens long (shorter, or empty, where it has none)."""

    def propose(self, wanted: list[Wanted]) -> list[tuple[int, ...]]: ...


class PromptLookup:
    """The ``ngram`` proposer: ``propose`` over each sequence's own tokens."""

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
