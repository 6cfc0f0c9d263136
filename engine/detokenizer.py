"""Generated token ids to streamed text, one token at a time, with stop strings.

A token's text depends on its neighbours (byte-level tokens may hold part of a UTF-8 character;
sentencepiece decoders drop the space of the first token they see), so each step decodes a short
window of recent tokens twice, with and without the new ones, and emits the difference:

1. ``_window[:_read]`` is text already handed on; ``_window[_read:]`` are tokens not yet turned into
   text. The window starts at a character boundary, one emission back, to give the decoder context.
2. While the window's text ends in U+FFFD (an unfinished UTF-8 character) nothing is emitted. Once it
   decodes cleanly, the new text passes on and the window slides forward.
3. New text then waits in ``_held`` for as long as its end could be the start of a stop string. A
   completed stop string ends the stream: only the text before it is emitted.

Each step costs a few tokens' decoding, not the whole output. Concatenating every ``step()`` result
and ``flush()`` gives ``decode(prompt + generated)`` minus ``decode(prompt)`` (for byte-level
tokenizers that is ``decode(generated)``), cut before the first stop string.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded before the first generated one
_MAX_PENDING = 8  # tokens held for an unfinished character before giving up (invalid UTF-8)


class SupportsDecode(Protocol):
    """What the detokenizer needs of a tokenizer (``pdfabric.engine.tokenizer.Tokenizer`` fits)."""

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated tokens into text as they arrive.

    ``text`` is everything emitted so far; ``stopped`` and ``stop_reason`` (the stop string matched)
    are set once a stop string completes, after which ``step`` and ``flush`` return "".
    """

    def __init__(
        self,
        tokenizer: SupportsDecode,
        prompt_ids: list[int],
        stop: Iterable[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        """``stop`` strings end the text before their first occurrence (empty strings are ignored)."""
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._max_held = max((len(s) - 1 for s in self._stops), default=0)
        self._window = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        self._held = ""
        self.text = ""
        self.stopped = False
        self.stop_reason: str | None = None

    def step(self, token_id: int) -> str:
        """Adds a generated token; returns the text that became final (often empty)."""
        if self.stopped:
            return ""
        self._window.append(token_id)
        return self._emit(self._advance(force=False), final=False)

    def flush(self) -> str:
        """At the end of generation: the text still held back (an unfinished character, a stop prefix)."""
        if self.stopped:
            return ""
        return self._emit(self._advance(force=True), final=True)

    def _advance(self, force: bool) -> str:
        """New text of the tokens after ``_read``, or "" while they end inside a character."""
        text = self._decode(self._window)
        pending = len(self._window) - self._read
        unfinished = text.endswith(_REPLACEMENT) and pending < _MAX_PENDING
        if pending == 0 or (unfinished and not force):
            return ""
        if len(text) <= len(self._read_text):
            # The tokens add no text (skipped special tokens): drop them so the window stays short.
            del self._window[self._read :]
            return ""
        new = text[len(self._read_text) :]
        # Slide: the tokens just emitted become the context of the next window.
        del self._window[: self._read]
        self._read = len(self._window)
        self._read_text = self._decode(self._window)
        return new

    def _emit(self, new: str, final: bool) -> str:
        """Passes ``new`` on, keeping back a possible stop-string start unless ``final``."""
        if not new and not (final and self._held):
            return ""
        held = self._held + new
        cut, reason = _first_stop(held, self._stops)
        if reason is not None:
            self.stopped, self.stop_reason = True, reason
            self._held = ""
            out = held[:cut]
        else:
            keep = 0 if final else _stop_prefix_len(held, self._stops, self._max_held)
            out, self._held = held[: len(held) - keep], held[len(held) - keep :]
        self.text += out
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str | None]:
    """Where the earliest stop string in ``text`` starts, and which one (the longest on a tie)."""
    best, reason = len(text), None
    for stop in stops:
        at = text.find(stop)
        if at != -1 and (at < best or (at == best and reason is not None and len(stop) > len(reason))):
            best, reason = at, stop
    return best, reason


def _stop_prefix_len(text: str, stops: tuple[str, ...], max_len: int) -> int:
    """Length of the longest end of ``text`` that some stop string starts with."""
    for size in range(min(max_len, len(text)), 0, -1):
        tail = text[-size:]
        if any(stop.startswith(tail) for stop in stops):
            return size
    return 0
