"""The calibrated step count charges a recipe whose calibration failed with the seconds it took to fail: it is
trained all the same, and its run spends them again where it fails again, so the plan's fixed seconds hold them
beside the measured recipes' setup, evaluations, checkpoint and export. By hand on made-up calibration records, and
through the command on a simulated clock."""
import argparse
import json

import pytest
import torch
import yaml
from test_compare_tools import recipes

from falcon_fwa.train import compare, distributed
from falcon_fwa.train import trainer as trainer_module

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_plan_charges_a_failed_calibrations_seconds_as_fixed_ones():
    """a: 3 setup + 5 x 2 evaluation + 1 save + 4 export = 18 s fixed, 0.5 s a step; broken failed after 7 s; late
    was stopped by the deadline before its timed steps (no time of a run to charge: the deadline has passed). Fixed
    18 + 7 = 25 s: a budget of 100 s fits (100 - 25) // 0.5 = 150 steps (164 were 7 s left out)."""
    calibration = {"a": dict(setup_s=3.0, eval_s=2.0, save_s=1.0, export_s=4.0, step_s=0.5),
                   "broken": {"error": "RuntimeError: out of memory", "traceback": "...", "wall_s": 7.0},
                   "late": {"stopped": "deadline", "first_step_s": 9.0}}
    assert compare.plan_steps(calibration, 100.0) == (150, {"budget_s": 100.0, "fixed_s": 25.0, "step_s_sum": 0.5,
                                                            "steps_fit": 150})
    for budget, fit in ((25.0, 0), (25.4, 0), (25.5, 1), (30.0, 10), (30.4, 10), (18.0, 0)):
        assert compare.plan_steps(calibration, budget)[0] == fit, budget
    # two failed recipes: both charged
    calibration["other"] = {"error": "ValueError: x", "wall_s": 5.0}
    assert compare.plan_steps(calibration, 100.0)[1]["fixed_s"] == 30.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


SETUP_S, MICRO_STEP_S, EVAL_BATCH_S = 3.0, 1.0, 0.25


def test_the_command_charges_a_recipe_whose_calibration_failed(tmp_path, monkeypatch, capsys):
    """On a clock that only the set-up (3 s), each training micro-step (1 s: 2 s a step of two) and each evaluation
    micro-batch (0.25 s) advance: ``good`` calibrates at setup 3 s, evaluation 2 x 0.25 = 0.5 s, no checkpoint or
    export time, 2 s a step; ``broken`` (``train.strategy: ddp``, refused by the trainer's set-up outside torchrun)
    fails after its 3 s of set-up. The plan: fixed 3 + 5 x 0.5 + 3 = 8.5 s, so ``--time-budget 100`` fits
    (100 - 8.5) // 2 = 45 steps; the failed calibration's record and printed line hold its 3 s."""
    clock = Clock()
    real_setup, real_loss = distributed.setup, trainer_module.causal_lm_loss

    def setup(*args, **kwargs):
        clock.now += SETUP_S
        return real_setup(*args, **kwargs)

    def loss(model, batch, device, autocast):
        clock.now += MICRO_STEP_S if torch.is_grad_enabled() else EVAL_BATCH_S
        return real_loss(model, batch, device, autocast)

    monkeypatch.setattr(compare, "_clock", clock)
    monkeypatch.setattr(distributed, "setup", setup)
    monkeypatch.setattr(trainer_module, "causal_lm_loss", loss)
    paths = recipes(tmp_path, {"good": "tiny-falcon", "broken": "tiny-falcon"})
    with open(paths[1]) as f:
        raw = yaml.safe_load(f)
    raw["train"]["strategy"] = "ddp"
    with open(paths[1], "w") as f:
        yaml.safe_dump(raw, f)
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    code = compare.run(parser.parse_args(["--configs", *paths, "--names", "good", "broken", "--out",
                                          str(tmp_path / "cmp"), "--time-budget", "100", "--calib-steps", "3",
                                          "--max-steps", "2"]))
    assert code == 1  # broken fails again in its run
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    good, broken = report["calibration"]["good"], report["calibration"]["broken"]
    assert (good["setup_s"], good["eval_s"], good["save_s"], good["export_s"], good["step_s"]) == (
        SETUP_S, 2 * EVAL_BATCH_S, 0.0, 0.0, 2 * MICRO_STEP_S)
    assert "needs a process group" in broken["error"] and broken["wall_s"] == SETUP_S
    assert report["plan"] == {"budget_s": 100.0, "fixed_s": 8.5, "step_s_sum": 2.0, "steps_fit": 45, "steps": 2}
    assert report["status"] == {"good": "done", "broken": "failed"}
    out = capsys.readouterr().out
    assert "calibrated broken: ValueError: train.strategy 'ddp' needs a process group" in out
    assert "(after 3.000 s)" in out
    assert "calibrated: 8.5 s fixed + 2.000 s per step for all recipes; 45 steps fit in 100 s" in out
