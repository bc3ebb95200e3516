"""Multi-GPU scaling of training recipes: DDP and FSDP2 through ``torchrun`` at several process counts.

``falcon-fwa scaling --configs configs/small/falcon-1a.3.yaml configs/small/transformer.yaml
--names Falcon-1A.3 Transformer --gpus 1 2 --strategies ddp fsdp2 --steps 200 --results results/multigpu``

Defaults: ``--gpus 1 2``, both strategies, ``--steps 200``, ``--warmup-steps 20``, ``--noise-seeds 0 1``,
``--out runs/scaling``, ``--results results/multigpu`` (``falcon-fwa scaling --help`` lists every option).

Every run keeps the recipe's per-process batch (``--micro-batch``, default the first recipe's
``train.micro_batch``) and one global batch for all process counts: micro batch times the
least common multiple of ``--gpus`` (times the largest count for 1, 2, 4, 8). A run on fewer
processes accumulates gradients over the missing ones, so every process count trains on the
same token stream with the same optimizer steps,
and the validation loss after the same tokens must agree across counts within run-to-run
noise. The noise is measured by repeating the one-process run of the first strategy with
every seed in ``--noise-seeds``. Scaling efficiency: tokens/s at N processes over N times the
mean tokens/s of the runs at the smallest count (one process, normally; every seed run there),
same model and strategy, scaled by that count (a one-process DDP/FSDP2 run is a real
one-member process group). Before a model's timed runs, a short untimed warm-up run
(``--warmup-steps``) fills the kernel caches (Triton compiles each kernel variant on first
use), so that the first timed run does not pay for compilation the later ones skip. Every run
gets the same ``OMP_NUM_THREADS`` (1 unless the caller's environment sets it): ``torchrun`` sets 1
for more than one process only, which would give the one-process runs a different CPU setup.

Before the first run, every recipe is loaded as its runs will read it and its local data sources are
looked up (unless its ``data.out_dir`` holds the tokens already): a recipe, ``--set`` or source that would
fail every run is named at once, and nothing starts. A failed run's line on the console ends with the last
``error:`` line of its log.

Each run is ``python -m torch.distributed.run --standalone --nproc_per_node=N -m
falcon_fwa.train.cli --config ... --set train.strategy=...``, with NCCL's NVLink multicast off
(``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).
After every run, ``RESULTS.json`` (rows: ``model``, ``strategy``, ``gpus``, ``seed``,
``tokens_per_s``, ``efficiency``, ``peak_mem_bytes_per_gpu``, ``val_loss``, ``tokens``,
``steps``, ``status``, ``command``, ``device``, ``omp_num_threads``, ``commit``, ``dirty``) and ``RESULTS.md``
are rewritten, so an interrupted sweep keeps what finished. ``--deadline`` (seconds) starts no run after it
and stops the one in progress (the launcher and its workers: the whole process group). A SIGTERM or SIGINT stops the run
in progress the same way (``stopped: SIGTERM``), starts no other and ends the command with status
128 + signal; a launcher whose sweep is killed outright (SIGKILL) is sent SIGHUP by the system
(``end_with_parent``), so no run goes on training unseen. One sweep runs in an ``--out`` folder at a time.

A sweep records the full commit of the falcon-fwa checkout it runs from, or ``--commit``, and whether that
checkout had uncommitted changes to tracked files (``dirty``, from
:func:`falcon_fwa.provenance.command_provenance`; ``None`` where git cannot tell, and for a ``--commit`` that does
not name the checkout's own commit): in every row it runs and in the header of ``RESULTS.md``, which adds
:func:`falcon_fwa.provenance.uncommitted_note` after the commit. A row kept from an earlier sweep keeps its own
(a row of a sweep that recorded neither still reads), and a header without ``dirty`` says nothing about changes.

Launched again with the same options, a sweep keeps the runs that finished before (``done`` in
``RESULTS.json``, with the same command and ``OMP_NUM_THREADS`` (the row's ``omp_num_threads``), on the same kind
of machine (the row's ``device``), whose
``summary.json`` in the run folder holds the recipe that command trains, trained with the checkout's code: its commit
and the same uncommitted changes to tracked files, or none on either side, as
:func:`falcon_fwa.train.compare.kept_result` keeps a recipe's run) and runs the others afresh: an interrupted sweep
goes on where it stopped, and no row of other settings or code is taken along. A finished run not kept is said in
one line, with why; outside a git checkout every run goes again.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional

from ..atomic import folder_lock, read_json, write_json, write_text
from ..cli_options import (check_input_files, check_output_file, check_output_folder, ends_in_separator,
                           finite_at_least)
from ..provenance import command_provenance, recorded_commit, uncommitted_changes, uncommitted_note
from .compare import check_run_names, kept_result
from .config import assign_text, load_config
from .launch import StopSignals, device_description, end_with_parent

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STRATEGIES = ("ddp", "fsdp2")
# the fields every run sets for itself (a --set of them would come after, and win), and why
SWEEP_FIELDS = {"train.global_batch": "use --micro-batch", "train.micro_batch": "use --micro-batch",
                "train.strategy": "use --strategies", "train.steps": "use --steps",
                "train.seed": "use --noise-seeds: each row's seed is the one it trained with",
                "train.out_dir": "use --out: every run has its own folder",
                "train.resume": "every run trains from scratch",
                "train.eval_every": "every run is evaluated once, at its end"}


def plan(configs: List[str], names: List[str], gpus: List[int], strategies: List[str],
         noise_seeds: List[int]) -> List[dict]:
    """The runs in launch order: for each model, the one-process runs first (every noise seed
    for the first strategy), then each larger count."""
    jobs = []
    for config, name in zip(configs, names):
        for n in sorted(gpus):
            for i, strategy in enumerate(strategies):
                seeds = noise_seeds if (n == min(gpus) and i == 0) else noise_seeds[:1]
                jobs += [dict(model=name, config=config, gpus=n, strategy=strategy, seed=s) for s in seeds]
    return jobs


def shared_global_batch(micro_batch: int, gpus: List[int]) -> int:
    """One global batch that every process count in ``gpus`` splits into whole micro-batches:
    ``micro_batch x lcm(gpus)``."""
    return micro_batch * math.lcm(*gpus)


def run_sets(job: dict, *, steps: int, micro_batch: int, global_batch: int, out_dir: str,
             extra_sets: List[str]) -> List[str]:
    """The ``--set`` assignments of one run (after the recipe file)."""
    return [f"train.strategy={job['strategy']}", f"train.steps={steps}", f"train.seed={job['seed']}",
            f"train.micro_batch={micro_batch}", f"train.global_batch={global_batch}",
            f"optim.warmup_steps={max(1, steps // 15)}", f"train.eval_every={steps}", f"train.save_every={steps}",
            "train.resume=none", "train.export_model=false", assign_text("train.out_dir", out_dir), "log.progress=false",
            f"log.every={max(1, steps // 10)}", *extra_sets]


def command(job: dict, sets: List[str]) -> List[str]:
    """The ``torchrun`` command line of one run, its recipe given the assignments ``sets`` (:func:`run_sets`)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={job['gpus']}",
           "-m", "falcon_fwa.train.cli", "--config", job["config"]]
    for s in sets:
        cmd += ["--set", s]
    return cmd


