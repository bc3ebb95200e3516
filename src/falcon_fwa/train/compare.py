"""Train several recipes on the same data, tokens and schedule, then collect validation
perplexity, tokens/s and peak memory of each.

``falcon-fwa compare --configs configs/small/{falcon-1a.3,transformer}.yaml --names ... --deadline 380 --out runs/compare``

The recipes train one after another in this process, each alone on the device (so its
tokens/s and peak memory are its own), each from scratch in ``OUT/main/NAME`` (an earlier run
there is replaced, unless this command would train the very same: see the end). ``--concurrent`` starts them all at once as separate processes instead
(only sensible where one model leaves the device mostly idle).

Step count: every recipe trains for the same number of steps (the same tokens), with learning-
rate warmup over 1/15 of them and four evaluations. ``--steps`` fixes it; otherwise it is
calibrated up front. Calibration trains each recipe for ``--calib-warmup`` + ``--calib-steps``
steps with the real trainer and measures ``setup_s`` (building the trainer), ``first_step_s``
(kernel compilation and autotuning happen here), ``step_s`` (median of the steps after the
warm-up ones: steady state, compilation excluded) and one evaluation, checkpoint and export
(``eval_s``, ``save_s``, ``export_s``). The step count is the largest ``N`` with

    sum over recipes of (setup_s + 5 eval_s + save_s + export_s + N step_s) <= budget,

where the budget is the smaller of ``--time-budget`` and 90% of what ``--deadline`` leaves
after calibration (whichever are given); at least 20, capped by ``--max-steps``. A recipe whose calibration failed
adds the seconds it took to fail to the fixed costs (its run, trained all the same, spends them again where it
fails again). Compilation
is paid once per process, during calibration (same shapes as the real runs), so it is recorded
but not charged again. (With ``--concurrent``, calibration runs all recipes at once, from step 0 as the sequential one (``train.resume=none``), for
``--calib-steps`` steps and the slowest one's tokens/s sets the count for ``--time-budget``.) In either
mode a recipe whose calibration fails is left out of the plan (its error under ``calibration`` in the results
file) and trained all the same: failing again, it is marked ``failed`` like any other; only a calibration
that measures no recipe at all ends the command (one error line, every recipe ``not_run``, each one's
calibration error in the results file: :class:`CalibrationFailed`).

``--deadline`` (wall-clock seconds for the whole command) is enforced as well: the recipe
training when it passes stops at its next step boundary, is evaluated and is marked
``partial`` (its ``steps`` say how far it got); recipes not started are marked ``not_run``. A SIGTERM,
SIGINT or SIGHUP stops the sequential recipe in progress the same way, with a checkpoint but no evaluation
(``stopped``), marks the rest ``not_run`` and ends the command with 128 + the signal (one between two recipes
leaves the first as it ended; one during the calibration stops it at its step and trains no recipe, all
``not_run``). With ``--concurrent``
it stops every run in progress so (each is asked with a SIGHUP, which a run takes once), waits for them and
records each as it ended (``stopped`` with its checkpoint, ``done`` or ``failed``; its ``signal`` names the
command's), and ends the command with 128 + the signal too; one during the concurrent calibration trains no
recipe (all ``not_run``), even where every calibration run finished anyway; one that comes as the last main
run ends cuts nothing short: the comparison is marked finished, and the command still ends with 128 + the
signal; one as the results file is first written (every recipe pending there) starts no run: all ``not_run``,
the signal named. Each run has a session of its own
(a Ctrl-C at a terminal reaches it through this command only; under ``nohup`` it still takes the SIGHUP). A
second SIGTERM or SIGINT kills the runs still going at once (SIGKILL to each one's process group), records each
``killed`` (no checkpoint of its last steps; its ``signal`` names the second signal) and ends the command with
128 + that signal; a third ends this command as a second ends ``falcon-fwa train``. A recipe that
fails is marked ``failed`` (with its error; a ``--concurrent`` run's is its exit code and the error it printed last,
:func:`printed_error`) and the others go on; the command then ends with status 1.
Without ``--steps``, ``--time-budget`` or ``--deadline`` the recipes must share ``train.steps``.

``OUT/compare.json`` (or ``--results``) is rewritten atomically when a recipe starts and when
it ends: ``status`` gives every recipe's state (pending, running, done, partial, stopped, killed, failed,
not_run), ``runs`` the finished ones, so a killed command loses at most the recipe in progress
(``signal`` names the stop signal that ended the command).
Launched again into the same ``OUT``, the sequential runs keep each recipe that an earlier launch
finished (``done``) with the very recipe this launch would train (the same step count, overrides and
recipe file, read from its ``OUT/main/NAME/summary.json`` and compared setting by setting, the model as the one
it builds: an override restating the preset's own value is no other recipe) of the same code, on the same kind of
machine (``device``) with as many torch threads (``threads``): it is not trained
again and its run says ``"kept": true``. The same code is the same commit with the same uncommitted changes to
tracked files (the summary's ``diff_sha256``, :func:`falcon_fwa.provenance.uncommitted_changes`), or none on
either side; a summary without ``diff_sha256`` counts only where it is not ``dirty``. Outside a git checkout
nothing tells the code of a run from this one's, so every recipe trains again. Every other recipe trains afresh,
so the results never mix runs of other settings or code; one that an earlier launch finished is said in one line
(its name, and why it is not kept). (A calibrated step count is measured anew, so it rarely matches; the
``--concurrent`` runs always train afresh, their speeds depending on what runs beside them, and a sequential
launch keeps none of a ``--concurrent`` one's runs: ``compare.json``'s ``concurrent`` says which mode wrote it.)
One command runs in an ``OUT`` folder at a time; a ``--concurrent`` run's processes end with it.
The data are prepared before the results file is first written: a preparation that fails (a tokenizer that
does not load, an empty split) leaves ``OUT`` as it was, without the lock file or the folders this command made.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from contextlib import nullcontext
from typing import Iterator, List, Optional, Tuple

from ..atomic import folder_lock, make_folders, read_json, remove_created, write_json
from ..cli_options import at_least, check_input_files, check_output_file, check_output_folder, finite_at_least
from ..provenance import git_commit, uncommitted_changes, unlike_code
from .config import apply_overrides, assign_text, load_config, recipe_differences, recipe_parent
from .launch import LOCK_NAME as RUN_LOCK_NAME
from .launch import PARENT_ENDED, StopSignals, device_description, end_with_parent
from .logger import read_log

LOCK_NAME = ".compare.lock"  # in --out: one command at a time

_clock = time.monotonic  # every time in this module comes from here
MIN_STEPS = 20
EVALS_PER_RUN = 5  # eval_every = steps // 4: four evaluations, a fifth at the end when 4 does not divide steps
DEADLINE_SHARE = 0.9  # of the time left after calibration that the planned runs may fill

Event = Tuple[str, str, Optional[dict]]  # (name, status, result)


class StepClock:
    """The ``should_stop`` hook of ``Trainer.train``: notes the time of every step boundary and
    answers true once ``deadline_at`` (a ``_clock()`` value) has passed, or once ``signals`` (the
    :class:`StopSignals` the command holds) has received a stop signal."""

    def __init__(self, deadline_at: Optional[float] = None, signals: Optional[StopSignals] = None):
        self.deadline_at = deadline_at
        self.signals = signals
        self.start = _clock()
        self.marks: List[float] = []

    def __call__(self, step: int) -> bool:
        self.marks.append(_clock())
        return (self.deadline_at is not None and self.marks[-1] >= self.deadline_at) or _stopped_by(self.signals)

    def durations(self) -> List[float]:
        """Seconds of each step so far (the first includes everything since construction)."""
        times = [self.start] + self.marks
        return [b - a for a, b in zip(times[:-1], times[1:])]


def _stopped_by(signals: Optional[StopSignals]) -> Optional[str]:
    """The name of the stop signal ``signals`` has received (the second one's where a :class:`RunSignals` has
    received two), else None."""
    if signals is None or not signals.received:
        return None
    return signal.Signals(getattr(signals, "again", 0) or signals.received).name


def _fresh_dir(path: str) -> str:
    """``path`` emptied for a run from scratch; a ``ValueError`` naming it where a run still holds it (one of a
    launch killed just before, still ending its step: its folder is not removed under it)."""
    if os.path.isdir(path):
        try:
            with folder_lock(path, RUN_LOCK_NAME, wait=False):
                shutil.rmtree(path, ignore_errors=True)
        except BlockingIOError:
            raise ValueError(f"{path} is in use by a run still going (one of an earlier launch, ending its step?): "
                             "wait for it to end, then launch again") from None
    os.makedirs(path)
    return path


def _free_device() -> None:
    """Give the last trainer's device memory back before the next one starts."""
    import torch

    if torch.cuda.is_available():
        gc.collect()  # the model and optimizer may sit in reference cycles
        torch.cuda.empty_cache()


