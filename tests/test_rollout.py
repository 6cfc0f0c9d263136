"""The canary rollout's state machine on a given clock, and the admin command line's requests."""

from __future__ import annotations

import argparse

import pytest

from pdfabric.cli import admin_cli
from pdfabric.profile import WorkerProfile
from pdfabric.router.platform.rollout import (
    PROMOTED,
    RAMPING,
    ROLLED_BACK,
    STOPPED,
    Guardrails,
    Rollout,
    RolloutSpec,
    token_cost,
)


def _rollout(**guard: float) -> Rollout:
    spec = RolloutSpec("chat", "v2", (10, 50, 100), step_s=30, guardrails=Guardrails(min_requests=4, **guard))
    return Rollout(spec, {"v1": 90.0, "old": 10.0}, now=0.0)


def _feed(r: Rollout, version: str, n: int, ok: bool = True, ttft: float = 0.1, itl: float = 0.02) -> None:
    for _ in range(n):
        r.observe(version, ok, ttft, itl)


def test_a_healthy_canary_ramps_step_by_step_then_takes_all_traffic() -> None:
    r = _rollout()
    assert r.weights() == {"v1": 81.0, "old": 9.0, "v2": 10.0}
    _feed(r, "v2", 4)
    _feed(r, "v1", 20)
    assert not r.tick(10.0)  # the step's time is not up
    assert r.tick(30.0) and r.weights()["v2"] == 50.0 and r.state == RAMPING
    assert not r.tick(70.0)  # time is up, but this step has no canary requests yet
    _feed(r, "v2", 4)
    assert r.tick(70.0) and r.weights()["v2"] == 100.0
    _feed(r, "v2", 4)
    assert r.tick(100.0) and r.state == PROMOTED
    assert r.weights() == {"v1": 0.0, "old": 0.0, "v2": 100.0}
    assert [h["event"] for h in r.history] == ["start", "step", "step", PROMOTED]


def test_errors_roll_back_to_the_incumbents_weights() -> None:
    r = _rollout(max_error_rate=0.2)
    _feed(r, "v2", 3)
    _feed(r, "v2", 1, ok=False)  # 1 in 4: 25% > 20%
    assert r.tick(1.0) and r.state == ROLLED_BACK
    assert r.weights() == {"v1": 90.0, "old": 10.0, "v2": 0.0}
    assert "error rate" in r.reason
    r.observe("v2", True, 0.1, 0.01)  # ignored once ended
    assert not r.tick(100.0)


@pytest.mark.parametrize(("name", "slow"), [("TTFT", {"ttft": 0.35}), ("ITL", {"itl": 0.05})])
def test_latency_ratios_over_the_guardrail_roll_back(name: str, slow: dict) -> None:
    r = _rollout(max_ttft_ratio=3.0, max_itl_ratio=2.0)
    _feed(r, "v1", 4)
    _feed(r, "v2", 3, **slow)
    assert not r.tick(1.0)  # too few canary samples to judge
    _feed(r, "v2", 1, **slow)
    assert r.tick(1.0) and r.state == ROLLED_BACK and name in r.reason


def test_within_the_ratios_it_passes_and_the_operator_can_stop_it() -> None:
    r = _rollout(max_ttft_ratio=3.0, max_itl_ratio=2.0)
    _feed(r, "v1", 4)
    _feed(r, "v2", 4, ttft=0.25, itl=0.035)
    assert r.tick(30.0) and r.state == RAMPING
    r.stop(31.0, "stopped by the operator")
    assert r.state == STOPPED and r.weights()["v2"] == 0.0


def test_a_dearer_canary_is_rolled_back_by_its_cost_per_token() -> None:
    r = _rollout(max_cost_ratio=1.5)
    _feed(r, "v1", 4)
    _feed(r, "v2", 3)
    r.observe_cost(2.0e-3, 1.0e-3)  # 2x the incumbents' work per token
    assert not r.tick(1.0)  # too few canary requests to judge
    r.observe_cost(None, 1.0e-3)  # the canary has not measured a decode step yet: not judged
    _feed(r, "v2", 1)
    assert not r.tick(1.0)
    r.observe_cost(2.0e-3, 1.0e-3)
    assert r.tick(1.0) and r.state == ROLLED_BACK
    assert r.reason == "cost per token 2.00x the incumbents' > 1.5x"
    assert r.report()["cost_per_token_s"] == {"canary": 2.0e-3, "incumbents": 1.0e-3}


