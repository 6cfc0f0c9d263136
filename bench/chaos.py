"""Killing workers of a running pdfabric deployment on a schedule, for ``pdfabric bench chaos``.

A kill's life:

1. due: its time comes (``KillPlan.due``), but never before the previous victim has settled;
2. chosen: a worker drawn at random (seeded) from those of the plan's kinds that run on this host,
   sparing the last registered worker of a kind (killing it would be an outage, not a failover);
3. signalled: SIGKILL (the launcher restarts the worker) or SIGTERM (it drains and leaves);
4. settled: the worker is back (registered again with its restart count up and a new pid), or, after
   SIGTERM, gone and listed as down, or ``back_timeout_s`` passed without either. The router's
   failover counter, read before the signal and once settled, says how many requests the kill moved
   (kills never overlap, so the difference is this kill's).

The deployment is seen through ``FabricView`` (its ``/health`` and ``/metrics``, and a way to signal a
pid), so that the schedule runs in unit tests without processes; ``LocalFabric`` is the real one.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from pdfabric.control import KINDS

SIGNALS = {"kill": signal.SIGKILL, "term": signal.SIGTERM}
FAILOVERS = "pdfabric_failovers_total"
BACK, DRAINED, NOT_BACK, NO_VICTIM, MISSED = "back", "drained", "not back", "no victim", "missed"


@dataclass(frozen=True)
class KillPlan:
    """When and whom to kill: every ``every_s`` seconds while the run lasts, or ``count`` kills evenly
    spaced over the run's expected span; workers of ``kinds``; ``signal`` is ``kill`` or ``term``."""

    every_s: float | None = None
    count: int | None = None
    kinds: tuple[str, ...] = KINDS
    signal: str = "kill"
    back_timeout_s: float = 60.0
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.every_s is None) == (self.count is None):
            raise ValueError("give exactly one of --kill-every and --kills")
        if self.every_s is not None and not self.every_s > 0:
            raise ValueError(f"--kill-every must be > 0 seconds, got {self.every_s}")
        if self.count is not None and self.count < 1:
            raise ValueError(f"--kills must be >= 1, got {self.count}")
        unknown = sorted(set(self.kinds) - set(KINDS))
        if not self.kinds or unknown:
            raise ValueError(f"--kinds must name some of {', '.join(KINDS)}, got {','.join(self.kinds)!r}")
        if self.signal not in SIGNALS:
            raise ValueError(f"--signal must be one of {', '.join(SIGNALS)}, got {self.signal!r}")
        if not self.back_timeout_s > 0:
            raise ValueError(f"--back-timeout must be > 0 seconds, got {self.back_timeout_s}")

    def due(self, k: int, span_s: float) -> float | None:
        """When kill ``k`` (0, 1, ...) is due, in seconds from the run's start; None: there is no such
        kill. With ``every_s``: (1) ``(k + 1) * every_s``, for as long as the run lasts. With ``count``:
        (2) ``(k + 1) * span_s / (count + 1)``, so the kills split the span into equal parts."""
        if self.every_s is not None:
            return (k + 1) * self.every_s
        assert self.count is not None  # __post_init__: one of the two is set
        return (k + 1) * span_s / (self.count + 1) if k < self.count else None

    def describe(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class KillEvent:
    """One kill: when it was due and done (seconds from the run's start), whom it hit, and how it
    settled (``back``, ``drained``, ``not back``; ``no victim`` or ``missed`` when nothing was killed)."""

    due_s: float
    at_s: float | None
    worker: str | None
    kind: str | None
    pid: int | None
    signal: str
    outcome: str
    settled_after_s: float | None = None
    failovers: int | None = None  # requests the router moved between the signal and settling
    note: str = ""

    def describe(self) -> str:
        if self.at_s is None:
            return f"kill due at {self.due_s:.1f}s not done: {self.outcome} ({self.note})"
        after = f" after {self.settled_after_s:.1f}s" if self.settled_after_s is not None else ""
        return (f"SIG{self.signal.upper()} {self.worker} (pid {self.pid}) at {self.at_s:.1f}s: "
                f"{self.outcome}{after}")


def pick_victim(
    workers: Sequence[dict[str, Any]], kinds: Sequence[str], host: str, rng: random.Random
) -> dict[str, Any] | None:
    """A worker (as ``/health`` lists it) of ``kinds`` on ``host``, drawn with ``rng``; never the last
    registered worker of its kind. None when no worker qualifies."""
    per_kind = Counter(w["kind"] for w in workers)
    candidates = sorted(
        (w for w in workers if w["kind"] in kinds and w.get("host") == host and per_kind[w["kind"]] > 1),
        key=lambda w: w["id"],
    )
    return rng.choice(candidates) if candidates else None


def settled(health: dict[str, Any], victim: dict[str, Any], sig: str) -> str | None:
    """``back`` when the victim registered again (restart count up, new pid), ``drained`` when it
    left on its own after SIGTERM (the launcher lists it as down), else None (not yet)."""
    for w in health.get("workers", []):
        if w["id"] == victim["id"] and w["pid"] != victim["pid"] and w["restarts"] > victim["restarts"]:
            return BACK
    if sig == "term" and any(d["id"] == victim["id"] for d in health.get("down", [])):
        return DRAINED
    return None


def counter(metrics_text: str, name: str, label: str | None = None) -> dict[str, float]:
    """One counter family of a Prometheus text scrape, summed by the value of ``label`` (key ``""``
    without one); ``{}`` when the family is absent."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if not line.startswith(name) or line[len(name):len(name) + 1] not in ("{", " "):
            continue
        series, _, value = line.rpartition(" ")
        key = ""
        if label is not None and "{" in series:
            for part in series[series.index("{") + 1:-1].split(","):
                k, _, v = part.partition("=")
                if k.strip() == label:
                    key = v.strip().strip('"')
        out[key] = out.get(key, 0.0) + float(value)
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """``after - before`` per key (a key new in ``after`` counts from 0)."""
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after)}


class FabricView(Protocol):
    async def health(self) -> dict[str, Any]: ...

    async def metrics(self) -> str: ...

    def signal(self, pid: int, signum: int) -> None: ...


class LocalFabric:
    """A deployment on this host, through its router's HTTP endpoints and ``os.kill``."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url.rstrip("/")

    async def health(self) -> dict[str, Any]:
        """``/health`` (its body also comes with a 503); an unreachable router lists no worker."""
        try:
            async with self.session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(5)) as r:
                return await r.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            return {"workers": [], "down": [], "error": f"{type(exc).__name__}: {exc}"}

    async def metrics(self) -> str:
        try:
            async with self.session.get(self.url + "/metrics", timeout=aiohttp.ClientTimeout(5)) as r:
                return await r.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise RuntimeError(f"could not read {self.url}/metrics: {exc}") from exc

    def signal(self, pid: int, signum: int) -> None:
        """Signals ``pid`` after checking that it runs a pdfabric worker (``ValueError`` if not: the
        pid may have been reused); ``ProcessLookupError`` when it is already gone."""
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            raise ProcessLookupError(f"no process {pid}") from None
        except OSError:
            cmdline = []  # no /proc here: trust the router's record
        ours = any(arg.endswith((b"pdfabric", b"pdfabric.cli")) for arg in cmdline)  # -m or the script
        if cmdline and not (ours and b"worker" in cmdline):
            raise ValueError(f"pid {pid} is not a pdfabric worker: {b' '.join(cmdline)[:120]!r}")
        os.kill(pid, signum)


