"""What a comparison and a scaling sweep record of runs cut short or timed under other settings: a stopped
recipe's planned step count where the recipes' own ``train.steps`` sets it, a stopped recipe's validation
figures only where they were measured at its last step, and a sweep's rows kept only from runs with the
thread count its table names."""
import json
import os
import signal

import pytest
import torch

from falcon_fwa.train import compare, compare_report
from falcon_fwa.train import trainer as trainer_module
from test_cli_journeys import _compare
from test_compare_tools import load, run_compare
from test_scaling import _fake_sweep
from test_train import recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def _presets_trained(monkeypatch) -> list:
    """The presets the trainer trains from now on, in order (``Trainer.train`` recorded, then run as it is)."""
    trained = []
    original = trainer_module.Trainer.train

    def train(self, *args, **kwargs):
        trained.append(self.cfg.model.preset)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train", train)
    return trained


def test_a_concurrent_comparison_stopped_without_steps_records_the_recipes_own_step_count(tmp_path, monkeypatch,
                                                                                        capsys):
    """``--concurrent`` without ``--steps``: the recipes share their own ``train.steps`` (4 in test_train's
    recipe), which is every run's planned count; a run stopped at step 3 by a SIGTERM reads "3 of 4 steps" on the
    console and in the report's table (not a count of None, which the table cannot print)."""
    def run_all(configs, names, out_dir, sets, tag, signals=None):
        yield "a", "running", None
        yield "b", "running", None
        yield "a", "stopped", {"steps": 3, "tokens": 3 * 4 * 24, "params": 10, "tokens_per_s": 40.0,
                               "signal": "SIGTERM"}
        yield "b", "done", {"steps": 4, "tokens": 4 * 4 * 24, "params": 12, "tokens_per_s": 50.0, "val_ppl": 9.0}

    monkeypatch.setattr(compare, "run_all", run_all)
    assert recipe(tmp_path)["train"]["steps"] == 4
    assert _compare(tmp_path, "--concurrent") == 128 + signal.SIGTERM
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["status"] == {"a": "stopped", "b": "done"}
    assert [report["runs"][n]["planned_steps"] for n in "ab"] == [4, 4]
    table = compare_report.markdown_table(compare_report.result_rows(report))
    assert "| a | stopped: 3 of 4 steps |" in table
    assert "[1/2] a: stopped 3/4 steps" in capsys.readouterr().out


def test_a_recipe_stopped_between_two_evaluations_carries_no_validation_figures_of_an_earlier_step(
        tmp_path, monkeypatch, capsys):
    """``--steps 8`` evaluates every 8 // 4 = 2 steps; a SIGTERM during the second recipe's third step stops it
    at step 3, not evaluated there (its log's last evaluation is of step 2): its result, console line and table
    row give no validation loss or perplexity, rather than step 2's beside step 3's tokens. The first recipe,
    done, keeps its step-8 evaluation."""
    presets = {"first": "tiny-falcon", "second": "tiny-transformer"}
    original, calls = trainer_module.causal_lm_loss, []

    def loss(model, batch, device, autocast):
        if torch.is_grad_enabled() and model.config.mixer == "transformer":
            calls.append(1)
            if len(calls) == 5:  # the first micro-step of step 3 (2 micro-steps per step)
                os.kill(os.getpid(), signal.SIGTERM)
        return original(model, batch, device, autocast)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", loss)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        code, out = run_compare(tmp_path, presets, "--steps", "8")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert code == 128 + signal.SIGTERM
    report = load(out)
    second = report["runs"]["second"]
    assert (report["status"]["second"], second["steps"]) == ("stopped", 3)
    assert [r["step"] for r in second["log"] if "val_loss" in r] == [2]
    assert "val_loss" not in second and "val_ppl" not in second
    first = report["runs"]["first"]
    assert first["val_loss"] == [r["val_loss"] for r in first["log"] if "val_loss" in r and r["step"] == 8][0]
    assert "[2/2] second: stopped 3/8 steps" in capsys.readouterr().out
    table = compare_report.markdown_table(compare_report.result_rows(report))
    tps = f"{second['tokens_per_s']:,.0f}" if second["tokens_per_s"] else "-"  # (None where too few steps were timed)
    assert f"| second | stopped: 3 of 8 steps | {second['params']:,} | 288 | - | {tps} | - |" in table
    assert second["tokens"] == 3 * 4 * 24  # 3 steps of 4 rows x 24 tokens


