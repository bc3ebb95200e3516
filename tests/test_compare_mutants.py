"""What the comparison and throughput commands state about their step counts, timings and rows, each
against a hand-computed case: the calibrated plan (the module docstring's sum, its 20-step floor, the
--max-steps cap, 90% of what the deadline leaves, the smaller of two budgets), the settings a step count N
sets, the calibration's median, warm-up and rate on a simulated clock, the concurrent runs' slowest rate,
the one-line summary's documented format, and throughput's mean, median, warm-up, max-seconds and
deadline cut-offs on a simulated clock."""
import argparse
import json

import pytest
import torch
import yaml

from falcon_fwa.provenance import CLEAN_TREE
from falcon_fwa.train import compare, throughput
from falcon_fwa.train import trainer as trainer_module
from falcon_fwa.train.config import assign_text
from test_compare_tools import recipes, run_compare
from test_train import recipe


# ----------------------------------------------------------------------------- compare: the plan
def test_the_plan_is_the_largest_count_whose_documented_sum_fits_the_budget():
    """sum over recipes of (setup_s + 5 eval_s + save_s + export_s + N step_s) <= budget, over the recipes
    whose steps were timed (one stopped by the deadline before them, or failed, adds nothing)."""
    calibration = {
        "a": dict(setup_s=3.0, eval_s=2.0, save_s=1.0, export_s=4.0, step_s=0.5),  # 3 + 10 + 1 + 4 = 18
        "b": dict(setup_s=1.0, eval_s=1.0, save_s=0.5, export_s=0.5, step_s=1.5),  # 1 + 5 + 0.5 + 0.5 = 7
        "late": {"stopped": "deadline", "first_step_s": 50.0},
        "broken": {"error": "RuntimeError: x"},
    }
    for budget, fit in ((45.0, 10), (44.9, 9), (46.9, 10), (47.0, 11), (25.0, 0), (20.0, 0)):
        steps, plan = compare.plan_steps(calibration, budget)
        assert steps == fit and 25.0 + fit * 2.0 <= max(budget, 25.0) < 25.0 + (fit + 1) * 2.0, budget
        assert plan == {"budget_s": budget, "fixed_s": 25.0, "step_s_sum": 2.0, "steps_fit": fit}
    # a CalibrationFailed (a ValueError: the command ends with one error line, status 2, not a traceback)
    with pytest.raises(compare.CalibrationFailed, match="calibration measured no recipe: late: stopped"):
        compare.plan_steps({"late": calibration["late"]}, 100.0)


@pytest.fixture
def planned(tmp_path, monkeypatch):
    """Runs ``compare`` on one recipe whose calibration (in no time but ``cost`` simulated seconds) times
    1 s a step and no fixed costs, so that a budget of B seconds fits B steps; the runs are not trained,
    only their settings recorded. Returns ``run(cost, *options) -> (exit code, report, seen)``."""
    now = [0.0]
    seen = {}
    monkeypatch.setattr(compare, "_clock", lambda: now[0])

    def calibrate(configs, names, sets, **kwargs):
        seen["calibration"] = kwargs
        now[0] += seen["cost"]
        return {n: dict(setup_s=0.0, eval_s=0.0, save_s=0.0, export_s=0.0, step_s=1.0) for n in names}

    def run_sequential(configs, names, out_dir, sets, tag, **kwargs):
        seen["sets"] = list(sets)
        for n in names:
            yield n, "running", None
            yield n, "done", {"steps": seen["steps"]}

    monkeypatch.setattr(compare, "calibrate_sequential", calibrate)
    monkeypatch.setattr(compare, "run_sequential", run_sequential)

    def run(cost, *options):
        now[0], seen["cost"] = 0.0, cost
        seen["steps"] = None
        code, out = run_compare(tmp_path, {"a": "tiny-falcon"}, *options)
        with open(out / "compare.json") as f:
            return code, json.load(f), seen

    return run


def _count_sets(sets):
    return {k: int(v) for k, v in (s.split("=", 1) for s in sets)
            if k in ("train.steps", "optim.warmup_steps", "train.eval_every", "train.save_every")}


