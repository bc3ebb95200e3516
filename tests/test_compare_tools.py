"""The comparison and throughput tools under slow first steps, deadlines and kills.

Time is simulated: the tools read a module clock, and the tests advance it by one second per
training micro-step (the first micro-step of each kind of model costs 100 seconds more,
like kernel compilation), so every expected step count is hand-computed."""
import json
import os

import pytest
import torch
import yaml

from falcon_fwa.provenance import CLEAN_TREE
from falcon_fwa.train import compare, compare_report, throughput
from falcon_fwa.train import latest_checkpoint, load_checkpoint
from falcon_fwa.train import trainer as trainer_module
from falcon_fwa.train.logger import read_log
from conftest import fake_git_commit
from test_train import recipe

COMPILE_S = 100.0


class FakeClock:
    def __init__(self):
        self.now = 0.0
        self.compiled = set()

    def __call__(self) -> float:
        return self.now

    def charge(self, kind: str) -> None:
        """One second of work, plus ``COMPILE_S`` the first time a ``kind`` of model runs."""
        self.now += 1.0 + (COMPILE_S if kind not in self.compiled else 0.0)
        self.compiled.add(kind)


@pytest.fixture
def clock(monkeypatch):
    """Training micro-steps (not evaluation) advance ``compare``'s clock."""
    fake = FakeClock()
    original = trainer_module.causal_lm_loss

    def timed_loss(model, batch, device, autocast):
        if torch.is_grad_enabled():
            fake.charge(model.config.mixer)
        return original(model, batch, device, autocast)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", timed_loss)
    monkeypatch.setattr(compare, "_clock", fake)
    return fake


def recipes(tmp_path, presets):
    """One recipe file per ``name: preset`` (global_batch 4 = 2 micro-steps of 2 rows per step)."""
    paths = []
    for name, preset in presets.items():
        raw = recipe(tmp_path)
        raw["model"]["preset"] = preset
        raw["data"]["out_dir"] = ""  # compare tokenizes once for every recipe
        raw["log"]["every"] = 2
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        paths.append(str(path))
    return paths


def run_compare(tmp_path, presets, *extra):
    import argparse

    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    out = tmp_path / "cmp"
    code = compare.run(parser.parse_args(["--configs", *recipes(tmp_path, presets), "--names", *presets,
                                          "--out", str(out), *extra]))
    return code, out


def load(out):
    with open(out / "compare.json") as f:
        return json.load(f)


