"""A request's latency breakdown, reported in the final streamed usage chunk as ``usage["pdfabric"]``.

It sets what the router predicted when it chose the route next to what the router then measured:

- ``route``: the worker(s) that ran it (``prefill->decode``, or one colocated worker);
- ``slo``: its class and budgets (``ttft_ms``, ``itl_ms``);
- ``predicted``: the chosen route's ``ttft_ms``, ``itl_ms`` and TTFT parts ``queue_ms`` (work queued
  ahead on the prefill side), ``prefill_ms`` (the prompt's compute) and ``transfer_ms`` (its KV);
- ``measured``, by stage:
  1. ``router_wait_ms``: arrival at the router to dispatch to the workers (admission wait and the
     decode worker's block reservation);
  2. ``prefill_ms``: dispatch to the first token reaching the router (the prefill side's queue and
     the prompt's compute; compare with the predicted ``queue_ms + prefill_ms``), so that
     ``router_wait_ms + prefill_ms == ttft_ms``;
  3. ``transfer_ms``: the KV push, from its start (as the first token leaves the prefill worker) to
     the decode worker's acknowledgement, as the prefill worker reports it in ``HandedOff``; 0 on a
     colocated route; absent if that report had not reached the router when the request ended;
  4. ``decode_ms``: first to last token;
  and the totals ``ttft_ms`` (arrival to the first token) and ``itl_ms_mean`` (first to last token
  over the tokens between them; absent with fewer than two). Stages 2 to 4 are absent when no token
  came.

The first token leaves the prefill worker before its KV is pushed, so the measured TTFT does not
include the transfer: the push runs at the start of the decode stage, and ``router_wait_ms +
prefill_ms + transfer_ms`` falls within ``ttft_ms + decode_ms``, give or take message delivery. All
times are in milliseconds; all but ``transfer_ms`` (the prefill worker's monotonic clock) are on the
router's monotonic clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pdfabric.router.routing.routes import Choice
from pdfabric.router.routing.slo import Resolved


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

    def latencies(self, arrival: float) -> tuple[float | None, float | None]:
        """(TTFT, mean inter-token latency) in seconds; None where too few tokens came."""
        ttft = None if self.first is None else self.first - arrival
        if self.first is None or self.last is None or self.tokens < 2:
            return ttft, None
        return ttft, (self.last - self.first) / (self.tokens - 1)


def breakdown(
    route: str,
    resolved: Resolved,
    choice: Choice | None,
    arrival: float,
    dispatched: float,
    times: TokenTimes,
    transfer_s: float | None = None,
) -> dict[str, Any]:
    """The ``usage["pdfabric"]`` object of one request (see the module docstring). ``arrival`` and
    ``dispatched`` are monotonic seconds; ``transfer_s`` is the KV push's duration (0 for a colocated
    route, None if unknown)."""
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
    if times.first is not None and times.last is not None:
        measured["ttft_ms"] = _ms(times.first - arrival)
        measured["prefill_ms"] = _ms(times.first - dispatched)
        if transfer_s is not None:
            measured["transfer_ms"] = _ms(transfer_s)
        measured["decode_ms"] = _ms(times.last - times.first)
        # Each token after the first arrived on average this long after the one before it.
        if times.tokens >= 2:
            measured["itl_ms_mean"] = _ms((times.last - times.first) / (times.tokens - 1))
    out["measured"] = measured
    return out


def _ms(seconds: float) -> float:
    return round(max(0.0, seconds) * 1e3, 3)
