"""addition-compare stopped by a signal or its deadline: the progress bar counts the runs that finished,
not those stopped at their checkpoints, and the closing line counts the stopped runs in words."""
import argparse
import signal
import subprocess

import pytest

from falcon_fwa.tasks.addition import compare


class _Run:
    """A run's process that trains until it is sent a signal, then ends with 128 + that signal, as a run
    stopped at its checkpoint does (no results.json of a finished run)."""
    started = []

    def __init__(self, cmd, **kw):
        self.model, self.seed = cmd[cmd.index("--model") + 1], int(cmd[cmd.index("--seed") + 1])
        self.returncode = None
        _Run.started.append((self.model, self.seed))

    def poll(self):
        return self.returncode

    def send_signal(self, signum):
        self.returncode = 128 + signum

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.returncode = -9

    def wait(self):
        return self.returncode


class _Bar:
    """Stands for tqdm: records the updates and the lines written."""
    made = []

    def __init__(self, total=None, **kw):
        self.total, self.n, self.lines = total, 0, []
        _Bar.made.append(self)

    def update(self, k=1):
        self.n += k

    def write(self, line):
        self.lines.append(line)

    def close(self):
        pass


class _Signals:
    """Stands for StopSignals: a SIGTERM is received after the first round of starts."""

    def __init__(self, enabled):
        self.received = 0

    def __enter__(self):
        _Signals.current = self
        return self

    def __exit__(self, *exc):
        return False


def _train(monkeypatch, tmp_path, argv, *, deadline=False, popen=_Run):
    import tqdm.auto

    monkeypatch.setattr(_Run, "started", [])
    monkeypatch.setattr(_Bar, "made", [])
    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    monkeypatch.setattr(compare, "StopSignals", _Signals)
    if deadline:
        clock = iter([0.0, 0.0, 10.0])  # start, first round, then past the deadline of 5 s
        monkeypatch.setattr(compare.time, "perf_counter", lambda: next(clock))
        monkeypatch.setattr(compare.time, "sleep", lambda s: None)
    else:
        monkeypatch.setattr(compare.time, "sleep", lambda s: setattr(_Signals.current, "received", signal.SIGTERM))
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    args = p.parse_args(["--steps", "2", "--device", "cpu", *argv])
    result = compare.train_all(args, tmp_path / "runs")
    (bar,) = _Bar.made
    return result, bar


@pytest.mark.parametrize("jobs, line", [
    ("1", "SIGTERM: stopped 1 run at its checkpoint, 1 not started"),
    ("2", "SIGTERM: stopped 2 runs at their checkpoints, 0 not started"),
])
def test_a_sigterm_counts_no_stopped_run_as_done(tmp_path, monkeypatch, jobs, line):
    (failed, stopped_by), bar = _train(monkeypatch, tmp_path, ["--models", "Transformer", "Mamba-2", "--jobs", jobs])
    assert stopped_by == signal.SIGTERM and len(_Run.started) == int(jobs)
    assert bar.total == 2 and bar.n == 0  # nothing finished: 0/2, not 1/2 or 2/2
    assert bar.lines == [line]
    assert len(failed) == 2


def test_a_deadline_counts_no_stopped_run_as_done(tmp_path, monkeypatch):
    (failed, stopped_by), bar = _train(monkeypatch, tmp_path, ["--models", "Transformer", "Mamba-2", "--jobs", "1",
                                                               "--deadline", "5"], deadline=True)
    assert stopped_by == 0 and _Run.started == [("Transformer", 0)]
    assert bar.total == 2 and bar.n == 0
    assert bar.lines == ["deadline of 5 s reached: stopped 1 run, 1 not started"]
    assert failed == ["Transformer seed 0 (stopped at the deadline, exit 143)",
                      "Mamba-2 seed 0 (not started before the deadline)"]


def test_a_run_that_finished_as_the_sigterm_came_is_counted_done_and_not_stopped(tmp_path, monkeypatch):
    class Finishing(_Run):
        def send_signal(self, signum):  # Transformer ended its last step as the signal came: status 0
            self.returncode = 0 if self.model == "Transformer" else 128 + signum

    (failed, stopped_by), bar = _train(monkeypatch, tmp_path, ["--models", "Transformer", "Mamba-2", "--jobs", "2"],
                                       popen=Finishing)
    assert bar.n == 1 and bar.lines == ["SIGTERM: stopped 1 run at its checkpoint, 0 not started"]
    assert failed == ["Mamba-2 seed 0 (stopped by SIGTERM, exit 143)"]
