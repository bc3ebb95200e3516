"""Plots of teacher-forced accuracy: against digit width (one line per model), by answer position
for a lineup (one line per model, one panel per width) and for one run (a heat map)."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ...atomic import atomic_path
from ...plotting import pyplot as _pyplot


def width_curve(runs: List[Dict[str, Any]], key: str) -> Dict[int, float]:
    """Mean over ``runs`` (seeds) of the best step's per-width accuracy ``key`` ("exact"/"digit")."""
    widths = sorted(int(w) for w in runs[0]["best"]["per_width"])
    return {w: sum(r["best"]["per_width"][str(w)][key] for r in runs) / len(runs) for w in widths}


def position_curve(runs: List[Dict[str, Any]], width: int) -> Optional[List[float]]:
    """Mean over ``runs`` (seeds) of the best step's digit accuracy at each answer position ``k = 0 ..
    width`` of ``width`` (``best["per_position"]``); ``None`` if a run did not record it."""
    pers = [(r.get("best") or {}).get("per_position") or {} for r in runs]
    if not all(str(width) in p for p in pers):
        return None
    return [sum(p[str(width)][k] for p in pers) / len(pers) for k in range(width + 1)]


def _save(plt, fig, path, dpi: int) -> Path:
    """Write ``fig`` to ``path`` atomically (its folder created) and close it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi)
    plt.close(fig)
    return path


def plot_accuracy_vs_width(runs: Dict[str, List[Dict[str, Any]]], path,
                           title: Optional[str] = None) -> Optional[Path]:
    """Two panels (exact match, digits) of accuracy vs width at each run's best step.

    ``runs`` maps a model name to its results dicts (one per seed; the curve is
    their mean). The training widths are shaded. Returns ``None`` (and draws
    nothing) when matplotlib is not installed (``pip install falcon-fwa[plot]``).
    """
    plt = _pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, key, label in zip(axes, ("exact", "digit"), ("exact match (whole answer)", "digit accuracy")):
        for name, rs in runs.items():
            curve = width_curve(rs, key)
            ax.plot(list(curve), list(curve.values()), marker=".", label=name)
        first = next(iter(runs.values()))[0]["preset"]
        lo, hi = first["train_widths"]
        ax.axvspan(lo - 0.5, hi + 0.5, color="0.92", zorder=0)
        ax.set_xlabel("digit width n (shaded: training widths)")
        ax.set_title(f"teacher-forced {label}")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    axes[1].legend(fontsize=8, loc="lower left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(plt, fig, path, dpi=120)


def plot_accuracy_by_position(result: Dict[str, Any], path, title: Optional[str] = None) -> Optional[Path]:
    """Heat map of the best step's digit accuracy by answer position (x: ``k = 0`` the units
    digit) and width (y), from one run's results dict (its ``best["per_position"]``).

    A dashed line marks the last answer position that training reached (``k = hi``, with
    ``hi`` the largest training width) and another the last training width. Above that line,
    a rule that does not depend on the width stays bright at every position; a look-up
    bounded by the trained positions goes dark right of the first line only; one tied to the
    width goes dark everywhere. Returns ``None`` (and draws nothing)
    without matplotlib or without ``per_position`` (runs from before it was recorded).
    """
    per = (result.get("best") or {}).get("per_position")
    if not per:
        print("no accuracy by answer position at the best step (a run from before it was recorded): no heat map")
        return None
    plt = _pyplot()
    if plt is None:
        return None
    import numpy as np

    widths = sorted(int(w) for w in per)
    lo = widths[0]
    grid = np.full((widths[-1] - lo + 1, widths[-1] + 1), np.nan)  # one row per width lo..max, blank if absent
    for w in widths:
        grid[w - lo, : w + 1] = per[str(w)]
    fig, ax = plt.subplots(figsize=(min(14, 4 + 0.25 * grid.shape[1]), min(10, 3 + 0.2 * grid.shape[0])))
    im = ax.imshow(grid, aspect="auto", origin="lower", vmin=0, vmax=100, cmap="viridis",
                   extent=(-0.5, grid.shape[1] - 0.5, lo - 0.5, widths[-1] + 0.5))
    hi = result["preset"]["train_widths"][1]
    ax.axvline(hi + 0.5, color="w", ls="--", lw=1)
    ax.axhline(hi + 0.5, color="w", ls="--", lw=1)
    ax.set_xlabel("answer position k (0 = units digit; dashed: last position seen in training)")
    ax.set_ylabel("digit width n (dashed: largest training width)")
    ax.set_title(title or f"{result.get('model', '')}: digit accuracy by position, best step {result['best']['step']}")
    fig.colorbar(im, ax=ax, label="digit accuracy (%)")
    fig.tight_layout()
    return _save(plt, fig, path, dpi=110)


def plot_lineup_positions(runs: Dict[str, List[Dict[str, Any]]], path, widths: Sequence[int],
                          title: Optional[str] = None) -> Optional[Path]:
    """Digit accuracy by answer position (x: ``k = 0`` the units digit), one panel per width in
    ``widths`` and one line per model (the mean over its seeds, :func:`position_curve`), with
    uniform guessing (``100 / base``) dotted. ``runs`` as in :func:`plot_accuracy_vs_width`. Where
    the lines fall shows which answer digits a model finds and which it does not. Returns ``None``
    (and draws nothing) without matplotlib, or when no run recorded ``per_position`` at these widths."""
    curves = {w: {name: c for name, rs in runs.items() if (c := position_curve(rs, w)) is not None} for w in widths}
    curves = {w: c for w, c in curves.items() if c}
    if not curves:
        print("no accuracy by answer position at these widths (runs from before it was recorded): no position plot")
        return None
    plt = _pyplot()
    if plt is None:
        return None
    first = next(iter(runs.values()))[0]["preset"]
    chance = 100.0 / first.get("base", 10)
    fig, axes = plt.subplots(1, len(curves), figsize=(4.5 * len(curves) + 1, 4.2), sharey=True, squeeze=False)
    for ax, (w, by_model) in zip(axes[0], curves.items()):
        for name, curve in by_model.items():
            ax.plot(range(w + 1), curve, marker=".", label=name)
        ax.axhline(chance, color="0.5", ls=":", lw=1)
        ax.set_xlabel("answer position k (0 = units digit)")
        seen = first["train_widths"][0] <= w <= first["train_widths"][1]
        ax.set_title(f"width {w} ({'training' if seen else 'out of distribution'})")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("digit accuracy (%); dotted: guessing")
    axes[0][-1].legend(fontsize=8, loc="lower left")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return _save(plt, fig, path, dpi=120)


RUN_PLOTS = ("accuracy_by_position.png", "accuracy_vs_width.png")
"""The plots a finished run draws in its folder (:func:`plot_run`)."""


def plot_run(result: Dict[str, Any], out) -> List[Path]:
    """Draw one run's plots into its folder ``out`` from its results dict: accuracy against width
    (``accuracy_vs_width.png``) and the heat map by answer position (``accuracy_by_position.png``); the paths
    drawn (none without matplotlib, no heat map for a run without ``per_position``)."""
    out = Path(out)
    title = f"addition, preset {result.get('preset_name', '?')}, best step {result['best']['step']}"
    drawn = [plot_accuracy_vs_width({result["model"]: [result]}, out / "accuracy_vs_width.png", title=title),
             plot_accuracy_by_position(result, out / "accuracy_by_position.png")]
    return [p for p in drawn if p is not None]


def missing_run_plots(result: Dict[str, Any], out) -> List[str]:
    """The names of :data:`RUN_PLOTS` that the finished run whose results dict is ``result`` should have in its
    folder ``out`` and has not (its plots failed, or were cut short, after its results were written): none
    without matplotlib, which draws them; the heat map only where the best step recorded ``per_position``."""
    if importlib.util.find_spec("matplotlib") is None:
        return []
    wanted = ["accuracy_vs_width.png"]
    if (result.get("best") or {}).get("per_position"):
        wanted.append("accuracy_by_position.png")
    return sorted(name for name in wanted if not (Path(out) / name).exists())