@pytest.mark.parametrize("options, cost, steps", [
    (("--time-budget", "31"), 0.0, 31),
    (("--time-budget", "19"), 0.0, 20),  # 19 fit: at least 20
    (("--time-budget", "40", "--max-steps", "25"), 0.0, 25),
    (("--time-budget", "10", "--max-steps", "15"), 0.0, 15),  # 10 fit, 20 at least, capped by --max-steps
    (("--deadline", "100"), 20.0, 72),  # 90% of the 80 s the deadline leaves after calibration
    (("--deadline", "100", "--time-budget", "50"), 20.0, 50),  # the smaller budget
    (("--deadline", "100", "--time-budget", "80"), 20.0, 72),
])
def test_the_calibrated_count_and_the_settings_it_sets(planned, options, cost, steps):
    """A step count N trains N steps with optim.warmup_steps N // 15, train.eval_every N // 4 and
    train.save_every N (docs/training.md); the calibration times 2 + 6 steps unless told otherwise."""
    code, report, seen = planned(cost, *options)
    assert code == 0 and report["steps"] == steps and report["plan"]["steps"] == steps
    assert _count_sets(seen["sets"]) == {"train.steps": steps, "optim.warmup_steps": max(1, steps // 15),
                                         "train.eval_every": max(1, steps // 4), "train.save_every": steps}
    assert (seen["calibration"]["warmup"], seen["calibration"]["steps"]) == (2, 6)
    budgets = [float(v) for k, v in zip(options[::2], options[1::2]) if k == "--time-budget"]
    if "--deadline" in options:
        budgets.append(0.9 * (100.0 - cost))
        assert seen["calibration"]["deadline_at"] == 100.0
    assert report["plan"]["budget_s"] == pytest.approx(min(budgets), rel=1e-12)


def test_a_calibration_that_takes_the_whole_deadline_runs_nothing(planned):
    """No second is left after calibration: no recipe starts, every one is not_run, the command ends with 1."""
    code, report, seen = planned(100.0, "--deadline", "100")
    assert code == 1 and "sets" not in seen
    assert report["status"] == {"a": "not_run"} and report["finished"] is True
    assert report["error"] == "calibration took the whole --deadline of 100 s"


@pytest.fixture
def calibrate(tmp_path, monkeypatch):
    """``calibrate(deadline, names)``: ``calibrate_sequential`` of tiny recipes, one warm-up and three timed
    steps, on a clock that each training micro-step advances by the next of its charges (two micro-steps a
    step): steps of 100, 2, 2 and 10 s."""
    charges, now = [], [0.0]
    real = trainer_module.causal_lm_loss

    def charged(model, batch, device, autocast):
        if torch.is_grad_enabled():
            now[0] += charges.pop(0) if charges else 1.0
        return real(model, batch, device, autocast)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", charged)
    monkeypatch.setattr(compare, "_clock", lambda: now[0])
    paths = recipes(tmp_path, {"a": "tiny-falcon", "b": "tiny-falcon"})
    sets = [assign_text("data.out_dir", str(tmp_path / "data"))]

    def run(deadline=None, names=("a",)):
        charges[:] = [50.0, 50.0, 1.0, 1.0, 1.0, 1.0, 5.0, 5.0]
        now[0] = 0.0
        return compare.calibrate_sequential(paths[:len(names)], list(names), sets, out_dir=str(tmp_path / "cal"),
                                            warmup=1, steps=3, deadline_at=deadline)

    return run


def test_calibration_times_the_median_of_the_steps_after_the_warmup(calibrate):
    """Steps of 100, 2, 2 and 10 s with one warm-up step: step_s is the median of 2, 2, 10 (not their mean
    4.67), warmup_s and first_step_s 100, 3 timed steps, tokens/s = global batch 4 x 24 tokens / 2 s."""
    cal = calibrate()["a"]
    assert "error" not in cal, cal
    assert (cal["first_step_s"], cal["warmup_s"], cal["step_s"], cal["timed_steps"]) == (100, 100, 2, 3)
    assert cal["tokens_per_s"] == 4 * 24 / 2 and "stopped" not in cal
    assert cal["setup_s"] == cal["eval_s"] == cal["save_s"] == cal["export_s"] == 0  # no micro-step in them


def test_a_deadline_stops_calibration_after_the_warmup_or_a_timed_step(calibrate):
    """A deadline at 100 s stops the first recipe after its warm-up step (nothing timed) and leaves the next
    one unstarted; one at 102 s stops it after one timed step."""
    cal = calibrate(deadline=100.0, names=("a", "b"))
    assert cal == {"a": {"stopped": "deadline", "first_step_s": 100}, "b": {"stopped": "deadline"}}
    cal = calibrate(deadline=102.0)["a"]
    assert (cal["step_s"], cal["timed_steps"], cal["stopped"]) == (2, 1, "deadline")


def test_the_slowest_concurrent_recipe_sets_the_count(monkeypatch):
    """--concurrent calibrates every recipe at once for 30 training steps (--calib-steps' default there);
    the slowest one's tokens/s over --time-budget seconds: 100 s x 48 tokens/s / 96 tokens a step = 50."""
    seen = {}

    def run_all(configs, names, out_dir, sets, tag, signals=None):
        seen["sets"] = sets
        yield "fast", "running", None
        yield "slow", "running", None
        yield "fast", "done", {"tokens_per_s": 96.0, "log": [{"step": 1}]}
        yield "slow", "done", {"tokens_per_s": 48.0, "log": []}

    monkeypatch.setattr(compare, "run_all", run_all)
    args = argparse.Namespace(calib_steps=None, time_budget=100.0, configs=["f.yaml", "s.yaml"], out="o")
    report = {"tokens_per_step": 96}
    assert compare._concurrent_steps(args, ["fast", "slow"], [], report) == 50
    assert "train.steps=30" in seen["sets"]
    assert report["calibration"] == {"fast": {"tokens_per_s": 96.0}, "slow": {"tokens_per_s": 48.0}}


# ----------------------------------------------------------------------------- compare: runs and refusals
def test_a_concurrent_run_is_reported_against_the_steps_it_was_given(tmp_path, monkeypatch, capsys):
    """A process's summary.json knows its steps, not the count planned: the result and its line carry --steps."""
    seen = {}

    def run_all(configs, names, out_dir, sets, tag, signals=None):
        seen["sets"] = sets
        for n in names:
            yield n, "running", None
        for n in names:
            yield n, "done", {"steps": 4, "tokens": 384}

    monkeypatch.setattr(compare, "run_all", run_all)
    code, out = run_compare(tmp_path, {"a": "tiny-falcon", "b": "tiny-transformer"}, "--concurrent", "--steps", "4")
    report = json.loads((out / "compare.json").read_text())
    assert code == 0 and report["status"] == {"a": "done", "b": "done"} and "train.steps=4" in seen["sets"]
    assert [r["planned_steps"] for r in report["runs"].values()] == [4, 4]
    printed = capsys.readouterr().out
    assert "[1/2] a: done 4/4 steps" in printed and "[2/2] b: done 4/4 steps" in printed


def test_a_concurrent_process_counts_as_done_only_with_exit_0_and_its_summary(tmp_path):
    """Each process as it ends: exit 0 with a summary.json is done (with its log), any other exit code or a
    missing summary is failed, with the last 2,000 characters of its output."""
    class Proc:
        def __init__(self, code):
            self.returncode = code

        def poll(self):
            return self.returncode

    procs = {}
    for name, code, summary in (("ok", 0, True), ("crashed", 1, True), ("silent", 0, False)):
        run_dir = tmp_path / name
        run_dir.mkdir()
        (run_dir / "stdout.txt").write_text("a" * 1000 + "b" * 1999 + name[0])
        (run_dir / "log.jsonl").write_text(json.dumps({"step": 1, "loss": 2.5}) + "\n")
        if summary:
            (run_dir / "summary.json").write_text(json.dumps({"steps": 1, "tokens_per_s": 10.0}))
        procs[name] = (Proc(code), str(run_dir))
    events = {name: (status, result) for name, status, result in compare._collect(procs)}
    assert procs == {} and set(events) == {"ok", "crashed", "silent"}
    assert events["ok"] == ("done", {"steps": 1, "tokens_per_s": 10.0, "log": [{"step": 1, "loss": 2.5}]})
    for name, code in (("crashed", 1), ("silent", 0)):
        status, result = events[name]
        assert status == "failed" and result == {"error": f"exit code {code}", "stdout_tail": "b" * 1999 + name[0]}


def test_the_summary_line_is_the_documented_one():
    """The docstring's example, from the numbers it shows."""
    result = dict(status="partial", steps=212, planned_steps=330, val_ppl=4.123, tokens_per_s=45678.0,
                  peak_mem_bytes=int(1.23 * 2**30) + 1, wall_s=61.0, first_step_s=2.1)
    documented = compare.summary_line.__doc__.strip().strip("`")
    assert compare.summary_line("DeltaNet", result, 3, 7) == documented


@pytest.mark.parametrize("names", [["a", ".."], ["a", "."], ["a", "a"], ["a", ""]])
def test_run_names_must_be_distinct_folder_names(names):
    with pytest.raises(ValueError, match="--names"):
        compare.check_run_names(names, ["x.yaml", "y.yaml"])


@pytest.mark.parametrize("option", [("--calib-steps", "3"), ("--max-steps", "30")])
def test_calibration_options_with_steps_and_a_deadline_are_refused(tmp_path, option):
    """--steps sets the count even with --deadline (which then only stops a late recipe): nothing is calibrated,
    so --calib-steps and --max-steps would be ignored."""
    with pytest.raises(ValueError, match=option[0] + " applies to a calibrated step count"):
        run_compare(tmp_path, {"a": "tiny-falcon"}, "--steps", "5", "--deadline", "100", *option)
    assert not (tmp_path / "cmp").exists()


def test_a_deadline_with_concurrent_runs_is_refused_before_anything_runs(tmp_path):
    """The deadline stops the sequential recipe in progress; the concurrent processes have none to stop."""
    with pytest.raises(ValueError, match="--deadline needs the sequential runs"):
        run_compare(tmp_path, {"a": "tiny-falcon", "b": "tiny-transformer"}, "--concurrent", "--deadline", "50")
    assert not (tmp_path / "cmp").exists()


def test_recipes_of_another_global_batch_are_refused_naming_it(tmp_path):
    paths = recipes(tmp_path, {"a": "tiny-falcon", "b": "tiny-transformer"})
    raw = yaml.safe_load(open(paths[1]))
    raw["train"]["global_batch"], raw["train"]["micro_batch"] = 8, 4
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=r"b\.yaml: train\.global_batch = 8, .*a\.yaml has 4"):
        parser = argparse.ArgumentParser()
        compare.add_arguments(parser)
        compare.run(parser.parse_args(["--configs", *paths, "--out", str(tmp_path / "cmp"), "--steps", "4"]))
    assert not (tmp_path / "cmp" / "main").exists()


def test_an_earlier_result_is_taken_only_for_the_same_recipe_file_on_the_same_device(tmp_path):
    path = tmp_path / "compare.json"
    runs = {n: {"steps": 4, "val_ppl": 3.0 + i} for i, n in enumerate("abcd")}
    path.write_text(json.dumps({"device": "1 x CPU", "configs": {n: f"{n}.yaml" for n in runs},
                                "status": {"a": "done", "b": "failed", "c": "done", "d": "done"}, "runs": runs}))
    now = {"a": "a.yaml", "b": "b.yaml", "c": "other.yaml", "d": "d.yaml"}
    assert compare._earlier_runs(str(path), now, "1 x CPU") == {"a": runs["a"], "d": runs["d"]}
    assert compare._earlier_runs(str(path), now, "1 x GPU") == {}
    assert compare._earlier_runs(str(tmp_path / "missing.json"), now, "1 x CPU") == {}


def test_a_result_of_code_of_unknown_commit_is_never_kept(tmp_path):
    """Outside a git checkout the commit is unknown (None), in the summary as in this launch: that two runs
    are of the same code cannot be told, so the recipe trains again."""
    config = {"train": {"steps": 4}}
    earlier = {"status": "done", "tokens": 96, "tokens_per_s": 10.0}
    (tmp_path / "summary.json").write_text(json.dumps({"config": config, "commit": None, "tokens": 96,
                                                       "tokens_per_s": 10.0}))
    assert compare.kept_result(earlier, str(tmp_path), config, None, None) is None
    assert compare.kept_result(earlier, str(tmp_path), config, None, CLEAN_TREE) is None
    assert compare.kept_result(earlier, str(tmp_path), config, "c0", CLEAN_TREE) is None


# ----------------------------------------------------------------------------- throughput
def test_op_backend_names_what_computed_the_falcon_layers():
    class Config:
        backend = "fla"

    assert throughput.op_backend({"layer": 0, "triton": 0}, Config(), "cuda") == "none"
    assert throughput.op_backend({"layer": 4, "triton": 4}, Config(), "cuda") == "triton"
    assert throughput.op_backend({"layer": 4, "triton": 2}, Config(), "cuda") == "mixed"
    assert throughput.op_backend({"layer": 4, "triton": 0}, Config(), "cuda:0") == "fla"
    assert throughput.op_backend({"layer": 4, "triton": 0}, Config(), "cpu") == "torch"  # fla needs CUDA tensors
    assert throughput.op_backend({"layer": 4, "triton": 0}, object(), "cuda") == "torch"


@pytest.fixture
def step_clock(monkeypatch):
    """Each forward of a model advances ``throughput``'s clock by the next of ``charges`` (1 s once they
    are used up) and records its input's shape and whether autocast was on."""
    from falcon_fwa.models import FalconForCausalLM

    state = {"now": 0.0, "charges": [], "inputs": [], "autocast": []}
    original = FalconForCausalLM.forward

    def forward(self, *args, **kwargs):
        state["now"] += state["charges"].pop(0) if state["charges"] else 1.0
        state["inputs"].append(tuple(kwargs["input_ids"].shape))
        state["autocast"].append(torch.is_autocast_enabled("cpu"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FalconForCausalLM, "forward", forward)
    monkeypatch.setattr(throughput, "_clock", lambda: state["now"])
    return state


def _measure(step_clock, charges, **kwargs):
    step_clock.update(now=0.0, charges=list(charges), inputs=[], autocast=[])
    options = dict(seq_len=8, batch_size=2, steps=5, warmup=2, min_steps=1, max_seconds=1000.0, device="cpu",
                   bf16=False)
    return throughput.measure(throughput.parse_preset("tiny-falcon"), **{**options, **kwargs})


def test_throughput_row_of_uneven_steps(step_clock):
    """Warm-up steps of 10 and 20 s, then timed steps of 1, 2, 9, 3, 3 s: step_s is their mean 3.6 and
    step_s_median 3, warmup_s 30, first_step_s 10, tokens/s 2 x 8 / 3.6; every step sees [2, 8] tokens;
    params counts every parameter of the model."""
    from falcon_fwa.models import FalconForCausalLM

    row = _measure(step_clock, [10.0, 20.0, 1.0, 2.0, 9.0, 3.0, 3.0])
    assert (row["first_step_s"], row["warmup_s"], row["warmup_steps"], row["timed_steps"]) == (10, 30, 2, 5)
    assert row["step_s"] == pytest.approx(18 / 5, rel=1e-12) and row["step_s_median"] == 3
    assert row["tokens_per_s"] == pytest.approx(16 / 3.6, rel=1e-12)
    assert (row["stopped"], row["steady"]) == (None, True)
    assert step_clock["inputs"] == [(2, 8)] * 7 and step_clock["autocast"] == [False] * 7
    model = FalconForCausalLM(throughput.parse_preset("tiny-falcon"))
    assert row["params"] == sum(p.numel() for p in model.parameters())


def test_throughput_bf16_runs_the_step_under_autocast(step_clock):
    row = _measure(step_clock, [], steps=1, warmup=0, bf16=True)
    assert row["timed_steps"] == 1 and step_clock["autocast"] == [True]


def test_max_seconds_ends_timing_once_that_many_seconds_have_passed(step_clock):
    """1-s steps: 3 s of them have passed after the third, which ends the timing of 5 with max_seconds 3;
    when the third is the last step asked for, the timing ran its course (nothing stopped it)."""
    row = _measure(step_clock, [], steps=5, max_seconds=3.0)
    assert (row["timed_steps"], row["stopped"], row["steady"]) == (3, "max_seconds", True)
    row = _measure(step_clock, [], steps=3, max_seconds=3.0)
    assert (row["timed_steps"], row["stopped"]) == (3, None)
    row = _measure(step_clock, [], steps=5, max_seconds=3.0, min_steps=4)  # never before min_steps
    assert (row["timed_steps"], row["stopped"]) == (4, "max_seconds")


def test_a_deadline_during_the_warmup_ends_the_measurement_untimed(step_clock):
    row = _measure(step_clock, [10.0, 20.0], deadline=5.0, min_steps=3)
    assert (row["timed_steps"], row["stopped"], row["steady"], row["step_s"]) == (0, "deadline", False, None)
    assert row["first_step_s"] == 10 and len(step_clock["inputs"]) == 1


def test_a_recipe_is_measured_at_its_seq_len_and_micro_batch(tmp_path, monkeypatch):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path)))  # seq_len 24, micro_batch 2, global_batch 4
    seen = []
    monkeypatch.setattr(throughput, "measure", lambda config, **kw: seen.append((kw["seq_len"], kw["batch_size"])) or {})
    monkeypatch.setattr(throughput, "_append_row", lambda path, row: None)
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    assert throughput.run(parser.parse_args(["--config", str(path), "--device", "cpu", "--seq-len", "8"])) == 0
    assert seen == [(24, 2)]


def test_the_falcon_layers_are_counted_inside_the_block_only():
    from falcon_fwa.layers.falcon_attention import FalconAttention
    from falcon_fwa.models import FalconForCausalLM

    model = FalconForCausalLM(throughput.parse_preset("tiny-falcon"))
    layers = sum(isinstance(m, FalconAttention) for m in model.modules())
    x = torch.randint(0, model.config.vocab_size, (1, 8))
    with torch.no_grad():
        with throughput.falcon_op_calls(model) as counts:
            model(input_ids=x, use_cache=False)
        model(input_ids=x, use_cache=False)
    assert layers > 0 and counts["layer"] == layers
