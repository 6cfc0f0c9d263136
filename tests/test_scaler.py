"""The pool scaler's policy (``router/platform/scaler.py``): sizing by the planner's model, shortage signals,
hysteresis, cooldown and bounds. Pure: signals in, decisions out, on a made-up clock."""

from __future__ import annotations

import pytest

from pdfabric.cluster_config import AutoscaleConfig
from pdfabric.profile import WorkerProfile
from pdfabric.router.platform.scaler import Finished, Observations, Pool, Scaler, Signals, sized

# 10 ms per prefill step plus 0.1 ms per token; 20 ms per decode step plus 1 ms per sequence.
PROFILE = WorkerProfile(
    prefill=(0.01, 1e-4, 0.0), decode=(0.02, 1e-3, 0.0), prefill_samples=9, decode_samples=9
)
CFG = AutoscaleConfig(
    enabled=True, min_prefill=1, max_prefill=4, min_decode=1, max_decode=4, up_after_s=2, down_after_s=10,
    cooldown_s=5, window_s=10,
)  # fmt: skip


def pools(prefill: int = 1, decode: int = 1, kv_use: float = 0.1) -> dict[str, Pool]:
    return {
        "prefill": Pool(prefill, 0.0, PROFILE, 8, 512),
        "decode": Pool(decode, kv_use, PROFILE, 8, 512),
    }


def signals(now: float, n: int = 0, ok: bool = True, **kw) -> Signals:  # noqa: ANN003
    done = [Finished(now - 0.1 * i, 400, 50, ok, True) for i in range(n)]
    return Signals(now, done, 10.0, 0, pools(**kw))


def test_sizing_follows_the_planners_model() -> None:
    # prefill of 400 tokens: 10 ms + 40 ms = 50 ms; at 30 req/s and 70%: ceil(30 * 0.05 / 0.7) = 3
    assert sized("prefill", pools()["prefill"], 30.0, 400, 50, 0.7) == 3
    # decode: 50 tokens x (20 + 8) ms / 8 per request = 175 ms; at 7 req/s: ceil(7 * 0.175 / 0.7) = 2
    assert sized("decode", pools()["decode"], 7.0, 400, 50, 0.7) == 2
    assert sized("decode", Pool(1), 8.0, 400, 50, 0.7) == 0  # no profile yet: nothing to size by


def test_a_load_step_scales_up_only_after_it_held_then_down_one_at_a_time() -> None:
    s = Scaler(CFG, {"prefill": 1, "decode": 1})
    # 300 requests in the 10 s window: 30 req/s needs 3 prefill workers (above) and 4 decode (capped)
    assert s.decide(signals(0.0, 300)) == []  # the need has not held for up_after_s yet
    assert s.decide(signals(1.0, 300)) == []
    up = {d.kind: d for d in s.decide(signals(2.0, 300))}
    assert (up["prefill"].current, up["prefill"].target, up["decode"].target) == (1, 3, 4)
    assert "needs 3" in up["prefill"].reason and up["prefill"].direction == "up"
    # The load goes: the surplus must hold for down_after_s, then one worker at a time, with cooldown.
    assert s.decide(signals(3.0, 0, prefill=3, decode=4)) == []
    assert s.decide(signals(12.0, 0, prefill=3, decode=4)) == []
    down = {d.kind: d for d in s.decide(signals(13.0, 0, prefill=3, decode=4))}
    assert (down["prefill"].target, down["decode"].target) == (2, 3) and down["decode"].direction == "down"
    assert s.decide(signals(14.0, 0, prefill=2, decode=3)) == []  # surplus again, timing from now
    assert {d.target for d in s.decide(signals(24.0, 0, prefill=2, decode=3))} == {1, 2}
    assert s.decide(signals(100.0, 0, prefill=1, decode=1)) == []  # at the lower bound


