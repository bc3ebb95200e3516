"""``falcon-fwa addition-compare``: train the Table-3 lineup under one budget and seeds.

Each (model, seed) is one ``falcon-fwa addition`` run in its own process
(``--jobs`` of them at a time, e.g. several on one GPU), writing to
``<runs>/<model>/seed<seed>/``; finished runs are skipped when the command is
started again, so an interrupted comparison resumes. The summary goes to
``<results>/<name>.json`` (a list of rows with ``model``, ``mean_acc_33_48``,
``acc_d33``, ``acc_d48``, ``val_acc``, ``best_step``, ``seeds``: means over seeds, with
``*_std`` and per-seed values), ``<name>_meta.json`` (budget, operand order, base, seeds,
device, wall time, command, commit, ``dirty`` (whether that commit's checkout had uncommitted changes to tracked
files) and the reference scores of :mod:`.reference` on the OOD set),
``<name>.md`` (the table next to the paper's numbers),
``<name>.png`` (accuracy against digit width) and ``<name>_positions.png`` (accuracy by answer
position at the largest training width and the first and last OOD widths).

A SIGTERM, SIGINT or SIGHUP is passed on to the runs in progress, which stop at the end of their step
with a checkpoint; the command waits for them and ends with exit status 128 + the signal number, without a
summary (the same command resumes the runs). A second SIGTERM or SIGINT ends the command at once; its runs,
told to stop by the first, still stop at their step (after a second SIGINT they are killed; their last
checkpoints stand).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from ...provenance import command_provenance, uncommitted_note
from ...cli_options import at_least, check_output_folder, check_seed, finite_at_least
from .cli import add_model_arguments, check_machine_options, check_model_config, preset_from_args, slug
from .data import width_set
from .lineup import BASELINES, LINEUP, PAPER_TABLE3, resolve_model
from .reference import reference_scores
from .train import (check_same_setup, check_same_task, held_task, run_lock, runs_folder, sample_fields, task_fields,
                    task_suffixes)
from ...train.launch import StopSignals, end_with_parent
from ...atomic import folder_lock, read_json, write_json, write_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(LINEUP),
                   help=f"paper names to train (default: all of {', '.join(LINEUP)})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (same for every model)")
    add_model_arguments(p)
    p.add_argument("--jobs", type=int, default=1, help="runs trained at the same time (processes)")
    p.add_argument("--runs", help="folder of the individual runs (default runs/addition/<preset>, with "
                                  "-lsd, -base<b> and -abacus<K> appended for --operand-order lsd, --base b "
                                  "and --abacus-offset K)")
    p.add_argument("--results", default="results/addition", help="folder of the summary files")
    p.add_argument("--name", help="summary file stem (default: the preset name, with _lsd, _base<b> and "
                                  "_abacus<K> appended for --operand-order lsd, --base b and --abacus-offset K)")
    p.add_argument("--no-train", action="store_true", help="only summarize the runs already in --runs")
    p.add_argument("--partial", action="store_true",
                   help="also summarize unfinished runs (their best evaluation so far; 'steps_done' says how far)")
    p.add_argument("--deadline", type=float,
                   help="seconds after which unfinished runs are stopped at a step, with a checkpoint; "
                        "the table then uses the seeds every model finished")


def _run_dir(runs: Path, model: str, seed: int) -> Path:
    return runs / slug(model) / f"seed{seed}"


def _finished(run_dir: Path, steps: int) -> bool:
    """Has the run in ``run_dir`` done its ``steps`` (the budget asked for; a run finished under a shorter
    one is continued, as ``falcon-fwa addition`` does)?"""
    f = run_dir / "results.json"
    if not f.exists():
        return False
    r = read_json(f)
    return bool(r.get("finished", False)) and r.get("steps_done") == steps


def _started(run_dir: Path) -> bool:
    f = run_dir / "results.json"
    return f.exists() and read_json(f).get("best") is not None


def unfinished_runs(runs: Path, models: List[str], seeds: List[int], steps: int) -> List[str]:
    """The lineup's runs that are missing or have not done ``steps`` (:func:`_finished`), as the
    summary lists them."""
    out = []
    for s in seeds:
        for m in models:
            run_dir = _run_dir(runs, m, s)
            if not (run_dir / "results.json").exists():
                out.append(f"{m} seed {s} (no run)")
            elif not _finished(run_dir, steps):
                done = read_json(run_dir / "results.json").get("steps_done")
                out.append(f"{m} seed {s} (unfinished: {done} of {steps} steps)")
    return out


def check_runs_task(runs: Path, models: List[str], seeds: List[int], task: Dict[str, Any]) -> None:
    """A ``ValueError`` if a run folder of the lineup holds a run of another task (operand order or
    base, :data:`.train.TASK_DEFAULTS`; runs from before an option count as its default): it would
    be skipped as finished, or summarized, under the wrong task."""
    for m in models:
        for s in seeds:
            f = _run_dir(runs, m, s) / "results.json"
            if f.exists():
                check_same_task(held_task(read_json(f)), task, f.parent, "give --runs another folder")


def _wanted_setup(model: str, seed: int, preset, eval_seed: int, dtype: str,
                  preset_name: Optional[str] = None) -> Dict[str, Any]:
    """The settings of the lineup's run of ``model`` and ``seed``, as :func:`.train.check_same_setup` takes them."""
    wanted = {"config_fields": resolve_model(model), "eval_seed": eval_seed, "preset": preset.to_dict(),
              "seed": seed, "dtype": dtype, "model": model}
    if preset_name is not None:
        wanted["preset_name"] = preset_name
    return wanted


