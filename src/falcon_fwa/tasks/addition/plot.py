"""Plot of teacher-forced accuracy against digit width, one line per model."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

from ...atomic import atomic_path


def width_curve(runs: List[Dict[str, Any]], key: str) -> Dict[int, float]:
    """Mean over ``runs`` (seeds) of the best step's per-width accuracy ``key`` ("exact"/"digit")."""
    widths = sorted(int(w) for w in runs[0]["best"]["per_width"])
    return {w: sum(r["best"]["per_width"][str(w)][key] for r in runs) / len(runs) for w in widths}


def plot_accuracy_vs_width(runs: Dict[str, List[Dict[str, Any]]], path,
                           title: Optional[str] = None) -> Optional[Path]:
    """Two panels (exact match, digits) of accuracy vs width at each run's best step.

    ``runs`` maps a model name to its results dicts (one per seed; the curve is
    their mean). The training widths are shaded. Returns ``None`` (and draws
    nothing) when matplotlib is not installed (``pip install falcon-fwa[plot]``).
    """
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'falcon-fwa[plot]')")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
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
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return path
