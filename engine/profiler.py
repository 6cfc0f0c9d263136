"""Measures a worker's step times on a grid of shapes, bounded in time, to seed its latency profile.

Steps run on dummy tokens in the worker's own cache before it takes requests: attention reads
whatever the blocks hold, which costs the same as real data. Points are visited smallest first and
the run stops when its time budget is spent, so a slow model gets a coarser profile, never a long
start-up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdfabric.engine.block_pool import blocks_for
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.profile import ProfileBuilder, ProfilingPlan, StepShape


@dataclass(frozen=True)
class ProfilingRun:
    steps: int
    seconds: float
    complete: bool  # every point of the plan was measured


def run_plan(
    runner: ModelRunner, plan: ProfilingPlan, builder: ProfileBuilder, budget_s: float
) -> ProfilingRun:
    """Times the plan's points (each ``plan.repeats`` times after one warm-up) into ``builder``."""
    points: list[tuple[str, int, int]] = [("prefill", t, c) for t, c in plan.prefill]
    points += [("decode", b, n) for b, n in plan.decode]
    points.sort(key=lambda p: p[1] * max(1, p[2]))  # cheapest first
    start, steps = time.perf_counter(), 0
    for kind, a, b in points:
        if time.perf_counter() - start > budget_s:
            return ProfilingRun(steps, time.perf_counter() - start, False)
        point = _prefill(runner, a, b) if kind == "prefill" else _decode(runner, a, b)
        if point is None:
            continue
        entries, shape = point
        runner.step(entries)  # warm-up
        for _ in range(plan.repeats):
            t0 = time.perf_counter()
            runner.step(entries)
            builder.observe(shape, time.perf_counter() - t0)
            steps += 1
    return ProfilingRun(steps, time.perf_counter() - start, True)


def _prefill(runner: ModelRunner, tokens: int, cached: int) -> tuple[list[StepEntry], StepShape]:
    table = tuple(range(blocks_for(cached + tokens, runner.block_size)))
    return [StepEntry((1,) * tokens, cached, table)], StepShape.of([(cached, tokens)])


def _decode(runner: ModelRunner, batch: int, length: int) -> tuple[list[StepEntry], StepShape] | None:
    # Block rounding may not fit the plan's token room: shorten the sequences rather than overlap them.
    per_seq = min(blocks_for(length, runner.block_size), runner.num_blocks // batch)
    length = min(length, per_seq * runner.block_size)
    if length == 0:
        return None
    entries = [
        StepEntry((1,), length - 1, tuple(range(i * per_seq, (i + 1) * per_seq))) for i in range(batch)
    ]
    return entries, StepShape.of(decode_lengths=[length] * batch)