def _error(err: BaseException) -> dict:
    return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}


# ----------------------------------------------------------------------------- calibration
def calibrate_sequential(configs: List[str], names: List[str], sets: List[str], *, out_dir: str, warmup: int = 2,
                         steps: int = 6, deadline_at: Optional[float] = None,
                         signals: Optional[StopSignals] = None) -> dict:
    """Each recipe's costs (name -> dict, see the module docstring), from ``warmup + steps``
    steps of its real trainer in ``out_dir/NAME``. A recipe that fails gets ``{"error", "wall_s"}`` (the seconds
    from its start to the failure); one
    stopped by the deadline before its timed steps ``{"stopped": "deadline"}``. Once ``signals`` (what the
    command holds) has received a stop signal, the recipe calibrating stops at its step and the rest are not
    calibrated: ``"stopped"`` names the signal."""
    from .throughput import falcon_op_calls, op_backend
    from .trainer import Trainer

    out = {}
    for path, name in zip(configs, names):
        if _stopped_by(signals) or (deadline_at is not None and _clock() >= deadline_at):
            out[name] = {"stopped": _stopped_by(signals) or "deadline"}
            continue
        run_dir = _fresh_dir(os.path.join(out_dir, name))
        with warnings.catch_warnings():  # the recipe's warm-up outlasts these few steps by design: no warning
            warnings.filterwarnings("ignore", message=r"optim\.warmup_steps=\d+ exceeds train\.steps=",
                                    category=UserWarning)
            cfg = load_config(path, sets + [assign_text("train.out_dir", run_dir), f"train.steps={warmup + steps}",
                                            "train.eval_every=0", "train.save_every=0", "train.export_model=false",
                                            "train.resume=none", f"log.every={warmup + steps}",
                                            "log.progress=false"])
        print(f"calibrating {name}: {warmup} + {steps} steps", flush=True)
        trainer, t0 = None, _clock()
        try:
            trainer = Trainer(cfg)
            clock = StepClock(deadline_at, signals)
            with falcon_op_calls(trainer.core) as counts:
                trainer.train(should_stop=clock)
            durations = clock.durations()
            if len(durations) <= warmup:
                out[name] = {"stopped": _stopped_by(signals) or "deadline", "first_step_s": durations[0]}
                continue
            t_eval = _clock()
            trainer.evaluate()
            t_export = _clock()
            if load_config(path, sets).train.export_model:  # the real runs export their model
                trainer.export(os.path.join(run_dir, "model"))
            step_s = statistics.median(durations[warmup:])
            out[name] = {"setup_s": clock.start - t0, "first_step_s": durations[0],
                         "warmup_s": sum(durations[:warmup]), "step_s": step_s,
                         "timed_steps": len(durations) - warmup, "save_s": t_eval - clock.marks[-1],
                         "eval_s": t_export - t_eval, "export_s": _clock() - t_export,
                         "tokens_per_s": cfg.train.global_batch * cfg.data.seq_len / step_s if step_s else None,
                         "falcon_op": op_backend(counts, cfg.model, str(trainer.info.device)),
                         "wall_s": _clock() - t0}
            if len(durations) < warmup + steps:
                out[name]["stopped"] = _stopped_by(signals) or "deadline"
        except Exception as err:  # noqa: BLE001 - recorded; the main run shows the failure again
            out[name] = {**_error(err), "wall_s": _clock() - t0}  # what it took to fail (plan_steps charges it)
        finally:
            if trainer is not None:
                trainer.close()
            del trainer
            _free_device()
            for sub in ("checkpoints", "model"):
                shutil.rmtree(os.path.join(run_dir, sub), ignore_errors=True)
        times = "  ".join(f"{k} {v:.3f}" for k, v in out[name].items() if k.endswith("_s"))
        print(f"calibrated {name}: " + (f"{out[name]['error']} (after {out[name]['wall_s']:.3f} s)"
                                        if "error" in out[name] else times), flush=True)
    return out