def test_a_concurrent_run_stopped_at_an_evaluation_step_keeps_that_evaluation(tmp_path, monkeypatch):
    """With ``--concurrent``, a run stopped at step 3 whose log's last evaluation is of step 2 loses the summary's
    validation figures; one stopped at step 2, evaluated there, keeps them."""
    def run_all(configs, names, out_dir, sets, tag, signals=None):
        log = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}, {"step": 2, "val_loss": 2.5, "val_ppl": 12.18}]
        yield "a", "stopped", {"steps": 3, "val_loss": 2.5, "val_ppl": 12.18, "signal": "SIGTERM",
                               "log": log + [{"step": 3, "loss": 2.8}]}
        yield "b", "stopped", {"steps": 2, "val_loss": 2.5, "val_ppl": 12.18, "signal": "SIGTERM", "log": log}

    monkeypatch.setattr(compare, "run_all", run_all)
    assert _compare(tmp_path, "--concurrent", "--steps", "8") == 128 + signal.SIGTERM
    runs = json.loads((tmp_path / "cmp" / "compare.json").read_text())["runs"]
    assert "val_loss" not in runs["a"] and "val_ppl" not in runs["a"]
    assert (runs["b"]["val_loss"], runs["b"]["val_ppl"]) == (2.5, 12.18)


def test_a_relaunched_sweep_under_another_thread_count_runs_every_run_again(tmp_path, monkeypatch, cpu_machine,
                                                                             checkout):
    """The table says every run had the one OMP_NUM_THREADS of this launch: a sweep launched again with another
    keeps none of the runs timed under the first (their tokens/s are of another CPU setup), and one launched
    again with the same keeps them all. Each row names the thread count it was timed with."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    results = str(tmp_path / "multigpu")
    argv = ["--configs", str(path), "--names", "Tiny", "--gpus", "1", "2", "--strategies", "ddp", "--noise-seeds",
            "0", "--steps", "3", "--warmup-steps", "0", "--out", str(tmp_path / "runs"), "--results", results]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, ["Tiny-ddp-n1-s0", "Tiny-ddp-n2-s0"])
    first = json.load(open(results + ".json"))
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, ["Tiny-ddp-n1-s0", "Tiny-ddp-n2-s0"])
    rows = json.load(open(results + ".json"))
    assert [r["omp_num_threads"] for r in first] == ["1", "1"]
    assert [r["omp_num_threads"] for r in rows] == ["2", "2"]
    assert "OMP_NUM_THREADS=2 in every run" in open(results + ".md").read()
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, [])  # the same thread count: every run kept
    assert json.load(open(results + ".json")) == rows


def test_a_sequential_launch_keeps_no_run_of_an_earlier_concurrent_one(tmp_path, monkeypatch):
    """The sequential runs train each recipe alone, their tokens/s and peak memory its own: launched again without
    ``--concurrent`` into the ``--out`` of a finished ``--concurrent`` comparison of the very same recipes and step
    count (same commit, same machine), every recipe trains again in this process rather than keep the rate it had
    beside the others; the results file says which mode wrote it."""
    monkeypatch.setattr(compare, "git_commit", lambda short=True, cwd=None: "c0" * 20)
    assert _compare(tmp_path, "--concurrent", "--steps", "2") == 0
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["status"] == {"a": "done", "b": "done"} and report["concurrent"] is True
    for name in "ab":  # the runs' own summaries, of this (stand-in) commit, as a checkout's would be
        path = tmp_path / "cmp" / "main" / name / "summary.json"
        summary = json.loads(path.read_text())
        path.write_text(json.dumps(dict(summary, commit="c0" * 20)))
    trained = _presets_trained(monkeypatch)
    assert _compare(tmp_path, "--steps", "2") == 0
    assert trained == ["tiny-falcon", "tiny-transformer"]
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["concurrent"] is False and not any(r.get("kept") for r in report["runs"].values())


def test_a_sweep_from_two_processes_up_names_its_smallest_count_in_the_table_text():
    """``--gpus 2 4``: the reference rate and the noise seeds are those of the two-process runs (efficiency
    2,000 / (4 x mean(1,000, 1,200) / 2) = 90.9 %), and the table's text says so rather than "one-process"."""
    from falcon_fwa.train import scaling

    rows = [dict(model="A", strategy="ddp", gpus=2, seed=0, tokens_per_s=1000.0, val_loss=1.0, status="done",
                 command="c1"),
            dict(model="A", strategy="ddp", gpus=2, seed=1, tokens_per_s=1200.0, val_loss=1.25, status="done",
                 command="c2"),
            dict(model="A", strategy="ddp", gpus=4, seed=0, tokens_per_s=2000.0, val_loss=1.125, status="done",
                 command="c3")]
    scaling.efficiencies(rows)
    assert rows[2]["efficiency"] == pytest.approx(2000.0 / (4 * 1100.0 / 2))
    text = scaling.markdown(rows, dict(machine="M", commit="c0", steps=10, global_batch=8, seq_len=24,
                                       micro_batch=2, omp_num_threads="1"))
    assert "one-process" not in text
    assert "N times the mean per-process rate of the 2-process runs (all seeds)" in text
    assert "## Validation loss against the 2-process noise" in text.splitlines()
    assert ("- A: 2-process seeds 1.0000, 1.2500 (spread 0.2500); against the 2-process run of the same strategy "
            "and seed: ddp x4 +0.1250 (largest 0.1250: within the seed spread).") in text.splitlines()
    assert "| A | ddp | 4 | 0 | 2,000 | 90.9 % | - | 1.1250 | done |" in text.splitlines()


