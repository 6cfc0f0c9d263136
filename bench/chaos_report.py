"""What a chaos run did to its requests, measured against a fault-free baseline run of the same
workload, and the report's tables.

Both runs replay one workload with greedy sampling, so request ``i`` should give the same output in
both. Per request of the chaos run:

1. completed: its stream ended with a finish reason (``stop`` or ``length``): status ok;
2. token-exact: completed in both runs with the same text and the same token ids;
3. lost: not completed, because its stream ended with an error event, or it got an HTTP error (a 503
   or 429 refusal among them), or it had no terminal event (the stream broke off or timed out, or it
   got no HTTP answer at all); so completed + lost + not sent = total;
4. overlapping a kill: the kill's time falls inside its ``[sent, sent + e2e]`` in the chaos run.

Time added: the chaos run's end-to-end latency minus the baseline's, per request that overlapped a
kill and completed in both runs (median and p90), and the difference of the two runs' makespans (from
the run's start to the end of its last request). Failovers come from the router's
``pdfabric_failovers_total`` counter (by cause), read before and after each run.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

from pdfabric.bench.chaos import BACK, DRAINED, NOT_BACK, KillEvent
from pdfabric.bench.metrics import percentile
from pdfabric.bench.records import OK, RequestRecord

COMPLETED, ERROR_EVENT, HTTP_ERROR = "completed", "error event", "HTTP error"
NO_TERMINAL = "no terminal event"
LOST = (ERROR_EVENT, HTTP_ERROR, NO_TERMINAL)


def outcome(r: RequestRecord) -> str:
    """How one request ended, in the terms of the module docstring."""
    if r.status == OK:
        return COMPLETED
    if r.terminal:
        return ERROR_EVENT
    if r.http_status is not None and r.http_status != 200:
        return HTTP_ERROR
    return NO_TERMINAL


def makespan_s(records: list[RequestRecord]) -> float | None:
    """From the run's start to the end of its last request."""
    ends = [r.sent_s + r.e2e_ms / 1000.0 for r in records if r.e2e_ms is not None]
    return max(ends) if ends else None


def run_summary(records: list[RequestRecord], total: int, failovers: dict[str, float]) -> dict[str, Any]:
    """One run's counts (by outcome), failovers by cause, makespan, E2E and mean concurrency (the
    sum of the requests' E2E over the makespan: Little's law)."""
    by = Counter(outcome(r) for r in records)
    span = makespan_s(records)
    e2e = [r.e2e_ms for r in records if r.status == OK and r.e2e_ms is not None]
    busy = sum(r.e2e_ms for r in records if r.e2e_ms is not None) / 1000.0
    return {
        "total": total,
        "completed": by[COMPLETED],
        "lost": sum(by[k] for k in LOST),
        "lost_by": {k: by[k] for k in LOST},
        "not_sent": total - len(records),
        "no_terminal_event": by[NO_TERMINAL],
        "failovers": {k: int(v) for k, v in failovers.items()},
        "failovers_total": int(sum(failovers.values())),
        "makespan_s": _round(span, 3),
        "e2e_ms_p50": _round(percentile(e2e, 50), 1),
        "e2e_ms_p90": _round(percentile(e2e, 90), 1),
        "mean_concurrency": _round(busy / span, 1) if span else None,
    }


def same_output(a: RequestRecord, b: RequestRecord) -> bool:
    return a.text == b.text and a.token_ids == b.token_ids


def overlaps(r: RequestRecord, times_s: list[float]) -> bool:
    if r.e2e_ms is None:
        return False
    return any(r.sent_s <= t <= r.sent_s + r.e2e_ms / 1000.0 for t in times_s)


def in_flight(records: list[RequestRecord], at_s: float | None) -> int | None:
    """How many requests were in flight at ``at_s`` (None for a kill that was not done)."""
    return None if at_s is None else sum(overlaps(r, [at_s]) for r in records)


