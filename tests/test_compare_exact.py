"""The language-model experiment commands against independent references: the learning rate every
optimizer step ran at against the textbook warmup + cosine formula (with gradient accumulation, muP
groups and a resume mid-schedule), a comparison's table against the runs' own logs and a count of the
model's parameters, the summary's tokens/s against tokens over simulated seconds, and the options that
would make a comparison or a scaling sweep report something other than what it ran."""
import json
import math
import os

import pytest
import torch

from falcon_fwa.train import Trainer, compare, compare_report, config_from_dict, scaling
from falcon_fwa.train import trainer as trainer_module
from falcon_fwa.train.config import load_config
from falcon_fwa.train.logger import read_log
from falcon_fwa.train.model_factory import build_model
from test_compare_tools import load, recipes, run_compare
from test_train import recipe


def textbook_lr(step: int, *, peak: float, warmup: int, total: int, floor: float) -> float:
    """Optimizer step ``step`` (0-based): a linear ramp whose first step runs at peak / warmup and whose
    step warmup - 1 reaches the peak, then half a cosine period from the peak at step ``warmup`` down
    towards ``floor x peak`` at step ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    phase = math.pi * (step - warmup) / (total - warmup)
    return floor * peak + (1 - floor) * peak * (1 + math.cos(phase)) / 2


@pytest.mark.parametrize("warmup, total, micro, stop", [(3, 9, 2, 4), (0, 6, 1, 2)])
def test_every_step_runs_at_the_textbook_rate_times_its_groups_multiplier_across_a_resume(
        tmp_path, monkeypatch, warmup, total, micro, stop):
    """Every param group's lr at every optimizer step (recorded inside ``AdamW.step``) is the formula's
    value times the group's muP multiplier (1 / (width 32 / base 16) for matrices, 1 otherwise), through
    a launch stopped after step ``stop`` and one resumed from its checkpoint; global batch 4 over
    micro-batches of ``micro`` rows (2 or 4 accumulated micro-steps a step). The log's lr is the formula's."""
    taken, recording = [], [False]
    real_step = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        if recording[0]:  # not the state-initialising call of a checkpoint load
            taken.append({g["name"]: g["lr"] for g in self.param_groups})
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    raw = recipe(tmp_path, steps=total, micro_batch=micro, global_batch=4, save_every=0, eval_every=0)
    raw["model"]["overrides"] = {"mup_base_width": 16}  # tiny-falcon is 32 wide: matrices at lr / 2
    raw["optim"].update(lr=1e-2, warmup_steps=warmup, min_lr_ratio=0.2)
    for stop_at in (stop, None):
        trainer = Trainer(config_from_dict(raw))
        recording[0] = True
        trainer.train(stop_at=stop_at)
        recording[0] = False
        trainer.close()
    assert trainer.accum == 4 // micro and trainer.step == total
    assert len(taken) == total
    multiplier = {"matrices": 0.5, "embedding": 1.0, "vectors": 1.0}
    for s, groups in enumerate(taken):
        want = textbook_lr(s, peak=1e-2, warmup=warmup, total=total, floor=0.2)
        assert groups == pytest.approx({n: want * multiplier[n] for n in groups}, rel=1e-12, abs=0), s
    logged = [(r["step"], r["lr"]) for r in read_log(tmp_path / "run" / "log.jsonl") if "lr" in r]
    assert [s for s, _ in logged] == list(range(1, total + 1))
    for s, lr in logged:  # the record of step s is that of optimizer step s - 1
        assert lr == pytest.approx(textbook_lr(s - 1, peak=1e-2, warmup=warmup, total=total, floor=0.2), rel=1e-12)


def test_summary_tokens_per_s_is_the_timed_tokens_over_their_seconds(tmp_path, monkeypatch):
    """On a clock that a training micro-step advances by 1 s (the first by 101 s: compilation) and an
    evaluation batch by 50 s, 20 steps of 2 micro-steps: the summary's rate (the one a comparison's table
    quotes) leaves out the first 20 // 10 = 2 steps and every evaluation, so it is 18 steps x 96 tokens
    over 36 s."""
    now, calls = [0.0], []
    real = trainer_module.causal_lm_loss

    def charged(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        now[0] += (1.0 + 100.0 * (len(calls) == 1)) if calls[-1] else 50.0
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", charged)
    monkeypatch.setattr(trainer_module, "_clock", lambda: now[0])
    raw = recipe(tmp_path, steps=20, eval_every=5, save_every=0)
    trainer = Trainer(config_from_dict(raw))
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    tokens_per_step = raw["train"]["global_batch"] * raw["data"]["seq_len"]
    assert tokens_per_step == 96 and calls.count(False) == 8  # four evaluations of one batch: 2 micro-batches
    assert summary["tokens"] == 20 * tokens_per_step
    assert summary["tokens_per_s"] == pytest.approx(18 * tokens_per_step / 36.0, rel=1e-12)


def test_the_comparison_table_quotes_each_runs_own_log_summary_and_parameter_count(tmp_path, cpu_machine):  # "-" for peak memory
    """A real comparison of two tiny recipes (4 steps): every number of the report's JSON and markdown is
    the run's own (val ppl = exp of the last val_loss of its log.jsonl, as in its summary.json; tokens =
    steps x global batch x seq_len; params = the distinct parameters of the model its recipe builds), and
    the verdict's gap is the ratio of the two perplexities."""
    presets = {"Falcon-3A": "tiny-falcon", "Transformer": "tiny-transformer"}
    code, out = run_compare(tmp_path, presets, "--steps", "4")
    assert code == 0
    report = load(out)
    assert compare_report.main([str(out / "compare.json"), str(tmp_path / "rep" / "small")]) == 0
    rows = json.loads((tmp_path / "rep" / "small.json").read_text())
    table = (tmp_path / "rep" / "small_table.md").read_text()
    assert [r["model"] for r in rows] == list(presets)
    prepared = json.loads((out / "data" / "prepared.json").read_text())  # the tokenizer every run shared
    ppl = {}
    for row in rows:
        run_dir = out / "main" / row["model"]
        summary = json.loads((run_dir / "summary.json").read_text())
        val = [r["val_loss"] for r in read_log(run_dir / "log.jsonl") if "val_loss" in r]
        cfg = load_config(report["configs"][row["model"]])
        model = build_model(cfg.model, vocab_size=prepared["vocab_size"], eos_token_id=prepared["eos_token_id"])
        distinct = {id(p): p.numel() for p in model.parameters()}
        assert len(val) == 4 and row["val_ppl"] == summary["val_ppl"] == pytest.approx(math.exp(val[-1]), rel=1e-12)
        assert row["tokens"] == summary["tokens"] == 4 * cfg.train.global_batch * cfg.data.seq_len == 384
        assert row["params"] == summary["params"] == sum(distinct.values())
        assert row["tokens_per_s"] == summary["tokens_per_s"] and row["status"] == "done" and row["steps"] == 4
        assert (f"| {row['model']} | done | {row['params']:,} | 384 | {row['val_ppl']:.3f} | "
                f"{row['tokens_per_s']:,.0f} | - |") in table
        ppl[row["model"]] = row["val_ppl"]
    gap = (ppl["Falcon-3A"] / ppl["Transformer"] - 1) * 100
    verdict = "at or below" if gap <= 0 else f"{gap:.1f}% above"
    assert (f"Best Falcon (Falcon-3A, {ppl['Falcon-3A']:.3f}) is {verdict} the best baseline (Transformer, "
            f"{ppl['Transformer']:.3f}).") in table
    assert (tmp_path / "rep" / "small_loss.png").stat().st_size > 0


