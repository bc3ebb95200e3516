"""``falcon-fwa demo``: run every rule in its three forms on random inputs,
show that they agree, and time them (the fastest of ``CALLS`` calls: a form's first call,
with its one-off costs, is no measure of it). A form off the recurrent one by more than
``TOLERANCE`` (float64 rounding gives below 1e-13) ends it with exit status 1."""
from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from .cli_options import check_seed
from .ops import RULES, falcon_attention

CALLS = 3  # timed calls of each form and rule
TOLERANCE = 1e-10  # of max |o - o_recurrent| / max |o_recurrent|


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=256, help="sequence length T")
    p.add_argument("--heads", type=int, default=2, help="number of heads H")
    p.add_argument("--head-dim", type=int, default=32, help="K = V")
    p.add_argument("--window", type=int, default=4, help="window B of the rules 3 and 3A")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")


def run(args: argparse.Namespace) -> int:
    for option, value in (("--seq-len", args.seq_len), ("--heads", args.heads), ("--head-dim", args.head_dim),
                          ("--window", args.window)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    check_seed("--seed", args.seed)
    torch.manual_seed(args.seed)
    B, T, H, D = 1, args.seq_len, args.heads, args.head_dim
    dt = torch.float64
    q = torch.randn(B, T, H, D, dtype=dt) / D ** 0.5
    k = torch.randn(B, T, H, D, dtype=dt) / D ** 0.5
    v = torch.randn(B, T, H, D, dtype=dt)
    lam = torch.rand(B, T, H, dtype=dt)
    print(f"B={B} T={T} H={H} K=V={D} window={args.window}, float64; max |o - o_recurrent| / max |o_recurrent|; "
          f"ms: the fastest of {CALLS} calls")
    print(f"{'rule':>5} {'parallel':>10} {'chunk':>10} {'recurrent ms':>13} {'parallel ms':>12} {'chunk ms':>9}")
    disagree = []
    for rule, spec in RULES.items():
        beta = torch.rand(B, T, H, *((D,) if spec.per_column else ()), dtype=dt) * 1.9 + 0.05
        outs, times = {}, {}
        for form in ("recurrent", "parallel", "chunk"):
            times[form] = math.inf
            for _ in range(CALLS):
                t0 = time.perf_counter()
                outs[form], _ = falcon_attention(q, k, v, beta, lam, rule=rule, window=args.window, form=form)
                times[form] = min(times[form], (time.perf_counter() - t0) * 1e3)
        ref = outs["recurrent"]
        scale = ref.abs().max().clamp_min(torch.finfo(dt).tiny)  # all zeros when T = 1 (the sentinel step)
        err = {f: ((outs[f] - ref).abs().max() / scale).item() for f in ("parallel", "chunk")}
        print(f"{rule:>5} {err['parallel']:>10.1e} {err['chunk']:>10.1e} {times['recurrent']:>13.1f} "
              f"{times['parallel']:>12.1f} {times['chunk']:>9.1f}")
        disagree += [f"rule {rule} {form} {e:.1e}" for form, e in err.items() if not e <= TOLERANCE]
    if disagree:
        print(f"falcon-fwa demo: the forms disagree beyond {TOLERANCE:.0e}: {', '.join(disagree)}", file=sys.stderr)
        return 1
    return 0
