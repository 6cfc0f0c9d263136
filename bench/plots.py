"""PNG plots for bench reports (matplotlib, Agg backend; imported only when a plot is drawn).

Every function takes one series per deployment (name -> values), so a single run and a side-by-side
comparison use the same plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cdf(
    series: dict[str, list[float]], path: Path, title: str, xlabel: str, slo: float | None = None
) -> None:
    """Empirical CDFs, one line per series, with the SLO as a dashed vertical line."""
    import numpy as np

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    lows: list[float] = []
    highs: list[float] = []
    for name, values in series.items():
        if not values:
            continue
        xs = np.sort(np.asarray(values, dtype=float))
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=f"{name} (n={len(xs)})")
        lows.append(float(xs[0]))
        highs.append(float(xs[-1]))
    if lows and min(lows) > 0 and max(highs) / min(lows) > 100:
        ax.set_xscale("log")
    if slo is not None:
        ax.axvline(slo, color="gray", linestyle="--", linewidth=1, label=f"SLO {slo:g} ms")
    ax.set(title=title, xlabel=xlabel, ylabel="fraction of values <= x", ylim=(0, 1.02))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def attainment_curves(
    curves: dict[str, list[tuple[float, float]]],
    path: Path,
    target: float,
    xlabel: str,
    title: str,
    marks: dict[str, float | None] | None = None,
) -> None:
    """Attainment (y) against a rate or an SLO scale (x), one line per series, the target dashed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, points in curves.items():
        if not points:
            continue
        pts = sorted(points)
        line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)[0]
        mark = (marks or {}).get(name)
        if mark is not None:
            ax.axvline(mark, color=line.get_color(), linestyle=":", linewidth=1)
    ax.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    ax.set(title=title, xlabel=xlabel, ylabel="SLO attainment", ylim=(-0.02, 1.02))
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def goodput_bars(goodputs: dict[str, float | None], path: Path, target: float) -> None:
    """One bar per deployment: its goodput in req/s (a missing bar: no rate met the target)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(4.0, 1.3 * len(goodputs) + 2), 4.2))
    names = list(goodputs)
    values = [goodputs[n] or 0.0 for n in names]
    bars = ax.bar(names, values, color="tab:blue")
    for bar, name in zip(bars, names, strict=True):
        g = goodputs[name]
        label = "none" if g is None else f"{g:.3g}"
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set(title=f"goodput (>= {target:.0%} of requests meet both SLOs)", ylabel="req/s")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