def completed_run(run_dir: Path, model: str, seed: int, preset, eval_seed: int, dtype: str,
                  preset_name: Optional[str] = None) -> bool:
    """Does ``run_dir`` hold the finished run of ``model`` and ``seed`` that the lineup asked for: a
    ``results.json`` finished at the ``preset``'s steps (:func:`_finished`, what a relaunch skips) that names
    this model and seed and holds this task and setup (:func:`.train.check_same_task`,
    :func:`.train.check_same_setup`)? How a launched run whose process ended with a status other than 0 is
    judged: a signal that comes as it exits, once its results are written (a stop passed on as it ends, the
    deadline's), ends it by that signal, and plots that fail after the results end it with an error, yet the
    run is done (its missing plots are drawn then, :func:`tidy_finished_run`)."""
    if not _finished(run_dir, preset.steps):
        return False
    held = read_json(run_dir / "results.json")
    if held.get("model") != model or held.get("seed") != seed:
        return False
    try:
        check_same_task(held_task(held), task_fields(preset), run_dir, "")
        check_same_setup(held, _wanted_setup(model, seed, preset, eval_seed, dtype, preset_name), run_dir, "")
    except ValueError:
        return False
    return True


def check_runs_setup(runs: Path, models: List[str], seeds: List[int], preset, eval_seed: int, dtype: str,
                     preset_name: Optional[str] = None) -> None:
    """A ``ValueError`` if a run folder of the lineup holds a run of another model config, evaluation
    seed or preset (:func:`.train.check_same_setup`; a shorter budget is continued, not refused): it
    would be skipped as finished, or summarized, under the budget and size of this command. The error names
    the option as this command takes it (``--lr``, ``--seeds``, ``--models``); ``preset_name``, the
    ``--preset`` given, lets it say where the run's preset was another."""
    for m in models:
        for s in seeds:
            f = _run_dir(runs, m, s) / "results.json"
            if f.exists():
                wanted = _wanted_setup(m, s, preset, eval_seed, dtype, preset_name)
                check_same_setup(read_json(f), wanted, f.parent, "give --runs another folder",
                                 options={"seed": "--seeds", "config_fields": "--models"})


SUMMARY_LOCK = ".addition-compare.lock"
"""The lock file that ``addition-compare`` holds in its ``--results`` folder while it writes a summary there
(:func:`summary_lock`); removed when it lets go."""


def summary_files(name: str) -> List[str]:
    """The files a summary of stem ``name`` consists of (with the copies of replaced ones,
    :func:`keep_replaced_notes`, ``{name}.before.md``, ``{name}.before-2.md``, ... beside them)."""
    return [f"{name}.json", f"{name}_meta.json", f"{name}.md", f"{name}.png", f"{name}_positions.png"]


def _temporary_pattern(stem: str, suffix: str) -> str:
    """A regular expression of the names :func:`falcon_fwa.atomic.atomic_path` gives the temporary files of a
    file ``stem + suffix`` (``stem`` given as a regular expression): ``.{stem}.``, then ``tempfile.mkstemp``'s 8
    characters, then ``.tmp{suffix}``. No other file's temporaries match (``t`` does not take those of ``t.x``,
    ``tt`` or ``t_meta``)."""
    return rf"\.{stem}\.[a-z0-9_]{{8}}\.tmp{re.escape(suffix)}"


def remove_stale_summary_temporaries(folder: Path, name: str) -> List[str]:
    """Remove from ``folder`` the temporary files of the atomic writes of a summary ``name`` (its
    :func:`summary_files` and the ``{name}.before*.md`` copies) that a command killed during the write left
    there; the names removed. Only under :func:`summary_lock`: every writer of these files holds it, so none
    is alive while it is held."""
    patterns = [_temporary_pattern(re.escape(Path(f).stem), Path(f).suffix) for f in summary_files(name)]
    patterns.append(_temporary_pattern(re.escape(name) + r"\.before(?:-[0-9]+)?", ".md"))
    stale = re.compile("|".join(f"(?:{p})" for p in patterns))
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in sorted(os.listdir(folder)):
            if stale.fullmatch(entry) and not os.path.isdir(folder / entry):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(folder / entry)
                    removed.append(entry)
    return removed


