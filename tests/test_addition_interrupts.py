"""Addition task: runs killed between their writes, stopped by signals, or launched twice on one folder."""
import contextlib
import json
import os
import signal
import subprocess
import threading
import time

import pytest
import torch
from conftest import signal_while_drawing

from falcon_fwa.atomic import folder_lock
from falcon_fwa.tasks.addition import cli, compare, train

SMALL = ["--preset", "tiny", "--device", "cpu", "--batch-size", "4", "--val-per-width", "2", "--ood-per-width", "2",
         "--train-widths", "1", "3", "--ood-widths", "4", "5", "--threads", "1", "--hidden-size", "16",
         "--num-hidden-layers", "1", "--num-heads", "2", "--no-progress"]

VAL_ACC = {1: 10.0, 2: 30.0, 3: 40.0, 4: 20.0}
"""Scripted validation accuracy of each evaluated step: the best step is 3, not the last one."""


def _script_accuracy(monkeypatch):
    """Make the validation accuracy of every evaluation that of :data:`VAL_ACC` at its step (the
    step is known from the last training batch drawn), however the run is interrupted and resumed."""
    last = {}
    original_batch, original_summary = train.training_batch, train._summary

    def drawing(seed, step, *args, **kw):
        last["step"] = step
        return original_batch(seed, step, *args, **kw)

    def scripted(*args):
        return {**original_summary(*args), "val_acc": VAL_ACC[last["step"] + 1]}

    monkeypatch.setattr(train, "training_batch", drawing)
    monkeypatch.setattr(train, "_summary", scripted)


def _run(out, *extra):
    return cli.main(["--model", "Transformer", "--steps", "4", "--eval-every", "1", "--out", str(out), *SMALL, *extra])


def _state(out):
    res = json.loads((out / "results.json").read_text())
    best = torch.load(out / "best.pt", weights_only=False)
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    return res, best, ckpt


@pytest.mark.parametrize("killed_at", ["best.pt", "results.json"])
def test_a_run_killed_between_its_writes_ends_as_a_straight_run(tmp_path, monkeypatch, killed_at):
    """Killed at step 3 (the best step) after checkpoint.pt was written but before ``killed_at``, with
    half-written temporary files left behind: the relaunch loses no evaluation, and its history, best
    step and best.pt are those of a run never killed."""
    _script_accuracy(monkeypatch)
    straight, out = tmp_path / "straight", tmp_path / "killed"
    assert _run(straight) == 0

    save_torch, write_json = train.save_torch, train.write_json
    killed = []

    def kill_at(write, step_of):
        def writing(path, obj, **kw):
            if not killed and os.path.basename(path) == killed_at and step_of(obj) == 3:
                killed.append(path)
                raise KeyboardInterrupt  # like a kill: nothing of the run goes on
            return write(path, obj, **kw)
        return writing

    monkeypatch.setattr(train, "save_torch", kill_at(save_torch, lambda obj: obj["step"]))
    monkeypatch.setattr(train, "write_json", kill_at(write_json, lambda obj: obj["steps_done"]))
    with pytest.raises(KeyboardInterrupt):
        _run(out)
    assert killed and torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 3
    stale = [out / ".checkpoint.k1ll3d.tmp.pt", out / ".best.k1ll3d.tmp.pt", out / ".results.k1ll3d.tmp.json"]
    for f in stale:  # what a kill during a save leaves
        f.write_bytes(b"partial")
    assert _run(out) == 0  # the relaunch (the writes work again)

    (res, best, ckpt), (ref, ref_best, _) = _state(out), _state(straight)
    assert [h["step"] for h in res["history"]] == [1, 2, 3, 4]
    assert res["history"] == ref["history"] and res["best"] == ref["best"] and res["best"]["step"] == 3
    assert best["step"] == 3 and all(torch.equal(best["model"][k], v) for k, v in ref_best["model"].items())
    assert ckpt["step"] == res["steps_done"] == 4 and ckpt["results"]["history"] == res["history"]
    assert not any(f.exists() for f in stale)


def test_a_kill_before_results_json_is_put_right_by_the_relaunch_even_if_finished(tmp_path, monkeypatch):
    """Killed at the last step between checkpoint.pt and results.json: the relaunch trains nothing and
    writes the results the checkpoint holds (results.json said step 3, unfinished)."""
    out = tmp_path / "run"
    write_json = train.write_json

    def writing(path, obj, **kw):
        if os.path.basename(path) == "results.json" and obj["steps_done"] == 4:
            raise KeyboardInterrupt
        return write_json(path, obj, **kw)

    monkeypatch.setattr(train, "write_json", writing)
    with pytest.raises(KeyboardInterrupt):
        _run(out)
    assert json.loads((out / "results.json").read_text())["steps_done"] == 3
    monkeypatch.setattr(train, "write_json", write_json)
    assert _run(out) == 0
    res, _, ckpt = _state(out)
    assert res["finished"] and res["steps_done"] == 4 and [h["step"] for h in res["history"]] == [1, 2, 3, 4]