def test_compare_writes_results_after_every_recipe_and_a_kill_loses_only_the_one_running(tmp_path, monkeypatch,
                                                                                         capsys):
    presets = {"good": "tiny-falcon", "broken": "tiny-falcon", "killed": "tiny-transformer", "later": "tiny-falcon"}
    original = trainer_module.Trainer.train

    def train(self, **kwargs):
        if self.out_dir.endswith("broken"):
            raise RuntimeError("loss exploded")
        if self.out_dir.endswith("killed"):
            raise KeyboardInterrupt  # what a kill of the command leaves behind
        return original(self, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train", train)
    with pytest.raises(KeyboardInterrupt):
        run_compare(tmp_path, presets, "--steps", "4")
    report = load(tmp_path / "cmp")
    assert report["status"] == {"good": "done", "broken": "failed", "killed": "running", "later": "pending"}
    assert report["finished"] is False and set(report["runs"]) == {"good", "broken"}
    good = report["runs"]["good"]
    assert good["steps"] == good["planned_steps"] == 4 and good["tokens"] == 4 * 4 * 24
    assert [r["step"] for r in good["log"] if "val_loss" in r] == [1, 2, 3, 4]  # eval_every = steps // 4
    assert "loss exploded" in report["runs"]["broken"]["error"]
    printed = capsys.readouterr().out
    assert "[1/4] good: done 4/4 steps  val_ppl" in printed and "[2/4] broken: failed" in printed
    rows = compare_report.result_rows(report)
    assert [(r["model"], r["status"]) for r in rows] == list(report["status"].items())
    assert "| killed | running |" in compare_report.markdown_table(rows)


def test_a_sigterm_stops_the_recipe_in_progress_with_a_checkpoint_and_the_command(tmp_path, monkeypatch, capsys):
    """SIGTERM during the second recipe's third step: it ends that step with a checkpoint (status stopped), the
    third recipe is not run, the command returns 143 and the first recipe's result stands."""
    import signal

    presets = {"first": "tiny-falcon", "second": "tiny-transformer", "third": "tiny-falcon"}
    original, steps = trainer_module.causal_lm_loss, []

    def loss(model, batch, device, autocast):
        if torch.is_grad_enabled() and model.config.mixer == "transformer":
            steps.append(1)
            if len(steps) == 5:  # the first micro-step of step 3 (2 micro-steps per step)
                os.kill(os.getpid(), signal.SIGTERM)
        return original(model, batch, device, autocast)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", loss)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        code, out = run_compare(tmp_path, presets, "--steps", "6")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 128 + signal.SIGTERM
    report = load(out)
    assert report["status"] == {"first": "done", "second": "stopped", "third": "not_run"}
    assert report["finished"] is False
    second = report["runs"]["second"]
    assert second["steps"] == 3 and second["signal"] == "SIGTERM"
    checkpoints = out / "main" / "second" / "checkpoints"
    assert load_checkpoint(latest_checkpoint(str(checkpoints)))["step"] == 3
    assert report["runs"]["third"]["error"] == "stopped by SIGTERM before this recipe started"
    assert report["runs"]["first"]["steps"] == 6
    rows = compare_report.result_rows(report)
    assert "| second | stopped: 3 of 6 steps |" in compare_report.markdown_table(rows)
    assert "stopped by SIGTERM" in capsys.readouterr().err


def test_compare_refuses_the_base_recipe_that_a_glob_takes_along(tmp_path):
    import argparse

    base, model = tmp_path / "base.yaml", tmp_path / "model.yaml"
    base.write_text(yaml.safe_dump(recipe(tmp_path)))
    model.write_text("extends: base.yaml\nmodel: {preset: tiny-transformer}\n")
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args(["--configs", str(base), str(model), "--out", str(tmp_path / "cmp")])
    with pytest.raises(ValueError, match=r"base\.yaml is the base that .*model\.yaml extends"):
        compare.run(args)
    assert not (tmp_path / "cmp").exists()  # refused before anything ran


def test_run_names_with_yaml_syntax_stay_folder_names(tmp_path):
    """The run folder reaches each recipe through --set: a name with ' #' (a YAML comment) or ': ' (a
    mapping) must stay the text it is, or two runs would share one folder."""
    code, out = run_compare(tmp_path, {"win #4": "tiny-falcon", "win: 8": "tiny-falcon"}, "--steps", "2")
    assert code == 0
    assert sorted(p.name for p in (out / "main").iterdir()) == ["win #4", "win: 8"]
    assert load(out)["status"] == {"win #4": "done", "win: 8": "done"}


def test_deadline_stops_the_running_recipe_at_a_step_boundary_then_evaluates_it(tmp_path, clock):
    # falcon: 101 + 1 s for step 1, then 2 s a step: the deadline of 110 s is reached at step 5
    code, out = run_compare(tmp_path, {"falcon": "tiny-falcon", "transformer": "tiny-transformer"},
                            "--steps", "12", "--deadline", "110")
    assert code == 0
    report = load(out)
    assert report["status"] == {"falcon": "partial", "transformer": "not_run"} and report["finished"]
    run = report["runs"]["falcon"]
    assert (run["steps"], run["planned_steps"], run["tokens"]) == (5, 12, 5 * 4 * 24)
    assert run["first_step_s"] == COMPILE_S + 2
    val_steps = [r["step"] for r in run["log"] if "val_loss" in r]
    assert val_steps == [3, 5]  # eval_every = 3, then the evaluation at the stop
    assert run["val_loss"] == [r["val_loss"] for r in run["log"] if "val_loss" in r][-1]
    assert [r["step"] for r in read_log(out / "main" / "falcon" / "log.jsonl") if "loss" in r] == [2, 4, 5]
    with open(out / "main" / "falcon" / "summary.json") as f:
        assert json.load(f)["status"] == "partial"
    assert not os.path.exists(out / "main" / "transformer")

    assert compare_report.main([str(out / "compare.json"), str(tmp_path / "report" / "small")]) == 0
    table = (tmp_path / "report" / "small_table.md").read_text()
    assert "| falcon | partial: 5 of 12 steps |" in table and "| transformer | not_run: the deadline passed" in table
    assert "Best Falcon" not in table and "falcon, transformer" in table  # partial runs are no comparison
    assert (tmp_path / "report" / "small_loss.png").stat().st_size > 0


def test_calibration_times_steady_steps_and_plans_the_budget_without_the_compile_step(tmp_path, clock):
    # 1 + 3 calibration steps each: the first costs 102 s, every other 2 s (two micro-steps).
    # Fixed costs (setup, evaluation, save, export) take no simulated time, so 100 s buy
    # 100 // (2 + 2) = 25 steps; had the compile step been averaged in, 9.
    code, out = run_compare(tmp_path, {"falcon": "tiny-falcon", "transformer": "tiny-transformer"},
                            "--time-budget", "100", "--calib-warmup", "1", "--calib-steps", "3", "--max-steps", "6")
    assert code == 0
    report = load(out)
    for name, op in (("falcon", "torch"), ("transformer", "none")):
        cal = report["calibration"][name]
        assert (cal["first_step_s"], cal["warmup_s"], cal["step_s"], cal["timed_steps"]) == (102, 102, 2, 3)
        assert cal["falcon_op"] == op
    assert report["plan"] == {"budget_s": 100, "fixed_s": 0, "step_s_sum": 4, "steps_fit": 25, "steps": 6}
    assert report["status"] == {"falcon": "done", "transformer": "done"}
    for name in ("falcon", "transformer"):
        run = report["runs"][name]
        assert run["steps"] == 6 and run["wall_s"] == 12  # compiled during calibration: 2 s a step
    assert os.path.isfile(out / "data" / "prepared.json")  # one tokenized copy for every recipe
    assert not os.path.exists(out / "main" / "falcon" / "data")


@pytest.fixture
def forward_clock(monkeypatch):
    """Every forward of a model advances ``throughput``'s clock (the first of a kind by 101 s)."""
    from falcon_fwa.models import FalconForCausalLM

    fake = FakeClock()
    original = FalconForCausalLM.forward

    def forward(self, *args, **kwargs):
        fake.charge(self.config.mixer)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(FalconForCausalLM, "forward", forward)
    monkeypatch.setattr(throughput, "_clock", fake)
    return fake


def run_throughput(tmp_path, *extra):
    import argparse

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    out = tmp_path / "rows.jsonl"
    throughput.run(parser.parse_args(["--preset", "tiny-falcon", "tiny-transformer", "--seq-len", "8", "16",
                                      "--batch-tokens", "32", "--warmup", "1", "--device", "cpu", "--fp32",
                                      "--out", str(out), *extra]))
    with open(out) as f:
        return [json.loads(line) for line in f]


def test_throughput_times_after_warmup_and_measures_every_preset_per_length_first(tmp_path, forward_clock):
    rows = run_throughput(tmp_path, "--steps", "5", "--min-steps", "3", "--max-seconds", "2.5")
    assert [(r["preset"], r["seq_len"]) for r in rows] == [("tiny-falcon", 8), ("tiny-transformer", 8),
                                                           ("tiny-falcon", 16), ("tiny-transformer", 16)]
    first = rows[0]
    assert (first["first_step_s"], first["warmup_s"], first["batch_size"]) == (101, 101, 4)
    assert {r["dtype"] for r in rows} == {"fp32"}  # --fp32: each row says how it was timed
    for r in rows:  # 2.5 s of 1-s steps would stop at 3; the warm-up never counts against it
        assert (r["timed_steps"], r["step_s"], r["tokens_per_s"], r["stopped"], r["steady"]) == (
            3, 1, 32, "max_seconds", True)
    assert [r["falcon_op"] for r in rows] == ["torch", "none", "torch", "none"]

    # a deadline 6 s in: the second measurement stops after one timed step, the others are skipped
    (tmp_path / "rows.jsonl").unlink()
    rows = run_throughput(tmp_path, "--steps", "3", "--deadline", "6")
    assert (rows[0]["timed_steps"], rows[0]["stopped"]) == (3, None)
    assert (rows[1]["timed_steps"], rows[1]["stopped"], rows[1]["steady"]) == (1, "deadline", False)
    assert all("skipped" in r and "timed_steps" not in r for r in rows[2:]) and len(rows) == 4


def test_throughput_rows_are_on_disk_before_a_kill(tmp_path, monkeypatch):
    calls = []

    def measure(config, **kwargs):
        calls.append(kwargs["seq_len"])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return {"timed_steps": 3}

    monkeypatch.setattr(throughput, "measure", measure)
    with pytest.raises(KeyboardInterrupt):
        run_throughput(tmp_path)
    with open(tmp_path / "rows.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [(r["preset"], r["seq_len"], r["timed_steps"]) for r in rows] == [("tiny-falcon", 8, 3),
                                                                             ("tiny-transformer", 8, 3)]
    # launched again into the same file: the new rows follow the old ones, and each row names its launch
    calls.clear()
    monkeypatch.setattr(throughput, "measure", lambda config, **kwargs: {"timed_steps": 4})
    rows = run_throughput(tmp_path)
    assert [r["timed_steps"] for r in rows] == [3, 3, 4, 4, 4, 4]
    first, second = rows[0]["launch"], rows[2]["launch"]
    assert first != second and [r["launch"] for r in rows] == [first] * 2 + [second] * 4


def test_throughput_command_prints_a_bad_option_in_one_line(capsys):
    """``python -m falcon_fwa.train.throughput`` (as results/lm/run_small.sh runs it) ends as falcon-fwa throughput."""
    assert throughput.main(["--preset", "tiny-falcon", "--deadline", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa throughput: error: --deadline must be > 0") and "Traceback" not in err


def test_throughput_reports_the_triton_kernels_when_they_serve_the_falcon_layers(monkeypatch):
    pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or Triton's interpreter")
    import falcon_fwa.ops.api as op_api
    from falcon_fwa.ops import triton as kernels

    # "auto" keeps to PyTorch on CPU and for rules not checked on a GPU: route the chunk form to the kernels
    monkeypatch.setattr(op_api, "_triton_chunk", lambda backend, q, rule: kernels.falcon_chunk_triton)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = throughput.parse_preset("tiny-falcon:chunk_size=16")
    row = throughput.measure(config, seq_len=16, batch_size=2, steps=1, warmup=0, min_steps=1, device=device,
                             bf16=False)
    assert row["falcon_op"] == "triton" and row["timed_steps"] == 1
    assert kernels.falcon_chunk_triton.__name__ == "falcon_chunk_triton"  # the counter is gone afterwards


def test_throughput_profile_lists_the_most_expensive_operators_of_one_extra_step(tmp_path):
    rows = run_throughput(tmp_path, "--steps", "1", "--min-steps", "1", "--profile", "4")
    for r in rows:
        assert r["timed_steps"] == 1  # the profiled step comes after the timed ones
        top = r["profile"]
        assert len(top) == 4 and all(t["ms"] > 0 and t["calls"] >= 1 and t["name"] for t in top)
        assert [t["ms"] for t in top] == sorted((t["ms"] for t in top), reverse=True)
    # the operators are the step's own: the transformer's matmuls are among them. Which ones make the top 4 is a
    # matter of timing (on a loaded machine a preempted elementwise op can outrank them), so this asks for them all
    (tmp_path / "all").mkdir()
    every = run_throughput(tmp_path / "all", "--steps", "1", "--min-steps", "1", "--profile", "1000")[1]["profile"]
    assert 4 < len(every) < 1000 and any(t["name"] in ("aten::mm", "aten::addmm", "aten::linear") for t in every)


@pytest.mark.slow
def test_throughput_compiles_each_model_once(tmp_path):
    """Timed steps of a compiled model reuse one graph: no recompilation per step."""
    import torch._dynamo

    torch._dynamo.reset()
    import argparse

    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    out = tmp_path / "rows.jsonl"
    # config.patch restores the setting afterwards (a monkeypatch of it left the config broken for later
    # compilations in the same process)
    with torch._dynamo.config.patch(error_on_recompile=True):
        throughput.run(parser.parse_args(["--preset", "tiny-falcon", "--seq-len", "8", "--batch-tokens", "16",
                                          "--warmup", "1", "--steps", "3", "--min-steps", "3", "--device", "cpu",
                                          "--fp32", "--compile", "--out", str(out)]))
    row = json.loads(out.read_text())
    assert row["compiled"] and row["timed_steps"] == 3 and row["falcon_op"] == "torch"
    torch._dynamo.reset()


def test_throughput_activation_checkpointing_replays_every_block(tmp_path, monkeypatch):
    """--activation-checkpointing times steps whose backward runs each block's mixer again: twice the
    mixer calls of the plain step, and the row says which it measured."""
    from falcon_fwa.layers.falcon_attention import FalconAttention
    from falcon_fwa.layers.attention import CausalSelfAttention

    calls = []
    for cls in (FalconAttention, CausalSelfAttention):
        real = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, *a, _real=real, **k: calls.append(1) or _real(self, *a, **k))
    counts = {}
    for flag in ((), ("--activation-checkpointing",)):
        calls.clear()
        (tmp_path / str(bool(flag))).mkdir()
        rows = run_throughput(tmp_path / str(bool(flag)), "--steps", "1", "--min-steps", "1", "--warmup", "0", *flag)
        assert [r["activation_checkpointing"] for r in rows] == [bool(flag)] * 4
        counts[bool(flag)] = len(calls)
    assert counts[True] == 2 * counts[False] > 0


@pytest.mark.parametrize("extra, option", [
    (["--steps", "0"], "--steps"),
    (["--time-budget", "0"], "--time-budget"), (["--time-budget", "-5"], "--time-budget"),
    (["--time-budget", "nan"], "--time-budget"), (["--time-budget", "inf"], "--time-budget"),
    (["--deadline", "0"], "--deadline"), (["--deadline", "nan"], "--deadline"), (["--deadline", "inf"], "--deadline"),
    (["--time-budget", "10", "--calib-steps", "0"], "--calib-steps"),
    (["--time-budget", "10", "--max-steps", "0"], "--max-steps"),
    (["--time-budget", "10", "--calib-warmup", "0"], "--calib-warmup"),
    (["--steps", "5", "--time-budget", "10"], "--steps and --time-budget"),
    (["--steps", "5", "--max-steps", "3"], "--max-steps"),  # no calibrated count to cap
    (["--calib-steps", "3"], "--calib-steps"),  # nothing calibrates
    (["--names", "a"], "--names"), (["--names", "a", "../b"], "--names"),
])
def test_compare_refuses_bad_options_by_name_before_anything_runs(tmp_path, extra, option):
    with pytest.raises(ValueError, match=option.replace("-", r"\-")):
        run_compare(tmp_path, {"a": "tiny-falcon", "b": "tiny-transformer"}, *extra)
    assert not (tmp_path / "cmp").exists()


def test_compare_command_prints_a_bad_option_in_one_line(tmp_path, capsys):
    """``python -m falcon_fwa.train.compare`` (as results/lm/run_small.sh runs it) ends as falcon-fwa compare does."""
    code = compare.main(["--configs", *recipes(tmp_path, {"a": "tiny-falcon"}), "--out", str(tmp_path / "cmp"),
                         "--deadline", "nan"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("falcon-fwa compare: error: --deadline must be a finite number")
    assert "Traceback" not in err


def test_a_second_compare_into_the_same_folder_is_refused_while_the_first_runs(tmp_path):
    from falcon_fwa.atomic import folder_lock

    with folder_lock(tmp_path / "cmp", ".compare.lock"):
        with pytest.raises(ValueError, match="is in use by another falcon-fwa compare"):
            run_compare(tmp_path, {"a": "tiny-falcon"}, "--steps", "2")
    assert not (tmp_path / "cmp" / "compare.json").exists()


def test_relaunch_keeps_the_recipes_finished_with_the_same_settings_and_trains_the_rest(tmp_path, monkeypatch,
                                                                                       checkout):
    monkeypatch.setattr(compare, "git_commit", fake_git_commit)
    monkeypatch.setattr(trainer_module, "command_provenance",
                        lambda args: {"commit": fake_git_commit(short=False), "dirty": False, "options": vars(args)})
    presets = {"first": "tiny-falcon", "second": "tiny-transformer"}
    original = trainer_module.Trainer.train
    trained, kill = [], {"second"}

    def train(self, **kwargs):
        name = os.path.basename(self.out_dir)
        trained.append(name)
        if name in kill:
            raise KeyboardInterrupt  # the command killed while this recipe trains
        return original(self, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train", train)
    with pytest.raises(KeyboardInterrupt):
        run_compare(tmp_path, presets, "--steps", "4")
    first = load(tmp_path / "cmp")["runs"]["first"]
    kill.clear(), trained.clear()

    code, out = run_compare(tmp_path, presets, "--steps", "4")  # the same command again
    report = load(out)
    assert code == 0 and trained == ["second"] and report["status"] == {"first": "done", "second": "done"}
    kept = report["runs"]["first"]
    assert kept.pop("kept") is True and kept == first  # the earlier result, whole: log, losses, timings
    assert "kept" not in report["runs"]["second"] and report["runs"]["second"]["steps"] == 4
    assert compare_report.result_rows(report)[0]["val_ppl"] == first["val_ppl"]

    trained.clear()  # the same settings on another machine: its speeds are not this one's
    monkeypatch.setattr(compare, "device_description", lambda: "1 x Other GPU")
    code, out = run_compare(tmp_path, presets, "--steps", "4")
    assert trained == ["first", "second"] and load(out)["device"] == "1 x Other GPU"

    trained.clear()  # other settings: nothing of the earlier launches is taken along
    code, out = run_compare(tmp_path, presets, "--steps", "6")
    report = load(out)
    assert trained == ["first", "second"] and not any(r.get("kept") for r in report["runs"].values())
    assert {r["steps"] for r in report["runs"].values()} == {6}


def test_a_result_is_kept_only_with_its_own_summary_recipe_and_commit(tmp_path):
    config = {"train": {"steps": 4}, "model": {"preset": "tiny-falcon"}}
    earlier = {"status": "done", "tokens": 96, "tokens_per_s": 10.0, "val_ppl": 3.0}
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert compare.kept_result(earlier, str(run_dir), config, "c0", CLEAN_TREE) is None  # no summary in the folder
    (run_dir / "summary.json").write_text(json.dumps({"config": config, "commit": "c0", "tokens": 96,
                                                      "tokens_per_s": 10.0}))
    assert compare.kept_result(earlier, str(run_dir), config, "c0", CLEAN_TREE) == earlier
    assert compare.kept_result(earlier, str(run_dir), config, "c1", CLEAN_TREE) is None  # other code
    assert compare.kept_result(earlier, str(run_dir), config, None, CLEAN_TREE) is None  # code of unknown commit
    assert compare.kept_result(earlier, str(run_dir), {**config, "train": {"steps": 5}}, "c0", CLEAN_TREE) is None
    assert compare.kept_result(dict(earlier, tokens_per_s=11.0), str(run_dir), config, "c0",
                               CLEAN_TREE) is None  # another run
    assert compare.kept_result(dict(earlier, status="partial"), str(run_dir), config, "c0", CLEAN_TREE) is None
    assert compare.kept_result(None, str(run_dir), config, "c0", CLEAN_TREE) is None


def test_a_launched_run_ends_with_the_command_that_started_it_even_when_that_is_killed(tmp_path):
    """``end_with_parent``: the child of a process killed by SIGKILL gets SIGHUP (no orphan goes on)."""
    import signal
    import subprocess
    import sys
    import time

    from test_scaling import _running

    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from falcon_fwa.train.launch import end_with_parent\n"
        "child = subprocess.Popen(['sleep', '60'], preexec_fn=end_with_parent())\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n")])
    try:
        deadline = time.monotonic() + 120  # the parent imports torch first: seconds on a loaded machine
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            assert parent.poll() is None, "the parent ended before it started its child"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        assert _running(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        for _ in range(50):
            if not _running(child):
                break
            time.sleep(0.1)
        assert not _running(child)
    finally:
        if parent.poll() is None:
            parent.kill()


_LOAD_LAUNCH = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("launch", sys.argv[1])  # the module alone, without torch
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
"""

_THREADED_LAUNCHER = _LOAD_LAUNCH + """
import os, subprocess, threading, time
out = sys.argv[3]

def start_the_run():  # from a thread that ends once the run is ready: the run's first parent-death signal
    subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1], out], start_new_session=True,
                     preexec_fn=launch.end_with_parent())
    while not os.path.exists(out + ".ready"):
        time.sleep(0.01)

