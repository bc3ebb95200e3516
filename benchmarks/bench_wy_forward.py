"""The WY forward in one launch (``wy_fwd``) against two (``wy_inverse``, then ``wy_apply``), on one GPU.

For rule 1's write layout (one write per step) and rule 3's (window 4: four writes per step, read in
place from the extended axis) at B=8, T=2048, H=16, K=V=128 in bf16:

1. ``delta.wy_forward`` alone, replayed from a CUDA graph (median ms), in one launch (``ONE``) and
   under two-launch candidates: first the inverse's settings (the apply kernel at its
   first candidate), then the apply kernel's (at the fastest inverse). Every candidate's ``A``,
   ``U``, ``W`` are compared with the one-launch outputs (largest relative Frobenius difference).
2. The whole op forward+backward (``falcon-1``, ``falcon-3``) from a CUDA graph, in one launch and with
   the fastest two-launch setting, in alternation (``--rounds``), beside fla's
   ``chunk_gated_delta_rule`` (``--allow-fla-gated``: its Hopper guard lifted, for timing only).

    python benchmarks/bench_wy_forward.py --out OUT [--commit SHA] [--allow-fla-gated]

Writes ``OUT/wy_forward.json`` (every row, with ``commit`` and ``dirty``: the full commit of the falcon_fwa checkout
and whether it had uncommitted changes, as ``bench_kernels.source`` gives them) and ``OUT/wy_forward.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import (OPS, SHAPES, _versions, commit_words, lift_fla_gated_guard, measure_graph,  # noqa: E402
                           profile, source)

ONE = {"wy_fwd": dict(BK=64, BV=64, num_warps=4, num_stages=3)}  # the fastest one-launch setting (bf16)
INVERSE = [dict(BK=BK, num_warps=w, num_stages=s) for BK in (64, 128) for w in (2, 4) for s in (2, 3)]
APPLY = [dict(BK=b, BV=b, num_warps=w, num_stages=s) for b in (64, 128) for w in (4, 8) for s in (2, 3)]
LAYOUTS = {"rule 1": dict(slots=1, key="16bit", op="falcon-1"), "rule 3": dict(slots=4, key="16bit_grouped", op="falcon-3")}


def _inputs(slots: int, B: int, T: int, H: int, K: int, V: int):
    """bf16 keys and values (on the extended axis of ``T + slots - 1`` rows when ``slots > 1``), fp32 step
    sizes and log decays of ``T * slots`` write rows (decays on each step's first write only)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = T + slots - 1 if slots > 1 else T
    x = (torch.randn(B, rows, H, K, device="cuda", generator=g) / K ** 0.5).bfloat16()
    v = torch.randn(B, rows, H, V, device="cuda", generator=g).bfloat16()
    n = T * slots
    eta = 0.5 * torch.rand(B, n, H, device="cuda", generator=g)
    kappa = eta * torch.exp(-0.1 * torch.rand(B, n, H, device="cuda", generator=g))
    log_a = -0.05 * torch.rand(B, n, H, device="cuda", generator=g)
    log_a[:, torch.arange(n, device="cuda") % slots != 0] = 0.0
    return x, v, eta, kappa, log_a


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_forward(delta, slots: int, key: str, entry: dict, reference=None):
    """Median graph ms of ``wy_forward`` under ``entry`` (at ``key`` of the table) and the outputs'
    largest relative difference from ``reference``; returns ``(ms, err, outputs)``."""
    from triton.testing import do_bench_cudagraph

    from falcon_fwa.ops.triton.chunk_index import chunk_layout
    B, T, H, K, V = SHAPES[0]
    x, v, eta, kappa, log_a = _inputs(slots, B, T, H, K, V)
    layout = chunk_layout(B, T * slots, 64, None)
    saved = delta.WY_FWD_LAUNCH[key]
    delta.WY_FWD_LAUNCH[key] = entry
    try:
        call = lambda: delta.wy_forward(x, v, eta, kappa, log_a, layout, slots, windowed=slots > 1)  # noqa: E731
        out = call()
        torch.cuda.synchronize()
        err = 0.0 if reference is None else max(_rel(o, r) for o, r in zip(out, reference))
        ms = do_bench_cudagraph(call, rep=100, return_mode="median")
    finally:
        delta.WY_FWD_LAUNCH[key] = saved
    return float(ms), err, out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--commit", default=None,
                   help="commit to record, on a machine without git metadata (default: the full commit of the "
                        "falcon_fwa checkout that runs, with whether it had uncommitted changes)")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the op-level comparison")
    p.add_argument("--allow-fla-gated", action="store_true", help="time fla's chunk_gated_delta_rule beside, its refusal of its gated backward on this Triton lifted "
                        "(timings only: its gradients are not checked)")
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--profile", action="store_true", help="per-kernel device time of each op with the two-launch pick")
    p.add_argument("--inverse", nargs="+", default=None, metavar="BK,WARPS,STAGES",
                   help="wy_inverse candidates (default: BK 64/128 x 2/4 warps x 2/3 stages)")
    p.add_argument("--apply", nargs="+", default=None, metavar="BK,BV,WARPS,STAGES",
                   help="wy_apply candidates, the first one used while the inverse's are timed (default: BK = BV "
                        "64/128 x 4/8 warps x 2/3 stages)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_wy_forward.py needs a CUDA GPU")
    from falcon_fwa.ops.triton import delta
    inverse = INVERSE if args.inverse is None else [
        dict(zip(("BK", "num_warps", "num_stages"), map(int, c.split(",")))) for c in args.inverse]
    apply = APPLY if args.apply is None else [
        dict(zip(("BK", "BV", "num_warps", "num_stages"), map(int, c.split(",")))) for c in args.apply]
    os.makedirs(args.out, exist_ok=True)
    rows: List[Dict] = []
    best: Dict[str, dict] = {}
    for name in args.layouts:
        lay = LAYOUTS[name]
        one = ONE
        ms_one, _err, ref = time_forward(delta, lay["slots"], lay["key"], one)
        rows.append(dict(layout=name, form="one launch", setting=one, ms=ms_one, err=0.0))
        print(f"{name} one launch {one}: {ms_one:.4f} ms", flush=True)
        results = []
        for inv in inverse:
            entry = {"wy_inverse": inv, "wy_apply": apply[0]}
            ms, err, _ = time_forward(delta, lay["slots"], lay["key"], entry, ref)
            results.append((ms, err, entry))
            rows.append(dict(layout=name, form="two launches", setting=entry, ms=ms, err=err))
            print(f"{name} two launches {entry}: {ms:.4f} ms  err {err:.2e}", flush=True)
        inv = min((r for r in results if r[1] < 1e-2), key=lambda r: r[0])[2]["wy_inverse"]
        for app in apply[1:]:
            entry = {"wy_inverse": inv, "wy_apply": app}
            ms, err, _ = time_forward(delta, lay["slots"], lay["key"], entry, ref)
            results.append((ms, err, entry))
            rows.append(dict(layout=name, form="two launches", setting=entry, ms=ms, err=err))
            print(f"{name} two launches {entry}: {ms:.4f} ms  err {err:.2e}", flush=True)
        ms_two, err_two, entry = min((r for r in results if r[1] < 1e-2), key=lambda r: r[0])
        best[name] = entry
        print(f"{name} PICK {entry}: {ms_two:.4f} ms against {ms_one:.4f} (x{ms_two / ms_one:.3f})", flush=True)
        del ref
        torch.cuda.empty_cache()
    if args.allow_fla_gated:
        lift_fla_gated_guard()
    ops = [(LAYOUTS[n]["op"], n) for n in args.layouts] + ([("fla-gated-delta-rule", None)] if args.allow_fla_gated else [])
    for r in range(args.rounds):
        for op, name in ops:
            forms = {"-": None} if name is None else {"one launch": ONE, "two launches": best[name]}
            for form, entry in forms.items():
                saved = None
                if entry is not None:
                    key = LAYOUTS[name]["key"]
                    saved, delta.WY_FWD_LAUNCH[key] = delta.WY_FWD_LAUNCH[key], entry
                try:
                    ms = measure_graph(OPS[op], SHAPES[0], "fwdbwd")
                finally:
                    if saved is not None:
                        delta.WY_FWD_LAUNCH[key] = saved
                rows.append(dict(op=op, form=form, round=r, ms=ms, mode="fwdbwd", graph=True))
                print(f"round {r} {op} [{form}] fwd+bwd graph {ms:.4f} ms", flush=True)
    for name in args.layouts if args.profile else []:
        key = LAYOUTS[name]["key"]
        saved, delta.WY_FWD_LAUNCH[key] = delta.WY_FWD_LAUNCH[key], best[name]
        try:
            rows += [dict(r, form="two launches", profile=True) for r in profile(LAYOUTS[name]["op"], SHAPES[0])]
        finally:
            delta.WY_FWD_LAUNCH[key] = saved
    versions, recorded = _versions(), source(args.commit)
    with open(os.path.join(args.out, "wy_forward.json"), "w") as f:
        json.dump(dict(versions=versions, **recorded, shape=SHAPES[0], rows=rows, best=best), f, indent=1)
    lines = [f"# WY forward: one launch against two ({versions.get('gpu', '')}, {commit_words(**recorded)})", "",
             "| layout | form | setting | ms | err |", "|---|---|---|---|---|"]
    lines += [f"| {r['layout']} | {r['form']} | `{r['setting']}` | {r['ms']:.4f} | {r['err']:.1e} |"
              for r in rows if "layout" in r]
    lines += ["", "| op | form | round | fwd+bwd graph ms |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['form']} | {r['round']} | {r['ms']:.4f} |" for r in rows if "round" in r]
    prof = [r for r in rows if r.get("profile")]
    if prof:
        lines += ["", "Per kernel, two launches (ms, mean of 5 fwd+bwd calls):", "", "| op | kernel | calls | ms |",
                  "|---|---|---|---|"]
        lines += [f"| {r['op']} | `{r['kernel']}` | {r['calls']} | {r['ms']:.4f} |" for r in prof]
    with open(os.path.join(args.out, "wy_forward.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
