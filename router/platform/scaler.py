"""The pool scaler's policy: how many prefill, decode and colocated workers the traffic needs.

Each decision reads ``Signals`` (the recent requests, the admission queue, each pool's KV use and its
workers' fitted profiles) and, for each pool that ``[autoscale]`` lets it scale:

1. sizes it with the planner's model (``bench.planner.capacity_estimate``'s arithmetic): the
   request rate times the time one request keeps a worker of that kind busy (a prefill of the mean
   prompt; a full batch's decode of the mean output, shared by the batch), over the target
   utilization;
2. asks for one more worker than it has when the signals say it is short whatever the model says:
   TTFT attainment (requests refused for capacity count as misses) or the router's queue wait for the
   pool that prefills, ITL attainment or KV use for the pool that decodes; and never to fewer
   workers than the sequences they run now (or a non-empty queue) need at the target utilization,
   nor fewer at all while requests are in flight and none ended within the window (no evidence);
3. moves toward that size with hysteresis: up (straight to the size) once the need has held for
   ``up_after_s``, down (one worker at a time) once the surplus has held for ``down_after_s``, and no
   change to a pool within ``cooldown_s`` of the last one.

Pure: the caller's clock, no processes; ``pdfabric.cli.autoscale`` gathers the signals and acts.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field

from pdfabric.cluster_config import AutoscaleConfig
from pdfabric.control import COLOCATED, DECODE, KINDS, PREFILL
from pdfabric.profile import WorkerProfile


@dataclass(frozen=True)
class Finished:
    """One request the router answered: when, its sizes, whether it met its budgets (None: not
    measured), and how long it waited in the router's queue. A refusal for capacity misses both."""

    at: float
    prompt_tokens: int
    output_tokens: int
    ttft_ok: bool | None
    itl_ok: bool | None
    wait_s: float = 0.0


class Observations:
    """The requests finished (or refused for capacity) within the last ``window_s``."""

    def __init__(self, window_s: float = 30.0) -> None:
        self.window_s = window_s
        self._done: deque[Finished] = deque()

    def add(self, item: Finished) -> None:
        self._done.append(item)
        self._forget(item.at)

    def recent(self, now: float) -> list[Finished]:
        self._forget(now)
        return list(self._done)

    def _forget(self, now: float) -> None:
        while self._done and self._done[0].at < now - self.window_s:
            self._done.popleft()


@dataclass(frozen=True)
class Pool:
    """A kind's workers as the scaler sees them: serving (not draining) in its default pool, their
    KV blocks in use over all blocks, and one worker's profile and limits (None: none yet)."""

    workers: int
    kv_use: float = 0.0
    profile: WorkerProfile | None = None
    max_running: int = 1
    chunk_tokens: int = 512
    running: int = 0  # sequences its workers hold now, from their heartbeats


@dataclass(frozen=True)
class Signals:
    now: float
    finished: list[Finished]
    window_s: float
    queue_waiting: int
    pools: dict[str, Pool] = field(default_factory=dict)
    in_flight: int = 0  # requests the router holds now (waiting or running)


@dataclass(frozen=True)
class Decision:
    kind: str
    current: int
    target: int
    reason: str

    @property
    def direction(self) -> str:
        return "up" if self.target > self.current else "down"


