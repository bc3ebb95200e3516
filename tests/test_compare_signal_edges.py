"""``compare`` at the edges of its stop signals: with ``--concurrent``, a run whose first process has ended while
others of its process group live on (those are killed with it, never a group whose id may be another's by now)
and a second SIGTERM during the calibration; in either mode, a stop signal as the results file is first written;
in the sequential mode, one during the calibration and one between two recipes."""
import json
import os
import select
import signal
import subprocess
import sys
import time

import pytest
import torch

from falcon_fwa.train import compare
from test_cli_followups import assert_killed_whole

SLEEPER = "import subprocess; print(subprocess.Popen(['sleep', '60']).pid, flush=True)"


class Signals:
    """What :func:`compare._collect` and :func:`compare.run_all` read of a :class:`compare.RunSignals`."""

    def __init__(self, received=0, again=0):
        self.received, self.again = received, again


@pytest.fixture
def leader_leaving_a_sleeper():
    """A process started as :func:`compare._launch` starts a run (a session of its own, its pid the group's id)
    that starts ``sleep 60`` in its group and ends at once: ``(process, sleeper's pid, pipe)``, returned once the
    first process has ended, unreaped. The sleeper holds the pipe's only writing end (its standard output): the
    pipe reads as ended once the sleeper is gone."""
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=write_fd, start_new_session=True)
    os.close(write_fd)
    try:
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended, still holding its pid
        sleeper = int(os.read(read_fd, 64).decode().split()[0])
        assert os.getpgid(sleeper) == proc.pid  # the sleeper lives on in the ended process's group
        yield proc, sleeper, read_fd
    finally:
        if proc.returncode is None:  # (the group's id is still the ended process's own)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        os.close(read_fd)


def _gone(read_fd, timeout=10.0) -> bool:
    """Whether every holder of the pipe's writing end has ended within ``timeout`` seconds (the pipe reads as
    ended)."""
    ready, _, _ = select.select([read_fd], [], [], timeout)
    return bool(ready) and os.read(read_fd, 64) == b""


def test_kill_runs_reaches_the_group_of_a_run_whose_first_process_has_ended(leader_leaving_a_sleeper):
    """A second stop signal kills what is left of a run that had already ended its first process: the sleeper in
    its process group is killed (it would sleep on for a minute), and the first process's own exit status stays
    as it was (0), not a SIGKILL."""
    proc, _, read_fd = leader_leaving_a_sleeper
    compare._kill_runs([proc])
    assert _gone(read_fd)
    assert proc.wait() == 0


@pytest.mark.parametrize("signals", [None, Signals(signal.SIGTERM, signal.SIGTERM)],
                         ids=["no signal", "a second SIGTERM"])
def test_collect_ends_what_a_run_left_in_its_group_as_it_collects_it(tmp_path, leader_leaving_a_sleeper, signals):
    """A run collected as ended (by itself, or stopped by a first and second signal) leaves nothing of its process
    group running: the sleeper ends with it, and the run is recorded by its own exit (0 without a summary:
    failed), not killed."""
    proc, _, read_fd = leader_leaving_a_sleeper
    (tmp_path / "stdout.txt").write_text("")
    events = list(compare._collect({"a": (proc, str(tmp_path))}, signals))
    assert [(name, status, result["error"]) for name, status, result in events] == [("a", "failed", "exit code 0")]
    assert _gone(read_fd)


def test_run_all_closed_early_ends_what_a_run_left_in_its_group(tmp_path, monkeypatch, leader_leaving_a_sleeper):
    """``run_all`` ended before it collects its runs (its caller gone, an error): its clean-up kills every run's
    process group, also that of a run whose first process has already ended."""
    proc, _, read_fd = leader_leaving_a_sleeper
    monkeypatch.setattr(compare, "_launch", lambda *args: proc)
    events = compare.run_all([str(tmp_path / "a.yaml")], ["a"], str(tmp_path), [], "main", Signals())
    assert next(events) == ("a", "running", None)
    events.close()
    assert _gone(read_fd)
    assert proc.returncode == 0


