"""``compare --concurrent`` where ``os`` has ``WNOWAIT`` but no ``waitid``, as on macOS: CPython exports
``os.WNOWAIT`` wherever ``<sys/wait.h>`` defines it, but builds ``os.waitid`` only where ``HAVE_WAITID`` holds
and ``__APPLE__`` does not (Modules/posixmodule.c). A run's end is then seen by reaping it (``Popen.poll``), and
the runs are collected as they end, not ended by an ``AttributeError``."""
import os
import signal
import subprocess
import sys
import time

import pytest

from falcon_fwa.train import compare


@pytest.fixture
def no_waitid(monkeypatch):
    """This ``os`` without ``waitid`` (its ``WNOWAIT`` kept)."""
    assert hasattr(os, "WNOWAIT")
    if hasattr(os, "waitid"):
        monkeypatch.delattr(os, "waitid")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")
def test_a_run_is_seen_going_then_ended_without_waitid(no_waitid):
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert compare._has_ended(proc) is False  # still reading its input
        proc.stdin.close()
        deadline = time.monotonic() + 30
        while not compare._has_ended(proc):
            assert time.monotonic() < deadline, "the ended run was never seen as ended"
            time.sleep(0.05)
        assert proc.returncode == 0
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")
def test_collect_records_each_run_as_it_ends_without_waitid(tmp_path, no_waitid):
    """Two runs that end by themselves, one with exit code 0 and one with 3, neither with a summary: each is
    collected as failed with its own exit code (no summary.json is no finished run)."""
    procs = {}
    for name, code in (("a", 0), ("b", 3)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "stdout.txt").write_text("")
        procs[name] = (subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"], start_new_session=True),
                       str(run_dir))
    events = sorted((name, status, result["error"]) for name, status, result in compare._collect(procs, None))
    assert events == [("a", "failed", "exit code 0"), ("b", "failed", "exit code 3")]
