"""Train several recipes on the same data, tokens and schedule, then collect validation
perplexity, tokens/s and peak memory of each.

``falcon-fwa compare --configs configs/small/*.yaml --names ... --time-budget 300 --out runs/compare``

By default the recipes train one after another in this process (each alone on the device, so
its tokens/s and peak memory are its own). ``--concurrent`` starts them all at once as separate
processes instead (only sensible where one model leaves the device mostly idle).
With ``--time-budget`` (seconds of training for all recipes together) the step count is chosen
from a short throughput calibration so that the budget holds; every recipe trains for the same
number of steps (same tokens), with warmup scaled to 1/15 of them and four evaluations.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import List

from .config import load_config
from .logger import read_log


def _launch(config: str, out_dir: str, sets: List[str], log_path: str):
    cmd = [sys.executable, "-m", "falcon_fwa.train.cli", "--config", config, "--set", f"train.out_dir={out_dir}",
           "--set", "log.progress=false"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    return subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)


def run_all(configs: List[str], names: List[str], out_dir: str, sets: List[str], tag: str) -> dict:
    """Run every recipe concurrently; returns {name: summary + log}."""
    procs = {}
    for cfg, name in zip(configs, names):
        run_dir = os.path.join(out_dir, tag, name)
        os.makedirs(run_dir, exist_ok=True)
        procs[name] = (_launch(cfg, run_dir, sets, os.path.join(run_dir, "stdout.txt")), run_dir)
    results = {}
    for name, (proc, run_dir) in procs.items():
        rc = proc.wait()
        summary_path = os.path.join(run_dir, "summary.json")
        if rc != 0 or not os.path.isfile(summary_path):
            with open(os.path.join(run_dir, "stdout.txt")) as f:
                tail = f.read()[-2000:]
            results[name] = {"error": f"exit code {rc}", "stdout_tail": tail}
            continue
        with open(summary_path) as f:
            results[name] = json.load(f)
        results[name]["log"] = read_log(os.path.join(run_dir, "log.jsonl"))
    return results


def run_sequential(configs: List[str], names: List[str], out_dir: str, sets: List[str], tag: str) -> dict:
    """Train every recipe in turn in this process; returns {name: summary + log}."""
    import torch

    from .trainer import Trainer

    results = {}
    for cfg_path, name in zip(configs, names):
        run_dir = os.path.join(out_dir, tag, name)
        cfg = load_config(cfg_path, sets + [f"train.out_dir={run_dir}"])
        print(f"training {name} ({cfg_path})", flush=True)
        trainer = Trainer(cfg)
        try:
            results[name] = trainer.train()
        except Exception as err:  # keep going: one failing recipe must not lose the others
            results[name] = {"error": f"{type(err).__name__}: {err}"}
        finally:
            trainer.close()
        if os.path.isfile(os.path.join(run_dir, "log.jsonl")):
            results[name]["log"] = read_log(os.path.join(run_dir, "log.jsonl"))
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"{name}: {({k: v for k, v in results[name].items() if k != 'log'})}", flush=True)
    return results


def calibrate_sequential(configs: List[str], sets: List[str], steps: int = 6) -> dict:
    """Isolated training tokens/s of each recipe's model at its seq_len and micro_batch."""
    import torch

    from ..models import get_preset
    from .throughput import measure

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {}
    for path in configs:
        cfg = load_config(path, sets)
        config = get_preset(cfg.model.preset, **cfg.model.overrides)
        out[path] = measure(config, seq_len=cfg.data.seq_len, batch_size=cfg.train.micro_batch, steps=steps,
                            warmup=2, device=device, bf16=cfg.train.dtype == "bf16")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="+", required=True, help="recipe files (same data, optim, global_batch)")
    parser.add_argument("--names", nargs="+", default=None, help="display names (default: file names)")
    parser.add_argument("--out", required=True, help="folder for the runs and compare.json")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="applied to every recipe")
    parser.add_argument("--concurrent", action="store_true", help="all recipes at once, one process each")
    parser.add_argument("--steps", type=int, default=None, help="train steps of every recipe")
    parser.add_argument("--time-budget", type=float, default=None, help="seconds of training (calibrated)")
    parser.add_argument("--calib-steps", type=int, default=None,
                        help="steps of the --time-budget calibration (default: 6 timed steps per recipe; "
                             "30 training steps with --concurrent)")
    parser.add_argument("--max-steps", type=int, default=None, help="cap on the calibrated step count")


