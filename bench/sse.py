"""Reading an OpenAI-style completions stream (server-sent events) and turning it into token timings.

The token rule. A stream chunk may carry several tokens and its text does not say how many, so:

1. Every chunk whose ``choices[0].text`` is non-empty is a *token event*; its arrival time is recorded.
   The first event is the first token (TTFT).
2. The output token count N is ``usage.completion_tokens`` when the server reports it (the client asks
   for it with ``stream_options.include_usage``); otherwise one token per event (a lower bound).
3. With K events and N > K, the N - 1 tokens after the first are shared as evenly as possible among the
   K - 1 intervals between events (earlier intervals take the remainder first), and each interval is
   split evenly among its tokens. With K = 1 the other N - 1 tokens arrived with the first: gaps of 0.
   So there are always N - 1 inter-token gaps, and they sum to the time from the first to the last event.
4. With N < K (a server that splits tokens across chunks), the K - 1 event gaps are kept as observed and
   N is still reported as the token count.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Protocol


class _LineSource(Protocol):
    def __aiter__(self) -> AsyncIterator[bytes]: ...


async def iter_events(content: _LineSource) -> AsyncIterator[dict[str, Any]]:
    """Yield each ``data:`` payload as a dict until ``[DONE]`` or the end of the body.

    Multi-line ``data:`` fields of one event are joined with newlines; comments and other fields are
    skipped. A payload that is not JSON raises ``ValueError``.
    """
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
            continue
        if line or not data:
            continue
        payload, data = "\n".join(data), []
        if payload.strip() == "[DONE]":
            return
        try:
            yield json.loads(payload)
        except json.JSONDecodeError:
            raise ValueError(f"stream chunk is not JSON: {payload[:200]!r}") from None
    if data and "\n".join(data).strip() != "[DONE]":
        try:
            yield json.loads("\n".join(data))
        except json.JSONDecodeError:
            raise ValueError("stream ended inside a chunk that is not JSON") from None


def chunk_text(chunk: dict[str, Any]) -> str:
    """The completion text a chunk carries ('' when none; chat deltas are read too)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or {}).get("content")
    return text or ""


def spread_tokens(event_ms: list[float], usage_tokens: int | None) -> tuple[int, list[float]]:
    """(output token count, inter-token gaps in ms) from token-event times, per the module's rule."""
    k = len(event_ms)
    n = usage_tokens if usage_tokens is not None and usage_tokens > 0 else k
    if k == 0:
        return n, []
    intervals = [b - a for a, b in zip(event_ms, event_ms[1:], strict=False)]
    if n <= k:
        return n, intervals
    if k == 1:
        return n, [0.0] * (n - 1)
    base, extra = divmod(n - 1, k - 1)
    gaps: list[float] = []
    for i, width in enumerate(intervals):
        m = base + (1 if i < extra else 0)
        gaps.extend([width / m] * m)
    return n, gaps