def _attainment(values: list[bool | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def sized(kind: str, pool: Pool, rate: float, mean_in: float, mean_out: float, utilization: float) -> int:
    """Workers of ``kind`` that serve ``rate`` req/s of these mean sizes at ``utilization`` (0 when
    there is no profile or no traffic to size by)."""
    p = pool.profile
    if p is None or rate <= 0:
        return 0
    b = max(1, pool.max_running)
    prefill_s = p.prefill_seconds(max(1, round(mean_in)), pool.chunk_tokens)
    decode_s = mean_out * p.decode_seconds_per_token(b, mean_in + mean_out / 2)  # in a full batch
    busy = {PREFILL: prefill_s, DECODE: decode_s, COLOCATED: prefill_s + decode_s}[kind]
    return math.ceil(rate * busy / utilization)


class Scaler:
    """Decides pool sizes from ``Signals``; keeps the hysteresis state between decisions."""

    def __init__(self, config: AutoscaleConfig, configured: dict[str, int]) -> None:
        self.config = config
        self.bounds: dict[str, tuple[int, int]] = {}
        for kind in KINDS:
            lo, hi = config.bounds(kind)
            if configured.get(kind, 0) and hi > 0:  # only a kind the deployment has, with room to move
                self.bounds[kind] = (max(lo, 1), hi)
        self._need_since: dict[str, float] = {}
        self._surplus_since: dict[str, float] = {}
        self._changed: dict[str, float] = {}

    def decide(self, s: Signals) -> list[Decision]:
        cfg = self.config
        done = s.finished
        rate = len(done) / s.window_s
        mean_in = statistics.fmean(f.prompt_tokens for f in done) if done else 0.0
        mean_out = statistics.fmean(max(1, f.output_tokens) for f in done) if done else 0.0
        ttft = _attainment([f.ttft_ok for f in done])
        itl = _attainment([f.itl_ok for f in done])
        waits = [f.wait_s * 1e3 for f in done]
        queue_ms = statistics.median(waits) if waits else 0.0
        out = []
        for kind, (lo, hi) in self.bounds.items():
            pool = s.pools.get(kind, Pool(0))
            want = sized(kind, pool, rate, mean_in, mean_out, cfg.target_utilization)
            short = self._short(kind, pool, ttft, itl, queue_ms, s.queue_waiting)
            if short:
                want = max(want, pool.workers + 1)
            want = min(hi, max(lo, want))
            if want < pool.workers and (self._busy(pool, s.queue_waiting) or (s.in_flight and not done)):
                want = pool.workers  # what runs now would not fit in fewer, or nothing ended to judge by
            reason = short or (
                f"{rate:.2f} req/s of {mean_in:.0f} prompt and {mean_out:.0f} output tokens "
                f"needs {want} at {cfg.target_utilization:.0%} utilization"
            )
            decision = self._step(kind, pool.workers, want, reason, s.now)
            if decision is not None:
                out.append(decision)
        return out

    def _busy(self, pool: Pool, waiting: int) -> bool:
        """Whether one worker fewer would be over the target utilization with what runs now (or
        requests wait in the router): the recent window may not show requests still running."""
        room = (pool.workers - 1) * max(1, pool.max_running) * self.config.target_utilization
        return waiting > 0 or pool.running > room

    def _short(
        self, kind: str, pool: Pool, ttft: float | None, itl: float | None, queue_ms: float, waiting: int
    ) -> str:
        """Why the pool has too few workers whatever the model says ("": it has enough)."""
        cfg = self.config
        if kind in (PREFILL, COLOCATED):
            if ttft is not None and ttft < cfg.min_attainment:
                return f"TTFT attainment {ttft:.0%} < {cfg.min_attainment:.0%}"
            if waiting and queue_ms > cfg.max_queue_ms:
                return f"router queue wait {queue_ms:.0f} ms > {cfg.max_queue_ms:.0f} ms"
        if kind in (DECODE, COLOCATED):
            if itl is not None and itl < cfg.min_attainment:
                return f"ITL attainment {itl:.0%} < {cfg.min_attainment:.0%}"
            if pool.kv_use > cfg.max_kv_use:
                return f"KV use {pool.kv_use:.0%} > {cfg.max_kv_use:.0%}"
        return ""

    def _step(self, kind: str, current: int, want: int, reason: str, now: float) -> Decision | None:
        cfg = self.config
        if want > current:
            self._surplus_since.pop(kind, None)
            since = self._need_since.setdefault(kind, now)
            held, target = now - since >= cfg.up_after_s, want
        elif want < current:
            self._need_since.pop(kind, None)
            since = self._surplus_since.setdefault(kind, now)
            held, target = now - since >= cfg.down_after_s, current - 1
        else:
            self._need_since.pop(kind, None)
            self._surplus_since.pop(kind, None)
            return None
        if not held or now - self._changed.get(kind, -math.inf) < cfg.cooldown_s:
            return None
        self._changed[kind] = now
        self._need_since.pop(kind, None)
        self._surplus_since.pop(kind, None)
        return Decision(kind, current, target, reason)
