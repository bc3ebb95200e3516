"""Shared memory, registers and spills of every Triton kernel launch of a rule, compiled for
a GPU architecture on a machine without one.

    python benchmarks/kernel_resources.py --rules 1 2 --dtypes fp32 bf16 --dims 64 128 [--arch 90]

Runs each rule's forward and backward through ``falcon_chunk_triton`` on CPU tensors with every
kernel launch replaced by a compile for ``sm_<arch>`` (Triton ships ``ptxas``; no GPU or driver is
used, nothing is executed, so the outputs are garbage and only the launch configurations matter).
Prints one row per distinct compiled kernel: its launch settings and shared memory against the
architecture's limit, the registers per thread and the bytes spilled to local memory that
``ptxas -v`` reports for the kernel's PTX, and how many of its blocks an SM holds at once
(``blocks_per_sm``). A kernel that needs more shared memory than the limit
fails at launch on the GPU with ``OutOfResources``; this finds it before the GPU does. Spills are
local-memory traffic inside the kernel's loops: a change that adds them is worth a second look
before it is timed. ``--out`` writes the rows as JSON, each with ``commit`` and ``dirty``: the full commit of the
falcon_fwa checkout that compiles and whether it had uncommitted changes to tracked files, as
``bench_kernels.source`` gives them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

import torch

# The limits of one thread block (dynamic shared memory opt-in), per architecture.
SHARED_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}
# Per SM: 32-bit registers, shared memory (bytes), resident warps, resident blocks (CUDA occupancy tables).
SM_LIMITS = {80: (65536, 167936, 64, 32), 86: (65536, 102400, 48, 16), 89: (65536, 102400, 48, 24),
             90: (65536, 233472, 64, 32)}


def blocks_per_sm(regs: int, shared: int, warps: int, arch: int = 90) -> int:
    """Thread blocks of one launch resident on an SM at once: the least that its registers
    (allocated per warp in units of 256), its shared memory (with 1 KB reserved per block), its
    warps and the architecture's block limit allow. One block per SM leaves no other block's work
    to cover a block's waits (the reason ``wy_bwd`` runs faster at 4 warps than at 8)."""
    reg_file, smem, max_warps, max_blocks = SM_LIMITS[arch]
    per_warp = -(-regs * 32 // 256) * 256
    by_smem = smem // (shared + 1024) if shared else max_blocks
    return min(reg_file // (per_warp * warps), by_smem, max_warps // warps, max_blocks)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def ptxas_usage(ptx: str, arch: int) -> Optional[Dict[str, int]]:
    """Registers per thread and spill bytes (stores, loads) that ``ptxas -v`` reports for ``ptx``,
    compiled for ``sm_<arch>`` (``sm_90a`` on Hopper, as Triton compiles), with the ``ptxas`` that
    Triton ships; ``None`` where it is missing or prints no usage line."""
    from triton.backends.nvidia import compiler as nv
    ptxas = None
    for find in (lambda: nv.get_ptxas(arch).path, lambda: nv.get_ptxas().path,
                 lambda: nv._path_to_binary("ptxas")[0]):  # the call differs between Triton releases
        try:
            ptxas = find()
            break
        except Exception:  # noqa: BLE001 - try the next form; none: no figures
            continue
    if ptxas is None:
        return None
    name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        r = subprocess.run([ptxas, "-v", f"--gpu-name={name}", f.name, "-o", os.devnull], capture_output=True,
                           text=True, timeout=600)
    finally:
        os.unlink(f.name)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if regs is None:
        return None
    return dict(regs=int(regs.group(1)), spill_stores=int(spills.group(1)) if spills else 0,
                spill_loads=int(spills.group(2)) if spills else 0)


def _compile_only(arch: int, limit: int, rows: List[Dict], context: Dict):
    """A replacement for ``JITFunction.run`` that compiles for ``sm_<arch>`` and records resources."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    seen = {}

    def run(self, *args, grid, warmup, **kwargs):
        binder = create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(backend, kwargs, bound, specialization, options)
        key = (self.fn.__name__, str(sorted((str(k), repr(v)) for k, v in constexprs.items())),
               str(signature), str(options))
        if key not in seen:  # compile once per distinct launch; report it for every configuration using it
            kernel = compile(ASTSource(self, signature, constexprs, attrs), target=target, options=options.__dict__)
            md = kernel.metadata
            blocks = {self.params[p[0]].name: v for p, v in constexprs.items()
                      if self.params[p[0]].name.startswith("B") or self.params[p[0]].name in ("K", "V", "SLOTS")}
            usage = ptxas_usage(kernel.asm["ptx"], arch) or dict(regs=None, spill_stores=None, spill_loads=None)
            seen[key] = dict(kernel=self.fn.__name__, blocks=blocks, num_warps=md.num_warps,
                             num_stages=md.num_stages, shared=md.shared, limit=limit, **usage)
        row = dict(context, **seen[key])
        if row not in rows:
            rows.append(row)
        return None

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", nargs="+", default=["1A", "1", "2A", "2", "3A", "3"],
                   choices=["1A", "1", "2A", "2", "3A", "3"])
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--dims", nargs="+", type=int, default=[64, 128, 256], help="head dims K = V")
    p.add_argument("--chunk-sizes", nargs="+", type=int, default=[64])
    p.add_argument("--window", type=int, default=4, help="window of rules 3 and 3A")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80 (A100)")
    p.add_argument("--limit", type=int, default=None,
                   help="shared-memory bytes per block to check against (default: the architecture's)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        p.error("unset TRITON_INTERPRET: the kernels are compiled, not interpreted")
    for option, value in (("--dims", min(args.dims)), ("--chunk-sizes", min(args.chunk_sizes)),
                          ("--window", args.window), ("--limit", 1 if args.limit is None else args.limit)):
        if value < 1:
            p.error(f"{option} must be at least 1, got {value}")
    limit = args.limit if args.limit is not None else SHARED_LIMIT.get(args.arch)
    if limit is None:
        p.error(f"--arch {args.arch}: no known shared-memory limit; give --limit")

    from bench_kernels import source
    from triton.runtime.jit import JITFunction
    from falcon_fwa.ops.triton import api, launch
    from falcon_fwa.ops.triton.api import MAX_WY_HEAD_DIM, falcon_chunk_triton
    from falcon_fwa.ops.rules import get_rule

    recorded = source(None)  # the code that is compiled, as the run starts
    rows: List[Dict] = []
    context: Dict = {}
    # Every launch compiles instead of running, for the rest of this process (a command-line tool).
    JITFunction.run = _compile_only(args.arch, limit, rows, context)
    api._interpreting = lambda: True  # let CPU tensors through; no kernel runs
    launch.COMPILE_FOR_GPU = True  # the GPU's block sizes, not the interpreter's, for the CPU tensors here
    failures = 0
    for rule in args.rules:
        spec = get_rule(rule)
        for dtype in args.dtypes:
            for d in args.dims:
                if spec.regression and d > MAX_WY_HEAD_DIM:
                    print(f"rule {spec.name} K=V={d}: skipped (the regression kernels take K <= {MAX_WY_HEAD_DIM})")
                    continue
                for chunk in args.chunk_sizes:
                    context.clear()
                    context.update(rule=spec.name, dtype=dtype, K=d, V=d, chunk_size=chunk)
                    B, T, H = 1, 2 * chunk, 1
                    g = torch.Generator().manual_seed(0)
                    q, k = (torch.randn(B, T, H, d, generator=g).to(DTYPES[dtype]).requires_grad_() for _ in range(2))
                    v = torch.randn(B, T, H, d, generator=g).to(DTYPES[dtype]).requires_grad_()
                    beta = torch.rand(*((B, T, H, d) if spec.per_column else (B, T, H)), generator=g)
                    lam, log_gate = (torch.rand(B, T, H, generator=g) for _ in range(2))
                    window = args.window if spec.sliding else 1
                    try:
                        o, state = falcon_chunk_triton(
                            q, k, v, beta.requires_grad_(), lam.requires_grad_(), rule=spec.name, window=window,
                            log_gate=(-log_gate).requires_grad_(), chunk_size=chunk, output_final_state=True)
                        (o.float().sum() + state.S.sum()).backward()
                    except Exception as e:  # noqa: BLE001 - reported per configuration
                        failures += 1
                        print(f"rule {spec.name} {dtype} K=V={d} chunk {chunk}: {type(e).__name__}: {e}")
    over = [r for r in rows if r["shared"] > r["limit"]]
    for r in rows:
        fits = r["regs"] is not None and r["shared"] <= r["limit"] and args.arch in SM_LIMITS
        r["blocks_per_sm"] = blocks_per_sm(r["regs"], r["shared"], r["num_warps"], args.arch) if fits else None
    print(f"{'rule':4} {'dtype':5} {'K':>4} {'kernel':24} {'warps':>5} {'stages':>6} {'shared':>8} {'regs':>4} "
          f"{'spills':>6} {'per SM':>6}  blocks")
    for r in rows:
        flag = "  OVER" if r in over else ""
        spills = "-" if r["spill_stores"] is None else r["spill_stores"] + r["spill_loads"]
        per_sm = "-" if r["blocks_per_sm"] is None else r["blocks_per_sm"]
        print(f"{r['rule']:4} {r['dtype']:5} {r['K']:>4} {r['kernel']:24} {r['num_warps']:>5} {r['num_stages']:>6} "
              f"{r['shared']:>8} {r['regs'] if r['regs'] is not None else '-':>4} {spills:>6} {per_sm:>6}  "
              f"{r['blocks']}{flag}")
    print(f"{len(rows)} kernels compiled for sm_{args.arch}; {len(over)} above the shared-memory limit "
          f"({limit} bytes); {failures} configurations failed")
    if args.out:
        with open(args.out, "w") as f:
            json.dump([{**r, **recorded} for r in rows], f, indent=1)
    return 1 if over or failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
