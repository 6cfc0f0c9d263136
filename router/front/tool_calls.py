"""A chat reply's tool calls in OpenAI's shapes, from text in the default tool format
(``pdfabric.structure``): ``message.tool_calls`` of a whole reply, and ``delta.tool_calls`` of a
streamed one (each call's id, type and name first, then its arguments), with ``finish_reason``
``tool_calls`` when a reply that calls tools ends by itself."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from pdfabric import structure


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def finish_reason(reason: str, calls: int) -> str:
    """A reply's finish reason: ``tool_calls`` when it called tools and stopped by itself."""
    return "tool_calls" if calls and reason == "stop" else reason


def message(text: str) -> tuple[dict[str, Any], int]:
    """A whole reply's ``message`` (content, and ``tool_calls`` when it calls tools) and how many
    calls it makes."""
    content, calls = structure.split_calls(text)
    if not calls:
        return {"role": "assistant", "content": text}, 0
    body = [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
    return {"role": "assistant", "content": content or None, "tool_calls": body}, len(calls)


@dataclass
class ToolCallStream:
    """Splits a streamed reply's text into content (passed on at once, but for a tail that could
    open a call) and complete calls (each turned into two ``delta.tool_calls`` entries)."""

    calls: int = 0  # calls sent so far
    _pending: str = ""  # text not passed on yet: a possible start of a call, or a call in progress
    _in_call: bool = False
    _deltas: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Content to send now and the ``delta.tool_calls`` entries completed by ``text``; ``final``:
        the reply ended, so whatever is pending goes out (a call cut short, as content)."""
        self._pending += text
        content = ""
        while True:
            if not self._in_call:
                start = self._pending.find(structure.CALL_OPEN)
                if start < 0:
                    keep = 0 if final else _open_tail(self._pending)
                    if self.calls and not final and not self._pending[: len(self._pending) - keep].strip():
                        keep = len(self._pending)  # the newlines before another call, perhaps
                    cut = len(self._pending) - keep
                    content, self._pending = content + self._pending[:cut], self._pending[cut:]
                    break
                before = self._pending[:start]
                if self.calls == 0 or before.strip():  # the newlines between calls are not content
                    content += before
                self._pending, self._in_call = self._pending[start:], True
            end = self._pending.find(structure.CALL_CLOSE)
            if end < 0:
                break
            whole = self._pending[: end + len(structure.CALL_CLOSE)]
            _, calls = structure.split_calls(whole)
            if not calls:  # not a call after all: it is text
                content += whole
            for c in calls:
                self._deltas += [
                    {"index": self.calls, "id": call_id(), "type": "function",
                     "function": {"name": c.name, "arguments": ""}},
                    {"index": self.calls, "function": {"arguments": c.arguments}},
                ]  # fmt: skip
                self.calls += 1
            self._pending, self._in_call = self._pending[len(whole) :], False
        if final and self._pending:
            if self._pending.strip():
                content += self._pending
            self._pending = ""
        deltas, self._deltas = self._deltas, []
        return content, deltas


def _open_tail(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of a call's opening tag."""
    tag = structure.CALL_OPEN
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