def run(args: argparse.Namespace) -> int:
    from ..data import prepare_dataset

    names = args.names or [os.path.splitext(os.path.basename(c))[0] for c in args.configs]
    if len(names) != len(args.configs):
        raise ValueError("--names needs one name per --configs file")
    first = load_config(args.configs[0], args.overrides)
    d = first.data
    for c in args.configs[1:]:
        other = load_config(c, args.overrides)
        if (other.data, other.optim, other.train.global_batch) != (d, first.optim, first.train.global_batch):
            raise ValueError(f"{c}: data, optim and train.global_batch must equal {args.configs[0]}'s")
    sets = list(args.overrides)
    data_dir = d.out_dir
    if not data_dir:  # one tokenized copy shared by every recipe
        data_dir = os.path.join(args.out, "data")
        sets.append(f"data.out_dir={data_dir}")
    prepare_dataset(d.spec(), data_dir)
    report = {"configs": dict(zip(names, args.configs)), "overrides": args.overrides}
    steps = args.steps
    tokens_per_step = first.train.global_batch * d.seq_len
    if args.time_budget and not args.concurrent:
        t0 = time.time()
        calib = calibrate_sequential(args.configs, sets, steps=args.calib_steps or 6)
        report["calibration"] = {n: calib[c] for n, c in zip(names, args.configs)}
        report["calibration_wall_s"] = time.time() - t0
        seconds_per_step = sum(tokens_per_step / r["tokens_per_s"] for r in calib.values())
        steps = int(args.time_budget / seconds_per_step)
        if args.max_steps:
            steps = min(steps, args.max_steps)
        print(f"calibrated: {seconds_per_step:.3f} s per step for all recipes -> {steps} steps", flush=True)
    elif args.time_budget:
        calib_steps = args.calib_steps or 30
        calib = [f"train.steps={calib_steps}", "train.eval_every=0", "train.save_every=0",
                 "train.export_model=false", f"log.every={max(1, calib_steps // 3)}"]
        t0 = time.time()
        res = run_all(args.configs, names, args.out, sets + calib, "calibration")
        report["calibration"] = {n: {k: v for k, v in r.items() if k != "log"} for n, r in res.items()}
        report["calibration_wall_s"] = time.time() - t0
        slowest = min(r.get("tokens_per_s") or 0.0 for r in res.values())
        if slowest <= 0:
            raise RuntimeError(f"calibration failed: {report['calibration']}")
        steps = int(args.time_budget * slowest / tokens_per_step)
        if args.max_steps:
            steps = min(steps, args.max_steps)
        print(f"calibrated: slowest {slowest:,.0f} tokens/s concurrently -> {steps} steps", flush=True)
    if steps is not None:
        steps = max(steps, 20)
        sets += [f"train.steps={steps}", f"optim.warmup_steps={max(1, steps // 15)}",
                 f"train.eval_every={max(1, steps // 4)}", f"train.save_every={steps}"]
        report["steps"] = steps
    t0 = time.time()
    runner = run_all if args.concurrent else run_sequential
    report["runs"] = runner(args.configs, names, args.out, sets, "main")
    report["main_wall_s"] = time.time() - t0
    tmp = os.path.join(args.out, "compare.json.tmp")
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, os.path.join(args.out, "compare.json"))
    for name, r in report["runs"].items():
        print(f"{name:>16}: val_ppl {r.get('val_ppl')}  params {r.get('params')}  tokens {r.get('tokens')}  "
              f"{r.get('error', '')}", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="falcon-fwa compare", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