threading.Thread(target=start_the_run).start()
time.sleep(600)
"""

_STOPPING_RUN = _LOAD_LAUNCH + """
import os, time
out = sys.argv[2]
with launch.StopSignals(True) as stops:
    open(out + ".ready", "w").close()
    end = time.monotonic() + 60
    while not stops.received and time.monotonic() < end:
        time.sleep(0.01)
    open(out + ".stopping", "w").close()
    time.sleep(2.0)  # the launcher is killed meanwhile: the signal again, from its main thread's end
    with open(out + ".tmp", "w") as f:
        f.write(f"stopped by {stops.received}")
    os.replace(out + ".tmp", out)
"""


def test_a_run_gets_the_parent_death_signal_once_per_launcher_thread_and_stops_once_and_cleanly(tmp_path):
    """The system sends a launched run its parent-death signal each time a thread it belongs to ends:
    first the launcher's thread that started it (the run passes to the launcher's main thread), then, with
    the launcher killed by SIGKILL, that one. (A launcher killed outright with several threads does the
    same, in whatever order its threads end.) The run stops on the first SIGHUP and takes the second for a
    repeat: it ends its own way, its last line written, and is not interrupted by a second signal."""
    import signal
    import subprocess
    import sys
    import time

    from falcon_fwa.train import launch

    out = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", _THREADED_LAUNCHER, launch.__file__, _STOPPING_RUN,
                                 str(out)])
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run.stopping").exists() and time.monotonic() < deadline:
            assert launcher.poll() is None, "the launcher ended before its run was told to stop"
            time.sleep(0.02)
        assert (tmp_path / "run.stopping").exists(), "the run got no signal when its starting thread ended"
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.exists(), "the run ended without its own last line: the second signal interrupted it"
        assert out.read_text() == f"stopped by {int(signal.SIGHUP)}"
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_report_table_and_json_carry_the_same_numbers(tmp_path, capsys):
    log = [dict(step=4, loss=3.0, tokens=2048), dict(step=4, val_loss=2.5)]
    runs = {"Falcon-A": dict(status="done", steps=8, params=1000, tokens=4096, val_ppl=10.0, tokens_per_s=2000.0,
                             peak_mem_bytes=2**31, log=log),
            "Base": dict(status="done", steps=8, params=990, tokens=4096, val_ppl=8.0, tokens_per_s=3000.0,
                         peak_mem_bytes=None),
            "Falcon-B": dict(status="partial", steps=3, planned_steps=8, params=1000, tokens=1536, val_ppl=30.0),
            "Broken": dict(status="failed", error="RuntimeError: loss exploded")}
    report = {"configs": {n: f"{n}.yaml" for n in runs}, "status": {n: r["status"] for n, r in runs.items()},
              "runs": runs, "steps": 8}
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(report))
    assert compare_report.main([str(path), str(tmp_path / "out" / "r")]) == 0
    rows = json.loads((tmp_path / "out" / "r.json").read_text())
    table = (tmp_path / "out" / "r_table.md").read_text()
    assert [r["model"] for r in rows] == list(runs) and rows[0]["val_ppl"] == 10.0 and rows[2]["planned_steps"] == 8
    assert "| Falcon-A | done | 1,000 | 4,096 | 10.000 | 2,000 | 2.00 GiB |" in table
    assert "| Base | done | 990 | 4,096 | 8.000 | 3,000 | - |" in table
    assert "| Falcon-B | partial: 3 of 8 steps | 1,000 | 1,536 | 30.000 | - | - |" in table
    assert "| Broken | failed: RuntimeError: loss exploded |" in table
    # the verdict sets the best finished Falcon (10.0) against the best baseline (8.0): 10 / 8 - 1 = 25 %
    assert "Best Falcon (Falcon-A, 10.000) is 25.0% above the best baseline (Base, 8.000)." in table
    assert "Not in the comparison (fewer or no tokens trained): Falcon-B, Broken." in table
    assert (tmp_path / "out" / "r_loss.png").stat().st_size > 0
    assert capsys.readouterr().out.strip() == table.strip()  # what it prints is the file


def test_report_command_help_and_bad_input(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        compare_report.main(["--help"])
    assert exit_.value.code == 0 and "PREFIX_table.md" in capsys.readouterr().out
    (tmp_path / "other.json").write_text('{"text": "not a comparison"}')
    assert compare_report.main([str(tmp_path / "other.json"), str(tmp_path / "r")]) == 2
    assert compare_report.main([str(tmp_path / "missing.json"), str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "is not a compare.json" in err and "missing.json" in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()
