"""Prompt passes without gradients: the fused recurrent kernel against the chunk kernels, by prompt length.

    python benchmarks/bench_short_prompts.py --out benchmarks/results --name h200-short-prompts

For each rule, batch and prompt length ``T``, one layer's op at the 130M presets' mixer shape
(``H=6``, ``K=V=128``, bf16, random inputs, a fresh state, the final state returned as a model's
prompt pass does) under ``torch.no_grad()``: ``falcon_attention(form="recurrent",
backend="triton")`` (the fused recurrent kernel: every token of a sequence in one program per head
and block of value columns) and ``falcon_attention(form="chunk", backend="triton")`` (the chunk
kernels), median ms of ``triton.testing.do_bench``, one after the other in the same process.
``crossover`` is the longest ``T`` up to which the fused kernel is faster at every shorter
``T``; the limits of ``ops.triton.recurrent.SHORT_PROMPT_LIMITS`` (steps, and steps x rows x heads)
are set below the crossovers of every batch size measured. The two outputs are also compared (max relative difference).

Writes ``<out>/<name>.json`` (rows ``{rule, B, T, fused_ms, chunk_ms, ratio, rel_diff}``, or ``{rule, B, T,
error}`` for a shape that failed, out of memory say: the others still run; every row with ``commit`` and
``dirty``, the full commit of the falcon_fwa checkout that runs and whether it had uncommitted changes to tracked
files, as ``bench_kernels.source`` gives them) and ``<out>/<name>.md``, both rewritten after every row.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Optional

import torch

from bench_kernels import _atomic_write, commit_words, recovered, source

RULES = ("1", "1A", "2", "2A", "3", "3A")


def _inputs(rule: str, B: int, T: int, H: int, K: int, V: int, device: str):
    g = torch.Generator(device=device).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    beta_shape = (B, T, H, V) if rule in ("2", "2A") else (B, T, H)
    return dict(q=(r(B, T, H, K) * K ** -0.5).bfloat16(), k=(r(B, T, H, K) * K ** -0.5).bfloat16(),
                v=r(B, T, H, V).bfloat16(), beta=torch.rand(beta_shape, device=device, generator=g).bfloat16(),
                lam=(0.1 * torch.rand(B, T, H, device=device, generator=g)).bfloat16(),
                log_gate=(-0.1 * torch.rand(B, T, H, device=device, generator=g)).bfloat16())


def crossover(rows: List[Dict], rule: str, B: int) -> int:
    """The longest ``T`` up to which the fused kernel beat the chunk kernels at every measured ``T`` (a failed
    row ends it)."""
    best = 0
    for r in sorted((r for r in rows if r["rule"] == rule and r["B"] == B), key=lambda r: r["T"]):
        if "error" in r or r["fused_ms"] >= r["chunk_ms"]:
            break
        best = r["T"]
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", nargs="+", default=list(RULES), choices=RULES)
    p.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    p.add_argument("--lengths", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--device", default="cuda", help="cuda or cuda:N (triton.testing.do_bench times CUDA devices)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="short-prompts")
    args = p.parse_args(argv)
    for option, values, least in (("--batch", args.batch, 1), ("--lengths", args.lengths, 1),
                                  ("--heads", [args.heads], 1), ("--head-dim", [args.head_dim], 1),
                                  ("--window", [args.window], 1)):
        if min(values) < least:
            p.error(f"{option} must be at least {least}, got {values}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_short_prompts.py needs a CUDA GPU")
    if not args.device.startswith("cuda"):
        p.error(f"--device must be a CUDA device (cuda or cuda:N), got {args.device!r}")
    try:
        from falcon_fwa.cli_options import resolve_device
        resolve_device(args.device)
    except ValueError as e:
        p.error(str(e))
    from triton.testing import do_bench

    from falcon_fwa import falcon_attention
    H, D = args.heads, args.head_dim
    recorded = source(None)  # the code that is timed, as the run starts
    rows: List[Dict] = []
    for rule in args.rules:
        for B in args.batch:
            for T in args.lengths:
                t = _inputs(rule, B, T, H, D, D, args.device)

                def run(form):
                    return falcon_attention(t["q"], t["k"], t["v"], t["beta"], t["lam"], log_gate=t["log_gate"],
                                            rule=rule, window=args.window, form=form, backend="triton",
                                            output_final_state=True)

                try:
                    with torch.no_grad():
                        o_f, o_c = run("recurrent")[0], run("chunk")[0]
                        rel = ((o_f.float() - o_c.float()).abs().max()
                               / o_c.float().abs().max().clamp(min=1e-30)).item()
                        fused = do_bench(lambda: run("recurrent"), warmup=10, rep=50, return_mode="median")
                        chunk = do_bench(lambda: run("chunk"), warmup=10, rep=50, return_mode="median")
                except Exception as e:  # one failing shape (out of memory, a compile error) must not lose the others
                    row = dict(rule=rule, B=B, T=T, H=H, K=D, V=D, error=recovered(e))
                else:
                    row = dict(rule=rule, B=B, T=T, H=H, K=D, V=D, fused_ms=round(fused, 4), chunk_ms=round(chunk, 4),
                               ratio=round(fused / chunk, 3), rel_diff=float(f"{rel:.3g}"))
                rows.append({**row, **recorded})
                print(json.dumps(rows[-1]), flush=True)
                _write(rows, args, recorded)
    return 0


def _write(rows: List[Dict], args, recorded: Optional[Dict] = None) -> None:
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    for suffix, text in (("json", json.dumps(rows, indent=1) + "\n"), ("md", report(rows, args, recorded))):
        _atomic_write(os.path.join(args.out, f"{args.name}.{suffix}"), text)


def report(rows: List[Dict], args, recorded: Optional[Dict] = None) -> str:
    """The tables of ``rows``, after the commit ``recorded`` (``bench_kernels.source``'s; taken now if not given)."""
    import triton
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    out = [f"# Prompt passes without gradients: fused recurrent kernel vs chunk kernels ({dev})", "",
           f"{commit_words(**(recorded or source(None)))}; torch {torch.__version__}, triton {triton.__version__}; bf16; H={args.heads}, "
           f"K=V={args.head_dim}, window {args.window} (rules 3, 3A); final state returned; median ms of "
           "`triton.testing.do_bench`, both forms one after the other in the same process.", "",
           "| rule | B | T | fused ms | chunk ms | fused / chunk | max rel. diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['rule']} | {r['B']} | {r['T']} | failed: {r['error'].split(':')[0]} | - | - | - |")
            continue
        out.append(f"| {r['rule']} | {r['B']} | {r['T']} | {r['fused_ms']} | {r['chunk_ms']} | {r['ratio']} | "
                   f"{r['rel_diff']} |")
    out += ["", "Longest prompt up to which the fused kernel is faster at every shorter measured length:", "",
            "| rule | " + " | ".join(f"B={B}" for B in args.batch) + " |", "|---|" + "---|" * len(args.batch)]
    for rule in dict.fromkeys(r["rule"] for r in rows):
        out.append(f"| {rule} | " + " | ".join(str(crossover(rows, rule, B)) for B in args.batch) + " |")
    failed = [r for r in rows if "error" in r]
    if failed:
        out += ["", "Failures:", ""] + [f"- rule {r['rule']}, B={r['B']}, T={r['T']}: {r['error']}" for r in failed]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