async def run_kills(
    plan: KillPlan,
    fabric: FabricView,
    host: str,
    t0: float,
    span_s: float,
    done: asyncio.Event,
    note: Callable[[str], None] = lambda line: None,
    clock: Callable[[], float] = time.perf_counter,
    poll_s: float = 0.2,
    stop: asyncio.Event | None = None,
) -> list[KillEvent]:
    """Carries out ``plan`` against ``fabric`` from ``t0`` (on ``clock``) until its kills are done or
    ``done`` is set (the run is over); a victim being waited for is still waited for, within the bound,
    unless ``stop`` is set (Ctrl-C)."""
    rng = random.Random(plan.seed)
    stop = stop or asyncio.Event()
    events: list[KillEvent] = []
    k = 0
    while (due := plan.due(k, span_s)) is not None:
        k += 1
        if await _set_before(done, t0 + due - clock()):
            break  # the run is over
        event = await _kill_one(plan, fabric, host, rng, t0, due, clock, poll_s, stop)
        events.append(event)
        note(f"chaos: {event.describe()}")
    return events


async def _set_before(event: asyncio.Event, timeout_s: float) -> bool:
    """Waits until ``event`` is set (True) or ``timeout_s`` has passed (False)."""
    if event.is_set():
        return True
    try:
        await asyncio.wait_for(event.wait(), max(0.0, timeout_s))
        return True
    except TimeoutError:
        return False


async def _kill_one(
    plan: KillPlan, fabric: FabricView, host: str, rng: random.Random, t0: float, due: float,
    clock: Callable[[], float], poll_s: float, stop: asyncio.Event,
) -> KillEvent:
    """Draws a victim, signals it and waits (bounded) until it settled."""
    health = await fabric.health()
    victim = pick_victim(health.get("workers", []), plan.kinds, host, rng)
    if victim is None:
        why = health.get("error") or f"no second worker of kinds {','.join(plan.kinds)} on this host"
        return KillEvent(due, None, None, None, None, plan.signal, NO_VICTIM, note=why)
    worker, kind, pid = victim["id"], victim["kind"], victim["pid"]
    before = await _failovers(fabric)
    try:
        fabric.signal(pid, SIGNALS[plan.signal])
    except (ProcessLookupError, ValueError) as exc:
        return KillEvent(due, None, worker, kind, pid, plan.signal, MISSED, note=str(exc))
    at = clock()
    outcome, after_s, note = NOT_BACK, None, f"not back within {plan.back_timeout_s:g}s"
    while clock() - at < plan.back_timeout_s:
        if await _set_before(stop, poll_s):
            note = "not waited for: interrupted"
            break
        if (found := settled(await fabric.health(), victim, plan.signal)) is not None:
            outcome, after_s, note = found, clock() - at, ""
            break
    now = await _failovers(fabric)
    moved = int(now - before) if now is not None and before is not None else None
    return KillEvent(due, at - t0, worker, kind, pid, plan.signal, outcome, after_s, moved, note)


async def _failovers(fabric: FabricView) -> float | None:
    try:
        return sum(counter(await fabric.metrics(), FAILOVERS).values())
    except RuntimeError:  # /metrics unreadable: this kill's count is unknown
        return None