def test_missed_budgets_add_a_worker_whatever_the_model_says() -> None:
    s = Scaler(CFG, {"prefill": 1, "decode": 1})
    # 10 requests in 10 s is 1 req/s: the model wants one of each, but half missed their TTFT.
    late = [Finished(0.0, 400, 50, i % 2 == 0, True) for i in range(10)]
    for now in (0.0, 2.0):
        out = s.decide(Signals(now, late, 10.0, 0, pools()))
    assert [(d.kind, d.target) for d in out] == [("prefill", 2)] and "TTFT attainment 50%" in out[0].reason
    # A full decode pool's KV asks for another decode worker.
    s = Scaler(CFG, {"prefill": 1, "decode": 1})
    for now in (0.0, 2.0):
        out = s.decide(signals(now, 10, kv_use=0.95))
    assert [(d.kind, d.target) for d in out] == [("decode", 2)] and "KV use 95%" in out[0].reason


def test_a_need_that_comes_and_goes_does_not_flap() -> None:
    s = Scaler(CFG, {"prefill": 1, "decode": 1})
    for t in range(20):  # the need is there every other second: it never holds for 2 s
        assert s.decide(signals(float(t), 300 if t % 2 == 0 else 10)) == []


def test_cooldown_spaces_changes_to_one_pool() -> None:
    cfg = AutoscaleConfig(enabled=True, min_decode=1, max_decode=8, up_after_s=0, cooldown_s=5, window_s=10)
    s = Scaler(cfg, {"decode": 1})
    full = {"decode": Pool(1, 0.95, PROFILE, 8, 512)}
    assert [d.target for d in s.decide(Signals(0.0, [], 10.0, 0, full))] == [2]
    full = {"decode": Pool(2, 0.95, PROFILE, 8, 512)}
    assert s.decide(Signals(4.0, [], 10.0, 0, full)) == []
    assert [d.target for d in s.decide(Signals(5.0, [], 10.0, 0, full))] == [3]


def test_only_kinds_the_deployment_has_with_room_are_scaled() -> None:
    assert Scaler(CFG, {"colocated": 2}).bounds == {}
    assert Scaler(AutoscaleConfig(enabled=True, max_prefill=3), {"prefill": 1, "decode": 1}).bounds == {
        "prefill": (1, 3)
    }


def test_observations_forget_what_left_the_window() -> None:
    o = Observations(window_s=5.0)
    for t in range(10):
        o.add(Finished(float(t), 1, 1, True, True))
    assert [f.at for f in o.recent(10.0)] == [5.0, 6.0, 7.0, 8.0, 9.0]


@pytest.mark.parametrize(
    "table, message",
    [
        ({"max_decode": 1, "min_decode": 2}, "min_decode <= max_decode"),
        ({"target_utilization": 0}, "target_utilization"),
        ({"interval_s": 0}, "interval_s"),
        ({"max_pods": 3}, "unknown key"),
    ],
)
def test_bad_autoscale_tables_are_refused(table: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AutoscaleConfig.from_mapping(table)


def test_no_scale_in_while_what_runs_would_not_fit_in_fewer_workers() -> None:
    """Long requests still running finish no request in the window: the rate looks like 0, but the
    sequences the workers hold now (or a waiting queue) keep the pool from shrinking."""
    cfg = AutoscaleConfig(enabled=True, min_decode=1, max_decode=4, down_after_s=0, cooldown_s=0)
    s = Scaler(cfg, {"decode": 1})
    busy = {"decode": Pool(3, 0.2, PROFILE, 8, 512, running=12)}  # 2 workers x 8 x 70% = 11.2 < 12
    assert s.decide(Signals(0.0, [], 10.0, 0, busy)) == []
    assert s.decide(Signals(1.0, [], 10.0, 2, {"decode": Pool(3, 0.2, PROFILE, 8, 512)})) == []
    calm = {"decode": Pool(3, 0.2, PROFILE, 8, 512, running=11)}
    # Requests in flight and none ended in the window (a starved machine): no evidence, no change.
    assert s.decide(Signals(2.0, [], 10.0, 0, calm, in_flight=5)) == []
    assert [d.target for d in s.decide(Signals(2.0, [], 10.0, 0, calm))] == [2]
