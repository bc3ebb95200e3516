"""Launch-setting sweep of one kernel table, measured inside one Falcon op's forward+backward.

For every kernel named in ``--kernels`` of the table ``--table`` (a dict of per-kernel
``dict(BK=, BV=, num_warps=, num_stages=)`` settings, given as ``module.ATTR`` or
``module.ATTR.key`` under ``falcon_fwa.ops.triton``), each candidate setting replaces that
kernel's entry while the others keep theirs. The op (``bench_kernels.OPS``, at the first
benchmark shape or at ``--shape``) then runs forward+backward: the kernel's device time (mean of ``--calls``
calls under ``torch.profiler``), the op's total device time, and ``err``, the largest relative
(Frobenius) difference of its output and input gradients from those of the table as it was.

    python benchmarks/sweep_launch.py --op falcon-3 --table delta.SCALAR_LAUNCH.grouped \\
        --kernels output_fwd dqk_bwd --out OUT
    python benchmarks/sweep_launch.py --op falcon-1 --table delta.FULL_K_16BIT --kernels state_fwd state_bwd \\
        --candidates 128,64,4,2 128,32,4,2 --out OUT      # the full-key kernels: BK is ignored
    python benchmarks/sweep_launch.py --op falcon-1 --table delta.WY_FWD_LAUNCH.16bit --kernels wy_apply \\
        --candidates 64,64,4,2 128,64,4,3 64,128,4,3 --out OUT   # bf16: the inverse and its product, two launches
    python benchmarks/sweep_launch.py --op falcon-1 --table step_sizes.LAUNCH --kernels step_fwd step_bwd \\
        --candidates BR=32 BR=128,num_warps=8 BK=64 --out OUT   # named keys of the kernel's own entry

Prints one line per setting and ``PICK``: per kernel, the fastest setting with ``err < 1e-3``
that is at least 3 % faster than the table's own; writes ``OUT/sweep_<op>.json`` (``{op, table, default, base_ms,
rows, pick, commit, dirty}``; ``commit`` and ``dirty``: the full commit of the falcon_fwa checkout that runs and
whether it had uncommitted changes to tracked files, as ``bench_kernels.source`` gives them).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import OPS, SHAPES, source  # noqa: E402

CANDIDATES = [  # (BK, BV, num_warps, num_stages)
    (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 4, 2),
    (64, 128, 4, 2), (128, 64, 8, 2), (64, 128, 8, 2), (128, 128, 8, 2),
]


def resolve(path: str) -> dict:
    """``module.ATTR[.key]`` under ``falcon_fwa.ops.triton`` -> that dict."""
    parts = path.split(".")
    try:
        table = getattr(importlib.import_module(f"falcon_fwa.ops.triton.{parts[0]}"), parts[1])
        for key in parts[2:]:
            table = table[key]
    except (ImportError, AttributeError, IndexError, KeyError, TypeError) as e:
        raise SystemExit(f"--table {path}: not module.ATTR[.key] under falcon_fwa.ops.triton "
                         f"({type(e).__name__}: {e})")
    if not isinstance(table, dict):
        raise SystemExit(f"--table {path}: not a dict of kernel settings")
    return table


def run(op: str, calls: int, shape: tuple = SHAPES[0]):
    """Output and gradients of one call at ``shape`` ``(B, T, H, K, V)``, then the mean device ms per
    kernel name over ``calls``."""
    from torch.profiler import ProfilerActivity, profile
    torch.manual_seed(0)  # the same inputs and upstream gradient for every setting
    fn, leaves = OPS[op](*shape)
    out = fn()
    do = torch.randn_like(out.detach())
    out.backward(do)
    ref = [out.detach().float()] + [t.grad.detach().float().clone() for t in leaves]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            for t in leaves:
                t.grad = None
            fn().backward(do)
        torch.cuda.synchronize()
    times: Dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            times[e.key] = times.get(e.key, 0.0) + us / calls / 1e3
    del fn, leaves
    torch.cuda.empty_cache()
    return ref, times


def parse_candidate(text: str):
    """``"BK,BV,WARPS,STAGES"`` -> four positive ints, or ``"KEY=N,KEY=N"`` -> a dict of positive ints
    (``--candidates``; the second form changes the named keys of the kernel's own entry, e.g.
    ``BR=32,num_warps=8`` for a table whose entries name other blocks than ``BK``, ``BV``)."""
    parts = text.split(",")
    if "=" in text:
        try:
            named = {k.strip(): int(v) for k, v in (part.split("=") for part in parts)}
        except ValueError:
            named = {}
        if not named or min(named.values()) < 1 or not all(k.isidentifier() for k in named):
            raise SystemExit(f"--candidates: {text!r} is not KEY=N,KEY=N,... (positive integers)")
        return named
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        values = ()
    if len(values) != 4 or min(values) < 1:
        raise SystemExit(f"--candidates: {text!r} is not BK,BV,WARPS,STAGES (four positive integers)")
    return values


def setting_of(candidate, own: dict) -> dict:
    """The kernel entry a parsed candidate stands for: four values replace the entry, named keys
    change the entry's own (``own``), whose other keys stay."""
    if isinstance(candidate, dict):
        unknown = set(candidate) - set(own)
        if unknown:
            raise SystemExit(f"--candidates: {sorted(unknown)} not in the kernel's entry {own}")
        return dict(own, **candidate)
    BK, BV, warps, stages = candidate
    return dict(BK=BK, BV=BV, num_warps=warps, num_stages=stages)


