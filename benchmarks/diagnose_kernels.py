"""Per-quantity errors of the Triton kernels against the float64 recurrent form, without a pass/fail
cut, for one rule, dtype and shape, under several warp counts of the WY kernels (rules 1 and 3).

    python benchmarks/diagnose_kernels.py --rule 1 --dtype fp32 --shape 1 2048 2 128 128 --out OUT.json

Prints one line per configuration: the relative error (``||a - b|| / ||b||``) of the output, the final
state and the gradient of every input, as ``tests/kernel_checks.check_kernel`` measures them. Use it
when a kernel test fails on a GPU, to see which quantity is off and whether a launch setting moves it.
``--out`` writes the rows as JSON, each with ``commit`` and ``dirty``: the full commit of the falcon_fwa checkout
that runs and whether it had uncommitted changes to tracked files, as ``bench_kernels.source`` gives them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rule", default="1")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--shape", nargs=5, type=int, default=[1, 2048, 2, 128, 128], metavar=("B", "T", "H", "K", "V"))
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--warps", nargs="*", default=["4,8", "4,4", "8,8"],
                   help="WY kernel warps as forward,wy_bwd (rules 1 and 3; the forward's inverse: wy_fwd or "
                        "wy_inverse, whichever the table names)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    try:
        warps = [tuple(int(w) for w in spec.split(",")) for spec in args.warps]
    except ValueError:
        warps = []
    if not warps or any(len(w) != 2 or min(w) < 1 for w in warps):
        p.error(f"--warps takes FORWARD,WY_BWD pairs of warp counts such as 4,8, got {args.warps}")
    for option, value in (("--shape", min(args.shape)), ("--window", args.window), ("--chunk-size", args.chunk_size)):
        if value < 1:
            p.error(f"{option} sizes must be at least 1, got {value}")
    import kernel_checks as kc  # switches the interpreter on without CUDA, before triton is imported
    from bench_kernels import failure, source
    from falcon_fwa.ops.triton import delta

    torch.backends.cuda.matmul.allow_tf32 = False
    recorded = source(None)  # the code that is checked, as the run starts
    rows = []
    for fwd, bwd in warps:
        for entry in delta.WY_FWD_LAUNCH.values():
            entry["wy_fwd" if "wy_fwd" in entry else "wy_inverse"]["num_warps"] = fwd
        delta.WY_WARPS.update(wy_bwd=bwd)  # four-byte inputs; the 16-bit tables name their own warps
        for table in (delta.FULL_K_16BIT, delta.FULL_K_16BIT_GROUPED, delta.FULL_K_16BIT_256):
            table["wy_bwd"]["num_warps"] = bwd
        row = dict(rule=args.rule, dtype=args.dtype, shape=args.shape, wy_fwd_warps=fwd, wy_bwd_warps=bwd,
                   **recorded)
        rows.append(row)
        try:
            errors = kc.check_kernel(args.rule, tuple(args.shape), DTYPES[args.dtype], window=args.window,
                                     chunk_size=args.chunk_size, state=True, output_final_state=True,
                                     device=kc.DEVICE, tol={DTYPES[args.dtype]: float("inf")})
        except Exception as e:  # e.g. a launch out of shared memory: report it and try the next setting
            row["error"] = failure(e)
            print(f"warps {fwd},{bwd}: {row['error']}", flush=True)
            continue
        row["errors"] = errors
        worst = max(errors, key=errors.get)
        print(f"warps {fwd},{bwd}: worst {worst} {errors[worst]:.2e} | "
              + " ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