def launch_env(base) -> Dict[str, str]:
    """The environment of every run: ``base`` with NVLink multicast off and ``OMP_NUM_THREADS``
    1 unless ``base`` sets it (``torchrun`` sets 1 for more than one process only)."""
    return {"OMP_NUM_THREADS": "1", **base, **MULTICAST_OFF}


def efficiencies(rows: List[dict]) -> None:
    """Fill ``efficiency`` in place: tokens/s at N / (N x the reference rate), per model and
    strategy; the reference is the mean tokens/s of that model and strategy's rows at the
    smallest process count of its rows (every seed there), scaled by that count. Where no row
    there has a rate (failed, stopped), that model and strategy get no efficiency: a larger
    count is not made its own reference."""
    low: Dict[tuple, int] = {}
    for r in rows:
        key = (r["model"], r["strategy"])
        low[key] = min(low.get(key, r["gpus"]), r["gpus"])
    ref: Dict[tuple, float] = {}
    for key, n in low.items():
        rates = [r["tokens_per_s"] for r in rows if (r["model"], r["strategy"]) == key and r["gpus"] == n
                 and r.get("tokens_per_s") is not None]
        if rates:
            ref[key] = sum(rates) / len(rates) / n
    for r in rows:
        per_gpu = ref.get((r["model"], r["strategy"]))
        ok = per_gpu is not None and r.get("tokens_per_s") is not None
        r["efficiency"] = r["tokens_per_s"] / (r["gpus"] * per_gpu) if ok else None


