"""flash-linear-attention's delta-rule kernels against the textbook recurrence in float64, at one's own shapes.

    python benchmarks/check_fla_delta.py --keys 32 64 --values 64 --lengths 100 256 --out OUT.json

The ``backend="fla"`` layers of the DeltaNet and Gated DeltaNet baselines call fla's ``chunk_delta_rule`` and
``chunk_gated_delta_rule``. This script checks those two calls, outputs and the gradients of ``q, k, v, beta``,
against the recurrence they implement (``scale=1``, L2-normalized ``q`` and ``k``, ``beta`` in ``(0, 1)``,
``g_t`` in ``(-0.1, 0)``)::

    S_t = exp(g_t) S_{t-1}                  (the gated rule; g_t = 0 for chunk_delta_rule)
    S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T
    o_t = S_t^T q_t

run step by step in float64 on the CPU. Each configuration runs in a process of its own, so that a kernel
that faults (an illegal memory access leaves the CUDA context unusable) is reported and the others still
run. Prints one line per configuration: the relative error ``||a - b|| / ||b||`` of the output and of each
gradient, or the error the call raised (fla refuses float32 in ``chunk_delta_rule`` and, on Hopper with
Triton 3.4-3.7.0, the gated backward). ``--out`` writes the rows as JSON, each with ``commit`` and ``dirty``: the
full commit of the falcon_fwa checkout that runs and whether it had uncommitted changes to tracked files, as
``bench_kernels.source`` gives them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import subprocess
import sys
from typing import Dict, Optional

import torch

from falcon_fwa.atomic import write_json

EXCEPTION_LINE = re.compile(r"[\w.]*(Error|Exception)\b[^ ]*: ")  # a traceback's last line: "Type: message"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
              g: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The (gated) delta rule, one step at a time: ``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]``,
    ``beta`` and ``g`` ``[B, T, H]``; returns ``o`` ``[B, T, H, V]``."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        if g is not None:
            S = S * g[:, t].exp()[..., None, None]
        error = v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S)
        S = S + beta[:, t][..., None, None] * k[:, t][..., :, None] * error[..., None, :]
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, 1)


def inputs(B: int, T: int, H: int, K: int, V: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Float64 CPU inputs of one configuration, and the upstream gradient ``do``."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    unit = lambda x: x / x.norm(dim=-1, keepdim=True)  # noqa: E731
    return dict(q=unit(r(B, T, H, K)), k=unit(r(B, T, H, K)), v=r(B, T, H, V),
                beta=torch.rand(B, T, H, generator=gen, dtype=torch.float64),
                g=-0.1 * torch.rand(B, T, H, generator=gen, dtype=torch.float64), do=r(B, T, H, V))


def check(gated: bool, B: int, T: int, H: int, K: int, V: int, dtype: str) -> Dict:
    """One configuration on the GPU against :func:`reference`: ``{"o": err, "dq": err, ...}``."""
    x = inputs(B, T, H, K, V)
    names = ("q", "k", "v", "beta")
    ref_in = [x[n].clone().requires_grad_() for n in names]
    o_ref = reference(*ref_in, g=x["g"] if gated else None)
    grads_ref = torch.autograd.grad(o_ref, ref_in, x["do"])
    dev = [x[n].cuda().to(DTYPES[dtype]).requires_grad_() for n in names]
    if gated:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        o, _ = chunk_gated_delta_rule(dev[0], dev[1], dev[2], x["g"].cuda().float(), dev[3], scale=1.0)
    else:
        from fla.ops.delta_rule import chunk_delta_rule
        o, _ = chunk_delta_rule(dev[0], dev[1], dev[2], dev[3], scale=1.0)
    rel = lambda a, b: float((a.detach().cpu().double() - b).norm() / b.norm())  # noqa: E731
    row = {"o": rel(o, o_ref.detach())}
    print(json.dumps({"forward": row}), flush=True)  # kept if the backward faults
    grads = torch.autograd.grad(o, dev, x["do"].cuda().to(DTYPES[dtype]))
    row.update({f"d{n}": rel(a, b) for n, a, b in zip(names, grads, grads_ref)})
    return row


def child_result(stdout: str, stderr: str, failed: str) -> Dict:
    """A child's row: its result line, or else its forward line (if it got that far) with the last exception
    line of ``stderr``, or ``failed`` where there is none."""
    lines = [json.loads(s) for s in stdout.splitlines() if s.startswith("{")]
    result = next((x["result"] for x in lines if "result" in x), None)
    if result is None:
        forward = next((x["forward"] for x in lines if "forward" in x), {})
        err = [s for s in stderr.splitlines() if EXCEPTION_LINE.match(s)]
        result = dict(forward, error=(err[-1] if err else failed)[:300])
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", default=["delta", "gated"], choices=["delta", "gated"])
    p.add_argument("--keys", nargs="+", type=int, default=[32, 64, 128], help="K, the key dims to check")
    p.add_argument("--values", nargs="+", type=int, default=[64], help="V, the value dims to check")
    p.add_argument("--lengths", nargs="+", type=int, default=[100, 256], help="T, the sequence lengths to check")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dtypes", nargs="+", default=["bf16"], choices=sorted(DTYPES))
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--one", nargs=7, default=None, help=argparse.SUPPRESS)  # a child process: one configuration
    a = p.parse_args(argv)
    if a.one:
        op, B, T, H, K, V, dtype = a.one
        print(json.dumps({"result": check(op == "gated", int(B), int(T), int(H), int(K), int(V), dtype)}))
        return 0
    for option, values in (("--keys", a.keys), ("--values", a.values), ("--lengths", a.lengths),
                           ("--batch", [a.batch]), ("--heads", [a.heads])):
        if min(values) < 1:
            p.error(f"{option} must be at least 1, got {values}")
    if not 0 < a.timeout < float("inf"):
        p.error(f"--timeout must be a positive number of seconds, got {a.timeout}")
    if not torch.cuda.is_available():
        raise SystemExit("check_fla_delta.py needs a CUDA GPU")
    from bench_kernels import source
    recorded = source(None)  # the code that runs the checks, as the run starts
    rows = []
    for op, dtype, K, V, T in itertools.product(a.ops, a.dtypes, a.keys, a.values, a.lengths):
        cfg = dict(op=op, dtype=dtype, B=a.batch, T=T, H=a.heads, K=K, V=V)
        argv1 = [sys.executable, __file__, "--one", op, str(a.batch), str(T), str(a.heads), str(K), str(V), dtype]
        try:
            done = subprocess.run(argv1, capture_output=True, text=True, timeout=a.timeout)
            result = child_result(done.stdout, done.stderr, f"exit status {done.returncode}")
        except subprocess.TimeoutExpired as e:  # its output comes as bytes, whatever text= said
            result = child_result((e.stdout or b"").decode(errors="replace"), "", f"no result in {a.timeout:g} s")
        rows.append(dict(cfg, **result, **recorded))
        errs = " ".join(f"{k} {v:.2e}" for k, v in result.items() if k != "error")
        print(f"{op:5s} {dtype} B={a.batch} T={T} H={a.heads} K={K} V={V}: {errs}"
              + (f"  [{result['error']}]" if "error" in result else ""), flush=True)
        if a.out:  # after every row: a run cut off keeps the rows it had
            write_json(a.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
