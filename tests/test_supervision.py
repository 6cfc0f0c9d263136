"""How ``pdfabric serve`` restarts exited workers: backoff, and a circuit breaker for workers that keep
exiting (no processes; the end-to-end restart is in test_fabric_e2e.py)."""

from __future__ import annotations

import pytest

from pdfabric.cli.supervisor import RestartPolicy


def test_restarts_back_off_and_a_worker_that_keeps_exiting_stays_down() -> None:
    policy = RestartPolicy(base_s=0.5, max_s=3.0, window_s=100.0, max_exits=5)
    assert policy.exited("w", 0.0) == pytest.approx(0.5)
    assert policy.exited("w", 1.0) == pytest.approx(2.0)  # 1 s backoff
    assert policy.exited("w", 3.0) == pytest.approx(5.0)  # 2 s
    assert policy.exited("w", 6.0) == pytest.approx(9.0)  # 4 s, capped at 3
    assert policy.exited("other", 6.0) == pytest.approx(6.5)  # each worker counts its own exits
    assert policy.exited("w", 10.0) is None  # the fifth exit inside the window: left down


def test_exits_outside_the_window_are_forgiven() -> None:
    policy = RestartPolicy(base_s=1.0, max_s=30.0, window_s=10.0, max_exits=3)
    assert policy.exited("w", 0.0) == pytest.approx(1.0)
    assert policy.exited("w", 5.0) == pytest.approx(7.0)
    assert policy.exited("w", 100.0) == pytest.approx(101.0)  # the earlier two are long past
    assert policy.exited("w", 101.0) == pytest.approx(103.0)
    assert policy.exited("w", 102.0) is None