def test_cost_per_token_is_priced_at_one_operating_point() -> None:
    """Decode work per token at the given batch and context, times the pool's cost, averaged over
    the workers that measured a decode step."""
    fast = WorkerProfile(decode=(0.02, 0.001, 0.0), decode_samples=5)  # 20 ms + 1 ms per sequence
    dear = WorkerProfile(decode=(0.04, 0.002, 0.0), decode_samples=5)
    unmeasured = WorkerProfile(decode=(9.0, 9.0, 9.0))
    assert token_cost([(fast, 1.0)], 8, 100) == pytest.approx(0.028 / 8)
    assert token_cost([(fast, 1.0), (dear, 1.0), (unmeasured, 1.0)], 8, 100) == pytest.approx(
        (0.028 + 0.056) / 2 / 8
    )
    assert token_cost([(fast, 2.0)], 8, 100) == pytest.approx(0.056 / 8)  # a pool twice as dear
    assert token_cost([(unmeasured, 1.0)], 8, 100) is None and token_cost([], 1, 1) is None


def test_specs_and_bodies_are_checked() -> None:
    with pytest.raises(ValueError, match="ending at 100"):
        RolloutSpec("m", "v2", (10, 50))
    with pytest.raises(ValueError, match="increasing"):
        RolloutSpec("m", "v2", (50, 10, 100))
    with pytest.raises(ValueError, match="min_requests"):
        Guardrails(min_requests=0)
    with pytest.raises(ValueError, match="canary"):
        RolloutSpec.from_body("m", {"steps": [100]})
    with pytest.raises(ValueError, match="unknown field"):
        RolloutSpec.from_body("m", {"canary": "v2", "speed": 1})
    with pytest.raises(ValueError, match="guardrails must be"):
        RolloutSpec.from_body("m", {"canary": "v2", "guardrails": {"max_cost": 1}})
    spec = RolloutSpec.from_body("m", {"canary": "v2", "steps": [20, 100], "guardrails": {"min_requests": 2}})
    assert spec.steps == (20.0, 100.0) and spec.guardrails.min_requests == 2
    with pytest.raises(ValueError, match="no version with traffic"):
        Rollout(spec, {"v1": 0.0}, 0.0)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    admin_cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_admin_command_line_builds_the_api_calls() -> None:
    assert admin_cli.request(_args("models")) == ("GET", "/admin/models", None)
    assert admin_cli.request(_args("weights", "chat", "v1=90", "v2=10")) == (
        "POST", "/admin/models/chat/weights", {"weights": {"v1": 90.0, "v2": 10.0}},
    )  # fmt: skip
    method, path, body = admin_cli.request(
        _args("add-version", "chat", "v3", "--model", "tiny-b", "--colocated", "1", "--set", "max_running=8")
    )
    assert (method, path) == ("POST", "/admin/models/chat/versions")
    assert body == {"name": "v3", "model": "tiny-b", "weight": 0.0, "colocated": 1, "max_running": 8}
    _, _, spec = admin_cli.request(
        _args("rollout", "chat", "v3", "--steps", "10,100", "--max-error-rate", "0.1")
    )
    assert spec == {
        "canary": "v3",
        "steps": [10.0, 100.0],
        "step_s": 60.0,
        "guardrails": {"max_error_rate": 0.1},
    }
    assert admin_cli.request(_args("remove-version", "chat", "v1"))[:2] == (
        "DELETE",
        "/admin/models/chat/versions/v1",
    )
    with pytest.raises(ValueError, match="VERSION=WEIGHT"):
        admin_cli.request(_args("weights", "chat", "v1"))