def markdown(rows: List[dict], meta: dict) -> str:
    """The results table, the noise band and the commands."""
    warm = ", ".join(f"{w['model']}: {w['status']}" for w in meta.get("warmup") or [])
    seq_len = meta.get("seq_len")  # one length, or the length of each model where the recipes differ
    per_model = isinstance(seq_len, dict)
    tokens = "(" + ", ".join(f"{k}: {v}" for k, v in seq_len.items()) + ")" if per_model else seq_len
    smallest = min((r["gpus"] for r in rows), default=1)  # the reference count (one process, normally)
    reference = ("the mean one-process rate (all seeds)" if smallest == 1 else
                 f"the mean per-process rate of the {smallest}-process runs (all seeds)")
    note = uncommitted_note(meta["dirty"]) if "dirty" in meta else ""  # (a header recorded before dirty was)
    out = ["# Multi-GPU scaling", "",
           f"Machine: {meta.get('machine', '?')}; commit {_commit_text(meta)}{note}; {meta.get('steps')} steps of "
           f"{meta.get('global_batch')} rows x {tokens} tokens (micro batch {meta.get('micro_batch')} "
           f"per process; fewer processes accumulate gradients), the same for every run"
           f"{' of a model' if per_model else ''}. Efficiency: tokens/s over "
           f"N times {reference} of the same model and strategy. Tokens/s excludes each "
           f"run's first steps (allocation and warm-up); OMP_NUM_THREADS={meta.get('omp_num_threads', '?')} in every run"
           + (f"; an untimed warm-up run of {meta.get('warmup_steps')} steps per model filled the kernel caches "
              f"first ({warm})." if warm else "."), "",
           "| model | strategy | GPUs | seed | tokens/s | efficiency | peak memory / GPU | val loss | status |",
           "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tok = f"{r['tokens_per_s']:,.0f}" if r.get("tokens_per_s") else "-"
        eff = f"{100 * r['efficiency']:.1f} %" if r.get("efficiency") is not None else "-"
        mem = f"{r['peak_mem_bytes_per_gpu'] / 2**30:.2f} GiB" if r.get("peak_mem_bytes_per_gpu") else "-"
        val = f"{r['val_loss']:.4f}" if r.get("val_loss") is not None else "-"
        out.append(f"| {r['model']} | {r['strategy']} | {r['gpus']} | {r['seed']} | {tok} | {eff} | {mem} | {val} | "
                   f"{r['status']} |")
    out += ["", f"## Validation loss against the {_processes(smallest)} noise", ""]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r.get("val_loss") is not None]
        if not mine:
            continue
        low = min(r["gpus"] for r in mine)
        noise = [r["val_loss"] for r in mine if r["gpus"] == low and r["strategy"] == mine[0]["strategy"]]
        spread = max(noise) - min(noise) if len(noise) > 1 else None
        line = f"- {model}: {_processes(low)} seeds {', '.join(f'{v:.4f}' for v in noise)}"
        if spread is not None:
            line += f" (spread {spread:.4f})"
        same = []
        for r in mine:
            base = [b for b in mine if b["gpus"] == low and b["strategy"] == r["strategy"] and b["seed"] == r["seed"]]
            if r["gpus"] != low and base:
                same.append((f"{r['strategy']} x{r['gpus']}", r["val_loss"] - base[0]["val_loss"]))
        if same:
            worst = max(abs(d) for _, d in same)
            line += f"; against the {low}-process run of the same strategy and seed: " + \
                    ", ".join(f"{name} {d:+.4f}" for name, d in same)
            if spread is not None:
                line += f" (largest {worst:.4f}: {'within' if worst <= spread else 'outside'} the seed spread)"
        out.append(line + ".")
    out += ["", "## Commands", ""] + [f"    {r['command']}" for r in rows]
    return "\n".join(out) + "\n"


def _commit_text(meta: dict) -> str:
    """The commit a table names: `` `C` ``, ``unknown`` outside a git checkout, ``?`` where ``meta`` names none."""
    if "commit" not in meta:
        return "?"
    return f"`{meta['commit']}`" if meta["commit"] else "unknown"


def _processes(n: int) -> str:
    """``one-process``, ``2-process``, ..."""
    return "one-process" if n == 1 else f"{n}-process"


def _write(results: str, rows: List[dict], meta: dict) -> None:
    write_json(results + ".json", rows)
    write_text(results + ".md", markdown(rows, meta))


