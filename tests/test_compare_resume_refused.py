"""``compare`` trains each recipe from scratch in its own folder (``OUT/main/NAME``) and resumes its own runs on
relaunch: a ``train.resume`` checkpoint path given to the recipes (``--set`` or a recipe file) would make its
runs resume there, a run counted ``done N/N`` with every token of N steps while it trained fewer, so it is
refused by name before anything trains; ``auto`` and ``none`` (a fresh folder either way) are taken."""
import json
import os

import pytest
import yaml

from falcon_fwa.train import compare
from test_cli_journeys import compare_recipes
from test_train import recipe, run_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def checkpoint(tmp_path):
    """The step-2 checkpoint of a 4-step run of the tiny Falcon recipe (saved every 2 steps)."""
    trainer = run_trainer(recipe(tmp_path, out="earlier"))
    folder = os.path.join(trainer.ckpt_dir, "step-00000002")
    assert os.path.isdir(folder), sorted(os.listdir(trainer.ckpt_dir))
    return folder


def _main(tmp_path, config, *extra):
    return compare.main(["--configs", config, "--names", "a", "--out", str(tmp_path / "cmp"), "--steps", "4", *extra])


def test_a_resume_path_given_by_set_is_refused_before_anything_trains(tmp_path, capsys, checkpoint):
    """Before the refusal this comparison resumed ``a`` at step 2 and reported it done, 4 of 4 steps, having
    trained steps 3 and 4 only."""
    config = compare_recipes(tmp_path)[0]
    capsys.readouterr()  # (the earlier run's output)
    assert _main(tmp_path, config, "--set", f"train.resume={checkpoint}") == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa compare: error: --set train.resume=") and "Traceback" not in err
    assert "from scratch" in err.splitlines()[0]
    assert not os.path.exists(tmp_path / "cmp" / "main")


def test_a_resume_path_in_a_recipe_file_is_refused_by_file_and_field(tmp_path, capsys, checkpoint):
    config = compare_recipes(tmp_path)[0]
    raw = yaml.safe_load(open(config))
    raw["train"]["resume"] = checkpoint
    with open(config, "w") as f:
        yaml.safe_dump(raw, f)
    capsys.readouterr()
    assert _main(tmp_path, config) == 2
    err = capsys.readouterr().err
    first = err.splitlines()[0]
    assert "Traceback" not in err
    assert first.startswith(f"falcon-fwa compare: error: {config}: train.resume = ") and checkpoint in first
    assert not os.path.exists(tmp_path / "cmp" / "main")


@pytest.mark.parametrize("value", ["none", "auto"])
def test_resume_none_and_auto_train_from_step_zero(tmp_path, value):
    """Both leave the start to compare, which trains in a fresh folder: the log's first step is 1, 4 steps of
    4 x 24 tokens each are counted."""
    config = compare_recipes(tmp_path)[0]
    assert _main(tmp_path, config, "--set", f"train.resume={value}") == 0
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    run = report["runs"]["a"]
    assert run["steps"] == 4 and run["tokens"] == 4 * 4 * 24
    assert [r["step"] for r in run["log"] if "loss" in r][0] == 1
