"""Worker latency profiles: step shapes, fitting, robustness, the startup plan (numpy only, fast)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import msgpack
import numpy as np
import pytest

from pdfabric.profile import (
    ProfileBuilder,
    StepShape,
    WorkerProfile,
    nnls_normal,
    profiling_plan,
    queued_attention,
)

TRUE = WorkerProfile(prefill=(2e-3, 4e-5, 1e-8), decode=(5e-3, 1e-4, 2e-7))


def feed_plan(builder: ProfileBuilder, truth: WorkerProfile, noise: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    plan = profiling_plan(512, 64, 4096, 200_000)
    for _ in range(plan.repeats):
        for tokens, cached in plan.prefill:
            shape = StepShape.of([(cached, tokens)])
            builder.observe(shape, truth.step_seconds(shape) * (1 + rng.gauss(0, noise)))
        for batch, length in plan.decode:
            shape = StepShape.of(decode_lengths=[length] * batch)
            builder.observe(shape, truth.step_seconds(shape) * (1 + rng.gauss(0, noise)))


def assert_close(got: tuple[float, ...], want: tuple[float, ...], rel: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=rel), (got, want)


def test_step_shape_attention_is_the_same_however_a_prompt_is_chunked() -> None:
    whole = StepShape.of([(0, 100)])
    parts = [StepShape.of([(0, 30)]), StepShape.of([(30, 50)]), StepShape.of([(80, 20)])]
    total = sum(s.prefill_tokens * s.prefill_context for s in parts)
    assert whole.prefill_tokens * whole.prefill_context == pytest.approx(total) == 100 * 101 / 2
    mixed = StepShape.of([(0, 4), (10, 2)], decode_lengths=[7, 9, 11])
    assert (mixed.prefill_tokens, mixed.batch, mixed.context_tokens) == (6, 3, 27)
    assert mixed.prefill_context == pytest.approx((4 * 2.5 + 2 * 11.5) / 6)


def test_prefill_seconds_matches_summed_chunk_steps() -> None:
    chunked = TRUE.prefill_seconds(1000, chunk_tokens=256)
    steps = sum(TRUE.step_seconds(StepShape.of([(s, min(256, 1000 - s))])) for s in range(0, 1000, 256))
    assert chunked == pytest.approx(steps)
    assert TRUE.prefill_seconds(0, 256) == 0.0
    # evenly split queues have the least attention work
    assert queued_attention(1000, 4) == pytest.approx(4 * 250 * 251 / 2)
    assert queued_attention(1000, 1) > queued_attention(1000, 4) > 0 == queued_attention(0, 3)


def test_decode_step_seconds_is_the_decode_shapes_step_to_the_bit() -> None:
    """The router's shortcut gives what the general formula gives, so a prediction does not depend
    on which one it took."""
    rng = random.Random(5)
    for _ in range(2000):
        prefill, decode = (tuple(rng.random() * scale for _ in range(3)) for scale in (1e-3, 1e-2))
        p = WorkerProfile(prefill, decode)
        batch, context = rng.randrange(0, 300), rng.randrange(0, 500_000)
        shape = StepShape(batch=batch, context_tokens=context)
        assert p.decode_step_seconds(batch, context) == p.step_seconds(shape)


def test_fit_recovers_known_coefficients() -> None:
    builder = ProfileBuilder()
    feed_plan(builder, TRUE, noise=0.01)
    fit = builder.profile()
    assert_close(fit.prefill, TRUE.prefill, rel=0.1)
    assert_close(fit.decode, TRUE.decode, rel=0.1)
    assert fit.prefill_samples > 0 and fit.decode_samples > 0
    assert fit.fit_error < 0.03


def test_fit_separates_prefill_and_decode_in_mixed_steps() -> None:
    rng = random.Random(3)
    builder = ProfileBuilder(window=512)
    for _ in range(300):
        chunks = [(rng.randint(0, 2000), rng.randint(1, 256))] if rng.random() < 0.8 else []
        lengths = [rng.randint(10, 3000) for _ in range(rng.randint(0 if chunks else 1, 48))]
        shape = StepShape.of(chunks, lengths)
        builder.observe(shape, TRUE.step_seconds(shape))
    fit = builder.profile(force=True)
    assert_close(fit.prefill, TRUE.prefill, rel=0.02)
    assert_close(fit.decode, TRUE.decode, rel=0.02)


def test_outliers_do_not_move_the_fit() -> None:
    builder = ProfileBuilder()
    feed_plan(builder, TRUE, noise=0.005)
    for _ in range(4):  # e.g. a garbage collection or a first-call compile in the middle of a step
        builder.observe_decode(8, 8000, 0.5)
    fit = builder.profile()
    assert_close(fit.decode, TRUE.decode, rel=0.1)
    assert fit.decode_step_seconds(8, 8000) == pytest.approx(TRUE.decode_step_seconds(8, 8000), rel=0.05)


def test_one_very_slow_step_among_few_is_dropped() -> None:
    """The online case: a worker's first decode steps, one of them very slow (a kernel compiled in it,
    a page-fault storm). The first fit is pulled towards that step and misses every other one by about
    the same amount; the rule keeps those and drops the slow one."""
    for steps in (5, 15):
        builder = ProfileBuilder(prior=TRUE)
        builder.observe_decode(1, 600, 1.0)
        for i in range(steps):
            batch = 1 + i % 4
            builder.observe_decode(batch, 600 * batch, TRUE.decode_step_seconds(batch, 600 * batch))
        fit = builder.profile(force=True)
        assert fit.decode_step_seconds(1, 600) == pytest.approx(TRUE.decode_step_seconds(1, 600), rel=0.02)
        assert fit.decode_step_seconds(4, 2400) == pytest.approx(TRUE.decode_step_seconds(4, 2400), rel=0.02)


def test_few_samples_stay_sensible() -> None:
    assert ProfileBuilder().profile() == WorkerProfile()  # nothing measured: the prior
    one = ProfileBuilder()
    one.observe_decode(4, 1000, 0.01)
    fit = one.profile()
    assert fit.decode_step_seconds(4, 1000) == pytest.approx(0.01, rel=0.01)
    assert min(fit.decode) >= 0 and fit.prefill == (0.0, 0.0, 0.0)
    two = ProfileBuilder()
    two.observe_prefill(100, 50.5, 0.01)
    two.observe_prefill(400, 200.5, 0.03)
    fit = two.profile()
    assert fit.step_seconds(StepShape.of([(0, 100)])) == pytest.approx(0.01, rel=0.02)
    assert fit.step_seconds(StepShape.of([(0, 400)])) == pytest.approx(0.03, rel=0.02)
    assert fit.prefill_seconds(200, 512) == pytest.approx(0.0175, rel=0.25)  # between the two


def test_unmeasured_part_keeps_the_prior() -> None:
    builder = ProfileBuilder(prior=TRUE)
    for tokens in (64, 128, 256, 512):  # a prefill worker never runs decode steps
        builder.observe_prefill(tokens, (tokens + 1) / 2, 3 * TRUE.prefill_seconds(tokens, 512))
    fit = builder.profile()
    assert_close(fit.decode, TRUE.decode, rel=1e-6)
    assert fit.decode_samples == 0 and fit.prefill_samples == 4
    assert fit.prefill_seconds(300, 512) == pytest.approx(3 * TRUE.prefill_seconds(300, 512), rel=0.05)


def test_windows_are_bounded_and_kept_per_step_kind() -> None:
    builder = ProfileBuilder(window=16, refit_every=4)
    for tokens in range(10, 200, 10):
        builder.observe_prefill(tokens, (tokens + 1) / 2, TRUE.prefill_seconds(tokens, 512))
    for i in range(500):
        builder.observe_decode(
            1 + i % 32, 100 * (1 + i % 32), TRUE.decode_step_seconds(1 + i % 32, 100 * (1 + i % 32))
        )
    assert len(builder) == 32
    fit = builder.profile()
    assert fit.prefill_samples == 16  # a long run of decode steps did not push the prefill steps out
    assert fit.prefill_seconds(150, 512) == pytest.approx(TRUE.prefill_seconds(150, 512), rel=0.05)


def test_refits_only_after_enough_new_steps() -> None:
    builder = ProfileBuilder(refit_every=4)
    builder.observe_decode(1, 10, 0.01)
    first = builder.profile()
    for _ in range(3):
        builder.observe_decode(8, 800, 0.05)
    assert builder.profile() is first
    builder.observe_decode(8, 800, 0.05)
    assert builder.profile() is not first
    builder.observe_decode(1, 10, float("nan"))  # ignored
    builder.observe(StepShape(), 0.1)  # an empty step: ignored
    assert len(builder) == 5


def test_nnls_matches_brute_force() -> None:
    rng = np.random.default_rng(7)
    for _ in range(100):
        a = rng.normal(size=(12, 6))
        gram, rhs = a.T @ a + 1e-3 * np.eye(6), a.T @ rng.normal(size=12)
        best, best_loss = np.zeros(6), 0.0
        for size in range(1, 7):
            for subset in itertools.combinations(range(6), size):
                idx = list(subset)
                c = np.zeros(6)
                c[idx] = np.linalg.solve(gram[np.ix_(idx, idx)], rhs[idx])
                loss = c @ gram @ c - 2 * c @ rhs
                if (c >= 0).all() and loss < best_loss:
                    best, best_loss = c, loss
        np.testing.assert_allclose(nnls_normal(gram, rhs), best, atol=1e-9)


def test_profile_round_trips_through_msgpack_and_validates() -> None:
    fit = ProfileBuilder()
    feed_plan(fit, TRUE, noise=0.01)
    profile = fit.profile()
    raw = msgpack.unpackb(msgpack.packb(dataclasses.astuple(profile)), use_list=False)
    assert WorkerProfile(*raw) == profile
    assert WorkerProfile(prefill=(1, 0, 0)).prefill == (1.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="prefill"):
        WorkerProfile(prefill=(-1.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="decode"):
        WorkerProfile(decode=(0.0, 0.0))
    with pytest.raises(ValueError, match="fit_error"):
        WorkerProfile(fit_error=float("inf"))


def test_profiling_plan_is_bounded_and_within_limits() -> None:
    plan = profiling_plan(512, 64, 4096, kv_tokens=20_000, points_per_kind=12)
    assert 0 < len(plan.prefill) <= 12 and 0 < len(plan.decode) <= 12
    assert len(plan) == (len(plan.prefill) + len(plan.decode)) * plan.repeats
    for tokens, cached in plan.prefill:
        assert 1 <= tokens <= 512 and tokens + cached <= 4096
    assert {t for t, _ in plan.prefill} >= {16, 512} and {c for _, c in plan.prefill} >= {0}
    for batch, length in plan.decode:
        assert 1 <= batch <= 64 and 1 <= length <= 4096 and batch * length <= 20_000
    assert {b for b, _ in plan.decode} >= {1, 64}
    tiny = profiling_plan(8, 2, 32, kv_tokens=32, points_per_kind=2)
    assert len(tiny.prefill) <= 2 and len(tiny.decode) <= 2
    assert all(t + c <= 32 for t, c in tiny.prefill) and all(b * n <= 32 for b, n in tiny.decode)
    with pytest.raises(ValueError, match="max_running"):
        profiling_plan(512, 0, 4096, 1000)
