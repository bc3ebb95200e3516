"""The comparison's step count by hand: the calibration's costs from a simulated clock whose every training
step, evaluation, checkpoint and export takes a chosen time (median of the steady steps, the warm-up's sum,
tokens/s, each fixed cost, the deadline on and past the warm-up), the plan's arithmetic with fixed costs,
the budget the deadline leaves, the floor of 20 steps and the assignments the planned count gives, and the
concurrent calibration's slowest rate."""
import argparse
import os

import pytest
import torch
from test_compare_tools import recipes

from falcon_fwa.train import compare
from falcon_fwa.train import trainer as trainer_module
from falcon_fwa.train.config import assign_text

# seconds of each calibration step (2 untimed + 3 timed), each spread over its two micro-steps
STEP_COSTS = [50.0, 10.0, 3.0, 7.0, 4.0]
EVAL_S, SAVE_S, EXPORT_S = 0.75, 0.25, 8.0  # one evaluation (two micro-batches), one checkpoint, one export


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def timed(monkeypatch):
    """``compare``'s clock, advanced by the training micro-steps (``STEP_COSTS``, per recipe), the evaluation's
    micro-batches, the checkpoint saves and the exports; ``timed.save_s`` and ``timed.export_s`` may be changed."""
    clock = Clock()
    clock.save_s, clock.export_s, clock.calls = SAVE_S, EXPORT_S, {}
    real_loss, real_save, real_export = (trainer_module.causal_lm_loss, trainer_module.save_checkpoint,
                                         trainer_module.Trainer.export)

    def loss(model, batch, device, autocast):
        if torch.is_grad_enabled():
            n = clock.calls[id(model)] = clock.calls.get(id(model), 0) + 1
            clock.now += STEP_COSTS[(n - 1) // 2] / 2
        else:
            clock.now += EVAL_S / 2
        return real_loss(model, batch, device, autocast)

    def save(*args, **kwargs):
        clock.now += clock.save_s
        return real_save(*args, **kwargs)

    def export(self, folder):
        clock.now += clock.export_s
        return real_export(self, folder)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", loss)
    monkeypatch.setattr(trainer_module, "save_checkpoint", save)
    monkeypatch.setattr(trainer_module.Trainer, "export", export)
    monkeypatch.setattr(compare, "_clock", clock)
    return clock


def _calibrate(tmp_path, names, *, deadline_at=None, export=False):
    paths = recipes(tmp_path, {n: "tiny-falcon" for n in names})
    sets = [assign_text("data.out_dir", str(tmp_path / "data")), f"train.export_model={str(export).lower()}"]
    return compare.calibrate_sequential(paths, list(names), sets, out_dir=str(tmp_path / "cal"), warmup=2, steps=3,
                                        deadline_at=deadline_at)


def test_calibration_costs_by_hand(tmp_path, timed):
    """Steps of 50, 10 | 3, 7, 4 s: step_s is the median of the timed three (4, not their mean 4.67 nor a
    median that takes the 10 s step in), warmup_s the first two (60), tokens/s 4 rows x 24 tokens / 4 s; the
    checkpoint of the last step, the evaluation and the export (which the real runs do) are timed apart."""
    cal = _calibrate(tmp_path, ["a"], export=True)["a"]
    assert cal["falcon_op"] == "torch" and cal["wall_s"] == pytest.approx(74.0 + SAVE_S + EVAL_S + EXPORT_S)
    got = {k: cal[k] for k in ("setup_s", "first_step_s", "warmup_s", "step_s", "timed_steps", "save_s", "eval_s",
                               "export_s", "tokens_per_s")}
    assert got == {"setup_s": 0.0, "first_step_s": 50.0, "warmup_s": 60.0, "step_s": 4.0, "timed_steps": 3,
                   "save_s": SAVE_S, "eval_s": EVAL_S, "export_s": EXPORT_S, "tokens_per_s": 4 * 24 / 4.0}
    assert "stopped" not in cal
    assert not os.path.exists(tmp_path / "cal" / "a" / "model")  # the export is timed, then removed


def test_calibration_without_an_export_in_the_recipe_charges_none(tmp_path, timed):
    cal = _calibrate(tmp_path, ["a"])["a"]
    assert (cal["step_s"], cal["save_s"], cal["eval_s"], cal["export_s"]) == (4.0, SAVE_S, EVAL_S, 0.0)


def test_a_deadline_at_the_end_of_the_warmup_leaves_the_recipe_unmeasured_and_the_next_unstarted(tmp_path, timed):
    """The deadline falls exactly at the end of step 2 (60 s), the last untimed one: the first recipe has no
    timed step (only its first step's time), and the clock standing at the deadline starts no other."""
    timed.save_s = 0.0
    cal = _calibrate(tmp_path, ["a", "b"], deadline_at=60.0)
    assert cal == {"a": {"stopped": "deadline", "first_step_s": 50.0}, "b": {"stopped": "deadline"}}


def test_a_deadline_during_the_timed_steps_keeps_what_was_measured(tmp_path, timed):
    """Stopped after step 4 (70 s) of 5: the two timed steps measure step_s = median(3, 7) = 5, marked stopped."""
    cal = _calibrate(tmp_path, ["a"], deadline_at=65.0)["a"]
    assert (cal["stopped"], cal["timed_steps"], cal["step_s"], cal["warmup_s"]) == ("deadline", 2, 5.0, 60.0)
    plan_steps, _ = compare.plan_steps({"a": cal}, 100.0)
    assert plan_steps == int((100.0 - SAVE_S - 5 * EVAL_S) // 5.0)  # measured recipes plan, stopped or not


def test_plan_steps_by_hand_with_fixed_costs():
    """fixed = sum of setup + 5 evaluations + save + export = (3 + 10 + 1 + 4.5) + (1 + 5 + 0 + 0) = 24.5 s,
    2 s a step for both: a budget of 100 s fits (100 - 24.5) // 2 = 37 steps. Recipes without a step_s (failed,
    stopped before timing) add nothing."""
    calibration = {"a": dict(setup_s=3.0, eval_s=2.0, save_s=1.0, export_s=4.5, step_s=0.5),
                   "b": dict(setup_s=1.0, eval_s=1.0, save_s=0.0, export_s=0.0, step_s=1.5),
                   "c": {"error": "RuntimeError: out of memory"}, "d": {"stopped": "deadline", "first_step_s": 9.0}}
    assert compare.plan_steps(calibration, 100.0) == (37, {"budget_s": 100.0, "fixed_s": 24.5, "step_s_sum": 2.0,
                                                           "steps_fit": 37})
    for budget, fit in ((24.5, 0), (26.4, 0), (26.5, 1), (10.0, 0)):
        assert compare.plan_steps(calibration, budget)[0] == fit, budget
    # nothing to plan from: a CalibrationFailed (a ValueError, so the command ends with its one-line error and
    # status 2, not a traceback) naming each recipe's error, or what stopped it, in calibration order
    with pytest.raises(compare.CalibrationFailed, match="calibration measured no recipe: c: RuntimeError: out of "
                       r"memory; d: stopped \(deadline\) before its timed steps$") as failed:
        compare.plan_steps({"c": calibration["c"], "d": calibration["d"]}, 100.0)
    assert isinstance(failed.value, ValueError)


def _args(**kw):
    base = dict(configs=["a.yaml"], time_budget=None, deadline=None, calib_warmup=2, calib_steps=None, out="o",
                concurrent=False, steps=None, max_steps=None)
    return argparse.Namespace(**{**base, **kw})


CALIBRATION = {"a": dict(setup_s=0.0, eval_s=0.0, save_s=0.0, export_s=0.0, step_s=2.0)}


def test_the_deadline_leaves_nine_tenths_of_what_calibration_left_and_the_smaller_budget_wins(monkeypatch):
    """Calibration ends at 100 s of a 1000 s deadline: 0.9 x 900 = 810 s, unless --time-budget is smaller."""
    clock = Clock()
    monkeypatch.setattr(compare, "_clock", clock)

    def calibrate(configs, names, sets, **kw):
        clock.now += 100.0
        return CALIBRATION

    monkeypatch.setattr(compare, "calibrate_sequential", calibrate)
    for budget, want in ((None, 810.0), (500.0, 500.0), (900.0, 810.0)):
        clock.now, report = 0.0, {}
        steps = compare._sequential_steps(_args(time_budget=budget, deadline=1000.0), ["a"], [], report, 1000.0)
        assert report["plan"]["budget_s"] == pytest.approx(want) and steps == int(want // 2.0), budget
    clock.now, report = 0.0, {}  # calibration used the whole deadline
    assert compare._sequential_steps(_args(deadline=100.0), ["a"], [], report, 100.0) is None


@pytest.mark.parametrize("step_s, max_steps, steps", [(100 / 19, None, 20), (100 / 20, None, 20), (100 / 47, None, 47),
                                                      (100 / 47, 40, 40), (100 / 19, 10, 10)])
def test_the_planned_count_is_at_least_20_capped_by_max_steps_and_sets_the_schedule(tmp_path, monkeypatch, step_s,
                                                                                     max_steps, steps):
    """The plan's count, raised to 20 when fewer fit and then capped by --max-steps, trains every recipe with
    warm-up over 1/15 of it (at least 1), four evaluations and one save at the end."""
    seen = {}
    monkeypatch.setattr(compare, "calibrate_sequential", lambda configs, names, sets, **kw: {
        n: dict(setup_s=0.0, eval_s=0.0, save_s=0.0, export_s=0.0, step_s=step_s) for n in names})
    monkeypatch.setattr(compare, "run_sequential", lambda configs, names, out, sets, tag, **kw: seen.update(
        sets=sets) or iter(()))
    path = recipes(tmp_path, {"a": "tiny-falcon"})[0]
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    argv = ["--configs", path, "--out", str(tmp_path / "cmp"), "--time-budget", "100.5"]
    compare.run(parser.parse_args(argv + (["--max-steps", str(max_steps)] if max_steps else [])))
    assert seen["sets"][-4:] == [f"train.steps={steps}", f"optim.warmup_steps={max(1, steps // 15)}",
                                 f"train.eval_every={steps // 4}", f"train.save_every={steps}"]


def test_concurrent_calibration_plans_with_the_slowest_recipes_rate(monkeypatch):
    """Two recipes calibrated side by side at 96 and 48 tokens/s, 96 tokens a step: a 100 s budget fits
    100 x 48 / 96 = 50 steps, the slowest recipe's count; 30 calibration steps unless --calib-steps says."""
    seen = []

    def run_all(configs, names, out, sets, tag, signals=None):
        seen.append(sets)
        yield "a", "running", None
        yield "a", "done", {"tokens_per_s": 96.0, "log": []}
        yield "b", "done", {"tokens_per_s": 48.0, "log": []}

    monkeypatch.setattr(compare, "run_all", run_all)
    report = {"tokens_per_step": 96}
    assert compare._concurrent_steps(_args(time_budget=100.0, concurrent=True), ["a", "b"], ["x=1"], report) == 50
    assert seen[0] == ["x=1", "train.steps=30", "train.eval_every=0", "train.save_every=0",
                       "train.export_model=false", "train.resume=none", "log.every=10"]
    assert report["calibration"] == {"a": {"tokens_per_s": 96.0}, "b": {"tokens_per_s": 48.0}}
    compare._concurrent_steps(_args(time_budget=100.0, concurrent=True, calib_steps=6), ["a", "b"], [], {
        "tokens_per_step": 96})
    assert "train.steps=6" in seen[1] and "log.every=2" in seen[1]


def test_concurrent_calibration_plans_with_the_recipes_that_calibrated(monkeypatch):
    """A recipe whose concurrent calibration run failed is left out of the plan, as the sequential calibration
    leaves it out (``plan_steps`` sums the measured recipes only), instead of ending the command with every recipe
    pending: one broken recipe of a lineup must not cost the others their runs, and it is trained with them,
    failing again there and recorded ``failed`` with its error. So with a at 96 tokens/s and b failed, 96 tokens a
    step, a 100 s budget fits 100 x 96 / 96 = 100 steps, a's own count; the failure stays in the report's
    calibration. A calibration in which no recipe measured a rate still ends the command: there is nothing to
    plan from."""
    def failing(configs, names, out, sets, tag, signals=None):
        yield "a", "done", {"tokens_per_s": 96.0}
        yield "b", "failed", {"error": "exit code 1", "stdout_tail": "ValueError: broken"}

    monkeypatch.setattr(compare, "run_all", failing)
    report = {"tokens_per_step": 96}
    assert compare._concurrent_steps(_args(time_budget=100.0, concurrent=True), ["a", "b"], [], report) == 100
    assert report["calibration"]["b"] == {"error": "exit code 1", "stdout_tail": "ValueError: broken"}

    def all_failing(configs, names, out, sets, tag, signals=None):
        yield "a", "failed", {"error": "exit code 1"}
        yield "b", "failed", {"error": "exit code 1"}

    monkeypatch.setattr(compare, "run_all", all_failing)
    # (a CalibrationFailed, a ValueError: the command's one-line error, status 2, naming each recipe's error)
    with pytest.raises(compare.CalibrationFailed,
                       match="calibration measured no recipe: a: exit code 1; b: exit code 1$"):
        compare._concurrent_steps(_args(time_budget=100.0, concurrent=True), ["a", "b"], [], {"tokens_per_step": 96})


def test_the_calibration_does_not_warn_of_a_warmup_longer_than_its_few_steps(tmp_path, timed):
    """A recipe warming up over 100 steps is calibrated over 2 + 3: its warm-up outlasting them is the plan, not a
    mistake to warn of (one warning per recipe before). The same recipe loaded with train.steps=5 outside the
    calibration still warns, and so does a real mistake the calibration does not cause."""
    import warnings

    from falcon_fwa.train.config import load_config

    paths = recipes(tmp_path, {"a": "tiny-falcon", "b": "tiny-falcon"})
    sets = [assign_text("data.out_dir", str(tmp_path / "data")), "optim.warmup_steps=100", "train.steps=1000"]
    with pytest.warns(UserWarning, match=r"optim\.warmup_steps=100 exceeds train\.steps=5"):
        load_config(paths[0], sets + ["train.steps=5"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cal = compare.calibrate_sequential(paths, ["a", "b"], sets, out_dir=str(tmp_path / "cal"), warmup=2, steps=3)
    assert set(cal) == {"a", "b"} and all(c["timed_steps"] == 3 for c in cal.values())
    assert not [w for w in caught if "warmup_steps" in str(w.message)], [str(w.message) for w in caught]
    with pytest.warns(UserWarning, match=r"optim\.warmup_steps=100 exceeds train\.steps=5"):
        load_config(paths[0], sets + ["train.steps=5"])  # the filter ended with the calibration
