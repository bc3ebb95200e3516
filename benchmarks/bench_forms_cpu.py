"""CPU timings of the three forms of every rule, side by side in one process.

    python benchmarks/bench_forms_cpu.py --out benchmarks/results --name cpu_forms --overwrite   # renews the record

For each rule and each ``T`` (default 512, 2048, 8192) this times the recurrent,
parallel and chunk forms of ``falcon_attention`` in float32 at ``B=1, H=2,
K=V=64`` (window 4, chunk 64): ``fwd`` under ``torch.no_grad()`` and ``fwdbwd``
(forward plus backward of the output against a fixed upstream gradient, with
gradients for q, k, v, beta and lam). Each cell is the median of up to
``--repeats`` calls (fewer when one call is slow, at least one), after one
untimed warm-up call when a call is quick.

A cell is skipped, and the table says why, when its predicted memory exceeds
``--memory-limit-gib`` (the parallel form holds ``O(T^2)`` matrices, one per value
column for rule 2) or its time, extrapolated from the same cell at the previous
``T`` (linearly for the recurrent and chunk forms, quadratically for the parallel
form), exceeds ``--time-limit`` seconds per call.

Writes ``<out>/<name>.json`` (after every cell, so a crash loses nothing; ``commit`` and ``dirty``: the full
commit of the falcon_fwa checkout that is timed and whether it had uncommitted changes to tracked files, as
``falcon_fwa.provenance.command_provenance`` gives them, ``"unknown"`` and ``null`` outside a checkout; the
machine's ``commit`` says the same in words) and
``<out>/<name>.md`` (the tables, machine, versions and commit), and prints the
chunk-over-recurrent speedups and the chunk form's growth ratio between the two
largest ``T``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Dict, List, Optional

import torch
from tqdm import tqdm

from falcon_fwa import falcon_attention
from falcon_fwa.ops import RULES
from falcon_fwa.provenance import command_provenance, committed_files, uncommitted_note

FORMS = ("recurrent", "parallel", "chunk")
MODES = ("fwd", "fwdbwd")
SPEEDUP_TARGET = 10.0  # chunk over recurrent, fwd+bwd, rules 1 and 1A at T = 2048


def _atomic_write(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _machine(args: argparse.Namespace, provenance: Optional[Dict] = None) -> Dict[str, str]:
    """The machine, the versions and the commit of the falcon_fwa code that runs (:func:`command_provenance`'s full
    commit, with :func:`uncommitted_note` when its checkout had uncommitted changes to tracked files; "unknown"
    outside a git checkout), from ``provenance`` (taken now if not given)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    if provenance is None:  # the falcon_fwa checkout that is timed, whatever the working directory
        provenance = command_provenance(args)
    commit = provenance["commit"]
    commit = commit + uncommitted_note(provenance["dirty"]) if commit else "unknown"
    return {"cpu": cpu, "cores": str(os.cpu_count()), "threads": str(torch.get_num_threads()),
            "torch": torch.__version__, "python": platform.python_version(), "commit": commit}


def _inputs(rule: str, B: int, T: int, H: int, D: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g) / D ** 0.5
    k = torch.randn(B, T, H, D, generator=g) / D ** 0.5
    v = torch.randn(B, T, H, D, generator=g)
    beta = 0.05 + 1.9 * torch.rand(B, T, H, *((D,) if RULES[rule].per_column else ()), generator=g)
    lam = torch.rand(B, T, H, generator=g)
    cot = torch.randn(B, T, H, D, generator=g)
    return [t.requires_grad_() for t in (q, k, v, beta, lam)], cot


def _parallel_bytes(rule: str, B: int, T: int, H: int, D: int, window: int) -> float:
    """Rough peak of the parallel form with backward: a few [Vd, TW, TW] matrices
    (the triangular system) and [Vd, T, TW] scores per head, float32."""
    spec = RULES[rule]
    W = window if spec.sliding else 1
    Vd = D if spec.per_column else 1
    n = T * W
    square = n * n * (5 if spec.regression else 0)
    return 4.0 * B * H * Vd * (square + 4 * T * n)


def _time_cell(fn, predicted: Optional[float], repeats: int, budget: float) -> List[float]:
    if predicted is None or predicted < 2.0:
        fn()  # warm-up
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < repeats and (not times or time.perf_counter() - start + times[-1] <= budget):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _make_call(rule, form, mode, leaves, cot, options):
    def call():
        if mode == "fwd":
            with torch.no_grad():
                falcon_attention(*leaves, rule=rule, form=form, **options)
        else:
            for t in leaves:
                t.grad = None
            o, _ = falcon_attention(*leaves, rule=rule, form=form, **options)
            o.backward(cot)
    return call


