"""Writes that the disk refuses: the error names the file being written, the previous version stays,
and a run relaunched once there is room again goes on as if nothing had happened.

The full disk is the kernel's own: the files are opened on ``/dev/full``, where every write that
reaches the device fails with ENOSPC, as on a disk with no room left (Linux)."""
import builtins
import errno
import json
import os

import pytest
import torch

from falcon_fwa import atomic
from falcon_fwa.train import checkpoint as ckpt_module
from falcon_fwa.train import latest_checkpoint, load_checkpoint
from falcon_fwa.train.logger import MetricLogger, read_log

from test_train import losses, recipe, run_trainer

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


def full_disk(monkeypatch, module, which=lambda path: True):
    """Make ``module``'s ``open`` write to ``/dev/full`` (files ``which`` accepts, opened for writing)."""
    def opening(path, mode="r", *args, **kwargs):
        if any(c in mode for c in "wa") and which(os.fspath(path)):
            return builtins.open("/dev/full", mode, *args, **kwargs)
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(module, "open", opening, raising=False)


def assert_no_space(err, path):
    assert err.errno == errno.ENOSPC and err.filename == os.fspath(path)
    assert f"No space left on device: '{path}'" in str(err)


@pytest.mark.parametrize("write", ["json", "text", "torch"])
def test_a_write_to_a_full_disk_names_the_file_and_keeps_the_previous_version(tmp_path, monkeypatch, write):
    path = tmp_path / {"json": "r.json", "text": "t.md", "torch": "c.pt"}[write]
    # past the file's buffer, so that the writes meet the full disk before the flush (torch.save: inside
    # its zip writer, which reports it as a RuntimeError)
    big = {"w": torch.arange(50_000) if write == "torch" else list(range(50_000))}
    writes = {"json": lambda obj: atomic.write_json(path, obj), "text": lambda obj: atomic.write_text(path, repr(obj)),
              "torch": lambda obj: atomic.save_torch(path, obj)}[write]
    writes({"version": 1})
    before = path.read_bytes()
    full_disk(monkeypatch, atomic)
    for obj in ({"version": 2}, {"version": 2, **big}):
        with pytest.raises(OSError) as caught:
            writes(obj)
        assert_no_space(caught.value, path)  # the file being written, not its temporary file
        assert path.read_bytes() == before
        assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary file left


def test_a_folder_one_may_not_write_to_is_named_by_the_file_being_written(tmp_path, monkeypatch):
    def refused(dir, prefix, suffix):  # as mkstemp fails in a read-only folder, naming its random file
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.path.join(dir, prefix + "x1y2" + suffix))

    monkeypatch.setattr(atomic.tempfile, "mkstemp", lambda dir, prefix, suffix: refused(dir, prefix, suffix))
    with pytest.raises(PermissionError) as caught:
        atomic.write_json(tmp_path / "summary.json", {})
    assert caught.value.filename == str(tmp_path / "summary.json")


