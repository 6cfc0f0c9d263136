"""``pdfabric bench simulate --mode validate``: a measured goodput run beside its simulation.

Every trial rate of the measured run (``bench goodput``, or one deployment of ``bench compare --mode
goodput``) is simulated with the same workload; the table gives attainment, p90 TTFT and p90 ITL per
rate and the goodput both find by the same rule over the same rates, and ``validation.json`` keeps it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdfabric.bench.metrics import SLO
    from pdfabric.bench.simulator import SimConfig
    from pdfabric.bench.workload import Workload


def validate(
    config: SimConfig,
    workload: Workload,
    slo: SLO,
    args: argparse.Namespace,
    meta: dict[str, Any],
    out: Path,
    label: str,
) -> int:
    """Simulates each trial rate of a measured goodput run and prints measured beside simulated:
    attainment, p90 TTFT and ITL per rate, and goodput (the same search rule over the same rates)."""
    import json

    from pdfabric.bench.goodput import GoodputResult, settle
    from pdfabric.bench.options import fail
    from pdfabric.bench.report import build_report, write_json
    from pdfabric.bench.simulator import simulate

    if not args.measured:
        return fail("--mode validate needs --measured DIR")
    try:
        measured = json.loads((Path(args.measured) / "report.json").read_text())
        trials = measured["trials"]
        if not trials:
            raise ValueError("it has no trials")
    except (OSError, ValueError, KeyError) as exc:
        return fail(f"--measured {args.measured}: not a goodput run's report ({exc})")
    mine, theirs = workload.describe(), measured.get("workload", {})
    same = ("requests", "input_tokens", "output_tokens")
    if any(mine.get(k) != theirs.get(k) for k in same):
        there = ", ".join(f"{k} {theirs.get(k)}" for k in same)
        here = ", ".join(f"{k} {mine.get(k)}" for k in same)
        return fail(f"--measured {args.measured} replayed another workload ({there}; these flags: {here})")
    rows, sim_trials = [], []
    for t in sorted(trials, key=lambda t: t["rate"]):
        rate = t["rate"]
        records = simulate(config, workload.with_rate(rate))
        rep = build_report(records, slo, target=args.target, not_sent=0, meta=meta)
        sim_trials.append((rate, rep["attainment"] or 0.0))
        rows.append(
            {
                "rate": rate,
                "measured": _trial_figures(t["attainment"], t["ttft_ms"], t["itl_ms"]),
                "simulated": _trial_figures(rep["attainment"], rep["ttft_ms"], rep["itl_ms"]),
            }
        )
    sim = settle(GoodputResult(target=args.target, trials=sim_trials))
    out.mkdir(parents=True, exist_ok=True)
    goodput = {"measured": measured["goodput"]["goodput_rps"], "simulated": sim.goodput}
    write_json(out / "validation.json", {**meta, "measured_dir": args.measured, "goodput_rps": goodput,
                                          "trials": rows})  # fmt: skip
    print(f"{label}: measured ({args.measured}) vs simulated; SLO {slo.ttft_ms:g} / {slo.itl_ms:g} ms")
    print("| rate req/s | attainment meas / sim | TTFT p90 ms meas / sim | ITL p90 ms meas / sim |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        m, s_ = r["measured"], r["simulated"]
        cells = [
            f"{_pct(m['attainment'])} / {_pct(s_['attainment'])}",
            f"{_num(m['ttft_p90_ms'])} / {_num(s_['ttft_p90_ms'])}",
            f"{_num(m['itl_p90_ms'])} / {_num(s_['itl_p90_ms'])}",
        ]
        print(f"| {r['rate']:g} | " + " | ".join(cells) + " |")
    meas, simulated = _num(goodput["measured"], 3), _num(goodput["simulated"], 3)
    print(f"goodput req/s: measured {meas}, simulated {simulated} (the same search rule over the same rates)")
    return 0


def _trial_figures(att: float | None, ttft: dict[str, Any], itl: dict[str, Any]) -> dict[str, Any]:
    return {"attainment": att, "ttft_p90_ms": ttft.get("p90"), "itl_p90_ms": itl.get("p90")}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"