def run(args: argparse.Namespace) -> Dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    B, H, D = args.batch, args.heads, args.head_dim
    options = dict(window=args.window, chunk_size=args.chunk_size)
    provenance = command_provenance(args)  # the code that is timed, as the run starts
    report = {"commit": provenance["commit"] or "unknown", "dirty": provenance["dirty"],
              "machine": _machine(args, provenance),
              "shape": {"B": B, "H": H, "K": D, "V": D, "window": args.window, "chunk_size": args.chunk_size,
                        "dtype": "float32"},
              "limits": {"time_s_per_call": args.time_limit, "memory_gib": args.memory_limit_gib,
                         "repeats": args.repeats},
              "cells": []}
    cells = [(r, T, f, m) for r in args.rules for T in args.seq_lens for f in FORMS for m in MODES]
    last: Dict[tuple, tuple] = {}  # (rule, form, mode) -> (T, median seconds)
    for rule, T, form, mode in tqdm(cells, desc="cells", unit="cell"):
        cell = {"rule": rule, "T": T, "form": form, "mode": mode}
        predicted = None
        if (rule, form, mode) in last:
            T0, s0 = last[(rule, form, mode)]
            predicted = s0 * (T / T0) ** (2 if form == "parallel" else 1)
        mem = _parallel_bytes(rule, B, T, H, D, args.window) if form == "parallel" else 0.0
        if mem > args.memory_limit_gib * 2 ** 30:
            cell["skipped"] = f"predicted memory {mem / 2 ** 30:.1f} GiB > {args.memory_limit_gib:g} GiB"
        elif predicted is not None and predicted > args.time_limit:
            cell["skipped"] = f"predicted {predicted:.0f} s per call > {args.time_limit:g} s"
        else:
            leaves, cot = _inputs(rule, B, T, H, D, seed=T)
            times = _time_cell(_make_call(rule, form, mode, leaves, cot, options), predicted, args.repeats,
                               args.cell_budget)
            cell["times_s"] = times
            cell["median_s"] = statistics.median(times)
            last[(rule, form, mode)] = (T, cell["median_s"])
        report["cells"].append(cell)
        _write(report, args)
    _write(report, args)
    return report


def _write(report: Dict, args: argparse.Namespace) -> None:
    """Both files, from the cells timed so far (a killed run leaves a table of what it timed, never
    the table of an earlier run beside its own cells)."""
    report["summary"] = _summary(report, args)
    _atomic_write(os.path.join(args.out, args.name + ".json"), json.dumps(report, indent=1))
    _atomic_write(os.path.join(args.out, args.name + ".md"), _markdown(report, args))


def _median(report, rule, T, form, mode) -> Optional[float]:
    for c in report["cells"]:
        if (c["rule"], c["T"], c["form"], c["mode"]) == (rule, T, form, mode):
            return c.get("median_s")
    return None


def _summary(report, args) -> Dict:
    Ts = sorted(args.seq_lens)
    out = {"speedup_chunk_over_recurrent": {}, "chunk_growth": {}}
    for rule in args.rules:
        for mode in MODES:
            for T in Ts:
                r, c = _median(report, rule, T, "recurrent", mode), _median(report, rule, T, "chunk", mode)
                if r and c:
                    out["speedup_chunk_over_recurrent"][f"{rule}/{mode}/T={T}"] = r / c
            if len(Ts) >= 2:
                a, b = _median(report, rule, Ts[-2], "chunk", mode), _median(report, rule, Ts[-1], "chunk", mode)
                if a and b:
                    out["chunk_growth"][f"{rule}/{mode}"] = b / a
    return out


def _fmt(seconds: Optional[float], cell: Dict) -> str:
    if seconds is None:
        return "skipped*" if "skipped" in cell else "-"
    return f"{seconds * 1e3:.1f}" if seconds < 100 else f"{seconds * 1e3:.0f}"


