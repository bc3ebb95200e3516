"""Tables and plots of a ``compare`` run: ``python -m falcon_fwa.train.compare_report
runs/compare/compare.json results/lm/small`` writes ``small.json`` (rows: model, status, steps,
params, tokens, val_ppl, tokens_per_s, peak_mem_bytes, commit, dirty, diff_sha256), ``small_table.md`` and
``small_loss.png``.
The table ends with the commits the runs trained at (their ``commit``, with whether its checkout had uncommitted
changes to tracked files: ``dirty``) and the commit of the code that wrote it, with whether that checkout had
uncommitted changes (:func:`falcon_fwa.provenance.command_provenance`).

A ``compare.json`` of a command that was stopped early reads too: recipes that trained only
part of the steps (``partial``) are shown with their step count and left out of the verdict
(they saw fewer tokens); those that did not finish are listed with their status."""
from __future__ import annotations

import argparse
import json
import os
from typing import Optional

from ..atomic import atomic_path, write_json, write_text
from ..plotting import pyplot
from ..provenance import command_provenance, uncommitted_note, written_at_line


def plot_curves(runs: dict, path: str, *, title: str = "") -> None:
    """Training loss (lines) and validation loss (markers) against tokens, one colour per run; nothing (and a
    line saying so) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (name, run) in enumerate(runs.items()):
        log = run.get("log", [])
        logged = [r for r in log if "loss" in r and "tokens" in r]
        train = [(r["tokens"], r["loss"]) for r in logged]
        tokens_per_step = logged[0]["tokens"] / logged[0]["step"] if logged else 1
        val = [(r["step"] * tokens_per_step, r["val_loss"]) for r in log if "val_loss" in r]
        color = f"C{i}"
        label = name if run.get("status", "done") == "done" else f"{name} ({run['status']})"
        if train:
            ax.plot(*zip(*train), color=color, lw=1.2, label=label)
        if val:
            ax.plot(*zip(*val), color=color, ls="none", marker="o", ms=4)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("loss (nats/token): lines train, dots validation")
    if title:
        ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130)
    plt.close(fig)


def result_rows(report: dict) -> list:
    """Rows: model, status, steps, planned_steps, params, tokens, val_ppl, tokens_per_s,
    peak_mem_bytes, error, commit (the one the run trained at, ``None`` where its result names none), dirty
    (whether that checkout had uncommitted changes to tracked files; ``None`` where unknown, as in the result of a
    run trained before summaries recorded it), diff_sha256 (the fingerprint of those changes,
    :func:`falcon_fwa.provenance.uncommitted_changes`: runs of one commit with the same are of the same code;
    ``None`` where unknown); one per recipe of ``report["configs"]``, in that order."""
    runs = report.get("runs", {})
    statuses = report.get("status", {})
    rows = []
    for name in report.get("configs", runs):
        run = runs.get(name, {})
        status = statuses.get(name, run.get("status", "done" if run else "pending"))
        rows.append({"model": name, "status": status, "steps": run.get("steps"),
                     "planned_steps": run.get("planned_steps", report.get("steps")), "params": run.get("params"),
                     "tokens": run.get("tokens"), "val_ppl": run.get("val_ppl"),
                     "tokens_per_s": run.get("tokens_per_s"), "peak_mem_bytes": run.get("peak_mem_bytes"),
                     "error": run.get("error"), "commit": run.get("commit"), "dirty": run.get("dirty"),
                     "diff_sha256": run.get("diff_sha256")})
    return rows


def _cell(text: str) -> str:
    """``text`` as one markdown table cell: a ``|`` escaped, line ends as spaces (an error's traceback
    line or a name's ``|`` would otherwise cut the row)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _count(n) -> str:
    """A step count for the table: ``n`` with thousands separators, ``?`` where unknown (``None``, as in a
    hand-edited or older ``compare.json``)."""
    return "?" if n is None else f"{n:,}"


def _changes_note(row: dict) -> str:
    """What follows a run's commit in the table's closing line: :func:`falcon_fwa.provenance.uncommitted_note` of
    its ``dirty`` (nothing where ``None``), and for a run with changes their fingerprint, where recorded."""
    if row.get("dirty") is None:
        return ""
    note = uncommitted_note(row["dirty"])
    if row["dirty"] and row.get("diff_sha256"):
        note += f" (diff_sha256 `{row['diff_sha256'][:12]}`)"
    return note


def _provenance_lines(rows: list, provenance: Optional[dict]) -> list:
    """The table's closing lines: the commits the rows' runs trained at, each followed by
    :func:`falcon_fwa.provenance.uncommitted_note` where runs of it trained with uncommitted changes to tracked
    files and the first 12 hex digits of those changes' ``diff_sha256`` where the run recorded it (a commit of
    clean and edited runs is named twice, one of runs with different changes once per change; a run whose result
    does not say, ``dirty`` ``None``, adds no note), and (with ``provenance``, as
    :func:`falcon_fwa.provenance.command_provenance` gives it) the commit that wrote the table, dirty or not
    (:func:`falcon_fwa.provenance.written_at_line`)."""
    trained = sorted({(r["commit"], _changes_note(r)) for r in rows if r.get("commit")})
    lines = [f"Runs trained at commit {', '.join(f'`{c}`{note}' for c, note in trained)}."] if trained else []
    if provenance is not None:
        lines.append(written_at_line(provenance, "Table"))
    return ["", *lines] if lines else []


def markdown_table(rows: list, provenance: Optional[dict] = None) -> str:
    """The table of ``rows`` (:func:`result_rows`), the verdict, the recipes left out and the commits (the runs'
    and, with ``provenance``, the writer's: :func:`_provenance_lines`)."""
    lines = ["| model | status | params | tokens | val ppl | tokens/s | peak memory |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        status, model = r["status"], _cell(r["model"])
        if status in ("partial", "stopped"):
            status = f"{status}: {_count(r.get('steps'))} of {_count(r.get('planned_steps'))} steps"
        if r.get("error"):
            lines.append(f"| {model} | {status}: {_cell(r['error'][:80])} | | | | | |")
            continue
        if r.get("val_ppl") is None and r.get("tokens") is None:
            lines.append(f"| {model} | {status} | | | | | |")
            continue
        mem = f"{r['peak_mem_bytes'] / 2**30:.2f} GiB" if r.get("peak_mem_bytes") else "-"
        tps = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        ppl = "-" if r.get("val_ppl") is None else f"{r['val_ppl']:.3f}"  # (a stopped run not evaluated at its step)
        params = "-" if r.get("params") is None else f"{r['params']:,}"
        tokens = "-" if r.get("tokens") is None else f"{r['tokens']:,}"
        lines.append(f"| {model} | {status} | {params} | {tokens} | {ppl} | {tps} | {mem} |")
    done = [r for r in rows if r["status"] == "done" and r.get("val_ppl")]
    falcon = [r for r in done if r["model"].startswith("Falcon")]
    base = [r for r in done if not r["model"].startswith("Falcon")]
    if falcon and base:
        f, b = min(falcon, key=lambda r: r["val_ppl"]), min(base, key=lambda r: r["val_ppl"])
        gap = (f["val_ppl"] / b["val_ppl"] - 1) * 100
        verdict = "at or below" if gap <= 0 else f"{gap:.1f}% above"
        lines.append(f"\nBest Falcon ({f['model']}, {f['val_ppl']:.3f}) is {verdict} the best baseline "
                     f"({b['model']}, {b['val_ppl']:.3f}).")
    left_out = [r["model"] for r in rows if r["status"] != "done"]
    if left_out:
        lines.append(f"\nNot in the comparison (fewer or no tokens trained): {', '.join(left_out)}.")
    lines += _provenance_lines(rows, provenance)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from ..cli import run_command

    parser = argparse.ArgumentParser(prog="python -m falcon_fwa.train.compare_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="the compare.json of a falcon-fwa compare")
    parser.add_argument("prefix", help="writes PREFIX.json, PREFIX_table.md and PREFIX_loss.png")
    return run_command(parser.prog, _report, parser.parse_args(argv))


def _report(args: argparse.Namespace) -> int:
    with open(args.results) as f:
        try:
            report = json.load(f)
        except ValueError as err:
            raise ValueError(f"{args.results} is not a compare.json: {err}") from None
    if not isinstance(report, dict) or not isinstance(report.get("runs"), dict):
        raise ValueError(f"{args.results} is not a compare.json (no runs by name)")
    rows = result_rows(report)
    prefix = args.prefix
    os.makedirs(os.path.dirname(prefix) or ".", exist_ok=True)
    write_json(prefix + ".json", rows)
    table = markdown_table(rows, command_provenance(args))
    write_text(prefix + "_table.md", table)
    planned = {r["planned_steps"] for r in rows if r["planned_steps"] is not None}  # (one count: see compare)
    steps = report.get("steps") or (planned.pop() if len(planned) == 1 else None)
    plot_curves(report.get("runs", {}), prefix + "_loss.png", title=f"{len(rows)} models, {steps} steps")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