def test_sigterm_stops_a_run_at_the_end_of_its_step_with_a_consistent_checkpoint(tmp_path, monkeypatch, capsys):
    """A SIGTERM during step 3 of 4 (evaluations at 2 and 4): exit 143 with a checkpoint at step 3 that
    results.json agrees with; the relaunch trains step 4 only and ends with the straight run's history,
    train loss of the steps 3-4 included."""
    straight, out = tmp_path / "straight", tmp_path / "run"
    argv = ["--eval-every", "2"]
    assert _run(straight, *argv) == 0
    drawn = signal_while_drawing(monkeypatch, train, signal.SIGTERM, 3)  # the first launch, in its third step
    fallback = []  # the test's own handler: a signal the run does not catch is seen here
    previous = signal.signal(signal.SIGTERM, lambda *a: fallback.append(1))
    try:
        assert _run(out, *argv) == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not fallback and signal.getsignal(signal.SIGTERM) is previous  # caught by the run, handler given back
    assert "stopped by SIGTERM at step 3 of 4" in capsys.readouterr().err
    res, _, ckpt = _state(out)
    assert ckpt["step"] == res["steps_done"] == 3 and not res["finished"] and res["signal"] == "SIGTERM"
    assert [h["step"] for h in res["history"]] == [2] and ckpt["loss_n"] == 1
    drawn.clear()
    assert _run(out, *argv) == 0
    assert drawn == [3]  # only the step left
    res, ref = _state(out)[0], _state(straight)[0]
    assert res["history"] == ref["history"] and res["finished"] and "signal" not in res


def test_a_folder_being_trained_is_refused(tmp_path):
    out = tmp_path / "run"
    with folder_lock(out, train.LOCK_NAME, wait=False):  # another process training it
        with pytest.raises(ValueError, match=f"^{out} is being trained by another process"):
            _run(out)
    assert not (out / "results.json").exists() and not (out / "checkpoint.pt").exists()


def test_compare_passes_a_sigterm_to_its_runs_and_waits_for_them(tmp_path, monkeypatch):
    """SIGTERM to addition-compare while its run trains: the run stops at a step with a consistent
    checkpoint, the command ends with 143 once it has, and no process holds the run folder after."""
    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    run_dir = tmp_path / "runs" / "Transformer" / "seed0"
    fallback = []
    returned = threading.Event()

    def signal_then_watch():
        deadline = time.monotonic() + 120
        while not (run_dir / "results.json").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # the run has evaluated (at step 5) and trains on
        os.kill(os.getpid(), signal.SIGTERM)
        if not returned.wait(60):  # the command did not stop its run: end it, so the test ends
            for proc in started:
                with contextlib.suppress(OSError):
                    proc.kill()

    previous = signal.signal(signal.SIGTERM, lambda *a: fallback.append(1))
    watcher = threading.Thread(target=signal_then_watch, daemon=True)
    watcher.start()
    try:
        rc = compare.main(["--models", "Transformer", "--steps", "1000000", "--eval-every", "5", "--runs",
                           str(tmp_path / "runs"), "--results", str(tmp_path / "res"), *SMALL[:-1]])
    finally:
        returned.set()
        signal.signal(signal.SIGTERM, previous)
        watcher.join()
    children = [p for p in started if "falcon_fwa.tasks.addition.cli" in p.args]
    assert rc == 128 + signal.SIGTERM and not fallback
    assert len(children) == 1 and children[0].returncode == 128 + signal.SIGTERM  # it stopped by itself
    with folder_lock(run_dir, train.LOCK_NAME, wait=False):  # nobody trains the folder any more
        pass
    res, _, ckpt = _state(run_dir)
    assert ckpt["step"] == res["steps_done"] >= 5 and res["signal"] == "SIGTERM"
    assert "stopped by SIGTERM" in (run_dir / "log.txt").read_text()
    assert not (tmp_path / "res").exists()  # no summary of a stopped command


def test_a_checkpoint_of_an_earlier_version_resumes_where_results_json_agrees_and_is_refused_where_not(tmp_path):
    """Checkpoints written before they kept the results: resumed with results.json where both are at
    one step; where a kill left them apart, refused with a line naming the folder (nothing to rebuild
    the lost evaluation from)."""
    out = tmp_path / "run"
    assert _run(out, "--steps", "2") == 0
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    old = {k: ckpt[k] for k in ("model", "optimizer", "step")}  # the earlier format
    torch.save(old, out / "checkpoint.pt")
    res = json.loads((out / "results.json").read_text())
    (out / "results.json").write_text(json.dumps({**res, "steps_done": 1, "history": res["history"][:1]}))
    with pytest.raises(ValueError, match=f"^{out}: checkpoint.pt is at step 2 but results.json at step 1"):
        _run(out, "--steps", "3")
    (out / "results.json").write_text(json.dumps(res))
    assert _run(out, "--steps", "3") == 0
    assert [h["step"] for h in json.loads((out / "results.json").read_text())["history"]] == [1, 2, 3]


