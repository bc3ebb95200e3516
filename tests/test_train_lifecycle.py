"""A run's life over several launches: a stop step past the run's end is refused before any work."""
import json

import pytest
from test_train import recipe

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
