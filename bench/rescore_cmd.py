"""``pdfabric bench rescore``: the goodput of finished rate searches under another SLO, with no new runs.

A request's TTFT and inter-token gaps do not depend on the SLO it is judged by, so the trials that a
``bench goodput`` or ``bench compare --mode goodput`` run saved (``trials/rate-R/requests.jsonl``)
answer for any SLO: each trial's attainment is recomputed, and the goodput is, as in the search, the
highest passing rate below the lowest failing one. One search thus serves both a mean-TPOT SLO and a
no-stall SLO (``--itl-stat max``: every gap within the ITL target). A rate the search did not measure
cannot be rescored, so a goodput above the highest measured rate reads as "at least" that rate.

Exit status 0, 2 when the directory holds no trials.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from pdfabric.bench.options import add_slo_arguments

_TRIAL = re.compile(r"rate-([0-9.eE+-]+)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dirs", nargs="+", metavar="DIR", help="output directories of bench goodput / compare --mode goodput"
    )
    add_slo_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def find_searches(root: Path) -> dict[str, Path]:
    """Every search under ``root``, named by its directory relative to ``root`` (``.`` for root itself):
    the directories that hold a ``trials`` folder."""
    found = {}
    for trials in sorted(root.rglob("trials")):
        if trials.is_dir():
            rel = trials.parent.relative_to(root)
            found[str(rel) if str(rel) != "." else root.name] = trials.parent
    return found


def rescore(search_dir: Path, slo: Any, target: float) -> dict[str, Any]:
    """One search's trials judged by ``slo``: each rate's attainment and the goodput they support."""
    from pdfabric.bench.goodput import GoodputResult, Trial, settle
    from pdfabric.bench.records import read_jsonl

    res = GoodputResult(target=target)
    for trial in sorted((search_dir / "trials").iterdir()):
        match = _TRIAL.match(trial.name)
        if not match or not (trial / "requests.jsonl").is_file():
            continue
        res.record(float(match.group(1)), Trial.of(read_jsonl(trial / "requests.jsonl"), slo))
    settle(res)
    out = res.to_json()
    out["at_least"] = not res.bounded and res.lower_bound is not None
    return out


def _goodput_text(r: dict[str, Any]) -> str:
    """``1.5``, ``>= 3`` (no measured rate failed: not bounded) or ``< 0.25`` (none passed)."""
    if r["at_least"]:
        return f">= {r['lower_bound_rps']:g}"
    if r["goodput_rps"] is None:
        return f"< {min(t['rate'] for t in r['trials']):g}" if r["trials"] else "none"
    return f"{r['goodput_rps']:g}"


def run(args: argparse.Namespace) -> int:
    from pdfabric.bench.options import fail, slo_from_args

    try:
        slo = slo_from_args(args)
    except ValueError as exc:
        return fail(str(exc))
    results: dict[str, Any] = {}
    for d in args.dirs:
        for name, path in find_searches(Path(d)).items():
            results[name] = rescore(path, slo, args.target)
    if not results:
        return fail(f"no trials/rate-R folders under {', '.join(args.dirs)}")
    print(
        f"SLO: TTFT <= {slo.ttft_ms:g} ms, {slo.itl_stat} ITL <= {slo.itl_ms:g} ms, "
        f"target {args.target:.0%} of requests"
    )
    print(f"{'search':<32} {'goodput req/s':>14}  attainment by rate")
    for name, r in results.items():
        g = _goodput_text(r)
        trials = ", ".join(f"{t['rate']:g}: {t['attainment']:.0%}" for t in r["trials"])
        print(f"{name:<32} {g:>14}  {trials}")
    if args.json:
        Path(args.json).write_text(json.dumps({"slo": slo.to_json(), "searches": results}, indent=2))
    return 0
