"""What is alive at the peak of one forward+backward call, by the line that allocated it.

For each op of ``bench_kernels.OPS`` (same inputs, same shape), the CUDA caching allocator's
history is recorded over one forward+backward call (after a warm-up call that compiles the
kernels); the trace is replayed to find the moment of the peak, and the blocks alive then are
grouped by the innermost frame of this package (or of fla) that allocated them. Inputs and
the upstream gradient are allocated before the recording and are not counted, as in
``bench_kernels.measure``: the total is the figure its ``peak_mem_bytes`` reports.

    python benchmarks/memory_breakdown.py --ops falcon-2 fla-gated-delta-rule --allow-fla-gated --out OUT

Writes ``OUT/memory_breakdown.json`` (a list of ``{op, shape, peak_bytes, groups: [{where,
bytes, blocks}], commit, dirty}``, or ``{op, shape, error, commit, dirty}`` for an op that failed: the others still
run; ``commit`` and ``dirty``: the full commit of the falcon_fwa checkout that runs and whether it had uncommitted
changes to tracked files, as ``bench_kernels.source`` gives them) and prints the groups of each op, largest first.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections import defaultdict
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import OPS, SHAPES, _atomic_write, failure, lift_fla_gated_guard, recovered, source  # noqa: E402

_OURS = (os.sep + "falcon_fwa" + os.sep, os.sep + "fla" + os.sep)


def _where(frames: List[dict]) -> str:
    """The innermost frame inside falcon_fwa or fla (``file:line function``), else the innermost Python frame."""
    for f in frames:
        name = f.get("filename", "")
        if any(p in name for p in _OURS):
            tail = name.split(os.sep + "falcon_fwa" + os.sep)[-1] if "falcon_fwa" in name else name.split(
                os.sep + "fla" + os.sep)[-1]
            return f"{tail}:{f.get('line')} {f.get('name')}"
    for f in frames:
        if f.get("filename", "").endswith(".py"):
            return f"{os.path.basename(f['filename'])}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(trace: List[dict]) -> (int, Dict[int, dict]):
    """Replay allocator events: the peak of live bytes and the blocks alive at it."""
    live: Dict[int, dict] = {}
    cur = peak = 0
    at_peak: Dict[int, dict] = {}
    for e in trace:
        act = e["action"]
        if act == "alloc":
            live[e["addr"]] = e
            cur += e["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif act in ("free_requested",) and e["addr"] in live:
            cur -= live.pop(e["addr"])["size"]
    return peak, at_peak


def breakdown(name: str, shape) -> dict:
    fn, leaves = OPS[name](*shape)
    do = torch.randn_like(fn().detach())
    fn().backward(do)  # compile and autotune outside the record
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    fn().backward(do)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, alive = live_at_peak(trace)
    groups: Dict[str, dict] = defaultdict(lambda: dict(bytes=0, blocks=0))
    for e in alive.values():
        g = groups[_where(e.get("frames", []))]
        g["bytes"] += e["size"]
        g["blocks"] += 1
    rows = sorted(({"where": k, **v} for k, v in groups.items()), key=lambda r: -r["bytes"])
    for t in leaves:
        t.grad = None
    del fn, leaves, do
    torch.cuda.empty_cache()
    return dict(op=name, shape=list(shape), peak_bytes=peak, groups=rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", required=True, help=f"ops of bench_kernels ({', '.join(OPS)})")
    p.add_argument("--shape", type=int, default=0, help="index into bench_kernels.SHAPES")
    p.add_argument("--out", default=".")
    p.add_argument("--allow-fla-gated", action="store_true",
                   help="lift fla's refusal of its gated backward on Triton 3.4-3.7.0 (as in bench_kernels.py; "
                        "its memory stands, its gradients are not checked)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("memory_breakdown.py needs a CUDA GPU")
    if a.allow_fla_gated:
        try:
            lift_fla_gated_guard()
        except Exception as e:  # fla missing or broken: its ops fail below, reported, and the others run
            print(f"--allow-fla-gated: fla not importable: {failure(e)}", flush=True)
    for name in a.ops:
        if name not in OPS:
            sys.exit(f"--ops: unknown op {name!r}; choose from {', '.join(OPS)}")
    os.makedirs(a.out, exist_ok=True)
    recorded = source(None)  # the code that is measured, as the run starts
    results = []
    for name in a.ops:
        try:
            r = breakdown(name, SHAPES[a.shape])
        except Exception as e:  # one failing op (fla missing, out of memory) must not lose the others
            with contextlib.suppress(Exception):
                torch.cuda.memory._record_memory_history(enabled=None)
            r = dict(op=name, shape=list(SHAPES[a.shape]), error=recovered(e))
            print(f"{name}: failed: {r['error']}", flush=True)
        else:
            print(f"{name}: peak {r['peak_bytes'] / 2**20:.0f} MiB above the inputs", flush=True)
            for g in r["groups"]:
                print(f"  {g['bytes'] / 2**20:8.1f} MiB  x{g['blocks']:<3d} {g['where']}", flush=True)
        results.append({**r, **recorded})
        _atomic_write(os.path.join(a.out, "memory_breakdown.json"), json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