class CalibrationFailed(ValueError):
    """The calibration measured no recipe: nothing to plan the step count from. Its text names each recipe's
    error briefly, on one line (the command's ``falcon-fwa compare: error:`` message)."""

    def __init__(self, calibration: dict):
        def brief(c) -> str:
            text = c.get("error") if isinstance(c, dict) else None
            if not text and isinstance(c, dict) and c.get("stopped"):
                text = f"stopped ({c['stopped']}) before its timed steps"
            text = " ".join(str(text or "no rate measured").split())
            return text if len(text) <= 200 else text[:199] + "…"

        super().__init__("calibration measured no recipe: "
                         + "; ".join(f"{n}: {brief(c)}" for n, c in calibration.items()))


def plan_steps(calibration: dict, budget_s: float) -> Tuple[int, dict]:
    """The largest step count whose runs fit ``budget_s`` (see the module docstring), and how;
    :class:`CalibrationFailed` where the calibration measured no recipe. A recipe whose calibration failed is
    trained all the same: the seconds it took to fail (its ``wall_s``) count among the fixed ones, as its run
    spends them again where it fails again."""
    measured = [c for c in calibration.values() if "step_s" in c]
    if not measured:
        raise CalibrationFailed(calibration)
    fixed = sum(c["setup_s"] + EVALS_PER_RUN * c["eval_s"] + c["save_s"] + c["export_s"] for c in measured)
    fixed += sum(c.get("wall_s") or 0.0 for c in calibration.values() if "error" in c and "step_s" not in c)
    per_step = sum(c["step_s"] for c in measured)
    fit = int((budget_s - fixed) // per_step) if budget_s > fixed else 0
    return fit, {"budget_s": budget_s, "fixed_s": fixed, "step_s_sum": per_step, "steps_fit": fit}


# ----------------------------------------------------------------------------- runners
def run_sequential(configs: List[str], names: List[str], out_dir: str, sets: List[str], tag: str, *,
                   deadline_at: Optional[float] = None, earlier: Optional[dict] = None,
                   signals: Optional[StopSignals] = None) -> Iterator[Event]:
    """Train every recipe in turn in this process, from scratch in ``out_dir/tag/NAME``. Yields
    ``(name, "running", None)`` before each and ``(name, status, result)`` after it: done,
    partial (stopped by ``deadline_at``, then evaluated), stopped (by a SIGTERM, SIGINT or SIGHUP, at the end of
    its step, with a checkpoint; the recipes after it are not_run, their result's ``signal`` naming it), failed
    or not_run. ``signals``: the :class:`StopSignals` the command holds throughout (then the trainer takes none
    of its own: a stop that comes between two recipes, or as one is set up, is kept too), else each trainer
    takes the signals while it trains. A run of ``earlier`` (name -> result of an earlier launch) that
    :func:`kept_result` keeps is yielded as done, untrained."""
    from .trainer import Trainer

    commit, stopped_by = git_commit(short=False), None
    changes = uncommitted_changes() if earlier else None  # (only an earlier result needs it)
    for cfg_path, name in zip(configs, names):
        run_dir = os.path.join(out_dir, tag, name)
        cfg = load_config(cfg_path, sets + [assign_text("train.out_dir", run_dir)])
        kept = kept_result((earlier or {}).get(name), run_dir, cfg.to_dict(), commit, changes, name)
        if kept is not None:
            yield name, "done", dict(kept, kept=True)
            continue
        stopped_by = stopped_by or _stopped_by(signals)
        if stopped_by is not None:
            yield name, "not_run", {"error": f"stopped by {stopped_by} before this recipe started",
                                    "signal": stopped_by}
            continue
        if deadline_at is not None and _clock() >= deadline_at:
            yield name, "not_run", {"error": "the deadline passed before this recipe started"}
            continue
        yield name, "running", None
        _fresh_dir(run_dir)
        t0, trainer, status = _clock(), None, "done"
        try:
            trainer = Trainer(cfg)
            clock = StepClock(deadline_at, signals)
            result = trainer.train(should_stop=clock, stop_on_signal=signals is None)
            result["first_step_s"] = clock.durations()[0]
            if _stopped_by(signals) and result["steps"] < cfg.train.steps:  # (the trainer's own stop names it)
                result["signal"] = _stopped_by(signals)
            if result.get("signal"):  # not evaluated: the command is asked to end
                status, stopped_by = "stopped", result["signal"]
            elif result["steps"] < cfg.train.steps:
                status = "partial"
                every = cfg.train.eval_every
                if not (every and result["steps"] % every == 0):  # not evaluated at this step yet
                    val = trainer.evaluate()
                    trainer.logger.log(result["steps"], **val)
                    result.update(val)
        except Exception as err:  # noqa: BLE001 - one failing recipe must not lose the others
            status, result = "failed", _error(err)
        finally:
            if trainer is not None:
                trainer.close()
            del trainer
            _free_device()
        result.update(status=status, planned_steps=cfg.train.steps, wall_s=_clock() - t0)
        if status != "failed":
            write_json(os.path.join(run_dir, "summary.json"), result)
        log_path = os.path.join(run_dir, "log.jsonl")
        if os.path.isfile(log_path):
            result["log"] = read_log(log_path)
        yield name, status, result


def kept_result(earlier: Optional[dict], run_dir: str, config: dict, commit: Optional[str],
                changes: Optional[str], name: Optional[str] = None) -> Optional[dict]:
    """``earlier`` (a finished run's result, status done) if ``run_dir`` still holds its ``summary.json``,
    of this ``config`` (``RunConfig.to_dict()`` of the recipe about to train there) and of the same code: this
    ``commit`` with these uncommitted changes (``changes``, :func:`falcon_fwa.provenance.uncommitted_changes`;
    the rule is :func:`falcon_fwa.provenance.unlike_code`'s); else None: the run goes again. With ``name``, an
    ``earlier`` result not kept is said in one line: the run's name and why."""
    why = _not_kept(earlier, run_dir, config, commit, changes)
    if why is None:
        return dict(earlier)
    if name is not None and earlier is not None:
        print(f"{name}: trained again, not kept from the earlier launch: {why}", flush=True)
    return None


def _not_kept(earlier: Optional[dict], run_dir: str, config: dict, commit: Optional[str],
              changes: Optional[str]) -> Optional[str]:
    """Why :func:`kept_result` does not keep ``earlier``; ``None`` where it does."""
    if earlier is None:
        return "no earlier result"
    if earlier.get("status", "done") != "done":
        return f"the earlier launch left it {earlier.get('status')}"
    try:
        summary = read_json(os.path.join(run_dir, "summary.json"))
    except (OSError, ValueError):
        return f"{run_dir} holds no readable summary.json"
    if not isinstance(summary, dict):
        return f"{run_dir}/summary.json is not a summary"
    # the recipes as recorded (JSON), compared setting by setting: the model as the one each builds, so that an
    # override restating the preset's value is the same recipe, the data paths as the files they name, so that
    # ./corpus.jsonl and corpus.jsonl are the same source (config.recipe_differences)
    recorded, now = json.loads(json.dumps(summary.get("config"))), json.loads(json.dumps(config))
    if not isinstance(recorded, dict):
        return "its summary.json holds another recipe than this launch trains (it records none)"
    differ = recipe_differences(recorded, now)
    if differ:
        shown = "; ".join(f"{k} {a!r} there, {b!r} here" for k, a, b in differ[:5])
        more = f"; and {len(differ) - 5} more" if len(differ) > 5 else ""
        return f"its summary.json holds another recipe than this launch trains ({shown}{more})"
    unlike = unlike_code(summary, commit, changes)
    if unlike is not None:
        return unlike
    if (summary.get("tokens"), summary.get("tokens_per_s")) != (earlier.get("tokens"), earlier.get("tokens_per_s")):
        return "its folder holds another run than the earlier result's"
    return None


def _launch(config: str, out_dir: str, sets: List[str], log_path: str):
    cmd = [sys.executable, "-m", "falcon_fwa.train.cli", "--config", config, "--set", assign_text("train.out_dir", out_dir),
           "--set", "log.progress=false"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    with open(log_path, "w") as log:  # in a session of its own: its process group is ended at once by _kill_runs
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=end_with_parent())  # (SIGHUP taken even under nohup)


class RunSignals(StopSignals):
    """The stop signals of a command that launches runs (:func:`run_all`): the first SIGTERM, SIGINT or SIGHUP
    sets ``received`` as :class:`StopSignals` does (the runs are asked to stop at their step); a second SIGTERM
    or SIGINT sets ``again`` (its number) instead of ending this process, so that the runs are killed at once
    and recorded so (:func:`_collect`); a third is handled as :class:`StopSignals` handles a second."""

    def __init__(self, enabled: bool):
        super().__init__(enabled)
        self.again = 0

    def _handle(self, signum, frame):
        if (self.received and not self.again and signum != PARENT_ENDED
                and self.received != PARENT_ENDED):  # (after a SIGHUP, a SIGTERM or SIGINT is a first stop)
            self.again = signum
            return
        super()._handle(signum, frame)


def _active_run_signals() -> Optional[RunSignals]:
    """The :class:`RunSignals` whose handler this process has for SIGTERM now (one that a caller of
    :func:`run_all` holds over several of its calls), else None."""
    owner = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    return owner if isinstance(owner, RunSignals) else None


def _kill_runs(procs) -> None:
    """SIGKILL to the process group (its session, see :func:`_launch`) of each process of ``procs`` not reaped
    yet: its first process still going, or ended (unreaped, see :func:`_has_ended`) while others of its group live
    on (a data-loader worker, a torchrun worker, a grandchild). The group's id is that process's pid, which stays
    its own while the process is unreaped; once reaped, the number may name another process group, which is
    therefore never signalled."""
    for proc in procs:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # ended meanwhile
                pass


def _has_ended(proc) -> bool:
    """Whether the first process of a run (``proc``, launched by :func:`_launch`) has ended, without reaping it
    (``Popen.poll`` would): its pid, its process group's id, then stays reserved for :func:`_kill_runs`."""
    if proc.returncode is not None:
        return True
    if not (hasattr(os, "waitid") and hasattr(os, "WNOWAIT")):  # (macOS has WNOWAIT but no os.waitid: reaped
        # here, what is left of its group then goes unseen)
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped elsewhere
        return proc.poll() is not None


def run_all(configs: List[str], names: List[str], out_dir: str, sets: List[str], tag: str,
            signals: Optional[StopSignals] = None) -> Iterator[Event]:
    """Run every recipe concurrently, one process each (in a session of its own), from scratch in
    ``out_dir/tag/NAME``; yields like ``run_sequential``, each recipe as its process ends. While it runs, a
    SIGTERM, SIGINT or SIGHUP to this command (``signals``: the :class:`RunSignals` this process holds, else
    one of its own) asks every run still going to stop at the end of its step (:data:`PARENT_ENDED`, which a
    run takes once however often it comes); each is waited for and yielded as it ended: stopped (with its
    checkpoint; its result's ``signal`` names what stopped the command), done or failed. Recipes not launched
    yet are not_run (their result's ``signal`` names it too). A second SIGTERM or SIGINT kills the runs still
    going at once (their process groups, SIGKILL): each is yielded killed, its ``signal`` naming that second
    signal. Each launched run's result has its ``wall_s``: the seconds from its launch to its end (as
    :func:`_collect` saw it), done, stopped, killed or failed. What a run leaves in its process group (a data-loader worker, a grandchild) is killed as the run is
    collected, and on any other way out of this generator, where ``os.waitid`` can see a run's end without
    reaping it (not on macOS: there what outlives a run's first process is not reached)."""
    procs, launched = {}, {}
    if signals is None:
        signals = _active_run_signals()
    with (RunSignals(True) if signals is None else nullcontext(signals)) as signals:
        try:
            for cfg, name in zip(configs, names):
                if signals.received:
                    by = signal.Signals(signals.received).name
                    yield name, "not_run", {"error": f"stopped by {by} before this recipe started", "signal": by}
                    continue
                run_dir = _fresh_dir(os.path.join(out_dir, tag, name))
                procs[name] = (_launch(cfg, run_dir, sets, os.path.join(run_dir, "stdout.txt")), run_dir)
                launched[name] = _clock()
                yield name, "running", None
            for name, status, result in _collect(procs, signals):
                result["wall_s"] = _clock() - launched[name]  # from its launch to its end, whatever the end
                yield name, status, result
        finally:  # ended otherwise (an error, a third Ctrl-C, the caller gone): no run goes on unseen
            _kill_runs([proc for proc, _ in procs.values()])
            for proc, _ in procs.values():
                proc.wait()


def _collect(procs: dict, signals: Optional[StopSignals] = None) -> Iterator[Event]:
    """Yield each process of ``procs`` (name -> (process, run folder)) as it ends, removing it; once
    ``signals`` has received a stop signal, ask those still going to stop, and once it has received a second
    (``again``), kill them (see :func:`run_all`)."""
    asked, killed = False, 0
    while procs:
        if not asked and signals is not None and signals.received:
            asked = True
            for proc, _ in procs.values():
                if not _has_ended(proc):  # (not Popen.send_signal, which reaps an ended one first)
                    os.kill(proc.pid, PARENT_ENDED if PARENT_ENDED is not None else signal.SIGTERM)
        if not killed and getattr(signals, "again", 0):
            killed = signals.again
            _kill_runs([proc for proc, _ in procs.values()])
        ended = [name for name, (proc, _) in procs.items() if _has_ended(proc)]
        if not ended:
            time.sleep(0.05 if killed else 0.2 if asked else 0.5)
        for name in ended:
            proc, run_dir = procs.pop(name)
            _kill_runs([proc])  # what the run left in its process group ends with it, before its pid is freed
            proc.poll()  # (reaped: its returncode)
            if killed and proc.returncode == -signal.SIGKILL:
                by = signal.Signals(killed).name
                log_path = os.path.join(run_dir, "log.jsonl")
                log = read_log(log_path) if os.path.isfile(log_path) else []
                yield name, "killed", {"error": f"a second {by} ended it at once (SIGKILL), without a checkpoint "
                                                "of its last steps", "signal": by, "log": log}
                continue
            yield (name, *_outcome(proc.returncode, run_dir, signals.received if asked else 0))


def _outcome(returncode: int, run_dir: str, stop_signal: int) -> Tuple[str, dict]:
    """``(status, result)`` of a launched run that ended with ``returncode`` in ``run_dir``: done (exit 0,
    its summary), stopped (exit 128 + the signal its summary names: ended early with a checkpoint; when
    this command asked it to stop, the result names ``stop_signal``, what stopped the command), else failed."""
    summary_path = os.path.join(run_dir, "summary.json")
    summary = None
    if os.path.isfile(summary_path):
        try:
            summary = read_json(summary_path)
        except (OSError, ValueError):
            summary = None
    by = summary.get("signal") if isinstance(summary, dict) else None
    stopped = by in signal.Signals.__members__ and returncode == 128 + signal.Signals[by]
    if summary is None or not (returncode == 0 or stopped):
        with open(os.path.join(run_dir, "stdout.txt"), errors="replace") as f:
            printed = f.read()
        tail = printed[-2000:]
        ended_by = {stop_signal} | ({PARENT_ENDED} if PARENT_ENDED is not None else set())
        if stop_signal and (-returncode in ended_by or returncode - 128 in ended_by):
            error = f"stopped by {signal.Signals(stop_signal).name} before its first step (no checkpoint)"
            return "stopped", {"signal": signal.Signals(stop_signal).name, "steps": 0, "error": error,
                               "stdout_tail": tail}
        cause = printed_error(printed)
        return "failed", {"error": f"exit code {returncode}" + (f": {cause}" if cause else ""), "stdout_tail": tail}
    result = dict(summary)
    log_path = os.path.join(run_dir, "log.jsonl")
    result["log"] = read_log(log_path) if os.path.isfile(log_path) else []
    if stopped:
        if stop_signal:
            result["signal"] = signal.Signals(stop_signal).name
        return "stopped", result
    return "done", result


TRAIN_ERROR = "falcon-fwa train: error: "  # how the train command prints the error it ends with (cli.run_command)


def printed_error(text: str) -> Optional[str]:
    """The error a launched run printed last in its output ``text``: the message of the train command's
    ``falcon-fwa train: error: MESSAGE`` (its lines up to the ``(raised at ...)`` one), else the last line of the
    last traceback (``TYPE: MESSAGE``); None where it printed neither."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith(TRAIN_ERROR):
            message = [lines[i][len(TRAIN_ERROR):]]
            for line in lines[i + 1:]:
                if line.startswith("  (raised at "):
                    break
                message.append(line)
            return "\n".join(message).strip() or None
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    if starts:
        last = [line for line in lines[starts[-1] + 1:] if line.strip() and not line[0].isspace()]
        return last[-1].strip() if last else None
    return None


def summary_line(name: str, result: dict, index: int, total: int) -> str:
    """``[3/7] DeltaNet: partial 212/330 steps  val_ppl 4.123  45,678 tok/s  peak 1.23 GiB  61 s (first step 2.1 s)``"""
    r = result
    head = f"[{index}/{total}] {name}: {r['status']}"
    if r.get("error"):  # (a failed run's line says how long it ran too; a run never started has no wall_s)
        took = f" after {r['wall_s']:.0f} s" if r.get("wall_s") is not None else ""
        return f"{head}{took}  {r['error'][:200]}"
    parts = [head + (f" {r.get('steps')}/{r.get('planned_steps')} steps" if r.get("planned_steps") else "")]
    if r.get("val_ppl") is not None:
        parts.append(f"val_ppl {r['val_ppl']:.3f}")
    if r.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if r.get("peak_mem_bytes"):
        parts.append(f"peak {r['peak_mem_bytes'] / 2**30:.2f} GiB")
    if r.get("wall_s") is not None:
        parts.append(f"{r['wall_s']:.0f} s" + (f" (first step {r['first_step_s']:.1f} s)"
                                               if r.get("first_step_s") is not None else ""))
    return "  ".join(parts)


# ----------------------------------------------------------------------------- command line
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="+", required=True, help="recipe files (same data, optim, global_batch)")
    parser.add_argument("--names", nargs="+", default=None, help="display names (default: file names)")
    parser.add_argument("--out", required=True, help="folder for the runs (and compare.json)")
    parser.add_argument("--results", default=None, help="the results file (default: OUT/compare.json)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a recipe field in every recipe (repeatable)")
    parser.add_argument("--concurrent", action="store_true", help="all recipes at once, one process each")
    parser.add_argument("--steps", type=int, default=None,
                        help="train steps of every recipe, no calibration (default: each recipe's train.steps, "
                             "unless --time-budget or --deadline calibrates a count)")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for all the runs together after calibration (sets the step count)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="wall-clock seconds for the whole command: sets the step count unless --steps "
                             "does (with --time-budget, the smaller of the two budgets), and stops the run in "
                             "progress when it passes")
    parser.add_argument("--calib-steps", type=int, default=None,
                        help="timed calibration steps per recipe (default 6; with --concurrent: 30 training steps)")
    parser.add_argument("--calib-warmup", type=int, default=None,
                        help="untimed calibration steps first (default 2; the sequential calibration only)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="cap on the calibrated step count (which is at least 20 otherwise)")


def check_run_names(names: List[str], configs: List[str]) -> None:
    """``ValueError`` naming ``--names`` unless there is one name per ``--configs`` file, each a
    folder name (the run's folder), all different."""
    if len(names) != len(configs):
        raise ValueError(f"--names has {len(names)} entries for {len(configs)} --configs")
    for name in names:
        if not name or name in (".", "..") or os.sep in name or (os.altsep and os.altsep in name):
            raise ValueError(f"--names: {name!r} is not a folder name")
    if len(set(names)) != len(names):
        raise ValueError(f"--names must differ from each other, got {names}")


# the train.resume values that leave the start to compare (a fresh folder either way); a checkpoint path is refused
COMPARE_RESUMES = ("auto", "none")
RESUME_REFUSED = ("compare trains each recipe from scratch in its own folder (--out's main/NAME) and resumes its "
                  "own runs when launched again; train.resume takes 'auto' or 'none' here, not a checkpoint path")


def _sets_out_dir(item: str) -> bool:
    """Whether the ``--set`` assignment ``item`` sets ``train.out_dir`` as the recipe loader reads it
    (:func:`falcon_fwa.train.config.apply_overrides`): ``train.out_dir=DIR``, or a whole section such as
    ``train={out_dir: DIR}``. The loader takes the key as written, so a spelling with spaces in it
    (`` train.out_dir=DIR``) names no field of the recipe and is refused by the loader itself."""
    try:
        train = apply_overrides({}, [item]).get("train")
    except ValueError:  # no '=', or a value that is no YAML: loading the recipes says so
        return False
    return isinstance(train, dict) and "out_dir" in train


def _check_args(args: argparse.Namespace, names: List[str]) -> None:
    check_run_names(names, args.configs)
    if args.deadline is not None and args.concurrent:
        raise ValueError("--deadline needs the sequential runs (drop --concurrent)")
    at_least("--steps", args.steps, 1)
    finite_at_least("--time-budget", args.time_budget, 0, strict=True)
    finite_at_least("--deadline", args.deadline, 0, strict=True)
    at_least("--calib-steps", args.calib_steps, 1)
    at_least("--calib-warmup", args.calib_warmup, 1)
    at_least("--max-steps", args.max_steps, 1)
    if args.steps is not None and args.time_budget is not None:
        raise ValueError("--steps and --time-budget both set the step count: give one")
    calibrated = args.steps is None and (args.time_budget is not None or args.deadline is not None)
    for option, value in (("--calib-steps", args.calib_steps), ("--calib-warmup", args.calib_warmup),
                          ("--max-steps", args.max_steps)):
        if value is not None and not calibrated:
            raise ValueError(f"{option} applies to a calibrated step count: give --time-budget or --deadline "
                             "(without --steps)")
    if args.calib_warmup is not None and args.concurrent:
        raise ValueError("--calib-warmup applies to the sequential calibration: --concurrent calibrates "
                         "--calib-steps training steps, whose tokens/s leave out the first ones itself")
    for item in args.overrides:  # each recipe's run folder is OUT/main/NAME, whatever the recipe says
        if _sets_out_dir(item):
            raise ValueError(f"--set {item}: compare trains each recipe in --out's main/NAME folder, not in "
                             "train.out_dir; give --out (and --names) instead")
        key, _, value = item.partition("=")
        if key.strip() == "train.resume" and value.strip().strip("'\"") not in COMPARE_RESUMES:
            raise ValueError(f"--set {item}: {RESUME_REFUSED}")
    check_input_files("--configs", args.configs)
    parents = {os.path.realpath(p): c for c in args.configs if (p := recipe_parent(c))}
    for c in args.configs:  # a glob such as configs/small/*.yaml also takes the recipes' shared base
        if os.path.realpath(c) in parents:
            raise ValueError(f"--configs: {c} is the base that {parents[os.path.realpath(c)]} extends, not a model "
                             "of its own; leave it out (to compare its model too, list a recipe file that holds "
                             f"only 'extends: {os.path.basename(c)}', next to it)")


def _sequential_steps(args, names: List[str], sets: List[str], report: dict, deadline_at: Optional[float],
                      signals: Optional[StopSignals] = None):
    """Calibrate in this process and plan the step count (None: the deadline passed first);
    ``CalibrationStopped`` where ``signals`` (what the command holds) received a stop signal meanwhile."""
    t0 = _clock()
    calib_dir = os.path.join(args.out, "calibration")
    report["calibration"] = calibrate_sequential(args.configs, names, sets, out_dir=calib_dir,
                                                 warmup=args.calib_warmup or 2, steps=args.calib_steps or 6,
                                                 deadline_at=deadline_at, signals=signals)
    report["calibration_wall_s"] = _clock() - t0
    if _stopped_by(signals):
        raise CalibrationStopped(_stopped_by(signals))
    budgets = [] if args.time_budget is None else [args.time_budget]
    if deadline_at is not None:
        left = deadline_at - _clock()
        if left <= 0:
            return None
        budgets.append(DEADLINE_SHARE * left)
    steps, report["plan"] = plan_steps(report["calibration"], min(budgets))
    plan = report["plan"]
    print(f"calibrated: {plan['fixed_s']:.1f} s fixed + {plan['step_s_sum']:.3f} s per step for all recipes; "
          f"{plan['steps_fit']} steps fit in {plan['budget_s']:.0f} s", flush=True)
    return steps


class CalibrationStopped(Exception):
    """A stop signal (its name, the exception's text) ended the calibration (sequential or concurrent)."""


def _concurrent_steps(args, names: List[str], sets: List[str], report: dict,
                      signals: Optional[StopSignals] = None) -> int:
    """Run every recipe at once for ``--calib-steps`` steps; the slowest of those that measured a rate sets the
    step count (one whose calibration failed is left out of it and trained all the same;
    :class:`CalibrationFailed` where none measured one).
    ``CalibrationStopped`` where a stop signal ended a calibration run, or where ``signals`` (what the command
    holds through calibration and main runs) received one while the calibration ran, even if every
    calibration run finished anyway (one that came as they ended, or that they did not take)."""
    calib_steps = args.calib_steps or 30
    calib = [f"train.steps={calib_steps}", "train.eval_every=0", "train.save_every=0",
             "train.export_model=false", "train.resume=none",  # from step 0, as the sequential calibration
             f"log.every={max(1, calib_steps // 3)}"]
    t0 = _clock()
    res = {n: r for n, _, r in run_all(args.configs, names, args.out, sets + calib, "calibration", signals) if r}
    # in the lineup's order (the runs end in any order)
    report["calibration"] = {n: {k: v for k, v in res[n].items() if k != "log"} for n in names if n in res}
    report["calibration_wall_s"] = _clock() - t0
    by = [r["signal"] for r in res.values() if r.get("signal")]
    if _stopped_by(signals):
        by = [_stopped_by(signals)]
    if by:
        raise CalibrationStopped(by[0])
    rates = [r["tokens_per_s"] for r in res.values() if (r.get("tokens_per_s") or 0) > 0]
    if not rates:  # (as plan_steps refuses a sequential calibration that measured no recipe)
        raise CalibrationFailed(report["calibration"])
    slowest = min(rates)
    failed = [n for n in names if (res.get(n, {}).get("tokens_per_s") or 0) <= 0]
    if failed:  # trained all the same, as the sequential runs do: one that fails again is recorded failed
        print(f"calibration failed for {', '.join(failed)} (its error is under calibration in the results "
              "file): the step count is planned from the others, which it trains beside", flush=True)
    steps = int(args.time_budget * slowest / (report["tokens_per_step"]))
    print(f"calibrated: slowest {slowest:,.0f} tokens/s concurrently -> {steps} steps", flush=True)
    return steps


def run(args: argparse.Namespace) -> int:
    started = _clock()
    deadline_at = None if args.deadline is None else started + args.deadline
    names = args.names or [os.path.splitext(os.path.basename(c))[0] for c in args.configs]
    _check_args(args, names)
    check_output_folder("--out", args.out)
    check_output_file("--results", args.results)
    first = _check_recipes(args)  # the recipes and their data sources, before --out is made
    made = make_folders(args.out)
    before = set(os.listdir(args.out))  # (the lock file too, where an earlier command left it)
    try:
        with folder_lock(args.out, LOCK_NAME, wait=False):
            try:  # (before the results file is written: a preparation that fails leaves an earlier one as it was)
                _prepare_data(args, first)
            except Exception:  # a tokenizer that does not load, an empty split: what this command made goes
                remove_created(args.out, before, made, LOCK_NAME)
                raise
            return _compare(args, names, started, deadline_at, first)
    except BlockingIOError:
        raise ValueError(f"--out {args.out} is in use by another falcon-fwa compare") from None


def _prepare_data(args: argparse.Namespace, first) -> None:
    """The one tokenized copy of the recipes' data (:func:`_data_dir`), prepared or reused."""
    from ..data import prepare_dataset

    prepare_dataset(first.data.spec(), _data_dir(args, first))


def _earlier_runs(path: str, configs: dict, device: str, threads: Optional[int] = None) -> dict:
    """The finished runs (name -> result) of an earlier sequential launch's results file at ``path`` on this
    ``device`` (with this many torch ``threads`` where given), of the names that stand for the same recipe files now
    (``configs``: name -> file)."""
    try:
        report = read_json(path)
        if report.get("device") != device or report.get("concurrent"):  # timed on another machine, or beside others
            return {}
        if threads is not None and report.get("threads") != threads:  # (the runs trained in its process)
            return {}
        return {n: r for n, r in report["runs"].items() if report["status"].get(n) == "done"
                and report["configs"].get(n) == configs.get(n, "") and isinstance(r, dict)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _shared_fields_that_differ(first, other) -> List[Tuple[str, object, object]]:
    """``(field, other's value, first's value)`` for each field the recipes of one comparison must share
    (``data``, ``optim``, ``train.global_batch``) where ``other`` differs from ``first``."""
    a, b = first.to_dict(), other.to_dict()
    shared = [("data", k) for k in a["data"]] + [("optim", k) for k in a["optim"]] + [("train", "global_batch")]
    return [(f"{s}.{k}", b[s][k], a[s][k]) for s, k in shared if a[s][k] != b[s][k]]


def _data_dir(args: argparse.Namespace, first) -> str:
    """The one tokenized copy every recipe trains on: the recipes' ``data.out_dir``, else ``OUT/data``."""
    return first.data.out_dir or os.path.join(args.out, "data")


def _check_recipes(args: argparse.Namespace):
    """The first recipe (with ``--set``); ``ValueError`` naming a recipe that does not load, whose batch
    does not split into its micro-batches, that does not share the first's ``data``, ``optim`` and
    ``train.global_batch`` (or ``train.steps`` where no option sets it), or whose data sources do not
    name files."""
    from ..data.prepare import check_sources

    first = load_config(args.configs[0], args.overrides)
    sets_steps = args.steps is not None or args.time_budget is not None or args.deadline is not None
    for c in args.configs:  # each trains in one process: a batch that does not split fails here, not after the others
        other = first if c == args.configs[0] else load_config(c, args.overrides)
        if other.train.resume not in COMPARE_RESUMES:  # a run resumed there would count steps it did not train
            raise ValueError(f"{c}: train.resume = {other.train.resume!r}: {RESUME_REFUSED}")
        if other.train.global_batch % other.train.micro_batch:
            raise ValueError(f"{c}: train.global_batch = {other.train.global_batch} is not a multiple of "
                             f"train.micro_batch = {other.train.micro_batch} (each recipe trains in one process)")
        if other is first:
            continue
        differ = _shared_fields_that_differ(first, other)
        if differ:
            raise ValueError(f"{c}: {', '.join(f'{k} = {v!r}' for k, v, _ in differ)}, {args.configs[0]} has "
                             f"{', '.join(repr(v) for _, _, v in differ)}: data, optim and train.global_batch "
                             "must be the same in every recipe")
        if not sets_steps and other.train.steps != first.train.steps:  # the table would set unequal tokens side by side
            raise ValueError(f"{c}: train.steps = {other.train.steps}, {args.configs[0]} has {first.train.steps}: "
                             "the recipes must train the same tokens; give --steps (or --time-budget / --deadline)")
    check_sources(first.data.spec(), _data_dir(args, first))
    return first


def _compare(args: argparse.Namespace, names: List[str], started: float, deadline_at: Optional[float],
             first) -> int:
    import torch

    d = first.data
    results_path = args.results or os.path.join(args.out, "compare.json")
    report = {"configs": dict(zip(names, args.configs)), "overrides": args.overrides, "deadline_s": args.deadline,
              "time_budget_s": args.time_budget, "tokens_per_step": first.train.global_batch * d.seq_len,
              "status": {n: "pending" for n in names}, "runs": {}, "finished": False,
              "device": device_description(), "concurrent": args.concurrent, "threads": torch.get_num_threads()}
    earlier = {} if args.concurrent else _earlier_runs(results_path, report["configs"], report["device"],
                                                       report["threads"])

    def save() -> None:
        report["wall_s"] = _clock() - started
        write_json(results_path, report)

    sets = list(args.overrides)
    data_dir = _data_dir(args, first)
    if not d.out_dir:  # one tokenized copy shared by every recipe
        sets.append(assign_text("data.out_dir", data_dir))
    # the stop signals, from before the results file is first written, over calibration and main runs, so that a
    # stop anywhere from then on is kept (the recipes it finds unstarted are not_run, the signal named): with
    # --concurrent a RunSignals, else a StopSignals whose stop the trainer in progress takes at its step
    with RunSignals(True) if args.concurrent else StopSignals(True) as signals:
        save()
        return _train(args, names, report, sets, started, deadline_at, results_path, earlier, save, signals)


def _train(args: argparse.Namespace, names: List[str], report: dict, sets: List[str], started: float,
           deadline_at: Optional[float], results_path: str, earlier: dict, save, signals: Optional[StopSignals]) -> int:
    """:func:`_compare`'s step count and runs (``signals``: the command's :class:`StopSignals`, with
    ``--concurrent`` a :class:`RunSignals`)."""
    steps = args.steps
    if steps is None and (args.time_budget or args.deadline):
        try:
            steps = (_concurrent_steps(args, names, sets, report, signals) if args.concurrent else
                     _sequential_steps(args, names, sets, report, deadline_at, signals))
        except CalibrationFailed as failed:  # the command's one-line error; every recipe's error in the results file
            report.update(status={n: "not_run" for n in names}, error=str(failed))
            save()
            raise
        except CalibrationStopped as stop:
            report.update(status={n: "not_run" for n in names}, error=f"stopped by {stop} during calibration",
                          signal=str(stop))
            save()
            print(f"{report['error']}: no recipe trained", file=sys.stderr, flush=True)
            return 128 + signal.Signals[str(stop)]
        if steps is None:  # (sequential: the deadline passed during calibration)
            report.update(status={n: "not_run" for n in names}, finished=True,
                          error=f"calibration took the whole --deadline of {args.deadline:g} s")
            save()
            print(report["error"], flush=True)
            return 1
        fit = steps
        steps = max(steps, MIN_STEPS)
        if args.max_steps:
            steps = min(steps, args.max_steps)
        if steps > fit:  # raised to the floor of 20 (or to --max-steps, where that caps the floor)
            print(f"only {fit} steps fit: training {steps}", flush=True)
    if steps is not None:
        sets += [f"train.steps={steps}", f"optim.warmup_steps={max(1, steps // 15)}",
                 f"train.eval_every={max(1, steps // 4)}", f"train.save_every={steps}"]
        report["steps"] = steps
        report.setdefault("plan", {})["steps"] = steps
    save()
    # every run's planned count: the recipes' shared train.steps where no option sets one (_check_recipes)
    planned = steps if steps is not None else load_config(args.configs[0], args.overrides).train.steps
    t0 = _clock()
    runner = (run_all(args.configs, names, args.out, sets, "main", signals) if args.concurrent else
              run_sequential(args.configs, names, args.out, sets, "main", deadline_at=deadline_at,
                             earlier=earlier, signals=signals))
    finished = 0
    for name, status, result in runner:
        report["status"][name] = status
        if result is not None:
            result.setdefault("status", status)
            result.setdefault("planned_steps", planned)
            if status == "stopped" and not _evaluated_at_its_step(result):
                for key in ("val_loss", "val_ppl"):  # (the summary's last evaluation, of an earlier step)
                    result.pop(key, None)
            report["runs"][name] = result
            finished += 1
            print(summary_line(name, result, finished, len(names))
                  + ("  (kept from the earlier launch)" if result.get("kept") else ""), flush=True)
        report["main_wall_s"] = _clock() - t0
        save()
    stopped = [r["signal"] for r in report["runs"].values() if r.get("status") in ("stopped", "not_run", "killed")
               and r.get("signal")]
    if _stopped_by(signals):  # the runs' results may not show it (done as it came)
        stopped = [_stopped_by(signals)]
        report["signal"] = stopped[0]
        save()
    if stopped and all(report["status"][n] in ("done", "failed") for n in names):
        # the stop came as the last runs ended: nothing was cut short, and the comparison is whole
        report["finished"] = True
        save()
        print(f"stopped by {stopped[0]} after every run had ended: the comparison is complete", file=sys.stderr,
              flush=True)
        return 128 + signal.Signals[stopped[0]]
    if stopped:
        again = ("the same command trains them all afresh" if args.concurrent else
                 "the same command goes on from the recipes done")
        print(f"stopped by {stopped[0]}: {again}", file=sys.stderr, flush=True)
        return 128 + signal.Signals[stopped[0]]
    report["finished"] = True
    save()
    failed = [n for n in names if report["status"][n] == "failed"]
    if failed:  # the others' results are in the report; a script sees that some recipe is missing
        print(f"failed: {', '.join(failed)} (the error is in {results_path})", file=sys.stderr, flush=True)
        return 1
    return 0


def _evaluated_at_its_step(result: dict) -> bool:
    """Whether the log of a run's ``result`` holds a validation record of the step the run ended at."""
    return any(r.get("step") == result.get("steps") and "val_loss" in r for r in result.get("log") or [])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="falcon-fwa compare", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    from ..cli import run_command

    return run_command("falcon-fwa compare", run, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