def _read_summary(out_dir: str) -> Optional[dict]:
    path = os.path.join(out_dir, "summary.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="+", required=True, help="recipe files, one per model")
    parser.add_argument("--names", nargs="+", default=None, help="model names for the table (default: file names)")
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 2], help="process counts (GPUs) to run")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                        help="the train.strategy values to run, each at every --gpus count")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of every run")
    parser.add_argument("--micro-batch", type=int, default=None, help="rows per process (default: the recipe's)")
    parser.add_argument("--warmup-steps", type=int, default=20,
                        help="steps of an untimed run per model before its timed runs, to fill the kernel caches "
                             "(0: none)")
    parser.add_argument("--noise-seeds", nargs="+", type=int, default=[0, 1],
                        help="seeds of the one-process runs that measure run-to-run noise")
    parser.add_argument("--out", default="runs/scaling", help="folder of the runs")
    parser.add_argument("--results", default="results/multigpu", help="writes RESULTS.json and RESULTS.md")
    parser.add_argument("--deadline", type=float, default=None, help="seconds: no run starts after, the current stops")
    parser.add_argument("--machine", default=None, help="machine description for the table")
    parser.add_argument("--commit", default=None,
                        help="commit to record (default: the full commit of the checkout falcon-fwa runs from)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a recipe field in every run (repeatable; not one the sweep sets: "
                             + ", ".join(SWEEP_FIELDS) + ")")


