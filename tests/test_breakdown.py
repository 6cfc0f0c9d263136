"""The usage breakdown's stages from recorded times (no processes)."""

from __future__ import annotations

import pytest

from pdfabric.router.front.breakdown import TokenTimes, breakdown
from pdfabric.router.routing.routes import Budgets, Choice
from pdfabric.router.routing.slo import resolve
from pdfabric.routing_config import AdmissionConfig

RESOLVED = resolve(AdmissionConfig(), {})
CHOICE = Choice("d", "p", False, 12.0, 3.0, 4.0, 6.0, 2.0, 1.0, 0.1)


def test_disaggregated_stages_add_up_to_ttft_and_decode() -> None:
    times = TokenTimes(first=10.050, last=10.250, tokens=5)  # arrival 10.000, dispatched 10.010
    out = breakdown("p->d", RESOLVED, CHOICE, 10.0, 10.010, times, transfer_s=0.003)
    assert out["route"] == "p->d" and out["slo"]["class"] == "interactive"
    assert out["predicted"] == {
        "ttft_ms": 12.0,
        "itl_ms": 3.0,
        "queue_ms": 4.0,
        "prefill_ms": 6.0,
        "transfer_ms": 2.0,
    }
    m = out["measured"]
    assert m == pytest.approx(
        {
            "router_wait_ms": 10,
            "prefill_ms": 40,
            "transfer_ms": 3,
            "decode_ms": 200,
            "ttft_ms": 50,
            "itl_ms_mean": 50,
        }
    )


def test_missing_parts_are_left_out() -> None:
    one_token = breakdown("c", RESOLVED, None, 1.0, 1.5, TokenTimes(first=2.0, last=2.0, tokens=1), 0.0)
    assert "predicted" not in one_token
    assert one_token["measured"] == pytest.approx(
        {"router_wait_ms": 500, "prefill_ms": 500, "transfer_ms": 0, "decode_ms": 0, "ttft_ms": 1000}
    )
    unreported = breakdown(
        "p->d", RESOLVED, CHOICE, 1.0, 1.5, TokenTimes(first=2.0, last=3.0, tokens=3), None
    )
    assert "transfer_ms" not in unreported["measured"]
    assert set(breakdown("p->d", RESOLVED, CHOICE, 1.0, 1.5, TokenTimes(), None)["measured"]) == {
        "router_wait_ms"
    }
    assert RESOLVED.budgets == Budgets(30_000, 5_000)
