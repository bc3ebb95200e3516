"""A run folder that holds another run (other data, another model) is refused before anything is written,
naming the folder, the settings that differ and the ways out; under torchrun only rank 0 says so."""
import json
import os
import subprocess
import sys

import pytest

from falcon_fwa.train import Trainer, config_from_dict
from falcon_fwa.train import cli as train_cli
from falcon_fwa.train import distributed
from falcon_fwa.train import trainer as trainer_module
from test_train import ROOT, recipe, run_trainer


def tree(folder):
    """Every file under ``folder`` with its bytes and modification time, and every folder."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for d in dirs:
            found[os.path.join(root, d)] = None
        for f in files:
            path = os.path.join(root, f)
            with open(path, "rb") as fh:
                found[path] = (fh.read(), os.stat(path).st_mtime_ns)
    return found


def other_run(tmp_path):
    """The recipe of ``run``'s folder with another row length and window, and its data in the run folder
    (``data.out_dir`` unset), where the finished run's data is elsewhere."""
    raw = recipe(tmp_path, "run")
    raw["data"]["seq_len"] = 16
    del raw["data"]["out_dir"]
    raw["model"]["overrides"] = {"window": 16}
    return raw


def test_a_folder_of_another_run_is_refused_by_name_before_anything_is_written(tmp_path):
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    before = tree(tmp_path / "run")
    with pytest.raises(ValueError) as err:
        Trainer(config_from_dict(other_run(tmp_path)))
    message = str(err.value)
    out_dir = str(tmp_path / "run")
    assert message.startswith(f"train.out_dir={out_dir!r} holds a run of other settings than this recipe's ("), message
    # every setting that differs, the data's and the model's, the checkpoint's value first
    assert "data.seq_len 24 there, 16 here" in message and "model.window 4 there, 16 here" in message, message
    assert "another train.out_dir" in message and "train.resume=none" in message, message
    # the other run's folder is as it was: no data prepared into it, no log rewritten, no checkpoint touched
    assert tree(tmp_path / "run") == before
    assert not (tmp_path / "run" / "data").exists()


def test_a_checkpoint_named_by_train_resume_of_another_model_is_refused_naming_it(tmp_path):
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    path = str(tmp_path / "run" / "checkpoints" / "step-00000002")
    raw = recipe(tmp_path, "new", resume=path)
    raw["model"]["overrides"] = {"window": 16}
    with pytest.raises(ValueError, match=rf"^train\.resume={path!r} holds a run of other settings than this "
                                         r"recipe's \(model\.window 4 there, 16 here\)"):
        Trainer(config_from_dict(raw))
    assert not (tmp_path / "new").exists()


def test_the_same_recipe_with_a_longer_run_still_resumes(tmp_path):
    """What a relaunch may change (train.steps, the optim section) is no other run."""
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    raw = recipe(tmp_path, "run", steps=6)
    raw["optim"]["lr"] = 1e-3
    trainer = Trainer(config_from_dict(raw))
    try:
        assert trainer.step == 2
    finally:
        trainer.close()


def _launch(tmp_path, monkeypatch, capsys, rank, world_size=1):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other_run(tmp_path)))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    capsys.readouterr()
    status = train_cli.main(["--config", str(path)])
    out = capsys.readouterr()
    return status, out.out + out.err


def test_only_rank_0_reports_a_refused_resume(tmp_path, monkeypatch, capsys):
    """Every process of a launch refuses alike; rank 0 prints the error, the others end with its exit
    status and print nothing (one process of each rank here, as torchrun describes it)."""
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    status, said = _launch(tmp_path, monkeypatch, capsys, rank=0)
    assert status == 2 and said.count("falcon-fwa train: error: train.out_dir=") == 1, said
    waits = []
    monkeypatch.setattr(train_cli.time, "sleep", waits.append)
    status, said = _launch(tmp_path, monkeypatch, capsys, rank=1)
    assert status == 2 and said == "", said
    assert waits == []  # one process: nobody to wait for
    # in a launch of several, a process other than rank 0 leaves rank 0 the time to print before it ends
    # (torchrun stops the rest as soon as one process ends)
    # (the trainer's refusal stands in for the one a process group of two would make)
    def refused(cfg):
        raise trainer_module.ResumeRefused("train.out_dir='run' holds a run of other settings")

    monkeypatch.setattr(trainer_module, "Trainer", refused)
    monkeypatch.setattr(distributed, "teardown", lambda: waits.append("teardown"))
    status, said = _launch(tmp_path, monkeypatch, capsys, rank=1, world_size=2)
    assert status == 2 and said == "", said
    assert waits == [train_cli.REPORT_GRACE_S, "teardown"] and train_cli.REPORT_GRACE_S >= 1


@pytest.mark.slow
def test_torchrun_prints_a_refused_resume_once(tmp_path, cpu_machine):
    """Two gloo processes launched into another run's folder: the error once (torchrun ends the process still
    running when the other exits, so only the first one's exit status is sure)."""
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    path = tmp_path / "other.json"
    path.write_text(json.dumps(other_run(tmp_path)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    env.pop("FALCON_FWA_TRACEBACK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "falcon_fwa.train.cli", "--config", str(path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert said.count("holds a run of other settings") == 1, said[-3000:]
    assert "exitcode  : 2" in said, said[-3000:]