def compare_runs(
    baseline: list[RequestRecord], chaos: list[RequestRecord], kill_times_s: list[float]
) -> dict[str, Any]:
    """The chaos run against the baseline: token-exactness of its completed requests, and the time
    the kills added."""
    base = {r.index: r for r in baseline}
    exact, differ, not_comparable = 0, [], []
    added: list[float] = []
    overlapping = 0
    for r in chaos:
        b = base.get(r.index)
        if r.status == OK:
            if b is None or b.status != OK:
                not_comparable.append(r.index)
            elif same_output(r, b):
                exact += 1
            else:
                differ.append(r.index)
        if overlaps(r, kill_times_s):
            overlapping += 1
            if r.status == OK and b is not None and b.status == OK:
                assert r.e2e_ms is not None and b.e2e_ms is not None  # ok records have an end
                added.append(r.e2e_ms - b.e2e_ms)
    spans = makespan_s(chaos), makespan_s(baseline)
    return {
        "token_exact": exact,
        "not_token_exact": differ,
        "not_comparable": not_comparable,
        "time_added": {
            "overlapping_requests": overlapping,
            "compared": len(added),
            "median_ms": _round(percentile(added, 50), 1),
            "p90_ms": _round(percentile(added, 90), 1),
            "makespan_s": _round(spans[0] - spans[1], 3) if None not in spans else None,
        },
    }


def kills_summary(kills: list[KillEvent], planned: int | None, chaos: list[RequestRecord]) -> dict[str, Any]:
    """Kills done, by kind and by how they settled, each with the chaos run's requests in flight at
    its time; ``planned`` is None for kills every S seconds."""
    done = [k for k in kills if k.at_s is not None]
    events = [{**asdict(k), "in_flight": in_flight(chaos, k.at_s)} for k in kills]
    return {
        "planned": planned,
        "done": len(done),
        "by_kind": dict(sorted(Counter(k.kind for k in done).items())),
        "back": sum(k.outcome == BACK for k in done),
        "drained": sum(k.outcome == DRAINED for k in done),
        "not_back": sum(k.outcome == NOT_BACK for k in done),
        "not_done": (planned if planned is not None else len(kills)) - len(done),
        "events": events,
    }


def build_report(
    meta: dict[str, Any],
    baseline: tuple[list[RequestRecord], dict[str, float]],
    chaos: tuple[list[RequestRecord], dict[str, float]],
    total: int,
    kills: list[KillEvent],
    planned_kills: int | None,
    server_lost: float | None = None,
) -> dict[str, Any]:
    """The ``report.json`` of a chaos run; ``baseline`` and ``chaos`` are each run's records and its
    failovers by cause; ``planned_kills`` is ``--kills`` (None with ``--kill-every``); ``server_lost``
    is the router's lost-request count over the chaos run, if it keeps one."""
    report = {
        **meta,
        "baseline": run_summary(baseline[0], total, baseline[1]),
        "chaos": run_summary(chaos[0], total, chaos[1]),
        "comparison": compare_runs(baseline[0], chaos[0], [k.at_s for k in kills if k.at_s is not None]),
        "kills": kills_summary(kills, planned_kills, chaos[0]),
        "server_lost": None if server_lost is None else int(server_lost),
    }
    report["warnings"] = warnings(report)
    report["streams_without_terminal_event"] = (report["baseline"]["no_terminal_event"]
                                                + report["chaos"]["no_terminal_event"])
    return report


def warnings(report: dict[str, Any]) -> list[str]:
    """What a reader must not miss: streams without an end, outputs that changed, a dirty baseline."""
    out = []
    for run in ("baseline", "chaos"):
        if n := report[run]["no_terminal_event"]:
            out.append(f"{n} streams of the {run} run had no terminal event (finish reason or error)")
    if differ := report["comparison"]["not_token_exact"]:
        out.append(f"{len(differ)} completed requests differ from the baseline's output "
                   f"(indices {differ[:10]}{' ...' if len(differ) > 10 else ''})")
    b = report["baseline"]
    if b["completed"] < b["total"] or b["failovers_total"]:
        out.append(f"the baseline was not clean: {b['completed']} of {b['total']} completed, "
                   f"{b['failovers_total']} failovers; requests it lost are not compared")
    k = report["kills"]
    if k["done"] == 0:
        out.append("no worker was killed: the chaos run measured nothing but noise")
    elif k["not_done"]:
        out.append(f"{k['not_done']} planned kills were not done (the run ended first, or no worker could be "
                   "killed then)")
    if report["comparison"]["time_added"]["overlapping_requests"] == 0 and report["kills"]["done"]:
        out.append("no request was in flight at a kill's time")
    return out


