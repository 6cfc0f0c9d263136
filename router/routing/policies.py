"""Routing policies: the budget-aware ranking and two baselines to measure it against, behind one entry.

``rank_routes(policy, ...)`` returns the same ``Ranking`` for every policy, so the router and the
simulator in ``bench/`` replay a trace under any of them with the same code:

1. ``budget`` (the default): ``predictor.rank``, routes that meet the request's TTFT and ITL budgets,
   cheapest and least loaded first;
2. ``round_robin``: every route in a fixed order (pairs by prefill then decode worker id, then the
   colocated workers), starting at route ``turn mod routes``, so successive requests cycle through
   them whatever their load;
3. ``least_loaded``: the route whose decode side holds the fewest sequences (running + waiting +
   sent since its last heartbeat) first, ties by the prompt tokens queued on its prefill side.

The baselines ignore budgets: they skip only routes whose decode side has no KV room for the prompt
or is at its batch limit. When every route is, the ranking is the one ``rank`` gives for budgets no
route can miss: no choices, reason ``batch_full`` or ``kv_full``, and the predicted drain time, so
admission control queues or rejects the request as it does for a full decode side under ``budget``.
Their choices still carry the predictor's TTFT, ITL and its parts, and ``load`` against the request's
budgets (above 1 when the route is predicted to miss them).

Pure: no clocks, processes or I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pdfabric.control import COLOCATED, DECODE, KINDS, PREFILL
from pdfabric.router.routing.predictor import rank
from pdfabric.router.routing.routes import Budgets, Candidate, Choice, Ranking, WorkerLoad
from pdfabric.routing_config import BUDGET, ROUND_ROBIN, PredictorConfig, check_policy

# Budgets no prediction reaches: ``rank`` under them fits every route with batch and KV room.
_UNBOUNDED = Budgets(1e18, 1e18)


def rank_routes(
    policy: str,
    prompt_len: int,
    budgets: Budgets,
    candidates: Sequence[Candidate],
    config: PredictorConfig,
    turn: int = 0,
) -> Ranking:
    """Ranks the routes for a prompt of ``prompt_len`` tokens under ``policy``. ``turn`` (e.g. the
    number of requests admitted so far) is where round robin starts and picks the order among equal
    routes under ``budget``."""
    check_policy(policy)
    if policy == BUDGET:
        return rank(prompt_len, budgets, candidates, config, turn)
    open_ = rank(prompt_len, _UNBOUNDED, candidates, config, turn)
    if not open_.fits:
        return open_
    choices = [_rescaled(ch, budgets) for ch in open_.choices]
    if policy == ROUND_ROBIN:
        order = _routes(candidates)
        start = turn % len(order)
        position = {key: (i - start) % len(order) for i, key in enumerate(order)}
        choices.sort(key=lambda ch: position[(ch.prefill, ch.decode)])
    else:
        load = {c.worker_id: c.load for c in candidates}

        def emptiest(ch: Choice) -> tuple[int, int, str, str]:
            return _held(load[ch.decode]), load[ch.prefill].queued_tokens, ch.decode, ch.prefill

        choices.sort(key=emptiest)
    return Ranking(tuple(choices))


def _routes(candidates: Sequence[Candidate]) -> list[tuple[str, str]]:
    """Every route as (prefill id, decode id) in round-robin order (a colocated worker is both)."""
    ids = {kind: sorted(c.worker_id for c in candidates if c.kind == kind) for kind in KINDS}
    pairs = [(p, d) for p in ids[PREFILL] for d in ids[DECODE]]
    return pairs + [(c, c) for c in ids[COLOCATED]]


def _held(load: WorkerLoad) -> int:
    """Sequences a decode side holds: decoding, waiting, and sent to it since its last heartbeat."""
    return load.running + load.waiting


def _rescaled(choice: Choice, budgets: Budgets) -> Choice:
    """``choice`` with its load measured against the request's own budgets."""
    return replace(choice, load=max(choice.ttft_ms / budgets.ttft_ms, choice.itl_ms / budgets.itl_ms))