def test_an_error_that_names_another_file_is_left_as_it_is(tmp_path):
    with pytest.raises(FileNotFoundError) as caught:
        with atomic.atomic_path(tmp_path / "plot.png"):
            open(tmp_path / "no-such-font.ttf")  # a file the writer reads, not the one written
    assert caught.value.filename == str(tmp_path / "no-such-font.ttf")
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_that_meets_a_full_disk_is_named_and_leaves_the_last_one_to_resume_from(tmp_path, monkeypatch):
    raw = recipe(tmp_path, "run")  # 4 steps, a checkpoint every 2
    full = run_trainer(recipe(tmp_path, "full"))
    run_trainer(raw, stop_at=2)
    ckdir = tmp_path / "run" / "checkpoints"
    full_disk(monkeypatch, atomic, lambda path: path.endswith("state.pt"))
    with pytest.raises(OSError) as caught:
        run_trainer(raw)
    assert_no_space(caught.value, ckdir / "step-00000004")
    # the failed save gave its space back; the previous checkpoint is the latest, whole
    assert sorted(os.listdir(ckdir)) == ["LATEST", "step-00000002"]
    assert load_checkpoint(latest_checkpoint(str(ckdir)))["step"] == 2
    monkeypatch.undo()  # room again: the relaunch resumes at step 2 and ends as the uninterrupted run
    resumed = run_trainer(raw)
    assert losses(tmp_path / "run") == losses(tmp_path / "full")
    assert losses(tmp_path / "run", "val_loss") == losses(tmp_path / "full", "val_loss")
    for (name, a), b in zip(full.core.state_dict().items(), resumed.core.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_save_killed_by_a_signal_keeps_its_folder_for_the_next_save_to_remove(tmp_path, monkeypatch):
    # only a failed write gives its folder back at once; an interrupt leaves the process to end
    def interrupted(obj, f):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_module.torch, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt_module.save_checkpoint(str(tmp_path), 3, {"step": 3})
    assert os.listdir(tmp_path) == [".tmp-step-00000003"]


def test_a_training_log_that_meets_a_full_disk_names_log_jsonl(tmp_path):
    logger = MetricLogger(str(tmp_path), enabled=True, tensorboard=False, wandb_project=None, config={})
    logger.log(1, loss=2.5)
    logger.file.close()
    logger.file = open("/dev/full", "a")  # the disk fills up
    with pytest.raises(OSError) as caught:
        logger.log(2, loss=2.25)
    assert_no_space(caught.value, tmp_path / "log.jsonl")
    with pytest.raises(OSError) as caught:  # closing tries the buffered record again
        logger.close()
    assert_no_space(caught.value, tmp_path / "log.jsonl")
    assert read_log(str(tmp_path / "log.jsonl")) == [{"step": 1, "loss": 2.5}]


def test_token_shards_that_meet_a_full_disk_are_named(tmp_path, monkeypatch):
    from falcon_fwa.data import shards
    from falcon_fwa.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("byte")
    full_disk(monkeypatch, shards, lambda path: path.endswith(".bin"))
    with pytest.raises(OSError) as caught:
        shards.write_token_shards(["some text"] * 10_000, tokenizer, str(tmp_path / "train"))
    assert_no_space(caught.value, tmp_path / "train.tmp" / "tokens-00000.bin")
    assert not (tmp_path / "train").exists()  # no folder that looks finished


def test_a_tokenizer_that_meets_a_full_disk_is_named(tmp_path):
    from falcon_fwa.data.prepare import save_tokenizer

    class RefusedByTheDisk:
        def save_pretrained(self, folder):  # the fast tokenizers' (Rust) report of ENOSPC
            raise Exception("No space left on device (os error 28)")

    with pytest.raises(OSError, match=rf"cannot write the tokenizer into '{tmp_path}/tok': No space left on device"):
        save_tokenizer(RefusedByTheDisk(), str(tmp_path / "tok"))

    class Broken:
        def save_pretrained(self, folder):
            raise TypeError("a bug, not the disk")

    with pytest.raises(TypeError, match="a bug"):
        save_tokenizer(Broken(), str(tmp_path / "tok"))


def test_a_relaunch_removes_the_temporary_files_a_killed_launch_left(tmp_path):
    # what a SIGKILL during the atomic writes of summary.json, log.jsonl, loss.png and prepared.json leaves behind
    raw = recipe(tmp_path, "run")
    run_trainer(raw, stop_at=2)
    run, data = tmp_path / "run", tmp_path / "data"
    stale = [run / ".summary.k1ll3d.tmp.json", run / ".log.k1ll3d.tmp.jsonl", run / ".loss.k1ll3d.tmp.png",
             data / ".prepared.k1ll3d.tmp.json"]
    others = [run / ".summary.json.bak", run / "notes.tmp.json", data / ".prepared.tmp"]  # no temporaries of ours
    for path in stale:
        path.write_text('{"half": ')
    for path in others:
        path.write_text("kept")
    run_trainer(raw)
    assert not any(p.exists() for p in stale)
    assert all(p.read_text() == "kept" for p in others)
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