def test_the_loss_plot_of_a_comparison_without_a_step_option_is_titled_with_the_recipes_step_count(
        tmp_path, monkeypatch):
    """Without ``--steps`` (the recipes' own ``train.steps``, 4 here) ``compare.json`` has no ``steps``; the plot's
    title still gives the count every run planned, not "None steps"."""
    report = {"configs": {"a": "a.yaml", "b": "b.yaml"}, "status": {"a": "done", "b": "done"},
              "runs": {n: {"steps": 4, "planned_steps": 4, "params": 10, "tokens": 384, "val_ppl": 3.0, "log": []}
                       for n in "ab"}}
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(report))
    titles = []
    monkeypatch.setattr(compare_report, "plot_curves", lambda runs, out, title="": titles.append(title))
    assert compare_report.main([str(path), str(tmp_path / "report")]) == 0
    assert titles == ["2 models, 4 steps"]


def test_a_relaunch_under_another_torch_thread_count_trains_every_recipe_again(tmp_path, monkeypatch, checkout):
    """The sequential runs train in this process with its torch threads: relaunched with another count, a finished
    recipe's tokens/s is of another CPU setup and is not kept; with the same count it is."""
    from conftest import fake_git_commit

    monkeypatch.setattr(compare, "git_commit", fake_git_commit)
    monkeypatch.setattr(trainer_module, "command_provenance",
                        lambda args: {"commit": fake_git_commit(short=False), "dirty": False, "options": vars(args)})
    trained = _presets_trained(monkeypatch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _compare(tmp_path, "--steps", "2") == 0 and trained == ["tiny-falcon", "tiny-transformer"]
        torch.set_num_threads(2)
        trained.clear()
        assert _compare(tmp_path, "--steps", "2") == 0
        assert trained == ["tiny-falcon", "tiny-transformer"]
        trained.clear()
        assert _compare(tmp_path, "--steps", "2") == 0 and trained == []  # the same count again: both kept
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["threads"] == 2 and all(r.get("kept") for r in report["runs"].values())
