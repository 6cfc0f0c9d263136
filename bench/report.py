"""Writing a run's results: ``report.json``, ``requests.jsonl``, ``summary.md`` and PNG plots.

``report.json`` of one replay holds (beside the metrics of ``pdfabric.bench.metrics.summarize``):
``target`` (URL, model, endpoint), ``workload`` (source, counts and the ``scaling`` applied),
``slo_scale`` (attainment at each SLO scale and the smallest scale that meets the target),
``stopped`` / ``partial`` (why the run ended early, if it did) and ``warnings``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from pdfabric.bench import plots
from pdfabric.bench.goodput import min_slo_scale, slo_scale_sweep
from pdfabric.bench.metrics import SLO, summarize
from pdfabric.bench.records import OK, RequestRecord, write_jsonl

DEFAULT_SLO_SCALES = (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0)


def write_json(path: Path, obj: Any) -> None:
    """JSON with non-finite floats written as null (strict JSON has no Infinity)."""
    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(obj), indent=2) + "\n")


def build_report(
    records: list[RequestRecord],
    slo: SLO,
    *,
    target: float,
    not_sent: int,
    meta: dict[str, Any],
    stopped: str | None = None,
    warnings: list[str] | None = None,
) -> dict[str, Any]:
    """The ``report.json`` object of one replay."""
    report: dict[str, Any] = {"created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **meta}
    report.update(summarize(records, slo, not_sent=not_sent))
    report["attainment_target"] = target
    report["slo_scale"] = {
        "points": [{"scale": s, "attainment": round(a, 4)}
                   for s, a in slo_scale_sweep(records, slo, list(DEFAULT_SLO_SCALES))],
        "min_scale_for_target": min_slo_scale(records, slo, target),
    }
    report["stopped"] = stopped
    report["partial"] = stopped is not None or not_sent > 0
    warn = list(warnings or [])
    if report["short_outputs"]:
        warn.append(
            f"{report['short_outputs']} ok requests returned fewer tokens than max_tokens: the server may "
            "ignore ignore_eos, so output lengths (and load) are below the workload's"
        )
    if report["requests"]["ok"] and not report["token_counts_from_usage"]:
        warn.append("the server sent no usage in the stream: output tokens were counted one per chunk")
    report["warnings"] = warn
    return report


def write_run(
    out: Path,
    records: list[RequestRecord],
    report: dict[str, Any],
    slo: SLO,
    label: str,
    with_plots: bool = True,
) -> None:
    """Write one replay's files into ``out`` (created if needed)."""
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(records, out / "requests.jsonl")
    write_json(out / "report.json", report)
    (out / "summary.md").write_text(summary_md(report, label))
    if not with_plots:
        return
    ok = [r for r in records if r.status == OK]
    plots.cdf({label: [r.ttft_ms for r in ok if r.ttft_ms is not None]}, out / "ttft_cdf.png",
              "TTFT", "time to first token (ms)", slo.ttft_ms)
    plots.cdf({label: [g for r in ok for g in r.itl_ms]}, out / "itl_cdf.png",
              "inter-token latency", "inter-token gap (ms)", slo.itl_ms)
    scale_pts = [(p["scale"], p["attainment"]) for p in report["slo_scale"]["points"]]
    plots.attainment_curves({label: scale_pts}, out / "slo_scale.png", report["attainment_target"],
                            "SLO scale (both SLOs times x)", "attainment vs SLO scale")


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def latency_table(report: dict[str, Any]) -> list[str]:
    rows = ["| metric (ms) | p50 | p90 | p99 | mean | max | n |", "|---|---:|---:|---:|---:|---:|---:|"]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL (all gaps)"), ("tpot_ms", "TPOT (per request)"),
                      ("e2e_ms", "E2E"), ("send_lateness_ms", "send lateness")):
        d = report[key]
        rows.append(f"| {name} | " + " | ".join(_fmt(d[k]) for k in ("p50", "p90", "p99", "mean", "max"))
                    + f" | {d['count']} |")
    return rows


def summary_md(report: dict[str, Any], label: str) -> str:
    """A one-screen markdown summary of a replay report."""
    req, slo, thr = report["requests"], report["slo"], report["throughput"]
    att, tgt = report["attainment"], report.get("target", {})
    lines = [
        f"# replay: {label}",
        "",
        f"- target: `{tgt.get('url', '-')}` model `{tgt.get('model', '-')}`",
        f"- requests: {req['total']} sent, {req['ok']} ok, {req['rejected']} rejected, {req['error']} error, "
        f"{req['timeout']} timeout, {req['cancelled']} cancelled, {req['not_sent']} not sent",
        f"- SLO: TTFT <= {slo['ttft_ms']:g} ms and ITL ({slo['itl_stat']}) <= {slo['itl_ms']:g} ms; "
        f"attainment **{'-' if att is None else f'{att:.1%}'}** "
        f"(TTFT only {_fmt(report['attainment_ttft_only'], 3)}, "
        f"ITL only {_fmt(report['attainment_itl_only'], 3)})",
        f"- smallest SLO scale meeting {report['attainment_target']:.0%}: "
        f"{_fmt(report['slo_scale']['min_scale_for_target'], 2)}",
        f"- throughput: {_fmt(thr['requests_per_s'], 3)} req/s, "
        f"{_fmt(thr['output_tokens_per_s'], 1)} output tok/s "
        f"over {report['duration_s']} s",
        "",
        *latency_table(report),
        "",
    ]
    if cache := report.get("prefix_cache"):  # the header's last item
        rate = "-" if cache["hit_rate"] is None else f"{cache['hit_rate']:.1%}"
        lines.insert(lines.index("", 2), (
            f"- prefix cache (server-reported): {cache['cached_tokens']} of {cache['prompt_tokens']} prompt "
            f"tokens cached, hit rate **{rate}** over {cache['requests']} requests"
        ))
    lines += scaling_lines(report.get("workload", {}))
    if report.get("stopped"):
        lines += ["", f"**Partial run**: stopped early ({report['stopped']})."]
    if report.get("warnings"):
        lines += ["", "## warnings", *[f"- {w}" for w in report["warnings"]]]
    return "\n".join(lines) + "\n"


def scaling_lines(workload: dict[str, Any]) -> list[str]:
    """The workload and its scaling, as markdown lines."""
    if not workload:
        return []
    src = workload.get("source", {})
    lines = ["## workload", "", f"- source: {', '.join(f'{k}={v}' for k, v in src.items())}"]
    sc = dict(workload.get("scaling", {}))
    before, after = sc.pop("before", None), sc.pop("after", None)
    if sc:
        lines.append(f"- scaling: {', '.join(f'{k}={v}' for k, v in sc.items() if v is not None)}")
    if before and after:
        lines.append(f"- before scaling: {before['requests']} requests over {before['span_s']} s "
                     f"({before['mean_rate']} req/s)")
    lines.append(f"- replayed: {workload.get('requests')} requests over {workload.get('span_s')} s "
                 f"({workload.get('mean_rate')} req/s), {workload.get('input_tokens')} input / "
                 f"{workload.get('output_tokens')} output tokens")
    if workload.get("shared_prefix_tokens") is not None and workload.get("input_tokens"):
        share = workload["shared_prefix_tokens"] / workload["input_tokens"]
        lines.append(f"- shared prefixes: {workload['shared_prefix_tokens']} input tokens ({share:.1%}) "
                     "repeat an earlier prompt's start (what an unbounded prefix cache could reuse)")
    return lines