def test_recipes_of_other_step_counts_are_refused_without_a_common_count(tmp_path):
    """Without --steps, --time-budget or --deadline each recipe trains its own train.steps: recipes of 4
    and 6 steps would stand side by side in the table (and its verdict) on other token counts."""
    paths = recipes(tmp_path, {"a": "tiny-falcon", "b": "tiny-transformer"})
    raw = __import__("yaml").safe_load(open(paths[1]))
    raw["train"]["steps"] = 6
    (tmp_path / "b.yaml").write_text(__import__("yaml").safe_dump(raw))
    parser = __import__("argparse").ArgumentParser()
    compare.add_arguments(parser)
    with pytest.raises(ValueError, match=r"b\.yaml: train\.steps = 6, .*a\.yaml has 4.*--steps"):
        compare.run(parser.parse_args(["--configs", *paths, "--out", str(tmp_path / "cmp")]))
    assert not (tmp_path / "cmp" / "main").exists()


def test_recipes_that_train_otherwise_are_refused_naming_the_fields_that_differ(tmp_path):
    """The recipes of a comparison share data, optim and train.global_batch: one with another learning rate
    and row length is refused naming both fields and both values, before anything is tokenized."""
    paths = recipes(tmp_path, {"a": "tiny-falcon", "b": "tiny-transformer"})
    raw = __import__("yaml").safe_load(open(paths[1]))
    raw["optim"]["lr"], raw["data"]["seq_len"] = 1e-3, 16
    (tmp_path / "b.yaml").write_text(__import__("yaml").safe_dump(raw))
    parser = __import__("argparse").ArgumentParser()
    compare.add_arguments(parser)
    with pytest.raises(ValueError, match=r"b\.yaml: data\.seq_len = 16, optim\.lr = 0\.001, .*a\.yaml has 24, 0\.003: "
                                         r"data, optim and train\.global_batch must be the same in every recipe$"):
        compare.run(parser.parse_args(["--configs", *paths, "--out", str(tmp_path / "cmp"), "--steps", "4"]))
    assert not (tmp_path / "cmp" / "main").exists()


