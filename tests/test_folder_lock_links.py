"""``folder_lock`` where a link stands at the lock file's path or at the folder's: a link to a file not there yet
is opened as ``open(path, "a")`` opens it (its target made) and locked; a link whose target cannot be made, or a
folder that is a link to nothing, is an error naming the path. None of them is retried for ever."""
import os
import subprocess
import sys
import textwrap

import pytest

HOLD = textwrap.dedent("""
    import sys
    from falcon_fwa.atomic import folder_lock
    with folder_lock(sys.argv[1], ".lock") as remade:
        print("held", list(remade.folders), remade.lock)
""")


def _hold(folder):
    """``folder_lock(folder, ".lock")`` in a process of its own, ended after 30 s if it has not ended itself:
    ``(exit status, its output)``; ``None`` where it had to be ended (it never got past the lock)."""
    try:
        done = subprocess.run([sys.executable, "-c", HOLD, str(folder)], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return None
    return done.returncode, done.stdout + done.stderr


@pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32", reason="POSIX links and flock")
def test_a_lock_file_that_is_a_link_to_a_file_not_there_yet_is_made_and_locked(tmp_path):
    """``.lock`` links to ``target``, which does not exist, in a folder that does: the lock is held (the
    target made, empty, as ``open(path, "a")`` makes it), and the lock file is not reported as one the lock made
    (the link was there before it)."""
    os.symlink(tmp_path / "target", tmp_path / ".lock")
    got = _hold(tmp_path)
    assert got is not None, "folder_lock did not end: it retried the link for ever"
    assert got == (0, "held [] False\n")
    assert (tmp_path / "target").read_bytes() == b"" and os.path.islink(tmp_path / ".lock")


@pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32", reason="POSIX links and flock")
def test_a_lock_file_linked_into_a_missing_folder_is_an_error_naming_it(tmp_path):
    """``.lock`` links into a folder that does not exist: no lock file can be opened there, and the error names
    the lock file's path (a FileNotFoundError), rather than a lock that never ends trying."""
    os.symlink(tmp_path / "gone" / "target", tmp_path / ".lock")
    got = _hold(tmp_path)
    assert got is not None, "folder_lock did not end: it retried the link for ever"
    code, output = got
    assert code == 1 and "FileNotFoundError" in output and str(tmp_path / ".lock") in output
    assert not (tmp_path / "gone").exists()


@pytest.mark.skipif(not hasattr(os, "symlink") or sys.platform == "win32", reason="POSIX links and flock")
def test_a_folder_that_is_a_link_to_nothing_is_an_error_naming_it(tmp_path):
    """The folder to lock is a link to a folder that does not exist: it cannot be made (``os.makedirs`` refuses
    it, FileExistsError naming it), so the lock ends with that error instead of trying for ever."""
    os.symlink(tmp_path / "nowhere", tmp_path / "out")
    got = _hold(tmp_path / "out")
    assert got is not None, "folder_lock did not end: it retried the link for ever"
    code, output = got
    assert code == 1 and "FileExistsError" in output and str(tmp_path / "out") in output
    assert not (tmp_path / "nowhere").exists()
