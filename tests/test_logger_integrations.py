"""MetricLogger's optional sinks: TensorBoard and Weights & Biases receive what the JSONL file records.

Neither package is needed: stand-in modules in ``sys.modules`` record the calls the logger makes, and a
TensorBoard that cannot be imported leaves the JSONL file as the one sink, with a line saying so.
"""
import json
import sys
import types

import pytest

from falcon_fwa.train.logger import MetricLogger


class _Writer:
    def __init__(self, log_dir):
        self.log_dir, self.scalars, self.closed = log_dir, [], False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def close(self):
        self.closed = True


class _Run:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, metrics, step):
        self.logged.append((dict(metrics), step))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_tensorboard(monkeypatch):
    writers = []

    def make(log_dir):
        writers.append(_Writer(log_dir))
        return writers[-1]

    module = types.ModuleType("torch.utils.tensorboard")
    module.SummaryWriter = make
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", module)
    return writers


@pytest.fixture
def fake_wandb(monkeypatch):
    runs = []

    def init(**kwargs):
        runs.append(_Run(**kwargs))
        return runs[-1]

    module = types.ModuleType("wandb")
    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return runs


def _records(folder):
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


def test_tensorboard_gets_every_numeric_metric_at_its_step_and_is_closed(tmp_path, fake_tensorboard):
    logger = MetricLogger(str(tmp_path), enabled=True, tensorboard=True, wandb_project=None, config={})
    logger.log(3, loss=2.5, lr=1e-3, tokens=4096, phase="train")
    logger.log(4, val_loss=2.25)
    logger.close()
    (writer,) = fake_tensorboard
    assert writer.log_dir == str(tmp_path / "tensorboard")
    # numbers only (a text field has no scalar), each at the step it was logged at
    assert writer.scalars == [("loss", 2.5, 3), ("lr", 1e-3, 3), ("tokens", 4096, 3), ("val_loss", 2.25, 4)]
    assert writer.closed
    assert _records(tmp_path) == [{"step": 3, "loss": 2.5, "lr": 1e-3, "tokens": 4096, "phase": "train"},
                                  {"step": 4, "val_loss": 2.25}]


def test_without_tensorboard_the_jsonl_file_is_the_one_sink_and_a_line_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails with ImportError
    logger = MetricLogger(str(tmp_path), enabled=True, tensorboard=True, wandb_project=None, config={})
    logger.log(1, loss=3.0)
    logger.close()
    assert "tensorboard package is not installed" in capsys.readouterr().out
    assert logger.tb is None
    assert _records(tmp_path) == [{"step": 1, "loss": 3.0}]


def test_wandb_run_is_started_in_the_run_folder_gets_each_record_and_is_finished(tmp_path, fake_wandb):
    config = {"train": {"steps": 10}}
    logger = MetricLogger(str(tmp_path), enabled=True, tensorboard=False, wandb_project="proj", config=config)
    logger.log(2, loss=1.5, phase="train")
    logger.close()
    (run,) = fake_wandb
    # resume="allow": a resumed run continues the same W&B run rather than failing or starting another
    assert run.init == {"project": "proj", "config": config, "dir": str(tmp_path), "resume": "allow"}
    assert run.logged == [({"loss": 1.5, "phase": "train"}, 2)]
    assert run.finished


def test_a_disabled_logger_starts_no_sink(tmp_path, fake_tensorboard, fake_wandb):
    # the processes other than the main one: nothing written, no W&B run, no TensorBoard folder
    logger = MetricLogger(str(tmp_path / "run"), enabled=False, tensorboard=True, wandb_project="proj", config={})
    logger.log(1, loss=1.0)
    logger.close()
    assert fake_tensorboard == [] and fake_wandb == []
    assert not (tmp_path / "run").exists()
