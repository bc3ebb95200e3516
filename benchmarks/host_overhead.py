"""Host time against device time of the fast rows (bf16, forward + backward, B=8, T=2048,
H=16, K=V=128): whether a row's median is set by the GPU or by the Python that launches it.

For each op it prints ``do_bench``'s median (as ``bench_kernels.py`` times it), the host's
enqueue time per call (ten calls with no synchronization: the GPU queue absorbs them), the
wall time per call of those ten, and the device busy time per call (sum of the kernels'
times in the profiler); then a ``cProfile`` of the host side of 20 calls of Falcon-1A and of
fla's chunk_simple_gla. A row whose host enqueue time exceeds its device busy time is bound
by the host: its median measures Python and launch overhead, not the kernels. The first line names the full
commit of the falcon_fwa checkout that runs, with whether it had uncommitted changes to tracked files
(``bench_kernels.source`` and ``commit_words``), and the torch and Triton versions.

    python benchmarks/host_overhead.py > host.txt     # CUDA, fla 0.6.0 for the fla rows
    python benchmarks/host_overhead.py --ops falcon-1 fla-gated-delta-rule --profile falcon-1
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch
import triton
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402

try:  # time fla's gated kernels on this Triton, as bench_kernels.py --allow-fla-gated does
    bk.lift_fla_gated_guard()
except Exception as e:  # fla missing or broken: its rows fail, reported, and the others run
    print("fla not importable:", bk.failure(e))

SHAPE = (8, 2048, 16, 128, 128)
OPS = {"fla-simple-gla": bk.OPS["fla-simple-gla"], "falcon-1a": bk.falcon_triton("1A"),
       "fla-gated-delta-rule": bk.OPS["fla-gated-delta-rule"], "falcon-1": bk.falcon_triton("1"),
       "falcon-3a": bk.falcon_triton("3A"), "falcon-1a-nv": bk.falcon_triton("1A", validate=False),
       "falcon-core-1a": bk.falcon_core}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", choices=list(OPS), default=list(OPS), help="rows, in this order")
    p.add_argument("--profile", nargs="*", choices=list(OPS), default=["falcon-1a", "fla-simple-gla"],
                   help="rows whose host side is profiled with cProfile")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_overhead.py needs a CUDA GPU")
    print(f"{bk.commit_words(**bk.source(None))}; torch {torch.__version__}, triton {triton.__version__}", flush=True)
    for name in args.ops:
        try:
            row(name, args.profile)
        except Exception as e:  # one failing op (fla missing, out of memory) must not lose the others
            print(f"{name:22s} failed: {bk.recovered(e)}", flush=True)


def row(name: str, profiled) -> None:
    """One op's line: do_bench's median, host enqueue, wall and device busy time per call; then its
    host side under cProfile when ``name`` is in ``profiled``."""
    fn, leaves = OPS[name](*SHAPE)
    do = torch.randn_like(fn().detach())

    def step():
        fn().backward(do)
        for t in leaves:
            t.grad = None
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    ms = do_bench(step, warmup=25, rep=100, return_mode="median")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        step()
    host = (time.perf_counter() - t0) / 10 * 1e3
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 10 * 1e3
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    busy = sum(e.device_time_total for e in prof.key_averages()) / 5 / 1e3
    print(f"{name:22s} do_bench {ms:6.3f} ms | host enqueue {host:6.3f} ms | 10-call wall/call {wall:6.3f} ms"
          f" | device busy {busy:6.3f} ms", flush=True)
    if name in profiled:
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            step()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print(s.getvalue()[:6000])


if __name__ == "__main__":
    main()
