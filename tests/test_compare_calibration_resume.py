"""The ``--concurrent`` calibration trains every recipe from step 0, as the sequential one does, whatever
``train.resume`` the recipes are given: a checkpoint path (here of an earlier run of the same recipe) is not
resumed from by the calibration runs."""
import json
import os

import pytest
from test_cli_journeys import compare_recipes
from test_train import recipe, run_trainer

from falcon_fwa.train import compare

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_concurrent_calibration_does_not_resume_from_a_train_resume_checkpoint(tmp_path):
    """A two-step run of recipe ``a`` leaves ``checkpoints/step-00000002``; the ``--concurrent`` calibration of
    ``a`` given ``train.resume=`` that checkpoint among its settings and 3 steps: the calibration run logs steps 1,
    2 and 3 (``log.every`` 1 for 3 steps), says nothing of a resume and measures a rate. It used to resume from
    the checkpoint at step 2 and log step 3 only (and with a checkpoint at the calibration's last step, train
    nothing and end the command with "calibration failed"). The command itself refuses such a ``--set`` before
    it calibrates (test_compare_resume_refused.py), so the calibration is called here as the command calls it,
    with the settings it would pass on: the calibration's own ``train.resume=none`` still decides."""
    import argparse

    earlier = recipe(tmp_path, out="earlier", steps=2, save_every=2, eval_every=0)
    run_trainer(earlier)
    checkpoint = os.path.join(str(tmp_path / "earlier"), "checkpoints", "step-00000002")
    assert os.path.isdir(checkpoint)
    out = tmp_path / "cmp"
    args = argparse.Namespace(configs=[compare_recipes(tmp_path)[0]], out=str(out), calib_steps=3, time_budget=5.0)
    report = {"tokens_per_step": 4 * 24}
    sets = [f"train.resume={checkpoint}", f"data.out_dir={tmp_path / 'data'}"]  # (the data the earlier run made)
    assert compare._concurrent_steps(args, ["a"], sets, report) >= 0
    calib_dir = out / "calibration" / "a"
    with open(calib_dir / "log.jsonl") as f:
        steps = [r["step"] for r in map(json.loads, f) if "loss" in r]
    assert steps == [1, 2, 3]
    assert "resumed from" not in (calib_dir / "stdout.txt").read_text()
    assert report["calibration"]["a"]["steps"] == 3 and report["calibration"]["a"]["tokens_per_s"] > 0