def rel(a: List[torch.Tensor], b: List[torch.Tensor]) -> float:
    return max(float((x - y).norm() / y.norm().clamp_min(1e-30)) for x, y in zip(a, b))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", required=True, help=f"one of {', '.join(OPS)}")
    p.add_argument("--table", required=True, help="module.ATTR[.key] under falcon_fwa.ops.triton")
    p.add_argument("--kernels", nargs="+", required=True)
    p.add_argument("--candidates", nargs="+", default=None, metavar="BK,BV,WARPS,STAGES",
                   help="the settings to try (default: CANDIDATES), or KEY=N,... to change named keys")
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--shape", nargs=5, type=int, default=list(SHAPES[0]), metavar=("B", "T", "H", "K", "V"),
                   help=f"the op's shape (default: the first benchmark shape, {SHAPES[0]})")
    p.add_argument("--out", default=".")
    a = p.parse_args(argv)
    if a.op not in OPS:
        p.error(f"--op: unknown {a.op!r}; choose from {', '.join(OPS)}")
    if a.calls < 1:
        p.error(f"--calls must be at least 1, got {a.calls}")
    if min(a.shape) < 1:
        p.error(f"--shape sizes must be at least 1, got {a.shape}")
    try:  # every argument checked before the GPU is asked for (resolve and the candidates name their option)
        table = resolve(a.table)
        candidates = CANDIDATES if a.candidates is None else [parse_candidate(c) for c in a.candidates]
        for k in a.kernels:
            if k not in table:
                raise SystemExit(f"--kernels: {k!r} is not in {a.table} ({', '.join(table)})")
            for candidate in candidates:
                setting_of(candidate, dict(table[k]))
    except SystemExit as e:
        p.error(str(e.code))
    if not torch.cuda.is_available():
        sys.exit("sweep_launch.py needs a CUDA GPU")
    os.makedirs(a.out, exist_ok=True)
    recorded = source(None)  # the code that is timed, as the run starts
    start = time.time()
    shape = tuple(a.shape)
    ref, base = run(a.op, a.calls, shape)
    total = sum(base.values())
    print(f"default {json.dumps({k: table[k] for k in a.kernels})} " +
          " ".join(f"{k}={base.get(k, 0):.3f}" for k in a.kernels) + f" total={total:.3f}", flush=True)
    rows, pick = [], {}
    for kernel in a.kernels:
        own = dict(table[kernel])
        best = (base.get(kernel, 0.0) * 0.97, None)
        for candidate in candidates:
            setting = setting_of(candidate, own)
            if setting == own:
                continue
            table[kernel] = setting
            try:
                got, times = run(a.op, a.calls, shape)
                err, ms = rel(got, ref), times.get(kernel, float("nan"))
            except Exception as e:  # a setting that does not compile or fit (shared memory)
                err, ms, times = float("nan"), float("nan"), {}
                print(f"{kernel} {setting}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            finally:
                table[kernel] = own
            rows.append(dict(kernel=kernel, **setting, ms=ms, total=sum(times.values()), err=err))
            print(f"{kernel} {setting}: {ms:.3f} ms (default {base.get(kernel, 0):.3f}) "
                  f"total={sum(times.values()):.3f} err={err:.1e} [{time.time() - start:.0f}s]", flush=True)
            if err < 1e-3 and ms < best[0]:
                best = (ms, setting)
        if best[1] is not None:
            pick[kernel] = best[1]
    print("PICK " + json.dumps(pick), flush=True)
    with open(os.path.join(a.out, f"sweep_{a.op}.json"), "w") as f:
        json.dump(dict(op=a.op, table=a.table, default={k: table[k] for k in a.kernels}, base_ms=base, rows=rows,
                       pick=pick, **recorded), f, indent=1)
    print(f"done in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
