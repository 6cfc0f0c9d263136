"""``pdfabric bench chaos``: the kill schedule and the report's arithmetic without processes, then one
bounded run against a real fabric on loopback (one kill of a decode worker)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pdfabric.bench.chaos import (
    BACK,
    DRAINED,
    NO_VICTIM,
    NOT_BACK,
    KillEvent,
    KillPlan,
    LocalFabric,
    counter,
    delta,
    pick_victim,
    run_kills,
    settled,
)
from pdfabric.bench.chaos_cmd import add_arguments, deployment, greedy_body
from pdfabric.bench.chaos_report import build_report, compare_runs, outcome, summary_md
from pdfabric.bench.records import CANCELLED, ERROR, OK, REJECTED, RequestRecord
from tests.fabric import get_json, metric_values, running_fabric, wait_blocks_free

HOST = "box/boot-1"


def _worker(wid: str, kind: str, pid: int, restarts: int = 0, host: str = HOST) -> dict[str, Any]:
    return {"id": wid, "kind": kind, "pid": pid, "host": host, "restarts": restarts}


# --- the kill schedule ---------------------------------------------------------------------------


def test_kills_every_s_or_evenly_spaced_over_the_span() -> None:
    every = KillPlan(every_s=2.5)
    assert [every.due(k, 100.0) for k in range(3)] == [2.5, 5.0, 7.5]  # as long as the run lasts
    spaced = KillPlan(count=3)
    assert [spaced.due(k, 8.0) for k in range(4)] == [2.0, 4.0, 6.0, None]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"every_s": 1.0, "count": 2}, "exactly one of"),
        ({"every_s": 0.0}, "--kill-every"),
        ({"count": 0}, "--kills"),
        ({"count": 1, "kinds": ("decode", "router")}, "--kinds"),
        ({"count": 1, "kinds": ()}, "--kinds"),
        ({"count": 1, "signal": "hup"}, "--signal"),
        ({"count": 1, "back_timeout_s": -1.0}, "--back-timeout"),
    ],
)
def test_a_bad_plan_is_refused_naming_the_flag(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KillPlan(**kwargs)


def test_victims_are_of_the_kinds_asked_on_this_host_and_never_the_last_of_a_kind() -> None:
    workers = [
        _worker("prefill-0", "prefill", 10),
        _worker("decode-0", "decode", 11),
        _worker("decode-1", "decode", 12),
        _worker("decode-2", "decode", 13, host="elsewhere/boot-2"),
    ]
    picks = {pick_victim(workers, ("prefill", "decode"), HOST, random.Random(s))["id"] for s in range(40)}
    assert picks == {"decode-0", "decode-1"}  # prefill-0 is the only prefill worker; decode-2 is remote
    assert pick_victim(workers, ("prefill",), HOST, random.Random(0)) is None
    assert pick_victim(workers[:2], ("decode",), HOST, random.Random(0)) is None
    # The draw is seeded: the same seed gives the same victims, in the same order.
    draw = [pick_victim(workers, ("decode",), HOST, random.Random(7))["id"] for _ in range(3)]
    assert len(set(draw)) == 1


def test_a_victim_is_back_when_it_registered_again_with_a_new_pid() -> None:
    victim = _worker("decode-0", "decode", 11, restarts=1)
    assert settled({"workers": [victim]}, victim, "kill") is None  # the router has not noticed yet
    assert settled({"workers": []}, victim, "kill") is None  # gone, not back yet
    assert settled({"workers": [_worker("decode-0", "decode", 99, restarts=2)]}, victim, "kill") == BACK
    down = {"workers": [], "down": [{"id": "decode-0", "reason": "drained"}]}
    assert settled(down, victim, "term") == DRAINED
    assert settled(down, victim, "kill") is None  # after SIGKILL, down means the launcher gave up


def test_counters_are_read_from_a_prometheus_scrape() -> None:
    text = "\n".join([
        "# HELP pdfabric_failovers_total Requests moved",
        "# TYPE pdfabric_failovers_total counter",
        'pdfabric_failovers_total{cause="worker_gone"} 3.0',
        'pdfabric_failovers_total{cause="error"} 1.0',
        'pdfabric_failovers_created{cause="error"} 1.7e+09',
        "pdfabric_requests_lost_total 2.0",
    ])  # fmt: skip
    fo = counter(text, "pdfabric_failovers_total", "cause")
    assert fo == {"worker_gone": 3.0, "error": 1.0}
    assert counter(text, "pdfabric_requests_lost_total") == {"": 2.0}
    assert counter(text, "pdfabric_nothing_total") == {}
    assert delta({"worker_gone": 1.0}, fo) == {"error": 1.0, "worker_gone": 2.0}


def test_only_a_pdfabric_worker_process_is_signalled() -> None:
    fabric = LocalFabric(None, "http://127.0.0.1:9")  # type: ignore[arg-type]  # no HTTP here
    with pytest.raises(ValueError, match="not a pdfabric worker"):
        fabric.signal(os.getpid(), 0)  # this test process: a pid the router could list after reuse
    with pytest.raises(ProcessLookupError):
        fabric.signal(2**22 + 1, 0)  # above the kernel's pid limit: no such process


class FakeFabric:
    """Two decode workers; a killed one is gone for ``gone_polls`` health reads, then registers again
    with a new pid (or, with ``never_back``, stays gone). Each kill moves ``moves`` requests."""

    def __init__(self, gone_polls: int = 2, moves: int = 3, never_back: bool = False) -> None:
        pair = (_worker("decode-0", "decode", 100), _worker("decode-1", "decode", 101))
        self.workers = {w["id"]: w for w in pair}
        self.gone_polls, self.moves, self.never_back = gone_polls, moves, never_back
        self.away: dict[str, int] = {}  # worker id -> health reads until it is back
        self.failovers = 0.0
        self.signalled: list[tuple[int, int]] = []

    async def health(self) -> dict[str, Any]:
        for wid in list(self.away):
            self.away[wid] -= 1
            if self.away[wid] <= 0 and not self.never_back:
                old = self.workers[wid]
                self.workers[wid] = {**old, "pid": old["pid"] + 1000, "restarts": old["restarts"] + 1}
                del self.away[wid]
        return {"workers": [w for wid, w in self.workers.items() if wid not in self.away], "down": []}

    async def metrics(self) -> str:
        return f'pdfabric_failovers_total{{cause="worker_gone"}} {self.failovers}\n'

    def signal(self, pid: int, signum: int) -> None:
        self.signalled.append((pid, signum))
        wid = next(wid for wid, w in self.workers.items() if w["pid"] == pid)
        self.away[wid] = self.gone_polls
        self.failovers += self.moves


def _kills(plan: KillPlan, fabric: FakeFabric, span_s: float, run_s: float) -> list[KillEvent]:
    async def main() -> list[KillEvent]:
        done = asyncio.Event()
        asyncio.get_running_loop().call_later(run_s, done.set)
        return await run_kills(plan, fabric, HOST, time.perf_counter(), span_s, done, poll_s=0.01)

    return asyncio.run(main())


def test_kills_wait_for_the_victim_to_be_back_and_count_its_failovers() -> None:
    fabric = FakeFabric(gone_polls=30, moves=4)  # back after 30 polls of 10 ms
    events = _kills(KillPlan(count=2, back_timeout_s=5.0), fabric, span_s=0.3, run_s=5.0)
    assert [e.due_s for e in events] == pytest.approx([0.1, 0.2])
    assert [e.outcome for e in events] == [BACK, BACK] and [e.failovers for e in events] == [4, 4]
    assert all(e.at_s is not None and e.at_s >= e.due_s for e in events)
    assert events[0].settled_after_s > 0.25
    # The second kill was due while the first victim was away: it waited until that one was back.
    assert events[1].at_s >= events[0].at_s + events[0].settled_after_s > events[1].due_s + 0.1
    assert len(fabric.signalled) == 2 and all(sig == 9 for _, sig in fabric.signalled)


def test_kills_stop_with_the_run_and_a_victim_that_stays_away_is_bounded() -> None:
    fabric = FakeFabric(never_back=True)
    events = _kills(KillPlan(every_s=0.05, back_timeout_s=0.2), fabric, span_s=0.0, run_s=0.3)
    # The first victim never returns; the second draw has a single decode worker left: spared.
    assert events[0].outcome == NOT_BACK and events[0].settled_after_s is None
    assert "not back within 0.2s" in events[0].note
    assert all(e.outcome == NO_VICTIM and e.at_s is None for e in events[1:])
    assert len(fabric.signalled) == 1
    assert max(e.due_s for e in events) < 0.3 + 0.2 + 0.1  # no kill is due after the run ended


# --- the report's arithmetic ---------------------------------------------------------------------


def _rec(i: int, status: str = OK, sent: float = 0.0, e2e_ms: float = 1000.0, ids: list[int] | None = None,
         terminal: bool | None = True, http: int | None = 200) -> RequestRecord:
    ids = [i, i + 1] if ids is None else ids
    return RequestRecord(index=i, scheduled_s=sent, sent_s=sent, input_len=8, output_len=2, status=status,
                         http_status=http, e2e_ms=e2e_ms, output_tokens=len(ids), terminal=terminal,
                         text="".join(map(chr, [65 + t for t in ids])), token_ids=ids,
                         finish_reason="length" if status == OK else None)  # fmt: skip


def test_how_a_request_ended() -> None:
    assert outcome(_rec(0)) == "completed"
    assert outcome(_rec(0, ERROR)) == "error event"  # a terminal event, but an error
    assert outcome(_rec(0, REJECTED, terminal=False, http=503)) == "HTTP error"
    assert outcome(_rec(0, ERROR, terminal=False)) == "no terminal event"  # the stream broke off
    assert outcome(_rec(0, CANCELLED, terminal=False, http=None)) == "no terminal event"


def test_report_counts_add_up_and_time_added_is_from_requests_that_overlapped_a_kill() -> None:
    # Baseline: 6 requests, 1 s each, sent 1 s apart; request 5 was lost in the baseline too.
    base = [_rec(i, sent=float(i)) for i in range(5)] + [_rec(5, ERROR, sent=5.0)]
    chaos = [
        _rec(0, sent=0.0),  # untouched
        _rec(1, sent=1.0, e2e_ms=1500.0),  # overlapped the kill at 1.5 s: +500 ms
        _rec(2, sent=2.0, e2e_ms=3000.0, ids=[9, 9]),  # overlapped the kill at 3.0 s; different output
        _rec(3, ERROR, sent=3.0, e2e_ms=200.0),  # overlapped the kill at 3.0 s; lost with an error event
        _rec(5, sent=5.0, e2e_ms=2000.0),  # completed, but the baseline has nothing to compare it with
    ]  # request 4 was never sent (the run was stopped)
    kills = [KillEvent(1.4, 1.5, "decode-0", "decode", 1, "kill", BACK, 3.2, 2),
             KillEvent(2.9, 3.0, "decode-1", "decode", 2, "kill", BACK, 3.4, 1)]
    report = build_report({"command": "chaos"}, (base, {}), (chaos, {"worker_gone": 3.0}), 6, kills,
                          planned_kills=3)
    b, c, cmp = report["baseline"], report["chaos"], report["comparison"]
    assert (b["completed"], b["lost"], b["not_sent"]) == (5, 1, 0)
    assert (c["completed"], c["lost"], c["not_sent"]) == (4, 1, 1)
    assert c["completed"] + c["lost"] + c["not_sent"] == c["total"] == 6
    assert c["lost_by"] == {"error event": 1, "HTTP error": 0, "no terminal event": 0}
    assert (cmp["token_exact"], cmp["not_token_exact"], cmp["not_comparable"]) == (2, [2], [5])
    assert cmp["token_exact"] + len(cmp["not_token_exact"]) + len(cmp["not_comparable"]) == c["completed"]
    ta = cmp["time_added"]
    assert ta["overlapping_requests"] == 3 and ta["compared"] == 2  # request 3 did not complete
    assert ta["median_ms"] == pytest.approx(1250.0) and ta["p90_ms"] == pytest.approx(1850.0)
    assert ta["makespan_s"] == pytest.approx(7.0 - 6.0)  # request 5 ends at 7 s instead of 6 s
    assert c["failovers"] == {"worker_gone": 3} and c["failovers_total"] == 3
    k = report["kills"]
    assert (k["done"], k["back"], k["not_done"], k["by_kind"]) == (2, 2, 1, {"decode": 2})
    assert [e["in_flight"] for e in k["events"]] == [1, 2]
    assert report["streams_without_terminal_event"] == 0
    warnings = " ".join(report["warnings"])
    assert "differ from the baseline" in warnings and "baseline was not clean" in warnings
    assert "1 planned kills were not done" in warnings
    md = summary_md(report, "tiny")
    assert "| completed token-exact vs baseline | - | 2 |" in md
    assert "| decode-1 | kill | 2 | 1 | back |" in md


def test_streams_without_a_terminal_event_are_counted_in_both_runs() -> None:
    base = [_rec(0), _rec(1, ERROR, terminal=False)]
    chaos = [_rec(0), _rec(1, CANCELLED, terminal=False, http=200)]
    report = build_report({}, (base, {}), (chaos, {}), 2, [], planned_kills=None)
    assert report["streams_without_terminal_event"] == 2
    assert report["chaos"]["lost_by"]["no terminal event"] == 1
    assert compare_runs(base, chaos, [])["time_added"]["overlapping_requests"] == 0


# --- the command line ----------------------------------------------------------------------------


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--trace", "synthetic", "--out", "x", "--kills", "1", *argv])


def test_the_deployment_is_a_url_or_started_from_a_config_or_flags() -> None:
    assert deployment(_args("--url", "http://127.0.0.1:9/")).url == "http://127.0.0.1:9"
    dep = deployment(_args("--config", "configs/default.toml", "--serve", "--prefill 2 --decode 2"))
    assert dep.server is not None and dep.server.config == "configs/default.toml"
    assert dep.server.flags == ("--prefill", "2", "--decode", "2")
    with pytest.raises(ValueError, match="one or the other"):
        deployment(_args("--url", "http://x:1", "--serve", "--colocated 2"))
    with pytest.raises(ValueError, match="give --url"):
        deployment(_args())
    with pytest.raises(SystemExit):  # --kills and --kill-every are exclusive
        _args("--kill-every", "3")


def test_requests_are_greedy_with_token_ids() -> None:
    assert greedy_body({"top_k": 5}) == {"top_k": 5, "temperature": 0, "return_token_ids": True}
    with pytest.raises(ValueError, match="temperature"):
        greedy_body({"temperature": 0.7})


# --- end to end ----------------------------------------------------------------------------------


def test_chaos_against_a_fabric_kills_a_decode_worker_and_every_stream_ends(tmp_path: Path) -> None:
    """One decode worker of 1 prefill + 2 decode is killed mid-run: every stream ends with a terminal
    event, the counts add up, completed outputs equal the baseline's, and the victim comes back."""
    flags = ("--model", "tiny", "--prefill", "1", "--decode", "2", "--num-blocks", "256")
    with running_fabric(*flags) as url:
        out = tmp_path / "chaos"
        cmd = [sys.executable, "-m", "pdfabric.cli", "bench", "chaos", "--url", url, "--kills", "1",
               "--back-timeout", "60", "--trace", "synthetic", "--rate", "6", "--arrival", "gamma",
               "--burstiness", "0", "--num-requests", "10", "--input-len", "16:64", "--output-len", "300",
               "--request-timeout", "60", "--max-run-time", "90", "--no-progress", "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads((out / "report.json").read_text())
        b, c, cmp, k = report["baseline"], report["chaos"], report["comparison"], report["kills"]
        assert report["streams_without_terminal_event"] == 0
        assert b["completed"] == b["total"] == 10 and b["failovers_total"] == 0
        assert c["completed"] + c["lost"] + c["not_sent"] == c["total"] == 10
        assert c["lost"] == 0 and cmp["token_exact"] == c["completed"]  # failover is token-exact
        assert (k["done"], k["back"]) == (1, 1) and k["by_kind"] == {"decode": 1}  # prefill-0 is spared
        victim = k["events"][0]["worker"]
        assert sum(metric_values(url, "pdfabric_failovers_total").values()) == c["failovers_total"]
        workers = {w["id"]: w for w in get_json(url + "/health")[1]["workers"]}
        assert workers[victim]["restarts"] == 1 and workers[victim]["pid"] != k["events"][0]["pid"]
        lines = (out / "chaos" / "requests.jsonl").read_text().splitlines()
        assert all(r["terminal"] and len(r["token_ids"]) == 300 for r in map(json.loads, lines))
        assert "| completed token-exact vs baseline | - | 10 |" in proc.stdout
        wait_blocks_free(url)
