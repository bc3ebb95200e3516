"""How a run ends once its results are complete: plots that failed after the results were written are drawn by
the next command over the run (the run's own, relaunched, or ``addition-compare``, which skips the run as
finished), and a SIGTERM that comes after the results are complete leaves the command's status at 0. Also: the
curriculum check of the options and of the preset is one check with one message."""
import json
import os
import signal
import subprocess

import pytest
import torch

from falcon_fwa.tasks.addition import cli, compare, plot, presets, train

SMALL = ["--preset", "tiny", "--device", "cpu", "--batch-size", "4", "--val-per-width", "2", "--ood-per-width", "2",
         "--train-widths", "1", "3", "--ood-widths", "4", "5", "--threads", "1", "--hidden-size", "16",
         "--num-hidden-layers", "1", "--num-heads", "2"]
PLOTS = ["accuracy_by_position.png", "accuracy_vs_width.png"]


def _run_argv(out):
    return ["--model", "Transformer", "--steps", "2", "--eval-every", "2", "--out", str(out), *SMALL, "--no-progress"]


def _lineup_argv(tmp_path):
    return ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--eval-every", "2", "--runs",
            str(tmp_path / "runs"), "--results", str(tmp_path / "res"), "--name", "t", *SMALL]


def _fail_plotting_once(monkeypatch):
    """The first drawing of a run's width plot fails (as a full disk or a broken backend would), after the
    run's results are written; the calls to it are counted."""
    original, calls = plot.plot_accuracy_vs_width, []

    def failing(*args, **kw):
        calls.append(args[1])
        if len(calls) == 1:
            raise OSError("no space left on device (for the test)")
        return original(*args, **kw)

    monkeypatch.setattr(plot, "plot_accuracy_vs_width", failing)
    return calls


def _launching(monkeypatch, run):
    """``subprocess.Popen`` with a run's command (``falcon-fwa addition`` as ``addition-compare`` starts it) given
    to ``run``; any other command (the platform's look-ups) starts as before."""
    real = subprocess.Popen

    def popen(cmd, *args, **kw):
        if isinstance(cmd, list) and "falcon_fwa.tasks.addition.cli" in cmd:
            return run(cmd, **kw)
        return real(cmd, *args, **kw)

    monkeypatch.setattr(subprocess, "Popen", popen)


def _pngs(folder):
    return sorted(p for p in os.listdir(folder) if p.endswith(".png"))


def _finished_without_plots(out, monkeypatch):
    with pytest.raises(OSError, match="no space left"):
        cli.main(_run_argv(out))
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and res["steps_done"] == 2 and _pngs(out) == []
    assert plot.missing_run_plots(res, out) == PLOTS
    return res


def test_a_relaunch_of_a_finished_run_draws_the_plots_that_failed(tmp_path, monkeypatch):
    out = tmp_path / "run"
    calls = _fail_plotting_once(monkeypatch)
    res = _finished_without_plots(out, monkeypatch)
    assert cli.main(_run_argv(out)) == 0
    assert _pngs(out) == PLOTS and len(calls) == 2
    assert json.loads((out / "results.json").read_text())["history"] == res["history"]  # nothing trained again
    assert plot.missing_run_plots(res, out) == []