def test_a_killed_compare_leaves_no_run_training(tmp_path):
    """SIGKILL to addition-compare (which can pass nothing on): its run gets a SIGHUP all the same
    (``end_with_parent``; the system may send it once per thread of the command), stops at a step with a
    consistent checkpoint, names the signal, and lets go of its folder."""
    import sys

    run_dir = tmp_path / "runs" / "Transformer" / "seed0"
    cmd = [sys.executable, "-m", "falcon_fwa.cli", "addition-compare", "--models", "Transformer", "--steps", "1000000",
           "--eval-every", "5", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "res"), *SMALL[:-1]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "results.json").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)  # the run has evaluated (at step 5) and trains on
        assert proc.poll() is None and (run_dir / "results.json").exists()
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with folder_lock(run_dir, train.LOCK_NAME, wait=False):
                    break
            except BlockingIOError:
                time.sleep(0.2)
        else:
            pytest.fail("the run still trains a minute after its command was killed")
    finally:
        if proc.poll() is None:
            proc.kill()
    res, _, ckpt = _state(run_dir)
    assert ckpt["step"] == res["steps_done"] >= 5
    # the run's own output names how it ended where it did not stop on the SIGTERM
    assert res.get("signal") == "SIGHUP", (run_dir / "log.txt").read_text()[-3000:]


def test_sigterm_before_the_first_step_says_no_checkpoint_was_written(tmp_path, monkeypatch, capsys):
    """A SIGTERM while the evaluation sets are drawn, before the first step: the run ends with 143, writes
    no checkpoint and says so (it named a checkpoint that was not there)."""
    out = tmp_path / "run"
    original = train.eval_batches

    def drawing(*args, **kw):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kw)

    monkeypatch.setattr(train, "eval_batches", drawing)
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        code = _run(out)
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGTERM and "before its first step (no checkpoint)" in err and "checkpoint in" not in err
    assert not (out / "checkpoint.pt").exists()


_KILLED_WRITE = """
import os, signal, sys
from falcon_fwa.atomic import atomic_path
with atomic_path(sys.argv[1]) as tmp:
    with open(tmp, "w") as f:
        f.write("[partial")
    os.kill(os.getpid(), signal.SIGKILL)
"""
"""A process killed (SIGKILL) in the middle of an atomic write of the file ``argv[1]``."""


def _kill_during_write(path):
    """Leave the temporary file of a write of ``path`` killed midway, as a killed command leaves it."""
    import sys

    proc = subprocess.run([sys.executable, "-c", _KILLED_WRITE, str(path)])
    assert proc.returncode == -signal.SIGKILL


def _hidden(folder):
    return sorted(name for name in os.listdir(folder) if name.startswith("."))


def test_a_lineup_removes_the_temporaries_of_its_summary_a_killed_one_left(tmp_path):
    """A summary write killed midway leaves a hidden temporary file in --results, which no later command would
    read: the next lineup of that name removes those of its own files (under the folder's summary lock, which
    every such writer holds), and leaves those of other files and no lock file behind."""
    res = tmp_path / "res"
    argv = ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--eval-every", "2", "--runs",
            str(tmp_path / "runs"), "--results", str(res), "--name", "t", *SMALL[:-1]]
    assert compare.main(argv) == 0
    written = {name: (res / name).read_bytes() for name in compare.summary_files("t")}
    for name in ("t.json", "t_meta.json", "t.md", "t_meta.json"):  # one killed command after another
        _kill_during_write(res / name)
    killed = _hidden(res)
    assert len(killed) == 4 and all(n.endswith(".tmp.json") or n.endswith(".tmp.md") for n in killed)
    assert {name: (res / name).read_bytes() for name in written} == written  # the summary itself is whole
    # by hand: temporaries of the other files of the summary, and of files that are not its own
    ours = [".t.abcd_123.tmp.png", ".t_positions.zz99zz99.tmp.png", ".t.before.a1b2c3d4.tmp.md",
            ".t.before-2.a1b2c3d4.tmp.md"]
    others = [".t.x.abcd1234.tmp.json",  # the summary "t.x"
              ".u.abcd1234.tmp.json", ".t_meta.short.tmp.json",  # another summary; not a name mkstemp gives
              ".tt.abcd1234.tmp.json", ".t.abcd1234.tmp.txt", ".results.abcd1234.tmp.json"]
    for name in ours + others:
        (res / name).write_text("partial")
    assert compare.main(argv + ["--no-train"]) == 0
    assert _hidden(res) == sorted(others)
    assert json.loads((res / "t.json").read_text())[0]["model"] == "Transformer"
    # the temporary of a write killed now is removed by the next command in turn: none accumulate
    _kill_during_write(res / "t.json")
    assert len(_hidden(res)) == len(others) + 1
    assert compare.main(argv + ["--no-train"]) == 0
    assert _hidden(res) == sorted(others)


