"""Measures a worker's step times on a grid of shapes, bounded in time, to seed its latency profile.

Steps run on dummy tokens in the worker's own cache before it takes requests: attention reads
whatever the blocks hold, which costs the same as real data. Points are visited smallest first and
the run stops when its time budget is spent, so a slow model gets a coarser profile, never a long
start-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdfabric.engine.block_pool import blocks_for
from pdfabric.engine.runner import ModelRunner, StepEntry
from pdfabric.profile import ProfileBuilder, ProfilingPlan, StepShape


@dataclass(frozen=True)
class ProfilingRun:
    steps: int
    seconds: float
    complete: bool  # every point of the plan was measured
    points: int = 0  # points visited
    max_prefill_tokens: int = 0  # the largest prefill chunk timed
    max_batch: int = 0  # the largest decode batch timed
    total: int = 0  # points in the plan


def run_plan(
    runner: ModelRunner,
    plan: ProfilingPlan,
    builder: ProfileBuilder,
    budget_s: float,
    on_point: Callable[[int, int], None] | None = None,
) -> ProfilingRun:
    """Times the plan's points (each ``plan.repeats`` times after one warm-up) into ``builder``;
    ``on_point(done, total)`` after each point (for a progress display)."""
    points: list[tuple[str, int, int]] = [("prefill", t, c) for t, c in plan.prefill]
    points += [("decode", b, n) for b, n in plan.decode]
    points.sort(key=lambda p: p[1] * max(1, p[2]))  # cheapest first
    start, steps, tokens, batch = time.perf_counter(), 0, 0, 0

    def result(done: int) -> ProfilingRun:
        elapsed = time.perf_counter() - start
        return ProfilingRun(steps, elapsed, done == len(points), done, tokens, batch, len(points))

    for done, (kind, a, b) in enumerate(points):
        if time.perf_counter() - start > budget_s:
            return result(done)
        point = _prefill(runner, a, b) if kind == "prefill" else _decode(runner, a, b)
        if point is not None:
            entries, shape = point
            runner.step(entries)  # warm-up
            for _ in range(plan.repeats):
                t0 = time.perf_counter()
                runner.step(entries)
                builder.observe(shape, time.perf_counter() - t0)
                steps += 1
            if kind == "prefill":
                tokens = max(tokens, a)
            else:
                batch = max(batch, a)
        if on_point is not None:
            on_point(done + 1, len(points))
    return result(len(points))


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
