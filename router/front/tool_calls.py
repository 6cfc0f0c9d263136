"""A chat reply's tool calls in OpenAI's shapes, from text in the default tool format
(``pdfabric.structure``): ``message.tool_calls`` of a whole reply, and ``delta.tool_calls`` of a
streamed one (each call's id, type and name first, then its arguments in fragments as they are
written), with ``finish_reason`` ``tool_calls`` when a reply that calls tools ends by itself."""

from __future__ import annotations

import json
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


# What ends a call after its arguments: the call's own "}", a newline and the closing tag. A
# streamed call's arguments go out but for this many last characters, which may be that end.
_CALL_END = len("}\n" + structure.CALL_CLOSE)


@dataclass
class ToolCallStream:
    """Splits a streamed reply's text into content (passed on at once, but for a tail that could
    open a call) and calls: once a call's name is written, a ``delta.tool_calls`` entry with its
    index, id, type and name; then its arguments in fragments as the model writes them."""

    calls: int = 0  # calls started so far
    _pending: str = ""  # text not passed on yet: a possible start of a call, or a call in progress
    _in_call: bool = False
    _head: int = 0  # where the open call's arguments start in _pending (0: its name not read yet)
    _sent: int = 0  # characters of the open call's arguments sent
    _deltas: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        """Content to send now and the ``delta.tool_calls`` entries that ``text`` completes;
        ``final``: the reply ended, so whatever is pending goes out (a call cut short as far as it
        got, or as content when its name was not written)."""
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
                self._pending, self._in_call, self._head, self._sent = self._pending[start:], True, 0, 0
            if not self._head:
                head = structure.CALL_HEAD.match(self._pending)
                if head:
                    self._head = head.end()
                    self._deltas.append(
                        {"index": self.calls, "id": call_id(), "type": "function",
                         "function": {"name": json.loads(head.group(1)), "arguments": ""}}
                    )  # fmt: skip
            end = self._pending.find(structure.CALL_CLOSE)
            if end < 0:
                if self._head:
                    self._arguments(self._pending[self._head : len(self._pending) - _CALL_END])
                break
            whole = self._pending[: end + len(structure.CALL_CLOSE)]
            _, calls = structure.split_calls(whole)
            if self._head and calls:
                self._arguments(calls[0].arguments)
                self.calls += 1
            elif calls:  # a call written in another shape: whole at once
                self._deltas += [
                    {"index": self.calls, "id": call_id(), "type": "function",
                     "function": {"name": calls[0].name, "arguments": ""}},
                    {"index": self.calls, "function": {"arguments": calls[0].arguments}},
                ]  # fmt: skip
                self.calls += 1
            else:  # not a call after all: it is text
                content += whole
            self._pending, self._in_call, self._head = self._pending[len(whole) :], False, 0
        if final and self._pending:
            if self._head:  # a call cut short: its arguments as far as they go
                self._arguments(self._pending[self._head :])
                self.calls += 1
            elif self._pending.strip():
                content += self._pending
            self._pending, self._in_call, self._head = "", False, 0
        deltas, self._deltas = self._deltas, []
        return content, deltas

    def _arguments(self, so_far: str) -> None:
        """Sends the open call's arguments from where the last fragment ended to ``so_far``'s end."""
        if len(so_far) > self._sent:
            self._deltas.append({"index": self.calls, "function": {"arguments": so_far[self._sent :]}})
            self._sent = len(so_far)


def _open_tail(text: str) -> int:
    """How many characters at the end of ``text`` could be the start of a call's opening tag."""
    tag = structure.CALL_OPEN
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
