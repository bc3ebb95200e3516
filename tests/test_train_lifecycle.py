"""A run's life over several launches: a stop step past the run's end, or before the checkpoint the launch
resumes from, is refused before any work (one at that checkpoint trains nothing, and says so); a run
stopped at the step that a later launch's train.steps makes its last is finished as a run of that length
(evaluated and exported there, its summary of that length); a finished run launched again does no work
again (its export stays, unless it is missing)."""
import json
import os
import signal

import pytest
import torch
from test_train import losses, recipe, run_trainer, signal_during_step_3

from falcon_fwa.train import Trainer, config_from_dict, latest_checkpoint, load_checkpoint
from falcon_fwa.train.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _write(tmp_path, raw, name="recipe.json"):
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return str(path)


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("stop_at", [5, 40])
def test_a_stop_step_past_train_steps_is_refused_before_any_data_is_read(tmp_path, capsys, monkeypatch, stop_at):
    """--stop-at N beyond train.steps would run on to train.steps and finish the run: refused, naming the
    option, N and train.steps, before the data folder or the run folder is made."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    raw = recipe(tmp_path, "run")  # train.steps = 4
    assert main(["--config", _write(tmp_path, raw), "--stop-at", str(stop_at)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa train: error: --stop-at {stop_at} ") and "train.steps = 4" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_a_stop_step_at_train_steps_finishes_the_run(tmp_path):
    raw = recipe(tmp_path, "run")
    assert main(["--config", _write(tmp_path, raw), "--stop-at", "4"]) == 0
    summary = _summary(tmp_path / "run")
    assert summary["steps"] == 4 and "signal" not in summary


def _stop_at_3_by_signal(tmp_path, raw, monkeypatch):
    signal_during_step_3(monkeypatch, signal.SIGTERM)
    trainer = Trainer(config_from_dict(raw))
    try:
        summary = trainer.train(stop_on_signal=True)
    finally:
        trainer.close()
    monkeypatch.undo()
    assert summary["steps"] == 3 and summary["signal"] == "SIGTERM"


@pytest.mark.parametrize("stop", ["stop_at", "signal"])
def test_a_run_stopped_at_what_becomes_train_steps_ends_as_a_run_of_that_length(tmp_path, monkeypatch, stop):
    """Stopped at step 3 of 4 (--stop-at 3, or a SIGTERM during step 3), then launched with train.steps=3:
    nothing is left to train, and the run ends as one of 3 steps does at its last step: a validation record
    of step 3 in the log, the summary's val_loss that of the step-3 weights (not step 2's, the last evaluation
    the stopped launch made), no signal in the summary, train.steps 3 in its recipe, and the export."""
    raw = recipe(tmp_path, "run", export_model=True)  # 4 steps, evaluations at 2 and 4
    if stop == "stop_at":
        run_trainer(raw, stop_at=3)
    else:
        _stop_at_3_by_signal(tmp_path, raw, monkeypatch)
    stopped = _summary(tmp_path / "run")
    assert stopped["steps"] == 3 and losses(tmp_path / "run", "val_loss")[-1][0] == 2
    three = {**raw, "train": {**raw["train"], "steps": 3}}
    run_trainer(three)

    # the validation loss of the step-3 weights, by a launch that evaluates the checkpoint without training
    probe = Trainer(config_from_dict({**three, "train": {**three["train"], "steps": 4}}))
    try:
        assert probe.step == 3
        want = probe.evaluate()["val_loss"]
    finally:
        probe.close()
    val = losses(tmp_path / "run", "val_loss")
    assert [s for s, _ in val] == [2, 3] and val[1][1] == pytest.approx(want, rel=1e-12)
    summary = _summary(tmp_path / "run")
    assert summary["steps"] == 3 and summary["val_loss"] == pytest.approx(want, rel=1e-12)
    assert summary["val_loss"] != stopped["val_loss"] and "signal" not in summary
    assert summary["config"]["train"]["steps"] == 3 and summary["tokens"] == 3 * 4 * 24
    assert summary["tokens_per_s"] == stopped["tokens_per_s"]  # of the launch that trained the steps

    # the same records as a straight run of 3 steps writes (which kinds of record, at which steps)
    run_trainer({**three, "train": {**three["train"], "out_dir": str(tmp_path / "straight")}})
    def kinds(run):
        return [(r["step"], "val_loss" in r) for r in map(json.loads, open(run / "log.jsonl"))]

    assert kinds(tmp_path / "run") == kinds(tmp_path / "straight")
    assert sorted(_summary(tmp_path / "run")) == sorted(_summary(tmp_path / "straight"))

    # the export holds the step-3 checkpoint's weights
    from falcon_fwa.eval import load_model

    state = load_checkpoint(latest_checkpoint(str(tmp_path / "run" / "checkpoints")))
    assert state["step"] == 3
    model, _ = load_model(str(tmp_path / "run" / "model"))
    exported = model.state_dict()
    for name, value in state["model"].items():
        assert torch.equal(exported[name].float(), value.float()), name

    # launched once more, the finished run stays as it is: nothing evaluated or logged again
    log = (tmp_path / "run" / "log.jsonl").read_text()
    run_trainer(three)
    assert (tmp_path / "run" / "log.jsonl").read_text() == log and _summary(tmp_path / "run") == summary


def test_a_finished_run_launched_again_neither_exports_nor_evaluates_again(tmp_path, capsys, monkeypatch):
    raw = recipe(tmp_path, "run", export_model=True)
    run_trainer(raw)
    model_dir = tmp_path / "run" / "model"
    before = {f: os.stat(model_dir / f) for f in os.listdir(model_dir)}
    summary, log = _summary(tmp_path / "run"), (tmp_path / "run" / "log.jsonl").read_text()
    capsys.readouterr()

    calls = []
    monkeypatch.setattr(Trainer, "export", lambda self, folder: calls.append(("export", folder)))
    monkeypatch.setattr(Trainer, "evaluate", lambda self: calls.append(("evaluate",)) or {})
    run_trainer(raw)
    assert calls == []
    assert "the run is finished" in capsys.readouterr().out
    monkeypatch.undo()
    after = {f: os.stat(model_dir / f) for f in os.listdir(model_dir)}
    assert {f: (s.st_ino, s.st_mtime_ns) for f, s in after.items()} == \
           {f: (s.st_ino, s.st_mtime_ns) for f, s in before.items()}
    assert _summary(tmp_path / "run") == summary and (tmp_path / "run" / "log.jsonl").read_text() == log

    # an export removed since is written again, from the checkpoint's weights; the rest stays
    weights = (model_dir / "model.safetensors").read_bytes()
    for f in os.listdir(model_dir):
        os.remove(model_dir / f)
    os.rmdir(model_dir)
    run_trainer(raw)
    assert (model_dir / "model.safetensors").read_bytes() == weights
    assert _summary(tmp_path / "run") == summary and (tmp_path / "run" / "log.jsonl").read_text() == log


def _files(folder):
    """Every file under ``folder`` (relative path -> its bytes and modification time)."""
    return {os.path.relpath(os.path.join(d, n), folder): (open(os.path.join(d, n), "rb").read(),
                                                           os.stat(os.path.join(d, n)).st_mtime_ns)
            for d, _, files in os.walk(folder) for n in files}


@pytest.mark.parametrize("stop_at, resume, at", [(2, "auto", 3), (1, "auto", 3), (1, "step-00000002", 2),
                                                  (1, "./step-00000002", 2), (1, "step-00000002 (relative)", 2)])
def test_a_stop_step_before_the_runs_checkpoint_is_refused_before_any_work(tmp_path, capsys, monkeypatch,
                                                                            stop_at, resume, at):
    """A run stopped at step 3 of 4 (checkpoints at 2 and 3), launched again with --stop-at N before the
    checkpoint it resumes from (its latest, or the step-2 one that train.resume names) could stop after no
    step N: refused, exit status 2, naming the option, N and the checkpoint's step, before the trainer is
    built; the run and data folders are as the stopped launch left them, file for file."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    raw = recipe(tmp_path, "run")  # train.steps = 4, a checkpoint every 2 steps and at the stop
    assert main(["--config", _write(tmp_path, raw), "--stop-at", "3"]) == 0
    run_dir = tmp_path / "run"
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["LATEST", "step-00000002", "step-00000003"]
    before = _files(tmp_path)
    capsys.readouterr()
    if resume.endswith("(relative)"):  # a path relative to the working folder, without a folder part
        monkeypatch.chdir(run_dir / "checkpoints")
        raw["train"]["resume"] = resume.split()[0]
    elif resume != "auto":
        raw["train"]["resume"] = str(run_dir / "checkpoints" / resume)
    built = []
    monkeypatch.setattr(Trainer, "__init__", lambda self, *a, **k: built.append(1) or 1 / 0)
    assert main(["--config", _write(tmp_path, raw, "again.json"), "--stop-at", str(stop_at)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"falcon-fwa train: error: --stop-at {stop_at} ") and f"at step {at}" in err
    assert built == [] and out == ""
    after = _files(tmp_path)
    del after["again.json"]
    assert after == before


def test_a_stop_step_at_the_runs_checkpoint_says_that_nothing_is_trained(tmp_path, capsys):
    """--stop-at 3 again on a run stopped at step 3: the run is where the option stops it, so the launch
    trains nothing, says so and exits 0; its checkpoints, log and summary stay as they were."""
    raw = recipe(tmp_path, "run")
    path = _write(tmp_path, raw)
    assert main(["--config", path, "--stop-at", "3"]) == 0
    run_dir = tmp_path / "run"
    def kept():  # the files' bytes; the checkpoints' times too (none is saved again)
        return {f: v if f.startswith("checkpoints") else v[0] for f, v in _files(run_dir).items()}

    before = kept()
    capsys.readouterr()
    assert main(["--config", path, "--stop-at", "3"]) == 0
    out = capsys.readouterr().out
    assert "nothing to train" in out and "--stop-at 3" in out
    assert kept() == before
    assert _summary(run_dir)["steps"] == 3


def test_the_trainer_refuses_a_stop_step_before_the_one_it_resumed_at(tmp_path):
    raw = recipe(tmp_path, "run")
    run_trainer(raw, stop_at=3)
    log = (tmp_path / "run" / "log.jsonl").read_text()
    trainer = Trainer(config_from_dict(raw))
    try:
        assert trainer.step == 3
        with pytest.raises(ValueError, match=r"^stop_at=2 is before step 3, where this run resumed from .*step-00000003"):
            trainer.train(stop_at=2)
        assert trainer.step == 3
    finally:
        trainer.close()
    assert (tmp_path / "run" / "log.jsonl").read_text() == log and _summary(tmp_path / "run")["steps"] == 3