def _markdown(report, args) -> str:
    m, s = report["machine"], report["shape"]
    Ts = sorted(args.seq_lens)
    lines = [
        "# CPU timings of the three forms",
        "",
        "Produced by `python benchmarks/bench_forms_cpu.py` in one process. "
        f"float32, B={s['B']}, H={s['H']}, K=V={s['K']}, window={s['window']} (rules 3/3A), "
        f"chunk_size={s['chunk_size']}. Milliseconds per call, median of up to {args.repeats} calls. "
        "`fwd` runs under `torch.no_grad()`; `fwd+bwd` is the forward plus the backward into "
        "q, k, v, beta and lam.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['threads']} torch thread(s); torch {m['torch']}, "
        f"Python {m['python']}; commit {m['commit']}.",
        "",
        "| rule | T | fwd recurrent | fwd parallel | fwd chunk | fwd+bwd recurrent | fwd+bwd parallel "
        "| fwd+bwd chunk | chunk speedup over recurrent (fwd / fwd+bwd) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = {(c["rule"], c["T"], c["form"], c["mode"]): c for c in report["cells"]}
    speed = report["summary"]["speedup_chunk_over_recurrent"]
    for rule in args.rules:
        for T in Ts:
            row = [rule, str(T)]
            for mode in MODES:
                for form in FORMS:
                    c = cells.get((rule, T, form, mode), {})
                    row.append(_fmt(c.get("median_s"), c))
            sp = [speed.get(f"{rule}/{mode}/T={T}") for mode in MODES]
            row.append(" / ".join("-" if x is None else f"{x:.1f}x" for x in sp))
            lines.append("| " + " | ".join(row) + " |")
    skipped = [c for c in report["cells"] if "skipped" in c]
    if skipped:
        lines += ["", "\\* skipped cells:", ""]
        lines += [f"- rule {c['rule']}, T={c['T']}, {c['form']} {c['mode']}: {c['skipped']}" for c in skipped]
    if len(Ts) >= 2:
        growth = report["summary"]["chunk_growth"]
        lines += ["", f"Chunk form growth, time at T={Ts[-1]} over time at T={Ts[-2]} "
                      f"(linear cost gives {Ts[-1] / Ts[-2]:g}):", "",
                  "| rule | fwd | fwd+bwd |", "|---|---|---|"]
        for rule in args.rules:
            g = [growth.get(f"{rule}/{mode}") for mode in MODES]
            lines.append(f"| {rule} | " + " | ".join("-" if x is None else f"{x:.2f}" for x in g) + " |")
    if 2048 in Ts:
        lines += ["", f"Target: chunk at least {SPEEDUP_TARGET:g}x faster than recurrent at T=2048, fwd+bwd, "
                      "rules 1 and 1A:", ""]
        for rule in ("1", "1A"):
            x = speed.get(f"{rule}/fwdbwd/T=2048")
            if x is not None:
                lines.append(f"- rule {rule}: {x:.1f}x ({'met' if x >= SPEEDUP_TARGET else 'NOT met'})")
    return "\n".join(lines) + "\n"


def _print_summary(report, args) -> None:
    print(_markdown(report, args))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=list(RULES))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64, help="K = V")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per cell (at most)")
    p.add_argument("--cell-budget", type=float, default=20.0,
                   help="stop repeating a cell once this many seconds are spent (one call at least)")
    p.add_argument("--time-limit", type=float, default=90.0,
                   help="skip a cell whose predicted time per call exceeds this many seconds")
    p.add_argument("--memory-limit-gib", type=float, default=4.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--name", default="cpu_forms")
    p.add_argument("--overwrite", action="store_true",
                   help="write over NAME.md / NAME.json where git tracks them (the default: the record in "
                        "benchmarks/results)")
    args = p.parse_args(argv)
    committed = [] if args.overwrite else committed_files([os.path.join(args.out, args.name + end)
                                                           for end in (".md", ".json")])
    if committed:
        p.error(f"--out {args.out} --name {args.name} would write over {', '.join(committed)}, which git tracks (the "
                "recorded results): give --out DIR for a run of your own, or --overwrite to renew the record")
    for option, value, least in (("--seq-lens", min(args.seq_lens), 1), ("--batch", args.batch, 1),
                                 ("--heads", args.heads, 1), ("--head-dim", args.head_dim, 1),
                                 ("--window", args.window, 1), ("--chunk-size", args.chunk_size, 1),
                                 ("--repeats", args.repeats, 1), ("--threads", args.threads, 0)):
        if value < least:
            p.error(f"{option} must be at least {least}, got {value}")
    for option, value in (("--cell-budget", args.cell_budget), ("--time-limit", args.time_limit),
                          ("--memory-limit-gib", args.memory_limit_gib)):
        if not value > 0:
            p.error(f"{option} must be positive, got {value}")
    args.seq_lens = list(dict.fromkeys(args.seq_lens))
    args.rules = list(dict.fromkeys(args.rules))
    report = run(args)
    _print_summary(report, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