def test_a_lineup_removes_a_finished_runs_temporaries_unless_a_live_process_holds_it(tmp_path):
    """A finished run is skipped, not started again (which removes what a kill during its writes left): the
    lineup removes those temporary files itself where no live process holds the run's lock; --no-train
    writes nothing in --runs."""
    runs = tmp_path / "runs"
    argv = ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--eval-every", "2", "--runs", str(runs),
            "--results", str(tmp_path / "res"), "--name", "t", *SMALL[:-1]]
    assert compare.main(argv) == 0
    run_dir = runs / "Transformer" / "seed0"
    before = _hidden(run_dir)
    assert before == [train.LOCK_NAME]
    _kill_during_write(run_dir / "results.json")
    stale = [".checkpoint.abcd1234.tmp.pt", ".best.abcd1234.tmp.pt", ".accuracy_vs_width.abcd1234.tmp.png",
             ".accuracy_by_position.abcd1234.tmp.png"]
    for name in stale:
        (run_dir / name).write_text("partial")
    left = _hidden(run_dir)
    assert len(left) == len(stale) + 2
    assert compare.main(argv + ["--no-train"]) == 0
    assert _hidden(run_dir) == left
    with folder_lock(run_dir, train.LOCK_NAME, wait=False):  # a live process holds the run: its files stand
        assert compare.main(argv) == 0
        assert _hidden(run_dir) == left
    assert compare.main(argv) == 0
    assert _hidden(run_dir) == before
    assert json.loads((run_dir / "results.json").read_text())["finished"]


def test_a_run_writes_its_plots_under_its_lock_and_a_relaunch_removes_their_temporaries(tmp_path, monkeypatch):
    """The plots are written while the run still holds its folder (another process could not take it), so a
    temporary file of theirs that a kill left is the next holder's to remove."""
    from falcon_fwa.tasks.addition import plot

    out = tmp_path / "run"
    held = []
    original = plot.plot_accuracy_vs_width

    def drawing(*args, **kw):
        try:
            with folder_lock(out, train.LOCK_NAME, wait=False):
                held.append(False)
        except BlockingIOError:
            held.append(True)
        return original(*args, **kw)

    monkeypatch.setattr(plot, "plot_accuracy_vs_width", drawing)
    assert cli.main(["--model", "Transformer", "--steps", "2", "--eval-every", "2", "--out", str(out), *SMALL]) == 0
    assert held == [True] and (out / "accuracy_vs_width.png").stat().st_size > 0
    _kill_during_write(out / "accuracy_by_position.png")
    _kill_during_write(out / "accuracy_vs_width.png")
    assert len(_hidden(out)) == 3
    assert cli.main(["--model", "Transformer", "--steps", "2", "--eval-every", "2", "--out", str(out), *SMALL]) == 0
    assert _hidden(out) == [train.LOCK_NAME]


def test_a_lineup_of_finished_runs_in_a_folder_it_may_not_write_is_summarized(tmp_path, monkeypatch):
    """Finished runs in a ``--runs`` folder this command may not write (read-only, or another user's) are
    summarized, as the same lineup with ``--no-train`` summarizes them: their temporary files are left there (none
    can be removed), and the summary in ``--results`` is written."""
    import errno

    from falcon_fwa import atomic

    runs, res = tmp_path / "runs", tmp_path / "res"
    argv = ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--eval-every", "2", "--runs", str(runs),
            "--results", str(res), "--name", "t", *SMALL[:-1]]
    assert compare.main(argv) == 0
    run_dir = runs / "Transformer" / "seed0"
    (run_dir / ".best.abcd1234.tmp.pt").write_text("partial")
    held = sorted(os.listdir(run_dir))
    want = json.loads((res / "t.json").read_text())
    for name in compare.summary_files("t"):
        (res / name).unlink()
    opened = atomic._open_lock_file

    def read_only(path):  # as opening a file for writing fails on a read-only file system
        if str(path).startswith(str(runs)):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return opened(path)

    monkeypatch.setattr(atomic, "_open_lock_file", read_only)
    for no_train in ([], ["--no-train"]):
        assert compare.main(argv + no_train) == 0
        assert json.loads((res / "t.json").read_text()) == want
        assert sorted(os.listdir(run_dir)) == held