@contextlib.contextmanager
def summary_lock(folder: Path, name: str):
    """Hold ``folder``'s summary lock (:data:`SUMMARY_LOCK`; another ``addition-compare`` writing a summary
    there makes this wait) for the block, and first remove the stale temporary files of the summary ``name``
    (:func:`remove_stale_summary_temporaries`). The lock file is removed before the lock is let go, so that
    none stays in the folder (a waiter then locks the one made again, :func:`falcon_fwa.atomic.folder_lock`)."""
    with folder_lock(folder, SUMMARY_LOCK):
        try:
            remove_stale_summary_temporaries(folder, name)
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(folder / SUMMARY_LOCK)


def tidy_finished_run(run_dir: Path) -> Optional[List[Path]]:
    """Put right, where no live process trains it (its lock, :func:`.train.run_lock`, is free), the folder of a
    finished run that this command skips (not started again, which would do it) or whose process ended after
    its results were complete: remove the temporary files a kill during its writes left (those of its own
    files, :data:`.train._TEMPORARIES`), and draw the plots its results call for and it lacks
    (:func:`.plot.missing_run_plots`: they failed, or a signal cut them short, after the results were written).
    The plots drawn; ``None`` where a live process holds the lock (nothing is touched), where this command may
    not write ``run_dir`` (a read-only folder, another user's: summarizing its runs writes nothing there), or
    there is no run in it. A plot that fails again is reported and left for the next command."""
    from .plot import missing_run_plots, plot_run

    if not (run_dir / "results.json").exists():
        return None
    try:
        with run_lock(run_dir):
            results = read_json(run_dir / "results.json")
            if not missing_run_plots(results, run_dir):
                return []
            try:
                return plot_run(results, run_dir)
            except Exception as err:  # the summary still comes; the next command tries again
                print(f"addition-compare: the plots of {run_dir} could not be drawn ({type(err).__name__}: {err}); "
                      "the next addition-compare, or the run's own command, draws them", file=sys.stderr)
                return []
    except ValueError:  # trained by another live process: its temporary files may be in use
        return None
    except OSError as err:
        if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return None
        raise


def report_missing_plots(runs: Path, models: List[str], seeds: List[int], steps: int) -> List[str]:
    """Lines naming the finished runs of the lineup in ``runs`` whose folder lacks plots its results call for
    (:func:`.plot.missing_run_plots`), and how to draw them: what ``--no-train``, which writes nothing in
    ``--runs``, says of them."""
    from .plot import missing_run_plots

    lines = []
    for s in seeds:
        for m in models:
            run_dir = _run_dir(runs, m, s)
            if _finished(run_dir, steps):
                missing = missing_run_plots(read_json(run_dir / "results.json"), run_dir)
                if missing:
                    lines.append(f"addition-compare: {run_dir}: {', '.join(missing)} missing (the run's plots "
                                 "failed after its results were written); the lineup without --no-train, or the "
                                 "run's own command, draws them")
    return lines


