"""Cost of the normalized read (``eps_attn``) on the GPU: each inner-product rule with and without it.

The normalized read runs the rule on ``V + 1`` value columns (``2 V`` for 2A; padded to a multiple of 16) and divides.
This times ``falcon_attention`` (``backend="auto"``: the Triton kernels) with ``eps_attn=None``
and ``eps_attn=1e-6`` side by side, in alternating rounds, bf16, forward and forward+backward,
with peak memory, and writes ``<out>/<name>.md`` and ``.json`` (``{commit, dirty, versions, rows}``: the full
commit and uncommitted changes of the falcon_fwa checkout, as ``bench_kernels.source`` gives them).

    python benchmarks/bench_read_norm.py --out benchmarks/results --name h200-read-norm
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, List, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import WINDOW, _atomic_write, _falcon_inputs, _versions, commit_words, source  # noqa: E402

RULES = ("1A", "2A", "3A")


def _build(rule: str, eps_attn, shape) -> Tuple[Callable[[], torch.Tensor], List[torch.Tensor]]:
    from falcon_fwa import falcon_attention
    q, k, v, beta, lam = _falcon_inputs(*shape, per_column=rule == "2A")
    with torch.no_grad():  # nonnegative features, the setting of the normalized read
        q.abs_(), k.abs_()
    leaves = [q, k, v, beta, lam]
    return (lambda: falcon_attention(*leaves, rule=rule, window=WINDOW, chunk_size=64, eps_attn=eps_attn)[0]), leaves


def _time(fn, leaves, mode: str) -> Tuple[float, int]:
    import triton.testing
    out = fn()
    do = torch.randn_like(out)
    if mode == "fwd":
        def run():
            with torch.no_grad():
                fn()
    else:
        def run():
            fn().backward(do)
    run()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    ms = triton.testing.do_bench(run, grad_to_none=leaves if mode == "fwdbwd" else None, return_mode="median")
    return ms, peak


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", default="h200-read-norm")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per rule and mode (median reported)")
    p.add_argument("--shape", type=int, nargs=5, default=[8, 2048, 16, 128, 128], metavar=("B", "T", "H", "K", "V"))
    p.add_argument("--commit", default=None,
                   help="commit to record, on a machine without git metadata (default: the full commit of the "
                        "falcon_fwa checkout that runs, with whether it had uncommitted changes)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_read_norm.py needs a CUDA GPU")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    shape = tuple(args.shape)
    rows = []
    for rule in RULES:
        for mode in ("fwd", "fwdbwd"):
            ms = {None: [], 1e-6: []}
            peak = {}
            for _ in range(args.rounds):
                for eps in (None, 1e-6):
                    fn, leaves = _build(rule, eps, shape)
                    t, peak[eps] = _time(fn, leaves, mode)
                    ms[eps].append(t)
                    del fn, leaves
                    torch.cuda.empty_cache()
            ratios = [b / a for a, b in zip(ms[None], ms[1e-6])]
            row = dict(rule=rule, mode=mode, B=shape[0], T=shape[1], H=shape[2], K=shape[3], V=shape[4],
                       window=WINDOW if rule == "3A" else None, ms_plain=statistics.median(ms[None]),
                       ms_normalized=statistics.median(ms[1e-6]), ratio=statistics.median(ratios),
                       ratio_range=[min(ratios), max(ratios)], peak_plain=peak[None], peak_normalized=peak[1e-6])
            rows.append(row)
            print(json.dumps(row), flush=True)
    versions, recorded = _versions(), source(args.commit)
    B, T, H, K, V = shape
    md = [f"# The normalized read's cost: {versions['gpu']}", "",
          f"{commit_words(**recorded)}; torch {versions['torch']}, triton {versions['triton']}. "
          f"`falcon_attention` on the Triton kernels, bf16, B={B}, T={T}, H={H}, K={K}, V={V}, chunk 64, "
          f"window {WINDOW} for 3A, nonnegative features; medians of {args.rounds} alternating rounds "
          "(`triton.testing.do_bench` medians each). Command: `python benchmarks/bench_read_norm.py "
          f"--out {args.out} --name {args.name} --rounds {args.rounds}`.", "",
          "| rule | mode | denominator-free ms | normalized ms | ratio (range) | peak MiB, free / normalized |",
          "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['rule']} | {r['mode']} | {r['ms_plain']:.3f} | {r['ms_normalized']:.3f} | "
                  f"{r['ratio']:.2f}x ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f}) | "
                  f"{r['peak_plain'] / 2**20:,.0f} / {r['peak_normalized'] / 2**20:,.0f} |")
    os.makedirs(args.out, exist_ok=True)
    _atomic_write(os.path.join(args.out, f"{args.name}.md"), "\n".join(md) + "\n")
    _atomic_write(os.path.join(args.out, f"{args.name}.json"),
                  json.dumps(dict(**recorded, versions=versions, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