def _check(args: argparse.Namespace, names: List[str]) -> None:
    check_run_names(names, args.configs)
    if any(n < 1 for n in args.gpus):
        raise ValueError(f"--gpus must be >= 1, got {args.gpus}")
    for option, values in (("--gpus", args.gpus), ("--strategies", args.strategies),
                           ("--noise-seeds", args.noise_seeds)):
        if len(set(values)) != len(values):
            raise ValueError(f"{option} must differ from each other, got {values}")
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if not args.noise_seeds:
        raise ValueError("--noise-seeds needs at least one seed")
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.micro_batch is not None and args.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {args.micro_batch}")
    finite_at_least("--deadline", args.deadline, 0, strict=True)
    check_output_folder("--out", args.out)
    if ends_in_separator(args.results):  # DIR/ would write DIR/.json
        raise ValueError(f"--results {args.results!r} ends in a separator: give the files' path without its suffix "
                         f"(RESULTS writes RESULTS.json and RESULTS.md)")
    for suffix in (".json", ".md"):
        check_output_file("--results", args.results + suffix)
    folders = [_folder_name(n) for n in names]
    if len(set(folders)) != len(folders):
        raise ValueError(f"--names {names} give the same run folders {folders} (spaces become '_')")
    for o in args.overrides:
        field = o.split("=", 1)[0].strip()
        if field in SWEEP_FIELDS:
            raise ValueError(f"--set {o}: the sweep sets {field} itself ({SWEEP_FIELDS[field]})")
    check_input_files("--configs", args.configs)
    import torch

    if torch.cuda.is_available() and max(args.gpus) > torch.cuda.device_count():
        raise ValueError(f"--gpus {max(args.gpus)}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _folder_name(name: str) -> str:
    return name.replace(" ", "_")


def _group_alive(pgid: int) -> bool:
    """Whether the process group ``pgid`` still has a member (a zombie not yet reaped counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member this process may not signal is still a member
        pass
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_group(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether ``proc`` and every other member of its group ended within ``seconds``."""
    end = time.monotonic() + seconds
    while proc.poll() is None or _group_alive(proc.pid):
        if time.monotonic() >= end:
            return False
        time.sleep(0.02)
    return True


def _stop_group(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM to ``proc``'s process group, then SIGKILL to what is left of the group after ``grace``
    seconds. Returns once ``proc`` has ended and no member of its group is left (its leader ending first
    is not enough: a worker may still be finishing its own shutdown), or 5 s after the SIGKILL."""
    _signal_group(proc.pid, signal.SIGTERM)
    if not _wait_group(proc, grace):
        _signal_group(proc.pid, signal.SIGKILL)
        _wait_group(proc, 5.0)
    proc.wait()


def _run_group(cmd: List[str], env: dict, log, timeout: Optional[float], grace: float = 30.0,
               signals: Optional[StopSignals] = None) -> Optional[int]:
    """Run ``cmd`` in a new session; past ``timeout`` seconds, or once ``signals`` has received a stop
    signal, stop its whole process group (torchrun's workers too: TERM, then KILL after ``grace``
    seconds). Returns the exit code, or None if stopped. Should this end otherwise (an error, a second
    signal), the group is killed."""
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=end_with_parent())
    end = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            try:
                return proc.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if (signals is not None and signals.received) or (end is not None and time.monotonic() >= end):
                _stop_group(proc, grace)
                return None
    finally:
        if proc.poll() is None:
            _stop_group(proc, 0.0)


def _earlier_rows(results: str) -> Dict[str, dict]:
    """The finished rows of an earlier sweep into ``results``, by command."""
    try:
        rows = read_json(results + ".json")
    except (OSError, ValueError):
        return {}
    return {r["command"]: r for r in rows if isinstance(r, dict) and r.get("status") == "done" and "command" in r}


def _run_dir(out: str, job: dict) -> str:
    """The folder of one run of the sweep."""
    return os.path.join(out, _folder_name(f"{job['model']}-{job['strategy']}-n{job['gpus']}-s{job['seed']}"))


def _check_recipes(args: argparse.Namespace, names: List[str], micro: int, global_batch: int) -> Dict[str, int]:
    """Every recipe as its runs will read it, before any run starts: a recipe or ``--set`` that does not
    load, or a local data source that names no file where a run would have to tokenize it (a run whose data
    folder holds no tokenized data yet), is named here rather than in the log of each run that fails on it.
    The sequence length of each model's runs, by name."""
    from ..data.prepare import source_files

    jobs = plan(args.configs, names, args.gpus, args.strategies, args.noise_seeds)
    lengths = {}
    for config, name in zip(args.configs, names):
        own = [job for job in jobs if job["model"] == name]
        cfg = load_config(config, run_sets(own[0], steps=args.steps, micro_batch=micro, global_batch=global_batch,
                                           out_dir=_run_dir(args.out, own[0]), extra_sets=args.overrides))
        lengths[name] = cfg.data.seq_len
        # (a run whose data folder holds tokens reads them, whether it is kept or runs again; an untimed
        # warm-up that fails is recorded and leaves the timed runs to go on)
        folders = {cfg.data.out_dir or os.path.join(_run_dir(args.out, job), "data") for job in own}
        if all(os.path.isfile(os.path.join(folder, "prepared.json")) for folder in folders):
            continue
        source_files(cfg.data.spec(), sorted(folders)[0], name=lambda field: f"--configs {config}: data.{field}")
    return lengths


def run(args: argparse.Namespace) -> int:
    names = args.names or [os.path.splitext(os.path.basename(c))[0] for c in args.configs]
    _check(args, names)
    first = load_config(args.configs[0], args.overrides)
    micro = args.micro_batch or first.train.micro_batch
    global_batch = shared_global_batch(micro, args.gpus)
    lengths = _check_recipes(args, names, micro, global_batch)
    seq_len = first.data.seq_len if len(set(lengths.values())) == 1 else lengths
    source = command_provenance(args)
    meta = dict(machine=args.machine or device_description(), **recorded_commit(args.commit, source), steps=args.steps,
                global_batch=global_batch, micro_batch=micro, seq_len=seq_len,
                warmup_steps=args.warmup_steps, warmup=[], checkout_commit=source["commit"])
    try:
        with folder_lock(args.out, ".scaling.lock", wait=False):
            return _sweep(args, names, meta, micro, global_batch)
    except BlockingIOError:
        raise ValueError(f"--out {args.out} is in use by another falcon-fwa scaling") from None


def _sweep(args: argparse.Namespace, names: List[str], meta: dict, micro: int, global_batch: int) -> int:
    deadline_at = None if args.deadline is None else time.monotonic() + args.deadline
    env = launch_env(os.environ)
    meta["omp_num_threads"] = env["OMP_NUM_THREADS"]
    # a run is kept only where its summary.json names the commit of this checkout and its uncommitted changes
    # (which the trainer records)
    earlier, commit, device = _earlier_rows(args.results), meta.get("checkout_commit"), device_description()
    changes = uncommitted_changes() if earlier else None
    rows: List[dict] = []
    jobs = plan(args.configs, names, args.gpus, args.strategies, args.noise_seeds)
    stopped_by = 0
    with StopSignals(True) as signals:
        for i, job in enumerate(jobs):
            what = f"{job['model']} {job['strategy']} x{job['gpus']} seed {job['seed']}"
            run_dir = _run_dir(args.out, job)
            sets = run_sets(job, steps=args.steps, micro_batch=micro, global_batch=global_batch, out_dir=run_dir,
                            extra_sets=args.overrides)
            cmd = command(job, sets)
            row = dict(model=job["model"], strategy=job["strategy"], gpus=job["gpus"], seed=job["seed"],
                       tokens_per_s=None, efficiency=None, peak_mem_bytes_per_gpu=None, val_loss=None, tokens=None,
                       steps=None, status="not run", command=" ".join(shlex.quote(c) for c in cmd), device=device,
                       omp_num_threads=env["OMP_NUM_THREADS"], commit=meta.get("commit"), dirty=meta.get("dirty"))
            same = earlier.get(row["command"])
            same = same if same is not None and (same.get("device"), same.get("omp_num_threads")) == (
                device, env["OMP_NUM_THREADS"]) else None  # timed on this machine, with the threads the table names
            kept = kept_result(same, run_dir, load_config(job["config"], sets).to_dict(), commit, changes,
                               f"[{i + 1}/{len(jobs)}] {what}")
            if kept is not None:
                rows.append(kept)
                print(f"[{i + 1}/{len(jobs)}] {what}: kept from the earlier sweep", flush=True)
                continue
            rows.append(row)
            left = None if deadline_at is None else deadline_at - time.monotonic()
            if stopped_by or (left is not None and left <= 0):
                continue
            if args.warmup_steps and job["model"] not in {w["model"] for w in meta["warmup"]}:
                meta["warmup"].append(_warm_up(job, args, micro, global_batch, env, left, signals))
                left = None if deadline_at is None else deadline_at - time.monotonic()
                stopped_by = signals.received
                if stopped_by or (left is not None and left <= 0):
                    continue
            print(f"[{i + 1}/{len(jobs)}] {what}", flush=True)
            log_path = run_dir + ".log"
            os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
            with open(log_path, "w") as log:
                code = _run_group(cmd, env, log, left, signals=signals)
            stopped_by = signals.received
            row["status"] = _status(code, log_path, stopped_by)
            summary = _read_summary(run_dir)
            if summary is not None and row["status"] == "done":
                row.update(tokens_per_s=summary.get("tokens_per_s"), val_loss=summary.get("val_loss"),
                           peak_mem_bytes_per_gpu=summary.get("peak_mem_bytes"), tokens=summary.get("tokens"),
                           steps=summary.get("steps"))
            efficiencies(rows)
            _write(args.results, rows, meta)
            if row["status"] == "done":
                rate, loss = row["tokens_per_s"], row["val_loss"]
                print(f"    done: {'-' if rate is None else f'{rate:,.0f}'} tokens/s, val loss "
                      f"{'-' if loss is None else f'{loss:.4f}'}", flush=True)
            else:
                print(f"    {row['status']}{_error_line(log_path)}", flush=True)
    efficiencies(rows)
    _write(args.results, rows, meta)
    if stopped_by:
        print(f"stopped by {signal.Signals(stopped_by).name}: the same command goes on from the finished runs",
              file=sys.stderr, flush=True)
        return 128 + stopped_by
    return 0 if all(r["status"] == "done" for r in rows) else 1


def _warm_up(job: dict, args: argparse.Namespace, micro: int, global_batch: int, env: dict,
             timeout: Optional[float], signals: Optional[StopSignals] = None) -> dict:
    """One short untimed run of ``job`` (``--warmup-steps`` steps): fills the kernel caches."""
    run_dir = os.path.join(args.out, _folder_name(f"{job['model']}-warmup"))
    cmd = command(job, run_sets(job, steps=args.warmup_steps, micro_batch=micro, global_batch=global_batch,
                                out_dir=run_dir, extra_sets=args.overrides))
    print(f"[warm-up] {job['model']} {job['strategy']} x{job['gpus']}, {args.warmup_steps} steps", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(run_dir + ".log", "w") as log:
        code = _run_group(cmd, env, log, timeout, signals=signals)
    return dict(model=job["model"], status=_status(code, run_dir + ".log", signals.received if signals else 0))


def _error_line(log_path: str) -> str:
    """``'\n    LINE'``: the last ``falcon-fwa ...: error:`` line of a run's log (what stopped it), or ''."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.startswith("falcon-fwa ") and ": error: " in line]
    except OSError:
        return ""
    return f"\n    {lines[-1]}" if lines else ""


def _status(code: Optional[int], log_path: str, stopped_by: int = 0) -> str:
    """A run's status from its exit code (``None``: stopped, by ``stopped_by`` or else the deadline)."""
    if code is None:
        return f"stopped: {signal.Signals(stopped_by).name}" if stopped_by else "stopped: deadline"
    return "done" if code == 0 else f"failed (exit {code}, {log_path})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="falcon-fwa scaling", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    from ..cli import run_command

    return run_command("falcon-fwa scaling", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
