"""Time of one training step of the addition models, per model and batch size, alone on a device.

    python benchmarks/bench_addition_step.py --models Falcon-3A.3 Falcon-1.3 Transformer --batch 128 512 \
        --out benchmarks/results --name h200-addition-step [--profile 10]

Builds each model of the ``--preset`` (``paper`` by default) as ``falcon-fwa addition`` does, with its
optimizer, and times ``--steps`` of its training step (``train_step``: forward, suffix loss, backward,
clipping, AdamW) on fixed training
batches after ``--warmup`` untimed ones; device-synchronized, median ms per step. With ``--profile N``
the N most expensive device (or CPU) kernels of one extra step are kept per row. Rows go to
``<out>/<name>.json`` after every row: ``{model, batch, matmul_precision, ms_per_step, tokens_per_step, steps,
top_kernels, commit, dirty}`` (``commit`` and ``dirty``: the full commit of the falcon_fwa checkout that runs and
whether it had uncommitted changes to tracked files, as ``bench_kernels.source`` gives them).
``--matmul-precision highest high`` times each row under both float32 matmul settings (exact fp32 products vs
TF32 tensor cores; default: the preset's), side by side in one run.
Use it to see whether a budget's wall time comes from the model or from the way it is run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List

import torch

from bench_kernels import _atomic_write, source


def time_steps(name: str, preset, batch: int, steps: int, warmup: int, device: str, profile: int) -> Dict:
    from falcon_fwa.tasks.addition.data import VOCAB, training_batch
    from falcon_fwa.tasks.addition.lineup import build_model, resolve_model
    from falcon_fwa.tasks.addition.train import _autocast, make_optimizer, train_step

    torch.manual_seed(0)
    model = build_model(resolve_model(name), preset.size(), vocab_size=len(VOCAB)).to(device)
    opt = make_optimizer(model, preset)
    lo, hi = preset.train_widths
    batches = [training_batch(0, s, batch, lo, hi).to(device) for s in range(warmup + steps + 1)]
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    autocast = _autocast(torch.device(device), "float32")

    def step(b):  # the training loop's step, as `falcon-fwa addition` runs it
        train_step(model, opt, b, preset.grad_clip, autocast, label=f"{name} batch {batch}")

    for b in batches[:warmup]:
        step(b)
    times = []
    for b in batches[warmup:warmup + steps]:
        sync()
        t = time.perf_counter()
        step(b)
        sync()
        times.append(time.perf_counter() - t)
    row = dict(model=name, batch=batch, ms_per_step=round(1e3 * statistics.median(times), 3),
               tokens_per_step=int(sum(int(b.input_ids.numel()) for b in batches[warmup:warmup + steps]) / steps),
               steps=steps)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
        with torch_profile(activities=acts) as prof:
            step(batches[-1])
            sync()
        key = "device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
        top = sorted(prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)[:profile]
        row["top_kernels"] = [dict(name=e.key[:120], calls=e.count, us=round(getattr(e, key, 0.0), 1)) for e in top]
    return row


def main(argv=None) -> int:
    from falcon_fwa.tasks.addition.presets import MATMUL_PRECISIONS
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["Falcon-3A.3", "Falcon-1A.3", "Falcon-1.3", "Transformer", "Mamba-2"])
    p.add_argument("--batch", nargs="+", type=int, default=[128, 512])
    p.add_argument("--preset", default="paper")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation)")
    p.add_argument("--profile", type=int, default=0, metavar="N", help="keep the N most expensive kernels of a step")
    p.add_argument("--matmul-precision", nargs="+", default=None, choices=MATMUL_PRECISIONS,
                   help="torch.set_float32_matmul_precision values to time (default: the preset's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="addition-step")
    args = p.parse_args(argv)
    for name in ("steps", "warmup"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            p.error(f"--{name} must be at least {1 if name == 'steps' else 0}")
    if any(b < 1 for b in args.batch):
        p.error("--batch values must be at least 1")
    from falcon_fwa.cli_options import resolve_device
    from falcon_fwa.tasks.addition.lineup import resolve_model
    from falcon_fwa.tasks.addition.presets import get_addition_preset
    from falcon_fwa.tasks.addition.train import float32_matmul_precision
    checks = (("--device", lambda: resolve_device(args.device)), ("--preset", lambda: get_addition_preset(args.preset)),
              ("--models", lambda: [resolve_model(m) for m in args.models]))
    for option, check in checks:
        try:
            check()
        except ValueError as e:
            p.error(str(e) if str(e).startswith(option) else f"{option}: {e}")
    if args.profile < 0 or (args.threads is not None and args.threads < 1):
        p.error(f"--profile must be >= 0 and --threads >= 1, got {args.profile} and {args.threads}")
    preset = get_addition_preset(args.preset)
    if args.threads:
        torch.set_num_threads(args.threads)
    recorded = source(None)  # the code that is timed, as the run starts
    rows: List[Dict] = []
    for name in args.models:
        for batch in args.batch:
            for precision in args.matmul_precision or [preset.matmul_precision]:
                with float32_matmul_precision(precision):
                    row = {"matmul_precision": precision,
                           **time_steps(name, preset, batch, args.steps, args.warmup, args.device, args.profile),
                           **recorded}
                rows.append(row)
                print(f"{name:12s} batch {batch:5d} {precision:7s}: {row['ms_per_step']:9.2f} ms/step "
                      f"({row['tokens_per_step']:,} tokens)", flush=True)
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    _atomic_write(os.path.join(args.out, f"{args.name}.json"), json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