def summary_md(report: dict[str, Any], label: str) -> str:
    """The results table and the kills, in markdown (also what the command prints)."""
    b, c, cmp = report["baseline"], report["chaos"], report["comparison"]
    ta, k = cmp["time_added"], report["kills"]
    kinds = ", ".join(f"{n} {kind}" for kind, n in k["by_kind"].items()) or "none"

    def fo(run: dict[str, Any]) -> str:
        causes = ", ".join(f"{cause} {n}" for cause, n in run["failovers"].items() if n)
        return f"{run['failovers_total']}" + (f" ({causes})" if causes else "")

    def lost(run: dict[str, Any]) -> str:
        return f"{run['lost']} ({' / '.join(str(run['lost_by'][x]) for x in LOST)})"

    rows = [
        ("requests", b["total"], c["total"]),
        ("completed", b["completed"], c["completed"]),
        ("completed token-exact vs baseline", "-", cmp["token_exact"]),
        ("failed over (by cause)", fo(b), fo(c)),
        (f"lost ({' / '.join(LOST)})", lost(b), lost(c)),
        ("not sent", b["not_sent"], c["not_sent"]),
        ("streams without a terminal event", b["no_terminal_event"], c["no_terminal_event"]),
        ("makespan s", _fmt(b["makespan_s"]), _fmt(c["makespan_s"])),
        ("E2E p50 / p90 ms", f"{_fmt(b['e2e_ms_p50'])} / {_fmt(b['e2e_ms_p90'])}",
         f"{_fmt(c['e2e_ms_p50'])} / {_fmt(c['e2e_ms_p90'])}"),
        ("mean concurrency", _fmt(b["mean_concurrency"]), _fmt(c["mean_concurrency"])),
    ]
    if report.get("server_lost") is not None:
        rows.append(("lost per the router (pdfabric_requests_lost_total)", "-", report["server_lost"]))
    lines = [f"# chaos: {label}", "", "| | baseline | chaos |", "|---|---:|---:|"]
    lines += [f"| {name} | {x} | {y} |" for name, x, y in rows]
    lines += [
        "",
        f"Time added to the {ta['overlapping_requests']} requests that overlapped a kill ({ta['compared']} "
        f"completed in both runs): median {_fmt(ta['median_ms'])} ms, p90 {_fmt(ta['p90_ms'])} ms; "
        f"makespan {_signed(ta['makespan_s'])} s.",
        "",
        f"Kills: {k['done']} done ({kinds}), "
        f"{k['back']} workers back, {k['drained']} drained, {k['not_back']} not back"
        + (f", {k['not_done']} not done" if k["not_done"] else "") + ".",
        "",
        "| # | due s | at s | worker | signal | in flight | failed over | outcome | settled after s |",
        "|---:|---:|---:|---|---|---:|---:|---|---:|",
    ]
    for i, e in enumerate(k["events"], 1):
        outcome_ = e["outcome"] + (f": {e['note']}" if e["note"] and e["at_s"] is None else "")
        lines.append(f"| {i} | {e['due_s']:.2f} | {_fmt(e['at_s'], 2)} | {e['worker'] or '-'} | "
                     f"{e['signal']} | {_fmt(e['in_flight'])} | {_fmt(e['failovers'])} | {outcome_} | "
                     f"{_fmt(e['settled_after_s'], 2)} |")
    if report.get("warnings"):
        lines += ["", "Warnings:", "", *[f"- {w}" for w in report["warnings"]]]
    return "\n".join(lines) + "\n"


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _fmt(x: Any, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}"