def test_a_lineup_draws_the_plots_a_finished_run_it_skips_lacks(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "runs" / "Transformer" / "seed0"
    calls = _fail_plotting_once(monkeypatch)
    res = _finished_without_plots(run_dir, monkeypatch)
    capsys.readouterr()
    # --no-train writes nothing in --runs: it says which plots are missing and how to draw them
    assert compare.main(_lineup_argv(tmp_path) + ["--no-train"]) == 0
    out = capsys.readouterr().out
    assert f"{run_dir}: accuracy_by_position.png, accuracy_vs_width.png missing" in out
    assert _pngs(run_dir) == []
    # a lineup that may train skips the finished run and draws its plots from its results
    started = []
    _launching(monkeypatch, lambda cmd, **kw: started.append(cmd))
    assert compare.main(_lineup_argv(tmp_path)) == 0
    assert started == [] and _pngs(run_dir) == PLOTS
    assert f"drew {run_dir / 'accuracy_vs_width.png'}" in capsys.readouterr().out
    assert plot.missing_run_plots(res, run_dir) == []
    # and leaves them alone from then on
    drawn = len(calls)
    assert compare.main(_lineup_argv(tmp_path)) == 0
    assert len(calls) == drawn + 1  # the summary's own plot only


class _InProcessRun:
    """Stands for a run's process: trains the command's run in this process (the run's plots fail once), and
    ends with the status ``falcon-fwa addition`` gives an error (2), its results complete."""

    def __init__(self, cmd, **kw):
        try:
            self.returncode = cli.main(cmd[3:])
        except OSError:
            self.returncode = 2

    def poll(self):
        return self.returncode

    def wait(self):
        return self.returncode


def test_a_run_a_lineup_started_whose_plots_failed_gets_them(tmp_path, monkeypatch):
    """The run's process ends with exit 2 once its results are complete (its plots failed): the lineup counts
    it finished, as it counts a run a signal ended after its results, and draws the plots it lacks."""
    _fail_plotting_once(monkeypatch)
    _launching(monkeypatch, _InProcessRun)
    monkeypatch.setattr(compare.time, "sleep", lambda s: None)
    assert compare.main(_lineup_argv(tmp_path)) == 0
    run_dir = tmp_path / "runs" / "Transformer" / "seed0"
    assert json.loads((run_dir / "results.json").read_text())["finished"]
    assert _pngs(run_dir) == PLOTS
    assert json.loads((tmp_path / "res" / "t_meta.json").read_text())["failed"] == []


def test_a_run_without_positions_is_missing_no_heat_map(tmp_path):
    """A run resumed from before positions were recorded draws no heat map: none is missing."""
    res = {"best": {"step": 2, "per_position": {}}}
    assert plot.missing_run_plots(res, tmp_path) == ["accuracy_vs_width.png"]
    (tmp_path / "accuracy_vs_width.png").write_bytes(b"png")
    assert plot.missing_run_plots(res, tmp_path) == []


def test_a_sigterm_after_the_results_are_complete_ends_the_command_with_status_0(tmp_path, monkeypatch, capsys):
    """The SIGTERM comes as the run returns its complete results (a stop passed on by a launcher, coming as the
    run ends): the command takes it, says so, and ends with 0, as addition-compare judges such a run."""
    out = tmp_path / "run"
    original = train.train_run

    def then_sigterm(*args, **kw):
        res = original(*args, **kw)
        os.kill(os.getpid(), signal.SIGTERM)
        return res

    monkeypatch.setattr(train, "train_run", then_sigterm)
    fallback = []
    previous = signal.signal(signal.SIGTERM, lambda *a: fallback.append(1))  # stands for the default: exit 143
    try:
        assert cli.main(_run_argv(out)) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not fallback and signal.getsignal(signal.SIGTERM) is previous  # taken by the command, given back
    captured = capsys.readouterr()
    assert "SIGTERM came as the run finished: its results are complete" in captured.err and "stopped by" not in captured.err
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and "signal" not in res and _pngs(out) == PLOTS


def test_a_sigterm_while_the_plots_are_drawn_ends_the_command_with_status_0(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    original = plot.plot_accuracy_vs_width

    def signalled(*args, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kw)

    monkeypatch.setattr(plot, "plot_accuracy_vs_width", signalled)
    fallback = []
    previous = signal.signal(signal.SIGTERM, lambda *a: fallback.append(1))
    try:
        assert cli.main(_run_argv(out)) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not fallback and _pngs(out) == PLOTS
    assert "SIGTERM came as the run finished: its results are complete" in capsys.readouterr().err


def test_a_second_sigterm_during_training_still_interrupts_at_once(tmp_path, monkeypatch):
    """The command holds its signals from the start of training to its end: a second SIGTERM still reaches the
    handler that was there before (the default, which ends the process), during the step in progress."""
    out = tmp_path / "run"
    original, drawn = train.training_batch, []

    def twice(seed, step, *args, **kw):
        drawn.append(step)
        if len(drawn) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(seed, step, *args, **kw)

    monkeypatch.setattr(train, "training_batch", twice)
    fallback = []
    previous = signal.signal(signal.SIGTERM, lambda *a: fallback.append(1))
    try:
        assert cli.main(_run_argv(out)) == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert fallback == [1] and signal.getsignal(signal.SIGTERM) is previous
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    assert ckpt["step"] == 1 and ckpt["results"]["signal"] == "SIGTERM"


def test_the_preset_and_the_options_refuse_a_longer_curriculum_with_one_message():
    """One check (:func:`.presets.check_curriculum`) behind both: the message differs only in how the two
    values are named (the options as typed, the preset's fields by name)."""
    with pytest.raises(ValueError) as by_preset:
        presets.get_addition_preset("tiny").replace(steps=10, curriculum_steps=11, train_widths=(1, 5))
    import argparse

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    with pytest.raises(ValueError) as by_options:
        cli.preset_from_args(p.parse_args(["--steps", "10", "--curriculum-steps", "11", "--train-widths", "1", "5"]))
    reason = ("the widths would still be growing to 5 at the last step, the widest of 1-5 trained little or "
              "never, yet validated in choosing the best step")
    assert str(by_preset.value) == (f"curriculum_steps 11 is more than steps 10: {reason}; give curriculum_steps "
                                    "10 or fewer, or steps 11 or more")
    assert str(by_options.value) == (f"--curriculum-steps 11 is more than --steps 10: {reason}; give "
                                      "--curriculum-steps 10 or fewer, or --steps 11 or more")
