"""Predicts a request's TTFT and ITL on each candidate route and ranks the routes that fit its budgets.

A route is a (decode, prefill) pair of disaggregated workers or one colocated worker. For a prompt of
P tokens, from each worker's fitted ``WorkerProfile`` and reported ``WorkerLoad``:

1. prefill side (per prefill worker): queue wait = compute of the prompt tokens queued ahead of it,
   compute = the prompt's own chunks after its cached prefix, plus the read of the part of that
   prefix only its host KV store holds (tokens * kv_bytes_per_token / the store's measured read
   rate), transfer = P * kv_bytes_per_token / measured bytes per second;
   TTFT = (wait + compute + transfer) * (1 + safety_margin). The route fits if TTFT is within budget
   and the wait within ``max_queue_share`` of it, which keeps worker queues short so that a backlog
   waits in the router, where priorities and fair shares order it;
2. decode side (per decode worker): ITL = one decode step with every sequence it holds or has reserved,
   plus this one, and their context plus P tokens, times (1 + safety_margin); the batch must stay
   within the worker's limit and the prompt must fit in its free KV. A worker that speculates at that
   batch (``speculate_below``) gives a sequence several tokens a step: its step is divided by the
   speed-up it measured (``WorkerLoad.speculation``, drafting included);
3. colocated: prefill chunks share steps with the running decode batch, so its TTFT counts a decode
   step in every chunk step; its ITL is the mean gap over the request's life: a decode step at batch
   + 1, plus a prefill chunk (of the token budget the batch leaves) in the fraction of steps that
   carry one. That fraction follows from the prompt tokens per second recently sent to the worker
   (``WorkerLoad.prompt_tokens_per_s``): prefill takes a share rho of the worker's time, the mean gap
   is decode / (1 - rho), and every step carries a chunk once rho reaches 1 (the worst case), capped
   by ``colocated_prefill_share``;
4. local prefill: a decode worker whose prefix cache holds all but at most ``local_prefill_tokens``
   of the prompt is also a route on its own, predicted as a colocated worker (its decode batch shares
   the steps that prefill the rest), with no KV to move; the ranking decides between it and the
   disaggregated routes, and among equals it comes first;
5. the routes that fit both budgets are ranked by pool cost, then by load (the larger of TTFT/budget
   and ITL/budget); routes within ``tie_tolerance`` of the best one are equals and are put in a
   seeded, per-call shuffled order, so load spreads deterministically;
6. when none fits, the ranking says why (the failing constraint of the route that would fit soonest),
   how long until a new request would fit (``drain_ms``, the ``Retry-After``) and how long this one
   would wait in the router for a fit (``wait_ms``; waiting eats its TTFT budget, so a route whose
   TTFT is over budget now never fits by waiting).

Pure: no clocks, processes or I/O, so the router and the simulator in ``bench/`` share it.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pdfabric.control import COLOCATED, DECODE, PREFILL
from pdfabric.profile import queued_attention
from pdfabric.router.routing.routes import (
    BATCH_FULL,
    FOREGROUND,
    ITL,
    ITL_UNREACHABLE,
    KV_FULL,
    NO_WORKERS,
    TTFT,
    TTFT_UNREACHABLE,
    Budgets,
    Candidate,
    Choice,
    Ranking,
)
from pdfabric.routing_config import PredictorConfig


@dataclass(frozen=True)
class _Side:
    """One worker's share of a prediction (ms), whether it fits, and if not why and how long until it
    would (``math.inf``: never)."""

    worker: Candidate
    queue_ms: float = 0.0
    compute_ms: float = 0.0
    itl_ms: float = 0.0
    reason: str = ""
    drain_ms: float = 0.0
    foreground_itl_ms: float = 0.0  # the ITL of its foreground sequences alone (0: it holds none)


def rank(
    prompt_len: int, budgets: Budgets, candidates: Sequence[Candidate], config: PredictorConfig, turn: int = 0
) -> Ranking:
    """Ranks every route for a prompt of ``prompt_len`` tokens. ``turn`` (e.g. a request counter)
    picks the order among equals, reproducibly for a given ``config.seed``."""
    if prompt_len < 1:
        raise ValueError(f"prompt_len must be at least 1, got {prompt_len}")
    margin = 1 + config.safety_margin
    prefills = [_prefill_side(c, prompt_len, margin) for c in candidates if c.kind == PREFILL]
    decodes = [_decode_side(c, prompt_len, budgets, config) for c in candidates if c.kind == DECODE]
    fits: list[Choice] = []
    misses: list[tuple[float, float, str]] = []  # (drain ms, wait ms, reason) of each route that misses
    for p in prefills:
        for d in decodes:
            rate = _link_rate(p.worker, d.worker, config)
            sent = prompt_len - d.worker.cached_tokens  # the decode worker's cached prefix stays put
            transfer_ms = (sent * p.worker.kv_bytes_per_token / rate + _store_read(d.worker)) * 1e3 * margin
            own = p.compute_ms + transfer_ms
            miss = _judge(p.queue_ms, own, own, budgets.ttft_ms, config.max_queue_share, d)
            if miss is not None:
                misses.append(miss)
            else:
                cost = (p.worker.cost + d.worker.cost) / 2
                fits.append(_choice(d.worker, p.worker, p, d, transfer_ms, cost, budgets))
    for c in candidates:
        if c.kind == COLOCATED or _prefills_locally(c, prompt_len, config):
            side, idle_ms = _colocated_side(c, prompt_len, budgets, config)
            miss = _judge(
                side.queue_ms, side.compute_ms, idle_ms, budgets.ttft_ms, config.max_queue_share, side
            )
            if miss is not None:
                misses.append(miss)
            else:
                fits.append(_choice(c, c, side, side, 0.0, c.cost, budgets))
    if fits:
        return Ranking(_order(fits, config, turn))
    counts = tuple(sorted(Counter(r for _, _, r in misses).items()))
    if not misses:
        return Ranking((), NO_WORKERS, 0.0, 0.0, False, counts)
    drain, _, reason = min(misses)
    wait = min(w for _, w, _ in misses)
    return Ranking((), reason, drain, wait, math.isinf(drain), counts)


def sparing(ranking: Ranking, slowdown: float, config: PredictorConfig) -> Ranking:
    """The routes of ``ranking`` (a background request's) on which it slows the foreground sequences of
    the decode side by at most ``slowdown`` (0.1: their predicted ITL grows at most 10%); a worker
    that holds no foreground sequence is always spared. None left: a ``FOREGROUND`` miss that clears
    as those sequences finish (about ``mean_remaining_tokens`` of their steps)."""
    kept = tuple(
        ch
        for ch in ranking.choices
        if not ch.foreground_itl_ms or ch.itl_ms <= (1 + slowdown) * ch.foreground_itl_ms
    )
    if kept or not ranking.fits:
        return replace(ranking, choices=kept) if ranking.fits else ranking
    drain = min(ch.foreground_itl_ms for ch in ranking.choices) * config.mean_remaining_tokens
    return Ranking((), FOREGROUND, drain, drain, False, ((FOREGROUND, len(ranking.choices)),))


def _prefills_locally(c: Candidate, prompt_len: int, config: PredictorConfig) -> bool:
    """Whether a decode worker holds enough of the prompt to be ranked as prefilling the rest itself."""
    rest = prompt_len - c.cached_tokens
    return c.kind == DECODE and c.cached_tokens > 0 and rest <= config.local_prefill_tokens


def _judge(
    queue_ms: float, own_ms: float, floor_ms: float, ttft_budget: float, share: float, side: _Side
) -> tuple[float, float, str] | None:
    """None if a route fits; else (drain ms for a new request, wait ms for this one, reason).

    ``own_ms`` is the prompt's compute (and transfer) after ``queue_ms`` of queued work; ``floor_ms``
    the same on an idle worker; ``side`` the batch side's verdict. A route fits when TTFT is within
    budget and the queue ahead within ``share`` of it. A request waiting in the router loses from its
    TTFT budget what it waits, so only the share cap and the batch side can clear by waiting.
    """
    if floor_ms > ttft_budget:
        return math.inf, math.inf, TTFT_UNREACHABLE
    if math.isinf(side.drain_ms):
        return math.inf, math.inf, side.reason
    limit = share * ttft_budget
    ttft_drain = max(queue_ms + own_ms - ttft_budget, queue_ms - limit, 0.0)
    if not side.reason and ttft_drain == 0.0:
        return None
    if queue_ms + own_ms > ttft_budget:
        wait = math.inf
    else:
        share_wait = max(0.0, queue_ms - limit) / (1 - share) if share < 1 else 0.0
        wait = max(side.drain_ms, share_wait)
        if wait + own_ms > ttft_budget:
            wait = math.inf
    return max(side.drain_ms, ttft_drain), wait, side.reason or TTFT


def _choice(
    decode: Candidate,
    prefill: Candidate,
    side: _Side,
    batch: _Side,
    transfer_ms: float,
    cost: float,
    budgets: Budgets,
) -> Choice:
    """The route through ``prefill`` (whose TTFT ``side`` holds) and ``decode`` (whose ITL ``batch``
    holds; on a colocated route, or a decode worker prefilling the rest itself, the same side)."""
    ttft = side.queue_ms + side.compute_ms + transfer_ms
    load = max(ttft / budgets.ttft_ms, batch.itl_ms / budgets.itl_ms)
    colocated = decode is prefill
    return Choice(
        decode=decode.worker_id,
        prefill=prefill.worker_id,
        colocated=colocated,
        ttft_ms=ttft,
        itl_ms=batch.itl_ms,
        queue_ms=side.queue_ms,
        prefill_ms=side.compute_ms,
        transfer_ms=transfer_ms,
        cost=cost,
        load=load,
        cached_tokens=prefill.cached_tokens + (0 if colocated else decode.cached_tokens),
        local_prefill=colocated and decode.kind == DECODE,
        foreground_itl_ms=batch.foreground_itl_ms,
    )


def _prefill_side(c: Candidate, prompt_len: int, margin: float) -> _Side:
    """Queue wait and compute on a prefill worker (the transfer depends on the decode side)."""
    load = c.load
    attention = queued_attention(load.queued_tokens, load.waiting)
    queued = c.profile.prefill_seconds(load.queued_tokens, c.chunk_tokens, attention)
    own = c.profile.prefill_seconds(prompt_len - c.cached_tokens, c.chunk_tokens)  # its cached prefix is free
    own += _store_read(c)
    return _Side(c, queue_ms=queued * 1e3 * margin, compute_ms=own * 1e3 * margin)


def _decode_side(c: Candidate, prompt_len: int, budgets: Budgets, config: PredictorConfig) -> _Side:
    """ITL on a decode worker with this sequence added, and the wait until it would fit."""
    margin = 1 + config.safety_margin

    def itl(batch: int, context: float) -> float:
        return _speculated(c, batch, c.profile.decode_step_seconds(batch, round(context))) * 1e3 * margin

    return _batch_side(c, prompt_len, budgets, config, itl, _Side(c))


def _speculated(c: Candidate, batch: int, decode_s: float) -> float:
    """A decode step's share of a token's gap on ``c`` at ``batch`` sequences: the step itself, or,
    while the worker speculates (at most ``speculate_below`` decoding), the step over the speed-up its
    speculating steps measured (they give each sequence several tokens, drafting included)."""
    if c.speculate_below and batch <= c.speculate_below and c.load.speculation > 0:
        return decode_s / c.load.speculation
    return decode_s


def _colocated_side(
    c: Candidate, prompt_len: int, budgets: Budgets, config: PredictorConfig
) -> tuple[_Side, float]:
    """Queue wait, compute and ITL on a colocated worker, and its prompt's compute when idle (ms).

    Prompt tokens get the step budget the decode batch leaves, and every such step also runs the
    decode batch; the mean decode step carries a prefill chunk of the budget the batch leaves in the
    share of steps that ``_chunk_share`` estimates from the recent prompt rate (at most
    ``colocated_prefill_share``).
    """
    load, profile, margin = c.load, c.profile, 1 + config.safety_margin
    decode_s = profile.decode_step_seconds(load.running, load.context_tokens) if load.running else 0.0
    spare = max(1, c.chunk_tokens - load.running)  # prompt tokens per step beside the decode batch
    attention = queued_attention(load.queued_tokens, load.waiting)
    queue_s = profile.prefill_seconds(load.queued_tokens, spare, attention)
    queue_s += math.ceil(load.queued_tokens / spare) * decode_s
    new = prompt_len - c.cached_tokens  # its cached prefix is not computed again
    own_s = profile.prefill_seconds(new, spare) + math.ceil(new / spare) * decode_s + _store_read(c)

    def itl(batch: int, context: float) -> float:
        decode = profile.decode_step_seconds(batch, round(context))
        chunk = max(0, c.chunk_tokens - batch)
        mixed = profile.prefill_seconds(chunk, chunk) if chunk else 0.0
        share = _chunk_share(decode, mixed, chunk, load.prompt_tokens_per_s)
        own = _speculated(c, batch, decode)
        return (own + min(share, config.colocated_prefill_share) * mixed) * 1e3 * margin

    side = _Side(c, queue_ms=queue_s * 1e3 * margin, compute_ms=own_s * 1e3 * margin)
    idle_ms = (profile.prefill_seconds(new, c.chunk_tokens) + _store_read(c)) * 1e3 * margin
    return _batch_side(c, prompt_len, budgets, config, itl, side), idle_ms


def _store_read(c: Candidate) -> float:
    """Seconds the worker takes to read the part of the prompt's prefix only its host store holds."""
    return c.store_tokens * c.store_seconds_per_token


def _chunk_share(decode_s: float, chunk_s: float, chunk_tokens: int, prompt_tokens_per_s: float) -> float:
    """The fraction of a colocated worker's steps that carry a prompt chunk of ``chunk_tokens`` when
    prompts arrive at ``prompt_tokens_per_s``: prefill then takes rho = rate * chunk_s / chunk_tokens
    of the worker's time, the mean step is decode_s / (1 - rho), and a chunk comes every
    chunk_tokens / rate seconds; 1 once rho reaches 1."""
    if chunk_tokens <= 0 or prompt_tokens_per_s <= 0:
        return 0.0
    rho = prompt_tokens_per_s * chunk_s / chunk_tokens
    if rho >= 1:
        return 1.0
    return min(1.0, prompt_tokens_per_s * decode_s / (1 - rho) / chunk_tokens)


def _batch_side(
    c: Candidate,
    prompt_len: int,
    budgets: Budgets,
    config: PredictorConfig,
    itl: Callable[[int, float], float],
    side: _Side,
) -> _Side:
    """Fills in ``side``'s ITL and, when the new sequence does not fit the worker's batch, KV or ITL
    budget, the reason and the wait until enough held sequences have finished."""
    load = c.load
    held = load.running + load.waiting
    now_itl = itl(held + 1, load.context_tokens + prompt_len)
    foreground = held - min(c.background, held)
    alone = itl(foreground, load.context_tokens * foreground / held) if foreground else 0.0
    if itl(1, prompt_len) > budgets.itl_ms:
        reason = ITL_UNREACHABLE
    elif held + 1 > c.max_batch:
        reason = BATCH_FULL
    elif load.free_kv_tokens < prompt_len:
        reason = KV_FULL
    elif now_itl > budgets.itl_ms:
        reason = ITL
    else:
        reason = ""
    drain_ms = 0.0 if not reason else math.inf
    if reason and reason != ITL_UNREACHABLE:
        # Which k of the held sequences must finish first, then how long that takes: with remaining
        # lengths spread evenly up to twice their mean, k of n running sequences finish in
        # 2 * mean * k / n steps.
        per_seq = load.context_tokens / held if held else 0.0
        step_ms = c.profile.decode_step_seconds(max(1, held), load.context_tokens) * 1e3
        for k in range(1, held + 1):
            batch, context = held - k + 1, load.context_tokens - k * per_seq + prompt_len
            room = load.free_kv_tokens + k * per_seq >= prompt_len
            if batch <= c.max_batch and room and itl(batch, context) <= budgets.itl_ms:
                drain_ms = 2 * config.mean_remaining_tokens * k / max(1, load.running) * step_ms
                break
    return replace(side, itl_ms=now_itl, foreground_itl_ms=alone, reason=reason, drain_ms=drain_ms)


def _link_rate(p: Candidate, d: Candidate, config: PredictorConfig) -> float:
    """KV bytes per second between two workers: the rate measured over the transport the pair uses
    (shared memory on one host, ZeroMQ across hosts) if either end measured it, else the slower end's
    rate over all transports, else the default."""
    transport = "shm" if p.host and p.host == d.host else "zmq"
    known = [r for r in (p.kv_rates.get(transport, 0.0), d.kv_rates.get(transport, 0.0)) if r > 0]
    if not known:
        known = [r for r in (p.load.kv_bytes_per_s, d.load.kv_bytes_per_s) if r > 0]
    return min(known) if known else config.default_kv_bytes_per_s


def _order(fits: list[Choice], config: PredictorConfig, turn: int) -> tuple[Choice, ...]:
    """Cheapest first, then least loaded; among the equals of the best, a decode worker's local
    prefill first (it computes only the rest of the prompt, moves no KV and holds one worker), then
    those whose workers hold more of the prompt in their prefix caches, the rest shuffled by (seed,
    turn)."""
    fits.sort(key=lambda ch: (ch.cost, ch.load, ch.decode, ch.prefill))
    best = fits[0]
    equal = [ch for ch in fits if ch.cost == best.cost and ch.load <= best.load + config.tie_tolerance]
    rest = fits[len(equal) :]
    random.Random(config.seed * 1_000_003 + turn).shuffle(equal)
    equal.sort(key=lambda ch: (not ch.local_prefill, -ch.cached_tokens))  # stable: shuffled among the same
    return tuple(equal + rest)
