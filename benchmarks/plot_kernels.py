"""The ratios of one kernel-benchmark process as a plot: each Falcon rule's fwd+bwd time and peak memory
against its flash-linear-attention counterpart (the pairs and targets of ``bench_kernels.TARGETS``).

    python benchmarks/plot_kernels.py benchmarks/results/h100-9043e63.json --out benchmarks/results/h100-9043e63.png

Reads the rows of ``bench_kernels.py``'s ``<name>.json`` (one process) and draws one PNG with two panels:
the time ratio Falcon / fla of every pair with its target marked, and the peak-memory ratio with the 1.1x
line. Times are the CUDA-graph medians (``graph_ms``, the device's work) where both rows of a pair have
them, else both eager medians (``ms``); only the first shape of the file's fwd+bwd rows is drawn.
A pair with a row missing is skipped, and named. ``bench_kernels.py --plot`` draws the same plot next to
its table (:func:`plot_ratios`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional, Tuple

from bench_kernels import fwdbwd_ratios

PEAK_TARGET = 1.1  # peak memory at most this times the fla counterpart's


def _shape(row: dict) -> Tuple[int, int, int, int, int]:
    return row["B"], row["T"], row["H"], row["K"], row["V"]


def pair_ratios(rows: List[dict]) -> Tuple[Tuple[int, ...], List[dict], List[str]]:
    """``(shape, pairs, skipped)`` of the fwd+bwd rows at the first shape among them: the ratios of
    ``bench_kernels.fwdbwd_ratios`` (those of the table of ``<name>.md``) at that shape. ``pairs``: one dict per
    pair of ``bench_kernels.TARGETS`` with both rows, ``{op, fla_op, window, time_ratio, device, target, mem_ratio}``
    (``device``: the times are ``graph_ms``, which both rows have; else ``ms``; ``target`` is ``None``
    away from the shape it is set at, ``bench_kernels.target_at``, as in the table). ``skipped``: the pairs with a row
    missing, each naming it. Raises ``ValueError`` when there is no fwd+bwd row, when the rows come from
    several processes (``process``), or when no pair is left."""
    fwdbwd = [r for r in rows if r.get("mode") == "fwdbwd"]
    if not fwdbwd:
        raise ValueError(f"no fwd+bwd rows (mode 'fwdbwd') among its {len(rows)} rows")
    processes = sorted({str(r.get("process")) for r in fwdbwd})
    if len(processes) > 1:
        raise ValueError(f"rows of {len(processes)} processes {processes}: ratios are only taken within one")
    shape = _shape(fwdbwd[0])
    pairs, skipped = [], []
    for pair in fwdbwd_ratios(rows):  # (the ratios of the table of bench_kernels.py's <name>.md)
        if pair["shape"] != shape:
            continue
        if pair["missing"]:
            skipped.append(f"{pair['op']} / {pair['fla_op']} (no row of {' or '.join(pair['missing'])})")
            continue
        device = pair["graph_ratio"] is not None
        pairs.append(dict(op=pair["op"], fla_op=pair["fla_op"], window=pair["window"],
                          time_ratio=pair["graph_ratio"] if device else pair["eager_ratio"], device=device,
                          target=pair["target"], mem_ratio=pair["mem_ratio"]))
    if not pairs:
        raise ValueError(f"no Falcon op with its fla counterpart in the fwd+bwd rows at B, T, H, K, V = {shape}: "
                         + "; ".join(skipped))
    return shape, pairs, skipped


def _bars(ax, values, limits, labels):
    """Bars of ``values``, green within their limit (``None``: none), red past it, each value written on top."""
    colors = ["C0" if lim is None else "C2" if v <= lim else "C3" for v, lim in zip(values, limits)]
    ax.bar(range(len(values)), values, color=colors, width=0.6)
    for i, v in enumerate(values):  # inside the bar's top, clear of the target marks
        ax.annotate(f"{v:.2f}", (i, v), ha="center", va="top", fontsize=8, color="white", xytext=(0, -3),
                    textcoords="offset points")
    ax.set_xticks(range(len(values)))
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.grid(axis="y", alpha=0.3)


def _label(pair: dict, eager_mark: bool) -> str:
    window = f" (window {pair['window']})" if pair["window"] else ""
    return f"{pair['op']}{window}{' *' if eager_mark else ''}\nvs {pair['fla_op']}"


def plot_ratios(rows: List[dict], path, gpu: Optional[str] = None) -> Optional[Path]:
    """Draw :func:`pair_ratios` of ``rows`` into the PNG ``path`` (its folder created): time ratios with the
    targets, peak-memory ratios with the 1.1x line; the title names the shape, ``gpu`` (else the rows'
    ``gpu``, if any) and the rows' commit. Prints the skipped pairs. Returns ``path``, or ``None`` (drawing
    nothing) without matplotlib; raises ``ValueError`` as :func:`pair_ratios` does."""
    from falcon_fwa.atomic import atomic_path
    from falcon_fwa.plotting import pyplot

    shape, pairs, skipped = pair_ratios(rows)
    if skipped:
        print(f"plot: skipped {len(skipped)} pair(s): " + "; ".join(skipped))
    plt = pyplot()
    if plt is None:
        return None
    mixed = any(p["device"] for p in pairs) and not all(p["device"] for p in pairs)
    labels = [_label(p, eager_mark=mixed and not p["device"]) for p in pairs]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(13, 5.2))
    _bars(ax_t, [p["time_ratio"] for p in pairs], [p["target"] for p in pairs], labels)
    marked = [(i, p["target"]) for i, p in enumerate(pairs) if p["target"] is not None]
    for n, (i, target) in enumerate(marked):
        ax_t.hlines(target, i - 0.4, i + 0.4, colors="k", linestyles="--", lw=1.2, label=None if n else "target")
    clock = ("CUDA-graph device time" if all(p["device"] for p in pairs) else
             "eager medians" if not mixed else "device time; * eager medians")
    ax_t.set_ylabel(f"Falcon / fla time ({clock})")
    ax_t.set_title("time ratio (green: within target)")
    if ax_t.get_legend_handles_labels()[0]:
        ax_t.legend(fontsize=8, loc="upper left")
    _bars(ax_m, [p["mem_ratio"] for p in pairs], [PEAK_TARGET] * len(pairs), labels)
    ax_m.axhline(PEAK_TARGET, color="k", ls="--", lw=1.2, label=f"{PEAK_TARGET}x")
    ax_m.set_ylabel("Falcon / fla peak memory")
    ax_m.set_title(f"peak-memory ratio (green: within {PEAK_TARGET}x)")
    ax_m.legend(fontsize=8, loc="upper left")
    gpu = gpu or next((r["gpu"] for r in rows if r.get("gpu")), None)
    commits = sorted({str(r["commit"])[:12] for r in rows if r.get("commit")})  # full hashes in the rows; short in a title
    where = ([gpu] if gpu else []) + ([f"commit {', '.join(commits)}"] if commits else [])
    B, T, H, K, V = shape
    fig.suptitle(f"Falcon vs flash-linear-attention, bf16 fwd+bwd, B={B} T={T} H={H} K={K} V={V}"
                 + (f"\n{'; '.join(where)}" if where else ""), fontsize=10)
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("rows", metavar="ROWS.json", help="the rows of one process (bench_kernels.py's <name>.json)")
    p.add_argument("--out", metavar="PNG", default=None, help="the plot (default: ROWS.json's path with .png)")
    p.add_argument("--gpu", default=None, help="the GPU named in the title (rows do not record it)")
    args = p.parse_args(argv)
    try:
        with open(args.rows) as f:
            rows = json.load(f)
    except (OSError, ValueError) as e:
        p.error(f"ROWS.json {args.rows}: cannot read it: {e}")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        p.error(f"ROWS.json {args.rows}: not a JSON list of rows (bench_kernels.py's <name>.json)")
    out = args.out or str(Path(args.rows).with_suffix(".png"))
    try:
        written = plot_ratios(rows, out, gpu=args.gpu)
    except ValueError as e:
        p.error(f"ROWS.json {args.rows}: {e}")
    except KeyError as e:
        p.error(f"ROWS.json {args.rows}: a row has no {e} (not bench_kernels.py's <name>.json?)")
    if written is None:
        raise SystemExit(1)
    print(f"wrote {written}")


if __name__ == "__main__":
    main()
