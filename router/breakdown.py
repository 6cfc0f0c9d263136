"""A request's latency breakdown, reported in the final streamed usage chunk as ``usage["pdfabric"]``.

It sets what the router predicted when it chose the route next to what the router then measured:

- ``route``: the worker(s) that ran it (``prefill->decode``, or one colocated worker);
- ``slo``: its class and budgets (``ttft_ms``, ``itl_ms``);
- ``predicted``: the chosen route's ``ttft_ms``, ``itl_ms`` and TTFT parts ``queue_ms`` (work queued
  ahead on the prefill side), ``prefill_ms`` (the prompt's compute) and ``transfer_ms`` (its KV);
- ``measured``: ``router_wait_ms`` (arrival at the router to dispatch to the workers: admission wait
  and the decode worker's block reservation), ``ttft_ms`` (arrival to the first token) and
  ``itl_ms_mean`` (first to last token over the tokens between them; absent with fewer than two).

All times are in milliseconds, measured on the router's monotonic clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pdfabric.router.predictor import Choice
from pdfabric.router.slo import Resolved


@dataclass
class TokenTimes:
    """When a request's tokens reached the router (monotonic seconds)."""

    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def seen(self, count: int) -> None:
        """``count`` tokens arrived now."""
        now = time.monotonic()
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += count


def breakdown(
    route: str,
    resolved: Resolved,
    choice: Choice | None,
    arrival: float,
    dispatched: float,
    times: TokenTimes,
) -> dict[str, Any]:
    """The ``usage["pdfabric"]`` object of one request (see the module docstring)."""
    budgets = resolved.budgets
    out: dict[str, Any] = {
        "route": route,
        "slo": {"class": resolved.slo_class.name, "ttft_ms": budgets.ttft_ms, "itl_ms": budgets.itl_ms},
    }
    if choice is not None:
        out["predicted"] = {
            name: round(getattr(choice, name), 3)
            for name in ("ttft_ms", "itl_ms", "queue_ms", "prefill_ms", "transfer_ms")
        }
    measured: dict[str, float] = {"router_wait_ms": _ms(dispatched - arrival)}
    if times.first is not None:
        measured["ttft_ms"] = _ms(times.first - arrival)
        # Each token after the first arrived on average this long after the one before it.
        if times.last is not None and times.tokens >= 2:
            measured["itl_ms_mean"] = _ms((times.last - times.first) / (times.tokens - 1))
    out["measured"] = measured
    return out


def _ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1e3, 3)