def test_a_failed_recipe_ends_the_command_with_status_1_after_the_others(tmp_path, monkeypatch, capsys):
    original = trainer_module.Trainer.train

    def train(self, **kwargs):
        if self.out_dir.endswith("broken"):
            raise RuntimeError("loss exploded\n  in line 3 | of the step")
        return original(self, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train", train)
    code, out = run_compare(tmp_path, {"broken": "tiny-falcon", "good": "tiny-transformer"}, "--steps", "2")
    assert code == 1 and "failed: broken" in capsys.readouterr().err
    report = load(out)
    assert report["status"] == {"broken": "failed", "good": "done"} and report["finished"]
    table = compare_report.markdown_table(compare_report.result_rows(report))
    # the error's line end and '|' stay inside its cell: every row has the header's 8 unescaped bars
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 3 and all(line.replace("\\|", "").count("|") == 8 for line in rows)
    assert "| broken | failed: RuntimeError: loss exploded in line 3 \\| of the step |" in table


def test_the_fields_a_scaling_sweep_sets_per_run_are_refused_in_its_set(tmp_path):
    """A --set comes after the sweep's own assignments and wins: train.seed=3 made both noise seeds train
    seed 3 (a spread of 0 in rows saying seeds 0 and 1), train.out_dir one folder for every run."""
    job = dict(model="m", config="c.yaml", gpus=1, strategy="ddp", seed=0)
    sets = scaling.run_sets(job, steps=10, micro_batch=2, global_batch=4, out_dir="o", extra_sets=[])
    assert set(scaling.SWEEP_FIELDS) <= {s.split("=", 1)[0] for s in sets}
    parser = __import__("argparse").ArgumentParser()
    scaling.add_arguments(parser)
    path = recipes(tmp_path, {"a": "tiny-falcon"})[0]
    for field in scaling.SWEEP_FIELDS:
        with pytest.raises(ValueError, match=rf"--set {field}=1: the sweep sets {field} itself"):
            scaling.run(parser.parse_args(["--configs", path, "--set", f"{field}=1", "--out", str(tmp_path / "s"),
                                           "--results", str(tmp_path / "r")]))
    assert not os.path.exists(tmp_path / "s")