def test_kill_runs_leaves_the_group_of_a_reaped_run_alone(monkeypatch):
    """Once a run's first process is reaped, its pid (its group's id) may be taken by another process, which may
    lead a process group of its own: that group is never signalled."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    sent = []
    monkeypatch.setattr(os, "killpg", lambda *args: sent.append(args))
    compare._kill_runs([proc])
    assert sent == []


def _stops_at_its_step(pid: int) -> bool:
    """Whether process ``pid`` has its stop handler in place (it catches SIGHUP, as a run does while it trains:
    ``launch.StopSignals``), from the caught-signal mask in its ``/proc/PID/status``."""
    with open(f"/proc/{pid}/status") as f:
        caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught >> (signal.SIGHUP - 1) & 1)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads a run's caught signals in /proc")
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_stop_signal_during_the_concurrent_calibration_kills_its_runs_and_trains_no_recipe(
        tmp_path, monkeypatch, capsys, second):
    """A SIGTERM and a second one while the concurrent calibration runs train (each has its stop handler in place,
    far from its 100,000 steps): each calibration run is killed at once (SIGKILL to its process group, nothing of
    which is left; no summary), is recorded so in the calibration (its error and ``signal`` name the second
    signal), no step count is planned, no main run starts (every recipe not_run, no OUT/main) and the command
    ends with 128 + the second signal (a second SIGINT as a second SIGTERM)."""
    from test_cli_journeys import _compare

    name = signal.Signals(second).name
    launched, real_launch, real_collect = [], compare._launch, compare._collect

    def launch(*args, **kwargs):
        launched.append(real_launch(*args, **kwargs))
        return launched[-1]

    def collect_after_two_signals(procs, signals=None):
        end = time.monotonic() + 120.0
        while time.monotonic() < end and not all(_stops_at_its_step(proc.pid) for proc, _ in procs.values()):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # (each handled here, in the main thread, before the next line)
        os.kill(os.getpid(), second)
        yield from real_collect(procs, signals)

    monkeypatch.setattr(compare, "_launch", launch)
    monkeypatch.setattr(compare, "_collect", collect_after_two_signals)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        code = _compare(tmp_path, "--concurrent", "--time-budget", "5", "--calib-steps", "100000")
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = tmp_path / "cmp"
    assert_killed_whole(code, second, launched)
    report = json.loads((out / "compare.json").read_text())
    assert {n: (r["signal"], r["error"].startswith(f"a second {name} ended it at once"))
            for n, r in report["calibration"].items()} == {"a": (name, True), "b": (name, True)}
    for recipe in ("a", "b"):
        assert not (out / "calibration" / recipe / "summary.json").exists()
    assert report["status"] == {"a": "not_run", "b": "not_run"} and report["finished"] is False
    assert "steps" not in report and report["error"] == f"stopped by {name} during calibration"
    assert report["signal"] == name
    assert not (out / "main").exists()
    assert f"stopped by {name} during calibration" in capsys.readouterr().err


def _guarded_compare(tmp_path, *extra):
    """``_compare`` (test_cli_journeys') with this process's own SIGTERM handler failing the test: a SIGTERM sent
    while the command runs must reach the command's."""
    from test_cli_journeys import _compare

    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        return _compare(tmp_path, *extra)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _signal_at_write(monkeypatch, out, when):
    """A SIGTERM to this process right after the command writes ``out/compare.json`` holding a report for which
    ``when(report)`` is true (once); returns the list that gets that report."""
    written, real_write = [], compare.write_json

    def write_then_signal(path, obj, *args, **kwargs):
        real_write(path, obj, *args, **kwargs)
        if path == str(out / "compare.json") and not written and when(obj):
            written.append(json.loads((out / "compare.json").read_text()))
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(compare, "write_json", write_then_signal)
    return written


@pytest.mark.parametrize("mode", [["--concurrent"], []], ids=["concurrent", "sequential"])
@pytest.mark.parametrize("extra, error", [
    (["--steps", "3"], "stopped by SIGTERM before this recipe started"),
    (["--time-budget", "5", "--calib-steps", "3"], "stopped by SIGTERM during calibration"),
], ids=["steps", "calibrated"])
def test_a_stop_as_the_results_file_is_first_written_is_recorded(tmp_path, monkeypatch, capsys, mode, extra,
                                                                 error):
    """A SIGTERM right after ``compare`` first writes its results file (every recipe pending there) is the
    command's, not this process's: no recipe is calibrated or trained (with ``--concurrent`` none launched),
    every recipe is recorded not_run with the signal named (not left pending), and the command ends with 143."""
    from falcon_fwa.train import trainer as trainer_module

    out = tmp_path / "cmp"
    written = _signal_at_write(monkeypatch, out, lambda report: True)

    def launch(*args, **kwargs):
        raise AssertionError("a run was launched after the stop")

    monkeypatch.setattr(compare, "_launch", launch)
    monkeypatch.setattr(trainer_module.Trainer, "train", launch)
    code = _guarded_compare(tmp_path, *mode, *extra)
    assert written[0]["status"] == {"a": "pending", "b": "pending"}  # the first write, before the stop
    assert code == 128 + signal.SIGTERM
    report = json.loads((out / "compare.json").read_text())
    assert report["status"] == {"a": "not_run", "b": "not_run"} and report["finished"] is False
    assert report["signal"] == "SIGTERM"
    if "--steps" in extra:
        assert report["steps"] == 3 and report["runs"] == {n: {"error": error, "signal": "SIGTERM", "status": "not_run", "planned_steps": 3}
                                  for n in ("a", "b")}
    else:
        assert "steps" not in report and report["error"] == error and report["runs"] == {}
    assert not (out / "main").exists() and not (out / "calibration").exists()
    assert "stopped by SIGTERM" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_a_stop_during_the_sequential_calibration_ends_it_at_its_step_and_trains_no_recipe(tmp_path, monkeypatch,
                                                                                           capsys):
    """A SIGTERM during the second step of the first recipe's calibration (2 warm-up + 3 timed steps): that
    calibration ends at the step (2 steps, untimed), the second recipe is not calibrated, no step count is
    planned, no recipe trains (all not_run, no OUT/main) and the command ends with 143."""
    from falcon_fwa.train import trainer as trainer_module

    original, calls = trainer_module.causal_lm_loss, []

    def loss(model, batch, device, autocast):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 3:  # the first micro-step of step 2 (2 micro-steps per step)
                os.kill(os.getpid(), signal.SIGTERM)
        return original(model, batch, device, autocast)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", loss)
    code = _guarded_compare(tmp_path, "--time-budget", "5", "--calib-warmup", "2", "--calib-steps", "3")
    out = tmp_path / "cmp"
    assert code == 128 + signal.SIGTERM and len(calls) == 4  # step 2 ended, no other step trained
    report = json.loads((out / "compare.json").read_text())
    assert set(report["calibration"]["a"]) == {"stopped", "first_step_s"}
    assert report["calibration"]["a"]["stopped"] == "SIGTERM" and report["calibration"]["b"] == {"stopped": "SIGTERM"}
    assert report["status"] == {"a": "not_run", "b": "not_run"} and report["finished"] is False
    assert "steps" not in report and report["error"] == "stopped by SIGTERM during calibration"
    assert report["signal"] == "SIGTERM" and report["runs"] == {}
    assert not (out / "main").exists()
    assert "stopped by SIGTERM during calibration" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_a_stop_between_two_sequential_recipes_leaves_the_first_done_and_the_second_not_run(tmp_path, monkeypatch,
                                                                                           capsys):
    """A SIGTERM right after the first recipe's result is written (done, 3 of 3 steps), before the second starts:
    the second is not trained (not_run, the signal named), the first stands, the comparison is not finished and
    the command ends with 143."""
    out = tmp_path / "cmp"
    written = _signal_at_write(monkeypatch, out, lambda report: report["status"]["a"] == "done")
    code = _guarded_compare(tmp_path, "--steps", "3")
    assert written[0]["status"] == {"a": "done", "b": "pending"}
    assert code == 128 + signal.SIGTERM
    report = json.loads((out / "compare.json").read_text())
    assert report["status"] == {"a": "done", "b": "not_run"} and report["finished"] is False
    assert report["runs"]["a"]["steps"] == 3 and "signal" not in report["runs"]["a"]
    assert report["runs"]["b"] == {"error": "stopped by SIGTERM before this recipe started", "signal": "SIGTERM",
                                   "status": "not_run", "planned_steps": 3}
    assert report["signal"] == "SIGTERM"
    assert not (out / "main" / "b").exists()
    assert "stopped by SIGTERM" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_a_stop_as_a_sequential_recipe_is_set_up_stops_it_at_its_first_step(tmp_path, monkeypatch, capsys):
    """A SIGTERM as the second recipe's run folder is made (before its trainer is built): it trains its first
    step only, ends there with a checkpoint of step 1 (stopped, the signal named, in its summary.json too) and
    the command ends with 143; the first recipe stands."""
    from falcon_fwa.train import latest_checkpoint, load_checkpoint

    out = tmp_path / "cmp"
    real_fresh_dir = compare._fresh_dir

    def fresh_dir_then_signal(path):
        real_fresh_dir(path)
        if path == str(out / "main" / "b"):
            os.kill(os.getpid(), signal.SIGTERM)
        return path

    monkeypatch.setattr(compare, "_fresh_dir", fresh_dir_then_signal)
    code = _guarded_compare(tmp_path, "--steps", "3")
    assert code == 128 + signal.SIGTERM
    report = json.loads((out / "compare.json").read_text())
    assert report["status"] == {"a": "done", "b": "stopped"} and report["finished"] is False
    b = report["runs"]["b"]
    assert (b["steps"], b["signal"], b["planned_steps"]) == (1, "SIGTERM", 3)
    assert load_checkpoint(latest_checkpoint(str(out / "main" / "b" / "checkpoints")))["step"] == 1
    assert json.loads((out / "main" / "b" / "summary.json").read_text())["signal"] == "SIGTERM"
    assert report["runs"]["a"]["steps"] == 3
    assert "stopped by SIGTERM" in capsys.readouterr().err


@pytest.mark.usefixtures("one_thread")
def test_a_second_stop_signal_ends_the_sequential_command_at_once(tmp_path, monkeypatch):
    """The command's own stop handler (held from the first write on) leaves a second signal as the trainer's
    would: a SIGTERM and then a SIGINT during the first recipe's second step interrupt the command at once
    (KeyboardInterrupt, Ctrl-C's own), before that step ends."""
    from falcon_fwa.train import trainer as trainer_module

    original, calls = trainer_module.causal_lm_loss, []

    def loss(model, batch, device, autocast):
        if torch.is_grad_enabled():
            calls.append(1)
            if len(calls) == 3:  # the first micro-step of step 2
                os.kill(os.getpid(), signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGINT)
        return original(model, batch, device, autocast)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", loss)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # (ignored in a background job)
    try:
        with pytest.raises(KeyboardInterrupt):
            _guarded_compare(tmp_path, "--steps", "3")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(calls) == 3
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["status"] == {"a": "running", "b": "pending"}
