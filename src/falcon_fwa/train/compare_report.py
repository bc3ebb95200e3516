"""Tables and plots of a ``compare`` run: ``python -m falcon_fwa.train.compare_report
runs/compare/compare.json results/lm/small`` writes ``small.json`` (rows: model, params, tokens,
val_ppl, tokens_per_s, peak_mem_bytes), ``small_table.md`` and ``small_loss.png``."""
from __future__ import annotations

import json
import os
import sys


def plot_curves(runs: dict, path: str, *, title: str = "") -> None:
    """Training loss (lines) and validation loss (markers) against tokens, one colour per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, run) in enumerate(runs.items()):
        log = run.get("log", [])
        logged = [r for r in log if "loss" in r and "tokens" in r]
        train = [(r["tokens"], r["loss"]) for r in logged]
        tokens_per_step = logged[0]["tokens"] / logged[0]["step"] if logged else 1
        val = [(r["step"] * tokens_per_step, r["val_loss"]) for r in log if "val_loss" in r]
        color = f"C{i}"
        if train:
            ax.plot(*zip(*train), color=color, lw=1.2, label=name)
        if val:
            ax.plot(*zip(*val), color=color, ls="none", marker="o", ms=4)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats/token): lines train, dots validation")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def result_rows(report: dict) -> list:
    """``results/lm/small.json`` rows: model, params, tokens, val_ppl, tokens_per_s, peak_mem_bytes."""
    rows = []
    for name, run in report["runs"].items():
        rows.append({"model": name, "params": run.get("params"), "tokens": run.get("tokens"),
                     "val_ppl": run.get("val_ppl"), "tokens_per_s": run.get("tokens_per_s"),
                     "peak_mem_bytes": run.get("peak_mem_bytes"), "error": run.get("error")})
    return rows


def markdown_table(rows: list) -> str:
    lines = ["| model | params | tokens | val ppl | tokens/s | peak memory |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | failed: {r['error'][:80]} | | | | |")
            continue
        mem = f"{r['peak_mem_bytes'] / 2**30:.2f} GiB" if r.get("peak_mem_bytes") else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        lines.append(f"| {r['model']} | {r['params']:,} | {r['tokens']:,} | {r['val_ppl']:.3f} | {tps} | {mem} |")
    falcon = [r for r in rows if r["model"].startswith("Falcon") and r.get("val_ppl")]
    base = [r for r in rows if not r["model"].startswith("Falcon") and r.get("val_ppl")]
    if falcon and base:
        f, b = min(falcon, key=lambda r: r["val_ppl"]), min(base, key=lambda r: r["val_ppl"])
        gap = (f["val_ppl"] / b["val_ppl"] - 1) * 100
        verdict = "at or below" if gap <= 0 else f"{gap:.1f}% above"
        lines.append(f"\nBest Falcon ({f['model']}, {f['val_ppl']:.3f}) is {verdict} the best baseline "
                     f"({b['model']}, {b['val_ppl']:.3f}).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f:
        report = json.load(f)
    rows = result_rows(report)
    prefix = argv[1]
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    with open(prefix + ".json", "w") as f:
        json.dump(rows, f, indent=1)
    with open(prefix + "_table.md", "w") as f:
        f.write(markdown_table(rows))
    plot_curves(report["runs"], prefix + "_loss.png", title=f"{len(rows)} models, {report.get('steps')} steps")
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