def _command(args: argparse.Namespace, model: str, seed: int, out: Path) -> List[str]:
    cmd = [sys.executable, "-m", "falcon_fwa.tasks.addition.cli", "--model", model, "--seed", str(seed),
           "--out", str(out), "--no-progress", "--preset", args.preset, "--device", args.device,
           "--dtype", args.dtype, "--eval-seed", str(args.eval_seed)]
    for flag in ("steps", "batch_size", "lr", "hidden_size", "num_hidden_layers", "num_heads", "matmul_precision",
                 "curriculum_steps", "operand_order", "base", "abacus_offset", "eval_every", "val_per_width",
                 "ood_per_width", "threads"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    for flag in ("train_widths", "ood_widths"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", *map(str, value)]
    return cmd


def _runs(n: int) -> str:
    """``n`` runs, in words: ``1 run``, ``2 runs``, ``0 runs``."""
    return f"{n} run" + ("" if n == 1 else "s")


def train_all(args: argparse.Namespace, runs: Path) -> tuple:
    """Run every missing (model, seed) with at most ``args.jobs`` processes; return the failures and
    the signal number that stopped the command (0 if none did). A run fails where its process ends with a
    status other than 0 and its ``results.json`` is not the finished run asked for (:func:`completed_run`):
    one that a signal ended after its results were written is finished, as a relaunch, which skips it, finds.
    The progress bar counts the runs that finished; the failed ones are counted beside it (``1 failed``), each
    named in a ``FAILED:`` line.

    A SIGTERM, SIGINT or SIGHUP is passed on to the runs in progress (each stops at the end of its step with a
    checkpoint) and waited for; nothing more is started. The runs are started in sessions of their own,
    so that a Ctrl-C at a terminal reaches them once, through this command. Should this command end
    otherwise (a second SIGINT, an error), the runs still going are killed; should it be killed itself
    (SIGKILL), each run gets a SIGHUP (``end_with_parent``) and stops at its checkpoint: none trains on unseen."""
    from tqdm.auto import tqdm

    # seed-major order: every model's first seed is trained before any second seed
    preset = preset_from_args(args)
    steps = preset.steps
    todo = [(m, s) for s in args.seeds for m in args.models if not _finished(_run_dir(runs, m, s), steps)]
    failed: List[str] = []
    running: List[tuple] = []
    bar = tqdm(total=len(todo), desc="addition runs", dynamic_ncols=True)
    t0 = time.perf_counter()

    def done(proc, model: str, seed: int) -> bool:
        """Has the run ended finished: status 0, or its complete results written before its process ended
        otherwise (:func:`completed_run`: a signal that came as it was ending)?"""
        return proc.returncode == 0 or completed_run(_run_dir(runs, model, seed), model, seed, preset,
                                                     args.eval_seed, args.dtype, args.preset)

    def stop(how, signum, why: str) -> int:
        """Stop the runs going and wait for them; return how many stopped unfinished. The bar counts
        only those that ended their last step meanwhile."""
        for proc, _, _, _ in running:
            how(proc, signum)
        stopped = 0
        for proc, model, seed, logf in running:
            proc.wait()
            logf.close()
            if done(proc, model, seed):  # it ended its last step meanwhile
                bar.update(1)
            else:
                stopped += 1
                failed.append(f"{model} seed {seed} ({why}, exit {proc.returncode})")
        running.clear()
        return stopped

    stopped_by = 0
    with StopSignals(True) as signals:
        try:
            while todo or running:
                if signals.received:
                    stopped_by = signals.received
                    name = signal.Signals(stopped_by).name
                    n = stop(lambda proc, sig: proc.send_signal(sig), stopped_by, f"stopped by {name}")
                    failed += [f"{m} seed {s} (not started: stopped by {name})" for m, s in todo]
                    bar.write(f"{name}: stopped {_runs(n)} at {'its checkpoint' if n == 1 else 'their checkpoints'}, "
                              f"{len(todo)} not started")
                    break
                if args.deadline is not None and time.perf_counter() - t0 > args.deadline:
                    n = stop(lambda proc, sig: proc.terminate(), None, "stopped at the deadline")
                    failed += [f"{m} seed {s} (not started before the deadline)" for m, s in todo]
                    bar.write(f"deadline of {args.deadline:.0f} s reached: stopped {_runs(n)}, {len(todo)} not started")
                    break
                while todo and len(running) < args.jobs:
                    model, seed = todo.pop(0)
                    out = _run_dir(runs, model, seed)
                    out.mkdir(parents=True, exist_ok=True)
                    logf = open(out / "log.txt", "a")
                    proc = subprocess.Popen(_command(args, model, seed, out), stdout=logf, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=end_with_parent())
                    running.append((proc, model, seed, logf))
                time.sleep(1.0)
                for item in list(running):
                    proc, model, seed, logf = item
                    if proc.poll() is None:
                        continue
                    logf.close()
                    running.remove(item)
                    if not done(proc, model, seed):  # the bar counts the finished runs, and the failed apart
                        failed.append(f"{model} seed {seed} (exit {proc.returncode}, see "
                                      f"{_run_dir(runs, model, seed)}/log.txt)")
                        bar.write(f"FAILED: {failed[-1]}")
                        bar.set_postfix_str(f"{len(failed)} failed")
                    else:
                        bar.update(1)
                        best = read_json(_run_dir(runs, model, seed) / "results.json")["best"]
                        late = (f" (finished; its process then ended with exit {proc.returncode})"
                                if proc.returncode else "")
                        bar.write(f"{model} seed {seed}: val {best['val_acc']:.1f}% "
                                  f"ood mean {best['mean_acc_ood']:.1f}%{late}")
        finally:
            for proc, _, _, logf in running:  # ended otherwise: no run goes on training unseen
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                logf.close()
            bar.close()
    return failed, stopped_by


def _mean_std(xs: List[float]) -> tuple:
    m = sum(xs) / len(xs)
    return m, (math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0)


def summarize(results: Dict[str, List[Dict[str, Any]]], rounded: bool = True) -> List[Dict[str, Any]]:
    """One row per model: means (and sample standard deviations) over its seeds, rounded as the summary JSON
    keeps them (two decimals; the per-seed wall times one), or with ``rounded=False`` not rounded: the figures
    :func:`markdown` formats, so that a table's one decimal is that of the mean itself, not of its two-decimal
    rounding (a mean of 82.251 is 82.25 in the JSON and 82.3 in the table, not 82.2)."""
    def rnd(x: float, places: int) -> float:
        return round(x, places) if rounded else x

    rows = []
    for model, rs in results.items():
        lo, hi = rs[0]["preset"]["ood_widths"]
        keys = {f"mean_acc_{lo}_{hi}": "mean_acc_ood", f"acc_d{lo}": f"acc_d{lo}", f"acc_d{hi}": f"acc_d{hi}",
                "val_acc": "val_acc", f"digit_mean_acc_{lo}_{hi}": "digit_mean_acc_ood",
                f"digit_acc_d{lo}": f"digit_acc_d{lo}", f"digit_acc_d{hi}": f"digit_acc_d{hi}",
                "val_digit_acc": "val_digit_acc", "best_step": "step"}
        row: Dict[str, Any] = {"model": model, "seeds": [r["seed"] for r in rs]}
        for out_key, key in keys.items():
            mean, std = _mean_std([float(r["best"][key]) for r in rs])
            row[out_key] = rnd(mean, 2)
            row[f"{out_key}_std"] = rnd(std, 2)
        row["per_seed"] = [{"seed": r["seed"], "best_step": r["best"]["step"],
                            "mean_acc_ood": rnd(r["best"]["mean_acc_ood"], 2),
                            "val_acc": rnd(r["best"]["val_acc"], 2), "wall_time_s": rnd(r["wall_time_s"], 1)}
                           for r in rs]
        row["steps_done"] = [r["steps_done"] for r in rs]
        row["config_fields"] = rs[0]["config_fields"]
        row["parameters"] = rs[0]["parameters"]
        row["paper"] = PAPER_TABLE3.get(model)
        rows.append(row)
    return rows


def _fmt(row: Dict[str, Any], key: str, digits: int = 1) -> str:
    std = row.get(f"{key}_std", 0.0)
    return f"{row[key]:.{digits}f}" + (f" ± {std:.{digits}f}" if len(row["seeds"]) > 1 else "")


def _wall_time(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    if meta.get("wall_time_s") is not None:
        return f"wall time of the comparison: {meta['wall_time_s']:.0f} s"
    walls = [p["wall_time_s"] for r in rows for p in r["per_seed"]]
    return (f"wall time of each run: {min(walls):.0f}-{max(walls):.0f} s (a summary of runs trained before it; "
            "the JSON's `per_seed` gives each)")


def _verdict(rows: List[Dict[str, Any]], mean_key: str, paper_widths: bool = True) -> List[str]:
    """The goal's lines: Falcon-3A.3 against the paper's figure (only where the run's widths are the
    paper's: training 1-32, OOD 33-48) and against every other model of the run, on the means as the summary
    JSON keeps them (two decimals), which :func:`_points` states in full: rows not rounded (see
    :func:`summarize`) are rounded so first, and the verdict is the JSON's."""
    by = {r["model"]: {**r, mean_key: round(r[mean_key], 2), f"digit_{mean_key}": round(r[f"digit_{mean_key}"], 2)}
          for r in rows}
    target = "Falcon-3A.3"
    if target not in by:
        return []
    paper = PAPER_TABLE3[target]["mean_acc_33_48"]
    lines = []
    if not paper_widths:
        lines.append(f"- The paper's {paper:.1f} is a mean over widths 33-48 after training on widths 1-32; this run "
                     "has other widths, so its figures are not set against it.")
    for key, measure in ((mean_key, "exact-match"), (f"digit_{mean_key}", "per-digit")):
        if not paper_widths:
            break
        ours = by[target][key]
        gap = ours - paper
        lines.append(f"- {target} mean {measure} accuracy {_points(ours)} vs the paper's {paper:.1f}: "
                     + ("target met" if gap >= 0 else f"short by {_points(-gap)} points") + f" ({_points(gap, '+')}).")
    ours = by[target][mean_key]
    for name, r in by.items():
        if name == target:
            continue
        d = ours - r[mean_key]
        kind = "baseline" if name in BASELINES else "variant"
        verdict = "tied" if d == 0 else ("ahead" if d > 0 else "behind") + f" by {_points(abs(d))}"
        lines.append(f"- vs {name} ({kind}): {_points(r[mean_key])}, {target} {verdict}.")
    return lines


def _points(x: float, sign: str = "") -> str:
    """Accuracy points to one decimal, or to two where one would hide the second (the verdict's keep two): a mean
    of 87.15 is not printed as the paper's 87.2, nor a lead of 0.04 as one of 0.0."""
    decimals = 1 if round(x, 1) == round(x, 2) else 2
    return f"{x:{sign}.{decimals}f}"


NOTES_HEADING = "\n## Notes\n\n"
"""Where :func:`markdown` puts the notes: the summary's last section."""


def markdown(rows: List[Dict[str, Any]], meta: Dict[str, Any]) -> str:
    lo, hi = meta["ood_widths"]
    mean_key = f"mean_acc_{lo}_{hi}"
    lines = [f"# Variable-length addition ({meta['preset_name']} preset)", "",
             f"Teacher-forced accuracy on the n+1 sum digits, at the best validation step; "
             f"training widths {meta['train_widths'][0]}-{meta['train_widths'][1]}, OOD widths {lo}-{hi}. "
             "'acc' = exact match of the whole answer; 'digits' = fraction of sum digits right. The paper's figures "
             "fit the per-digit reading: a model right on every answer position of the training widths and at "
             "chance past them scores a mean of 82.5-84.7 on widths 33-48, 97.4-100 at 33 and 70.6-72.4 at 48; the "
             "verdict below gives both.", "",
             "| model | steps run | best step | val. acc | mean acc | Acc@d%d/d%d | digits: mean / d%d / d%d | "
             "paper: best step | val. acc | mean acc | Acc@d33/d48 |" % (lo, hi, lo, hi),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r["paper"] or {}
        pv = lambda k: "-" if p.get(k) is None else f"{p[k]:g}"  # noqa: E731
        lines.append(
            f"| {r['model']} | {'/'.join(map(str, r['steps_done']))} | {_fmt(r, 'best_step', 0)} | {_fmt(r, 'val_acc')} | {_fmt(r, mean_key)} | "
            f"{r[f'acc_d{lo}']:.1f}/{r[f'acc_d{hi}']:.1f} | {_fmt(r, f'digit_{mean_key}')} / "
            f"{r[f'digit_acc_d{lo}']:.1f} / {r[f'digit_acc_d{hi}']:.1f} | {pv('best_step')} | {pv('val_acc')} | "
            f"{pv('mean_acc_33_48')} | {pv('acc_d33')}/{pv('acc_d48')} |")
    paper_widths = tuple(meta["train_widths"]) == (1, 32) and (lo, hi) == (33, 48)
    lines += ["", "## Against the paper's goal", ""] + _verdict(rows, mean_key, paper_widths)
    if meta.get("reference"):
        lines += ["", f"## Scale: what simple rules score on widths {lo}-{hi}", "",
                  "Rules that read every operand digit right and take each carry from the few places below "
                  "only (`reference.short_carry_answer`), and uniform guessing, on the same OOD samples:", "",
                  "| rule | digits | exact |", "|---|---|---|"]
        for key, v in meta["reference"].items():
            window = key.rsplit("_", 1)[-1]
            rule = ("uniform guessing" if key == "uniform" else "no carry" if window == "0"
                    else f"carry from the {window} place{'s' if window != '1' else ''} below")
            lines.append(f"| {rule} | {v['digit']:.1f} | {v['exact']:.1f} |")
    lines += ["", "## Run", "",
              f"- seeds: {meta['seeds']}; every model: {meta['size']} ({meta['steps']} steps, batch "
              f"{meta['batch_size']}, peak lr {meta['lr']}"
              + (f", widths growing from {meta['train_widths'][0]} to {meta['train_widths'][1]} over the first "
                 f"{meta['curriculum_steps']} steps" if meta.get("curriculum_steps") else "")
              + (", operands written least significant digit first"
                 if meta.get("operand_order", "msd") != "msd" else "")
              + (f", numbers in base {meta['base']} (uniform guessing scores {100 / meta['base']:.0f} % of the digits)"
                 if meta.get("base", 10) != 10 else "")
              + (f", each digit's place in its number embedded (training offset up to {meta['abacus_offset']})"
                 if meta.get("abacus_offset") is not None else "")
              + f"), {meta['val_per_width']} validation samples per "
              f"training width, {meta['ood_per_width']} test samples per OOD width",
              f"- device: {meta['device']}; " + _wall_time(rows, meta),
              f"- command: `{meta['command']}`", f"- commit: {meta['commit']}{_uncommitted(meta)}"]
    if meta.get("trained_by"):
        lines.append(f"- the runs were trained by: `{meta['trained_by']}`")
    if meta.get("failed"):
        lines.append(f"- failed runs: {meta['failed']}")
    if meta.get("notes"):
        lines += [NOTES_HEADING.rstrip("\n"), "", meta["notes"]]
    return "\n".join(lines) + "\n"


def _uncommitted(meta: Dict[str, Any]) -> str:
    """:func:`falcon_fwa.provenance.uncommitted_note` of the summary's ``dirty``; nothing for a summary written
    before ``dirty`` was recorded, or without a commit."""
    return uncommitted_note(meta["dirty"]) if "dirty" in meta and meta.get("commit") else ""


def written_notes(md_file: Path) -> str:
    """The notes section of a summary ``md_file`` (what follows :data:`NOTES_HEADING`, where
    :func:`markdown` put ``meta["notes"]`` or where they were written into the file by hand), or ``""``."""
    if not md_file.exists():
        return ""
    _, found, notes = md_file.read_text().partition(NOTES_HEADING)
    return notes.strip("\n") if found else ""


def keep_replaced_notes(md_file: Path) -> Optional[Path]:
    """Before a trained lineup replaces the summary ``md_file``: where that summary has notes (a record
    of earlier attempts, often written by hand), copy the whole file to the first free
    ``{name}.before.md``, ``{name}.before-2.md``, ... beside it and return that path; else ``None``.
    (A rewrite from finished runs, ``--no-train``, carries the notes over instead.)"""
    if not written_notes(md_file):
        return None
    stem, n = md_file.name[: -len(".md")], 1
    while True:
        kept = md_file.with_name(f"{stem}.before{'' if n == 1 else f'-{n}'}.md")
        if not kept.exists():
            write_text(kept, md_file.read_text())
            return kept
        n += 1


def _ood_reference(eval_seed: int, preset) -> Dict[str, Dict[str, float]]:
    """:func:`.reference.reference_scores` on the OOD samples the runs were tested on."""
    lo, hi = preset.ood_widths
    return reference_scores(width_set(eval_seed, range(lo, hi + 1), preset.ood_per_width, **sample_fields(preset)))


def _invocation() -> str:
    argv = sys.argv[1:]
    if argv[:1] == ["addition-compare"]:  # through the falcon-fwa command or python -m falcon_fwa.cli
        argv = argv[1:]
    return "falcon-fwa addition-compare " + " ".join(shlex.quote(a) for a in argv)


def check_compare_options(args: argparse.Namespace) -> None:
    """A ``ValueError`` naming the option for ``--jobs`` < 1 (nothing would ever start), a ``--deadline``
    that is not a finite number > 0, or a model or seed given twice in ``--models`` / ``--seeds`` (the
    same run would be trained by two processes at once, and counted as two seeds), or a ``--name`` that is
    not a plain file stem (empty, ``.`` or ``..``, or holding a path separator: its files would go outside
    ``--results``, or fail after the training, half written)."""
    at_least("--jobs", args.jobs, 1)
    name = getattr(args, "name", None)
    if name is not None and (name in ("", ".", "..") or "\0" in name
                             or any(sep and sep in name for sep in (os.sep, os.altsep, "/"))):
        raise ValueError(f"--name must be a file stem without a path separator (its files go to --results), "
                         f"got {name!r}")
    finite_at_least("--deadline", args.deadline, 0, strict=True)
    for seed in args.seeds:
        check_seed("--seeds", seed)
    for option, values in (("--models", args.models), ("--seeds", args.seeds)):
        twice = [v for i, v in enumerate(values) if v in values[:i]]
        if twice:
            raise ValueError(f"{option}: {twice[0]} is given more than once; give each once")


def run(args: argparse.Namespace) -> int:
    from .plot import plot_accuracy_vs_width, plot_lineup_positions

    check_machine_options(args)
    check_compare_options(args)
    for m in args.models:
        if m not in LINEUP:
            raise ValueError(f"--models: unknown {m!r}; choose from {', '.join(LINEUP)}")
        resolve_model(m, name="--models")
    preset = preset_from_args(args)
    for m in args.models:  # a model the size options do not fit is refused before any run starts
        check_model_config(args, m, resolve_model(m), preset, option="--models")
    task = task_fields(preset)  # runs and summaries of another task get their own default names
    runs = Path(args.runs or runs_folder(args.preset, task))
    check_output_folder("--runs", str(runs))
    check_output_folder("--results", args.results)
    name = args.name or "_".join([args.preset, *task_suffixes(task)])
    check_runs_task(runs, args.models, args.seeds, task)
    check_runs_setup(runs, args.models, args.seeds, preset, args.eval_seed, args.dtype, args.preset)
    # nothing to train (--no-train, or every run already finished): the summary has no wall time of its own
    trains = not args.no_train and any(not _finished(_run_dir(runs, m, s), preset.steps)
                                       for s in args.seeds for m in args.models)
    t0 = time.perf_counter()
    failed, stopped_by = train_all(args, runs) if trains else ([], 0)
    wall = time.perf_counter() - t0 if trains else None
    if stopped_by:  # the runs stopped at their checkpoints: no summary, the same command resumes them
        print(f"addition-compare: stopped by {signal.Signals(stopped_by).name}; the runs in progress stopped at "
              f"their checkpoints, and the same command resumes them (no summary written)", file=sys.stderr)
        return 128 + stopped_by
    if args.no_train:  # --runs is left alone: the plots a finished run lacks are named
        for line in report_missing_plots(runs, args.models, args.seeds, preset.steps):
            print(line)
    else:  # the finished runs, skipped or ended after their results: their temporaries and missing plots
        for s in args.seeds:
            for m in args.models:
                if _finished(_run_dir(runs, m, s), preset.steps):
                    for drawn in tidy_finished_run(_run_dir(runs, m, s)) or []:
                        print(f"addition-compare: drew {drawn}, which the finished run lacked")

    usable = _started if args.partial else (lambda run_dir: _finished(run_dir, preset.steps))
    # the table uses the seeds that every model finished, so all rows average the same seeds
    seeds = [s for s in args.seeds if all(usable(_run_dir(runs, m, s)) for m in args.models)]
    if not seeds:
        seeds = [s for s in args.seeds if any(usable(_run_dir(runs, m, s)) for m in args.models)][:1]
    results = {}
    for m in args.models:
        rs = [read_json(_run_dir(runs, m, s) / "results.json") for s in seeds if usable(_run_dir(runs, m, s))]
        if rs:
            results[m] = rs
    if not results:
        print("addition-compare: no finished runs to summarize")
        return 1
    rows = summarize(results)
    exact = summarize(results, rounded=False)  # for the .md: one decimal of each figure itself
    first = next(iter(results.values()))[0]
    summary_file = Path(args.results) / f"{name}.json"
    meta_file = Path(args.results) / f"{name}_meta.json"
    # a rewrite from finished runs (--no-train) records its own command and commit, and keeps the
    # command that trained the runs, if an earlier summary of this name recorded one, and its notes (the
    # notes section of its .md, which holds its meta's notes and what was written there by hand since, else
    # those of its meta)
    previous = read_json(meta_file) if meta_file.exists() and not trains else {}
    notes = "" if trains else written_notes(summary_file.with_suffix(".md")) or previous.get("notes", "")
    trained_by = previous.get("trained_by") or (
        previous["command"] if "--no-train" not in previous.get("command", "--no-train") else None)
    meta = {
        "preset_name": args.preset,
        "train_widths": list(preset.train_widths),
        "ood_widths": list(preset.ood_widths),
        "size": preset.size(),
        "steps": preset.steps,
        "batch_size": preset.batch_size,
        "lr": preset.lr,
        "curriculum_steps": preset.curriculum_steps,
        **task,
        "val_per_width": preset.val_per_width,
        "ood_per_width": preset.ood_per_width,
        "seeds": seeds,
        "seeds_asked": list(args.seeds),
        "device": first["device"],
        "torch": first["torch"],
        "wall_time_s": wall,
        "command": _invocation(),
        # the full commit of the falcon_fwa checkout that wrote the summary, and whether it had uncommitted
        # changes to tracked files (None where git cannot tell)
        **{k: v for k, v in command_provenance(args).items() if k in ("commit", "dirty")},
        "trained_by": trained_by,
        "platform": platform.platform(),
        # what this command's training left undone, or, with nothing trained, the runs' own state
        "failed": failed if trains else unfinished_runs(runs, args.models, args.seeds, preset.steps),
        "notes": notes,
        "eval_seed": args.eval_seed,
        "reference": _ood_reference(args.eval_seed, preset),
    }
    # under the folder's summary lock: the temporary files of this summary's writes that a command killed
    # during them left there are removed first
    with summary_lock(Path(args.results), name):
        kept = keep_replaced_notes(summary_file.with_suffix(".md")) if trains else None
        if kept is not None:
            print(f"addition-compare: the notes of {summary_file.with_suffix('.md')}, which this lineup replaces, "
                  f"are kept with that summary in {kept}")
        write_json(summary_file, rows)
        write_json(meta_file, meta)
        write_text(summary_file.with_suffix(".md"), markdown(exact, meta))
        plot = plot_accuracy_vs_width(results, summary_file.with_suffix(".png"),
                                      title=f"addition, {args.preset} preset, seeds {seeds}")
        # by answer position at the largest training width and the first and last OOD widths
        positions = plot_lineup_positions(results, summary_file.with_name(f"{name}_positions.png"),
                                          widths=sorted({preset.train_widths[1], *preset.ood_widths}),
                                          title=f"addition, {args.preset} preset, seeds {seeds}: best step")
    print(markdown(exact, meta))
    plots = "".join(f", {p}" for p in (plot, positions) if p)
    print(f"wrote {summary_file}, {meta_file}, {summary_file.with_suffix('.md')}" + plots)
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="falcon-fwa addition-compare", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # errors as falcon-fwa addition-compare's, one line
    from ...cli import run_command

    parser = argparse.ArgumentParser(prog="falcon-fwa addition-compare", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run_command("falcon-fwa addition-compare", run, parser.parse_args()))
