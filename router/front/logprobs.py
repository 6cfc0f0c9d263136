"""Log-probabilities in OpenAI's two response shapes.

Completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, parallel lists, each top
entry a ``{token text: logprob}`` map. Chat: ``{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}]}]}``. A token's text is its decoding alone (special
tokens included); a token that ends inside a UTF-8 character decodes to U+FFFD, and ``bytes`` then
holds that replacement's bytes, not the raw ones. In a completions top map, of tokens that decode to
the same text only the likelier one is shown. The values are the model's own log-probabilities,
before penalties, bias and temperature.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pdfabric.engine.sequence import TopLogprobs


@dataclass
class LogprobsOut:
    """The log-probabilities of a run of output tokens, formatted as the request's endpoint wants."""

    chat: bool
    token_text: Callable[[int], str]
    offset: int = 0  # completions' text_offset of the next token
    _tokens: list[int] = field(default_factory=list)
    _values: list[float | None] = field(default_factory=list)
    _tops: list[TopLogprobs | None] = field(default_factory=list)

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[TopLogprobs]) -> None:
        """Appends tokens with their logprobs and (when asked for) their top log-probabilities."""
        self._tokens += token_ids
        self._values += logprobs
        self._tops += tops if tops else [()] * len(token_ids)

    def add_prompt(self, token_ids: Sequence[int], scored: Sequence[tuple[float, TopLogprobs]]) -> None:
        """Appends an echoed prompt's tokens: the first has no log-probability (null), each other its
        score (``TokenDelta.prompt_logprobs``; null where missing)."""
        scores: list[tuple[float, TopLogprobs] | None] = list(scored[: len(token_ids) - 1])
        scores += [None] * (len(token_ids) - 1 - len(scores))
        self._tokens += token_ids
        self._values += [None, *(s[0] if s else None for s in scores)]
        self._tops += [None, *(s[1] if s else None for s in scores)]

    def take(self) -> dict[str, Any]:
        """The block for the tokens added since the last ``take``, in the endpoint's shape."""
        tokens, values, tops = self._tokens, self._values, self._tops
        self._tokens, self._values, self._tops = [], [], []
        if self.chat:
            return {
                "content": [
                    self._chat_entry(t, v, top) for t, v, top in zip(tokens, values, tops, strict=True)
                ]
            }
        texts = [self.token_text(t) for t in tokens]
        offsets = []
        for text in texts:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": texts,
            "token_logprobs": values,
            "top_logprobs": [self._top_map(top) for top in tops],
            "text_offset": offsets,
        }

    def _top_map(self, top: TopLogprobs | None) -> dict[str, float] | None:
        """``{text: logprob}``, best first; of tokens that decode alike, the likelier one's."""
        if top is None:
            return None
        out: dict[str, float] = {}
        for token, value in top:
            out.setdefault(self.token_text(token), value)
        return out

    def _chat_entry(self, token: int, value: float, top: TopLogprobs) -> dict[str, Any]:
        text = self.token_text(token)
        return {
            "token": text,
            "logprob": value,
            "bytes": list(text.encode()),
            "top_logprobs": [
                {"token": (s := self.token_text(t)), "logprob": lp, "bytes": list(s.encode())}
                for t, lp in top
            ],
        }
