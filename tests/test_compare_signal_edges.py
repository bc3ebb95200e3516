"""``compare --concurrent`` at the edges of its stop signals: a run whose first process has ended while others
of its process group live on (those are killed with it, never a group whose id may be another's by now)."""
import os
import select
import signal
import subprocess
import sys

import pytest

from falcon_fwa.train import compare

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
