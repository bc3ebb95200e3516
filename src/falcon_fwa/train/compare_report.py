"""Tables and plots of a ``compare`` run: ``python -m falcon_fwa.train.compare_report
runs/compare/compare.json results/lm/small`` writes ``small.json`` (rows: model, params, tokens,
val_ppl, tokens_per_s, peak_mem_bytes), ``small_table.md`` and ``small_loss.png``."""
from __future__ import annotations

import json
import os
import sys

from .compare import plot_curves, result_rows


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
