"""Addition task: smoke runs of ``falcon-fwa addition`` / ``addition-compare`` and the summary."""
import contextlib
import importlib.util
import json
import sys

import pytest
import torch

from falcon_fwa.tasks.addition import cli, compare
from falcon_fwa.tasks.addition.lineup import LINEUP, resolve_model
from falcon_fwa.tasks.addition.presets import get_addition_preset

SMALL = ["--preset", "tiny", "--device", "cpu", "--batch-size", "4", "--val-per-width", "2", "--ood-per-width", "2",
         "--train-widths", "1", "3", "--ood-widths", "4", "5", "--threads", "1"]
TWO_STEPS = ["--steps", "2", "--eval-every", "2", "--hidden-size", "16", "--num-hidden-layers", "1", "--num-heads", "2"]


def test_two_step_run_writes_results_and_resumes(tmp_path, monkeypatch, capsys):
    from falcon_fwa.tasks.addition import train

    trained = []  # the optimizer steps each call runs, through the training batches it draws
    original = train.training_batch

    def recording(seed, step, batch_size, min_width, max_width, **kw):
        trained.append(step)
        return original(seed, step, batch_size, min_width, max_width, **kw)

    monkeypatch.setattr(train, "training_batch", recording)
    out = tmp_path / "run"
    assert cli.main(["--model", "Falcon-3A.3", "--steps", "2", "--eval-every", "2", "--out", str(out),
                     "--no-progress", *SMALL]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and res["steps_done"] == 2 and res["model"] == "Falcon-3A.3"
    assert res["operand_order"] == res["preset"]["operand_order"] == "msd"  # the paper's, by default
    assert res["config_fields"] == {"mixer": "falcon", "rule": "3A", "qk_norm": "rmsnorm", "gate": "ctx-eta"}
    assert [h["step"] for h in res["history"]] == [2] and res["best"]["step"] == 2
    assert sorted(res["best"]["per_width"], key=int) == ["1", "2", "3", "4", "5"]
    for key in ("val_acc", "val_digit_acc", "mean_acc_ood", "acc_d4", "acc_d5", "digit_acc_d5"):
        assert 0.0 <= res["best"][key] <= 100.0
    assert (out / "checkpoint.pt").exists() and (out / "best.pt").exists()
    assert (out / "accuracy_vs_width.png").stat().st_size > 0
    # digit accuracy by answer position, kept for the best step only: each width's positions
    # average to its digit accuracy (every sample of width w has w + 1 sum digits)
    per_position = res["best"]["per_position"]
    assert sorted(per_position, key=int) == ["1", "2", "3", "4", "5"]
    for w, acc in per_position.items():
        assert len(acc) == int(w) + 1
        assert sum(acc) / len(acc) == pytest.approx(res["best"]["per_width"][w]["digit"])
    assert all("per_position" not in h for h in res["history"])
    assert (out / "accuracy_by_position.png").stat().st_size > 0
    assert trained == [0, 1] and "resuming" not in capsys.readouterr().out
    # a longer budget on the same folder continues from step 2: it runs only the one remaining step
    trained.clear()
    assert cli.main(["--model", "Falcon-3A.3", "--steps", "3", "--eval-every", "2", "--out", str(out),
                     "--no-progress", *SMALL]) == 0
    assert "resuming Falcon-3A.3 seed 0 at step 2" in capsys.readouterr().out
    assert trained == [2]
    res = json.loads((out / "results.json").read_text())
    assert [h["step"] for h in res["history"]] == [2, 3] and res["steps_done"] == 3


def test_compare_trains_and_writes_the_table(tmp_path):
    # a summary of that name with notes written into it: the lineup replaces it, keeping it whole beside it
    (tmp_path / "res").mkdir()
    earlier = "# an earlier table\n\n## Notes\n\nWhat was tried before, written by hand.\n"
    (tmp_path / "res" / "t.md").write_text(earlier)
    assert compare.main(["--models", "Transformer", "--seeds", "0", "--steps", "2", "--eval-every", "2",
                         "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "res"), "--name", "t",
                         "--hidden-size", "32", "--num-hidden-layers", "1", "--num-heads", "2",
                         "--curriculum-steps", "2", *SMALL]) == 0
    run = json.loads(next((tmp_path / "runs").rglob("results.json")).read_text())
    assert run["size"] == {"hidden_size": 32, "num_hidden_layers": 1, "num_heads": 2,
                           "initializer_range": pytest.approx(32 ** -0.5)}  # the overrides reach the run
    rows = json.loads((tmp_path / "res" / "t.json").read_text())
    assert [r["model"] for r in rows] == ["Transformer"]
    for key in ("model", "mean_acc_4_5", "acc_d4", "acc_d5", "val_acc", "best_step", "seeds"):
        assert key in rows[0]
    assert rows[0]["seeds"] == [0] and rows[0]["best_step"] == 2
    assert run["preset"]["curriculum_steps"] == 2
    assert sorted(run["best"]["per_position"], key=int) == ["1", "2", "3", "4", "5"]  # the runs record it too
    assert "| Transformer |" in (tmp_path / "res" / "t.md").read_text()
    assert "widths growing from 1 to 3 over the first 2 steps" in (tmp_path / "res" / "t.md").read_text()
    assert (tmp_path / "res" / "t.png").exists() and (tmp_path / "res" / "t_meta.json").exists()
    assert (tmp_path / "res" / "t.before.md").read_text() == earlier


def _record_samples(monkeypatch):
    """Make training record what it draws: ``(texts, evaluated)``, filled as it runs with every
    training sample as written and every validation and OOD sample."""
    from falcon_fwa.tasks.addition import train
    from falcon_fwa.tasks.addition.data import decode

    texts = []  # every training sample, as written
    evaluated = []  # every validation and OOD sample
    original, original_sets = train.training_batch, train.width_set

    def recording(*args, **kw):
        batch = original(*args, **kw)
        texts.extend(decode(ids).rstrip("_") for ids in batch.input_ids)
        return batch

    def recording_sets(*args, **kw):
        sets = original_sets(*args, **kw)
        evaluated.extend(s for samples in sets.values() for s in samples)
        return sets

    monkeypatch.setattr(train, "training_batch", recording)
    monkeypatch.setattr(train, "width_set", recording_sets)
    return texts, evaluated


def test_lsd_operand_order_reaches_the_data_and_the_results(tmp_path, monkeypatch):
    from falcon_fwa.tasks.addition.data import check_text

    texts, evaluated = _record_samples(monkeypatch)
    out = tmp_path / "run"
    assert cli.main(["--model", "Transformer", "--steps", "2", "--eval-every", "2", "--operand-order", "lsd",
                     "--out", str(out), "--no-progress", "--hidden-size", "16", "--num-heads", "2", *SMALL]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and res["operand_order"] == res["preset"]["operand_order"] == "lsd"
    assert len(texts) == 2 * 4 and all(check_text(t, "lsd") for t in texts)
    # two-digit (or wider) operands that are not palindromes: read most significant first, the sum is wrong
    assert any(not check_text(t) for t in texts if t.index("+") > 1)
    # the validation and OOD sets are written in the same order (widths 1-3 and 4-5, two samples each)
    assert len(evaluated) == 5 * 2 and all(check_text(s.text, "lsd") for s in evaluated)
    assert any(not check_text(s.text) for s in evaluated)
    with pytest.raises(ValueError, match="operand_order"):  # no resuming in the other order
        cli.main(["--model", "Transformer", "--steps", "3", "--out", str(out), "--no-progress",
                  "--hidden-size", "16", "--num-heads", "2", *SMALL])


def test_compare_passes_the_operand_order_and_states_it(tmp_path):
    cmd = compare._command(_compare_parser().parse_args(["--operand-order", "lsd"]), "Transformer", 0, tmp_path)
    assert cmd[cmd.index("--operand-order") + 1] == "lsd"
    assert "--operand-order" not in compare._command(_compare_parser().parse_args([]), "Transformer", 0, tmp_path)
    rows = compare.summarize({"Falcon-3A.3": [_fake_result(0, 80.0, 100.0, 60.0, 99.0, 1900)]})
    meta = {"preset_name": "paper", "train_widths": [1, 32], "ood_widths": [33, 48], "size": {}, "steps": 2000,
            "batch_size": 128, "lr": 1e-3, "curriculum_steps": 0, "val_per_width": 64, "ood_per_width": 100,
            "seeds": [0], "device": "cpu", "wall_time_s": 1.0, "command": "c", "commit": "x"}
    note = "operands written least significant digit first"
    assert note not in compare.markdown(rows, {**meta, "operand_order": "msd"})
    assert note not in compare.markdown(rows, meta)  # summaries written before the option
    assert note in compare.markdown(rows, {**meta, "operand_order": "lsd"})


def test_compare_rewrite_records_its_own_command_and_the_training_one(tmp_path, monkeypatch):
    args = ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--eval-every", "2", "--runs",
            str(tmp_path / "runs"), "--results", str(tmp_path / "res"), "--name", "t", "--hidden-size", "16",
            "--num-hidden-layers", "1", "--num-heads", "2", *SMALL]
    meta_file, md_file = tmp_path / "res" / "t_meta.json", tmp_path / "res" / "t.md"

    def compare_as_cli(extra):
        monkeypatch.setattr(sys, "argv", ["falcon-fwa", "addition-compare", *args, *extra])
        assert compare.main(args + extra) == 0
        return json.loads(meta_file.read_text())

    trained = compare_as_cli([])
    assert trained["command"] == "falcon-fwa addition-compare " + " ".join(args)
    assert trained["trained_by"] is None and trained["wall_time_s"] is not None
    # a rewrite with another seed list: its own command (not the earlier one) and the training command kept
    rewrite = compare_as_cli(["--no-train", "--seeds", "0", "1"])
    assert rewrite["command"].endswith("--no-train --seeds 0 1") and rewrite["seeds_asked"] == [0, 1]
    assert rewrite["trained_by"] == trained["command"] and rewrite["wall_time_s"] is None
    assert f"the runs were trained by: `{trained['command']}`" in md_file.read_text()
    assert rewrite["failed"] == ["Transformer seed 1 (no run)"]  # the runs' own state, not the earlier list
    assert compare_as_cli(["--no-train"])["trained_by"] == trained["command"]  # kept over rewrites
    res_file = tmp_path / "runs" / "Transformer" / "seed0" / "results.json"
    res = json.loads(res_file.read_text())
    res_file.write_text(json.dumps({**res, "finished": False, "steps_done": 1}))  # as a run cut short
    assert compare_as_cli(["--no-train", "--partial"])["failed"] == ["Transformer seed 0 (unfinished: 1 of 2 steps)"]
    res_file.write_text(json.dumps(res))
    # a summary that trained: nothing to keep
    assert compare_as_cli(["--seeds", "1"])["trained_by"] is None


def test_compare_refuses_runs_of_the_other_operand_order(tmp_path):
    args = ["--models", "Transformer", "--seeds", "0", "--steps", "2", "--eval-every", "2", "--runs",
            str(tmp_path / "runs"), "--results", str(tmp_path / "res"), "--name", "t", "--hidden-size", "16",
            "--num-hidden-layers", "1", "--num-heads", "2", *SMALL]
    assert compare.main(args + ["--operand-order", "lsd"]) == 0
    assert json.loads((tmp_path / "res" / "t_meta.json").read_text())["operand_order"] == "lsd"
    # the finished lsd run must not be skipped as done, nor tabled, under the paper's order
    for extra in ([], ["--no-train"]):
        with pytest.raises(ValueError, match="operand_order"):
            compare.main(args + extra)
    # a folder from before the option holds the paper's order
    old = tmp_path / "old" / "Transformer" / "seed0"
    old.mkdir(parents=True)
    (old / "results.json").write_text(json.dumps({"finished": True}))
    paper = {"operand_order": "msd", "base": 10, "abacus_offset": None}
    compare.check_runs_task(tmp_path / "old", ["Transformer"], [0], paper)
    with pytest.raises(ValueError, match="operand_order"):
        compare.check_runs_task(tmp_path / "old", ["Transformer"], [0], {**paper, "operand_order": "lsd"})
    with pytest.raises(ValueError, match="base"):  # and the decimal base
        compare.check_runs_task(tmp_path / "old", ["Transformer"], [0], {**paper, "base": 2})
    with pytest.raises(ValueError, match="abacus_offset"):  # and no digit positions
        compare.check_runs_task(tmp_path / "old", ["Transformer"], [0], {**paper, "abacus_offset": 4})


def test_base_reaches_the_data_the_results_and_the_default_names(tmp_path, monkeypatch):
    from falcon_fwa.tasks.addition.data import check_text

    texts, evaluated = _record_samples(monkeypatch)
    monkeypatch.chdir(tmp_path)  # the default folders are relative
    budget = [*TWO_STEPS, "--base", "2", *SMALL]
    assert cli.main(["--model", "Transformer", "--no-progress", *budget]) == 0
    run_dir = tmp_path / "runs/addition/tiny-base2/Transformer/seed0"  # the default folder names the base
    res = json.loads((run_dir / "results.json").read_text())
    assert res["finished"] and res["base"] == res["preset"]["base"] == 2 and res["operand_order"] == "msd"
    assert len(texts) == 2 * 4 and all(check_text(t, base=2) for t in texts)
    assert all(set(t.split("=")[0]) <= set("01+") for t in texts)  # binary digits only
    assert len(evaluated) == 5 * 2 and all(s.base == 2 and check_text(s.text, base=2) for s in evaluated)
    with pytest.raises(ValueError, match="base"):  # no resuming in decimal
        cli.main(["--model", "Transformer", "--steps", "3", "--out", str(run_dir), "--no-progress",
                  "--hidden-size", "16", "--num-heads", "2", *SMALL])
    # the comparison finds the finished run under the same default folder, trains nothing and names the
    # summary after the base
    assert compare.main(["--models", "Transformer", "--seeds", "0", *budget]) == 0
    assert len(texts) == 2 * 4  # nothing was trained again
    meta = json.loads((tmp_path / "results/addition/tiny_base2_meta.json").read_text())
    assert meta["base"] == 2 and meta["operand_order"] == "msd"
    # the scale is scored on the runs' own OOD samples (eval seed, OOD widths 4-5, two per width, binary)
    from falcon_fwa.tasks.addition.data import width_set
    from falcon_fwa.tasks.addition.reference import reference_scores

    ood = [x for v in width_set(1234, range(4, 6), 2, base=2).values() for x in v]
    assert meta["eval_seed"] == 1234 and meta["reference"] == reference_scores(ood)  # the same samples
    assert meta["reference"]["uniform"]["digit"] == 50.0
    # a summary that trained nothing has no wall time of its own: it gives the runs' instead
    run_wall = res["wall_time_s"]
    assert meta["wall_time_s"] is None
    assert f"wall time of each run: {run_wall:.0f}-{run_wall:.0f} s" in \
        (tmp_path / "results/addition/tiny_base2.md").read_text()
    assert "numbers in base 2 (uniform guessing scores 50 % of the digits)" in \
        (tmp_path / "results/addition/tiny_base2.md").read_text()
    assert "| carry from the 2 places below |" in (tmp_path / "results/addition/tiny_base2.md").read_text()
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "results/addition/tiny_base2_positions.png").stat().st_size > 0
    cmd = compare._command(_compare_parser().parse_args(["--base", "2"]), "Transformer", 0, tmp_path)
    assert cmd[cmd.index("--base") + 1] == "2"
    assert compare.task_suffixes({"operand_order": "lsd", "base": 3}) == ["lsd", "base3"]
    assert compare.task_suffixes({"operand_order": "msd", "base": 10}) == []
    assert compare.task_suffixes({"operand_order": "msd", "base": 10, "abacus_offset": 0}) == ["abacus0"]


def _compare_parser():
    p = compare.argparse.ArgumentParser()
    compare.add_arguments(p)
    return p


def _fake_result(seed, mean_ood, d33, d48, val, step):
    per_width = {str(w): {"digit": 90.0, "exact": 80.0} for w in range(1, 49)}
    best = {"step": step, "val_acc": val, "val_digit_acc": 99.0, "mean_acc_ood": mean_ood, "acc_d33": d33,
            "acc_d48": d48, "digit_mean_acc_ood": 95.0, "digit_acc_d33": 99.0, "digit_acc_d48": 90.0,
            "per_width": per_width}
    return {"seed": seed, "best": best, "wall_time_s": 1.0, "steps_done": 2000, "preset": {"ood_widths": [33, 48]},
            "config_fields": {"mixer": "falcon"}, "parameters": 10}


def test_summary_means_and_spreads_over_seeds():
    rows = compare.summarize({"Falcon-3A.3": [_fake_result(0, 80.0, 100.0, 60.0, 99.0, 1900),
                                              _fake_result(1, 90.0, 100.0, 70.0, 100.0, 2000)]})
    r = rows[0]
    assert r["model"] == "Falcon-3A.3" and r["seeds"] == [0, 1]
    assert r["mean_acc_33_48"] == 85.0 and r["mean_acc_33_48_std"] == pytest.approx(7.07, abs=0.01)
    assert r["acc_d33"] == 100.0 and r["acc_d48"] == 65.0 and r["val_acc"] == 99.5 and r["best_step"] == 1950
    assert r["paper"]["mean_acc_33_48"] == 87.2 and r["steps_done"] == [2000, 2000]
    meta = {"preset_name": "paper", "train_widths": [1, 32], "ood_widths": [33, 48], "size": {}, "steps": 2000,
            "batch_size": 128, "lr": 1e-3, "val_per_width": 64, "ood_per_width": 100, "seeds": [0, 1],
            "device": "cpu", "wall_time_s": 12.0, "command": "c", "commit": "x"}
    table = compare.markdown(rows, meta)
    assert "| 85.0 ± 7.1 | 100.0/65.0 | 95.0 ± 0.0 / 99.0 / 90.0 |" in table  # both means carry the spread
    assert "wall time of the comparison: 12 s" in table
    # the verdict against the paper's 87.2 under both readings of its accuracy
    assert "Falcon-3A.3 mean exact-match accuracy 85.0 vs the paper's 87.2: short by 2.2 points (-2.2)." in table
    assert "Falcon-3A.3 mean per-digit accuracy 95.0 vs the paper's 87.2: target met (+7.8)." in table
    # other widths (the tiny preset's 1-5 and 6-8) are not set against the paper's widths 33-48
    tiny = "\n".join(compare._verdict(rows, "mean_acc_33_48", paper_widths=False))
    assert "vs the paper's" not in tiny and "this run has other widths" in tiny


def test_lineup_names_map_to_the_paper_variants():
    assert resolve_model("Falcon-1A.1") == {"mixer": "falcon", "rule": "1A", "qk_norm": "l2", "gate": "ctx-beta"}
    assert resolve_model("Falcon-1.3")["rule"] == "1"
    assert resolve_model("falcon", {"rule": "3A", "window": None}) == {"mixer": "falcon", "rule": "3A"}
    assert len(LINEUP) == 8
    with pytest.raises(ValueError, match="model"):
        resolve_model("Falcon-9")
    with pytest.raises(ValueError, match="train_widths"):
        get_addition_preset("tiny").replace(train_widths=(5, 2))
    with pytest.raises(ValueError, match="matmul_precision"):
        get_addition_preset("paper").replace(matmul_precision="tf32")
    with pytest.raises(ValueError, match="operand_order"):
        get_addition_preset("paper").replace(operand_order="reversed")
    with pytest.raises(ValueError, match="preset field base"):
        get_addition_preset("paper").replace(base=16)
    assert get_addition_preset("paper").matmul_precision == "high"  # TF32 products on the GPU
    assert get_addition_preset("tiny").matmul_precision == "highest"
    with pytest.raises(ValueError, match="num_heads"):
        get_addition_preset("paper").replace(num_heads=3)
    wide = get_addition_preset("paper").replace(hidden_size=512, num_heads=8)
    assert wide.size()["initializer_range"] == pytest.approx(512 ** -0.5)  # the init scale follows the width


@pytest.mark.parametrize("name", ["tiny", "paper"])
def test_presets_initialize_at_the_fan_in_scale(name):
    """Every model of a preset gets init std 1/sqrt(hidden_size), not the language-model default 0.02."""
    import torch

    from falcon_fwa.tasks.addition.data import VOCAB
    from falcon_fwa.tasks.addition.lineup import build_model

    preset = get_addition_preset(name)
    want = preset.hidden_size ** -0.5
    for model_name in ("Transformer", "Falcon-3A.3"):
        torch.manual_seed(0)
        model = build_model(resolve_model(model_name), preset.size(), vocab_size=len(VOCAB))
        assert model.config.initializer_range == pytest.approx(want)
        q = model.model.layers[0].mixer.q_proj.weight.detach()  # a hidden matrix of fan-in hidden_size
        assert float(q.std()) == pytest.approx(want, rel=0.1)
        assert float(model.model.embed_tokens.weight.detach().std()) == pytest.approx(want, rel=0.15)


def test_curriculum_schedule_by_hand():
    """max width = lo + ceil((hi - lo) * min(1, (step + 1) / curriculum_steps)); 0 steps = no curriculum."""
    p = get_addition_preset("tiny").replace(train_widths=(1, 5), curriculum_steps=4)
    assert [p.max_train_width(s) for s in range(6)] == [2, 3, 4, 5, 5, 5]
    wide = p.replace(curriculum_steps=10, train_widths=(1, 32), ood_widths=(33, 48))
    assert [wide.max_train_width(s) for s in (0, 4, 9)] == [5, 17, 32]
    assert {get_addition_preset("paper").max_train_width(s) for s in (0, 1999)} == {32}  # the paper: no curriculum
    with pytest.raises(ValueError, match="curriculum_steps"):
        p.replace(curriculum_steps=-1)


def test_training_draws_widths_under_the_curriculum(tmp_path, monkeypatch):
    from falcon_fwa.tasks.addition import train

    drawn = []
    original = train.training_batch

    def recording(seed, step, batch_size, min_width, max_width, **kw):
        batch = original(seed, step, batch_size, min_width, max_width, **kw)
        drawn.append((step, min_width, max_width, int(batch.widths.max())))
        return batch

    monkeypatch.setattr(train, "training_batch", recording)
    small = list(SMALL)
    small[small.index("--train-widths") + 2] = "7"
    small[small.index("--ood-widths") + 1: small.index("--ood-widths") + 3] = ["8", "9"]
    assert cli.main(["--model", "Transformer", "--steps", "3", "--eval-every", "3", "--curriculum-steps", "3",
                     "--out", str(tmp_path / "run"), "--no-progress", "--hidden-size", "16", "--num-heads", "2",
                     *small]) == 0
    assert [d[:3] for d in drawn] == [(0, 1, 3), (1, 1, 5), (2, 1, 7)]
    assert all(widest <= top for _, _, top, widest in drawn)


def test_validation_loss_sees_the_training_widths_only():
    """A stub that knows the next token on widths <= 2 (logit 3 on it) and is uniform on wider
    sums: the loss per suffix token is log(1 + (V - 1) e^-3) on the validation widths and log V
    on the OOD ones, by hand; mixing the two would give neither."""
    import math
    from types import SimpleNamespace

    import torch

    from falcon_fwa.tasks.addition import train
    from falcon_fwa.tasks.addition.data import VOCAB

    V = len(VOCAB)

    class Stub(torch.nn.Module):
        def forward(self, input_ids):
            B, T = input_ids.shape
            logits = torch.zeros(B, T, V)
            if T <= 3 * 2 + 4:  # widths 1-2
                logits[:, :-1] = 3.0 * torch.nn.functional.one_hot(input_ids[:, 1:], V)
            return SimpleNamespace(logits=logits)

    batches = train.eval_batches(0, range(1, 3), 5, 4)
    batches.update(train.eval_batches(0, range(6, 8), 5, 4))
    tally, losses = train.evaluate(Stub(), batches, torch.device("cpu"), contextlib.nullcontext)
    assert train.mean_loss(losses, range(1, 3)) == pytest.approx(math.log(1 + (V - 1) * math.exp(-3.0)))
    assert train.mean_loss(losses, range(6, 8)) == pytest.approx(math.log(V))
    assert tally.exact_acc(range(1, 3)) == 100.0


def test_summary_reports_each_accuracy_by_hand():
    """Validation widths 1-2, OOD widths 3-4; hits per sample (of w + 1 digits) chosen so that
    exact and digit accuracy, validation and OOD, pooled and per-width means all differ."""
    from falcon_fwa.tasks.addition import train
    from falcon_fwa.tasks.addition.metrics import AccuracyTally

    tally = AccuracyTally()
    rows = {1: [[1, 1], [1, 0]],  # 2/2 and 1/2 digits right: exact 1/2, digit 3/4
            2: [[1, 1, 1]],  # exact 1/1, digit 3/3
            3: [[1, 1, 1, 1]] + [[0, 0, 0, 1]] * 3,  # exact 1/4, digit 7/16
            4: [[1] * 5, [1, 0, 0, 0, 0]]}  # exact 1/2, digit 6/10
    for w, hits in rows.items():
        hits = torch.tensor(hits)
        tally.add(torch.full((len(hits),), w), hits.sum(1), torch.full((len(hits),), w + 1), positions=hits)
    s = train._summary(tally, range(1, 3), range(3, 5))
    assert s.pop("per_width") == {"1": {"exact": 50.0, "digit": 75.0}, "2": {"exact": 100.0, "digit": 100.0},
                                  "3": {"exact": 25.0, "digit": 43.75}, "4": {"exact": 50.0, "digit": 60.0}}
    assert s.pop("per_position") == {"1": [100.0, 50.0], "2": [100.0] * 3, "3": [25.0, 25.0, 25.0, 100.0],
                                     "4": [100.0, 50.0, 50.0, 50.0, 50.0]}
    assert s == pytest.approx({
        "val_acc": 100 * 2 / 3,  # pooled over the 3 validation samples (the mean of widths would be 75)
        "val_digit_acc": 100 * 6 / 7,  # pooled over their 7 digits
        "mean_acc_ood": (25.0 + 50.0) / 2,  # mean of the OOD widths (pooled would be 2/6)
        "digit_mean_acc_ood": (43.75 + 60.0) / 2,
        "acc_d3": 25.0, "acc_d4": 50.0, "digit_acc_d3": 43.75, "digit_acc_d4": 60.0,
    })


def test_best_step_prefers_val_acc_then_digit_acc_then_lower_loss():
    from falcon_fwa.tasks.addition.train import _better

    base = {"val_acc": 50.0, "val_digit_acc": 80.0, "val_loss": 1.0}
    for better in ({"val_acc": 60.0, "val_digit_acc": 70.0, "val_loss": 2.0},  # exact match first
                   {"val_acc": 50.0, "val_digit_acc": 90.0, "val_loss": 2.0},  # then digit accuracy
                   {"val_acc": 50.0, "val_digit_acc": 80.0, "val_loss": 0.5}):  # then the lower loss
        assert _better(better, base) and not _better(base, better), better
    assert not _better(dict(base), base)  # a full tie keeps the earlier step
    assert _better(base, None)


def test_best_pt_holds_the_best_validation_step(tmp_path, monkeypatch):
    """Four evaluations with scripted validation accuracies: by hand the best is step 3 (ties step 2
    on exact match, more digits right), not the last one nor the one with the highest digit accuracy."""
    from falcon_fwa.tasks.addition import train

    script = iter([(10.0, 95.0), (30.0, 60.0), (30.0, 70.0), (20.0, 90.0)])  # (val_acc, val_digit_acc)
    original = train._summary

    def scripted(*args):
        val_acc, val_digit_acc = next(script)
        return {**original(*args), "val_acc": val_acc, "val_digit_acc": val_digit_acc}

    monkeypatch.setattr(train, "_summary", scripted)
    out = tmp_path / "run"
    assert cli.main(["--model", "Transformer", "--steps", "4", "--eval-every", "1", "--out", str(out),
                     "--no-progress", "--hidden-size", "16", "--num-hidden-layers", "1", "--num-heads", "2",
                     *SMALL]) == 0
    res = json.loads((out / "results.json").read_text())
    assert [h["step"] for h in res["history"]] == [1, 2, 3, 4]
    assert res["best"]["step"] == 3 and res["best"]["val_digit_acc"] == 70.0
    assert torch.load(out / "best.pt", weights_only=False)["step"] == 3


def test_position_curves_average_seeds_and_skip_runs_without_positions(tmp_path, capsys):
    from falcon_fwa.tasks.addition.plot import plot_lineup_positions, position_curve

    def run(per):
        return {"preset": {"train_widths": [1, 2], "base": 2}, "best": {"step": 1, "per_position": per}}

    a, b = run({"2": [100.0, 50.0, 0.0]}), run({"2": [50.0, 50.0, 100.0]})
    assert position_curve([a, b], 2) == [75.0, 50.0, 50.0]
    assert position_curve([a, b], 3) is None  # a width no run recorded
    assert position_curve([a, run({})], 2) is None  # a run from before positions were recorded
    # nothing to draw at all: no file, and it says so
    assert plot_lineup_positions({"m": [run({})]}, tmp_path / "p.png", widths=[2]) is None
    assert "no position plot" in capsys.readouterr().out and not (tmp_path / "p.png").exists()
    if importlib.util.find_spec("matplotlib"):
        assert plot_lineup_positions({"m": [a, b]}, tmp_path / "p.png", widths=[2, 3]).stat().st_size > 0


def test_position_heat_map_places_rows_by_width(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    import numpy as np

    from falcon_fwa.tasks.addition.plot import plot_accuracy_by_position

    # training widths 1-2, OOD widths 5-6 (a gap): width 1 all right, width 6 all wrong, the rest half
    per = {"1": [100.0, 100.0], "2": [50.0] * 3, "5": [50.0] * 6, "6": [0.0] * 7}
    result = {"model": "m", "preset": {"train_widths": [1, 2]}, "best": {"step": 4, "per_position": per}}
    captured = {}
    original = plt.Axes.imshow

    def spy(self, X, *args, **kwargs):
        captured["grid"], captured["extent"] = X, kwargs.get("extent")
        return original(self, X, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "imshow", spy)
    path = plot_accuracy_by_position(result, tmp_path / "h.png")
    assert path is not None and path.stat().st_size > 0
    # one row per width from 1 to 6, blank rows for the absent widths 3 and 4
    grid = captured["grid"]
    assert grid.shape == (6, 7) and captured["extent"][2:] == (0.5, 6.5)
    assert list(grid[0, :2]) == [100.0, 100.0] and list(grid[5]) == [0.0] * 7
    assert np.isnan(grid[2]).all() and np.isnan(grid[3]).all() and np.isnan(grid[0, 2:]).all()
    # a run recorded before per_position existed: no heat map, and it says so
    old = {"model": "m", "preset": {"train_widths": [1, 2]}, "best": {"step": 4, "per_width": {}}}
    assert plot_accuracy_by_position(old, tmp_path / "h3.png") is None
    assert "no heat map" in capsys.readouterr().out and not (tmp_path / "h3.png").exists()


def test_compare_continues_runs_of_a_shorter_budget_and_refuses_another_size(tmp_path):
    args = ["--models", "Transformer", "--seeds", "0", "--eval-every", "2", "--runs", str(tmp_path / "runs"),
            "--results", str(tmp_path / "res"), "--name", "t", "--hidden-size", "16", "--num-hidden-layers", "1",
            "--num-heads", "2", *SMALL]
    assert compare.main(args + ["--steps", "2"]) == 0
    # a longer budget: the finished 2-step run is continued to 4 steps, not tabled as a 4-step run
    assert compare.main(args + ["--steps", "4"]) == 0
    meta = json.loads((tmp_path / "res" / "t_meta.json").read_text())
    rows = json.loads((tmp_path / "res" / "t.json").read_text())
    assert meta["steps"] == 4 and rows[0]["steps_done"] == [4]
    # another model size (or eval set): the runs in --runs are not those of this command
    for extra, option in ((["--hidden-size", "32"], "--hidden-size"), (["--val-per-width", "3"], "--val-per-width")):
        with pytest.raises(ValueError, match=f"^{option}: "):
            compare.main(args + ["--steps", "4", *extra])


def test_resume_refuses_another_evaluation_set(tmp_path):
    out = tmp_path / "run"
    base = ["--model", "Transformer", "--eval-every", "2", "--out", str(out), "--no-progress", "--hidden-size", "16",
            "--num-hidden-layers", "1", "--num-heads", "2", *SMALL]
    assert cli.main(base + ["--steps", "2"]) == 0
    for extra, option in ((["--ood-widths", "4", "6"], "--ood-widths"), (["--eval-seed", "7"], "--eval-seed"),
                          (["--batch-size", "8"], "--batch-size"), (["--seed", "5"], "--seed"),
                          (["--dtype", "bfloat16"], "--dtype")):
        with pytest.raises(ValueError, match=f"^{option}: "):
            cli.main(base + ["--steps", "4", *extra])
    assert json.loads((out / "results.json").read_text())["steps_done"] == 2


def test_a_finished_run_launched_again_keeps_its_wall_time(tmp_path):
    out = tmp_path / "run"
    argv = ["--model", "Transformer", "--steps", "2", "--eval-every", "2", "--out", str(out), "--no-progress",
            "--hidden-size", "16", "--num-hidden-layers", "1", "--num-heads", "2", *SMALL]
    assert cli.main(argv) == 0
    first = json.loads((out / "results.json").read_text())
    assert first["wall_time_s"] > 0
    assert cli.main(argv) == 0
    again = json.loads((out / "results.json").read_text())
    assert again["wall_time_s"] == first["wall_time_s"] and again["history"] == first["history"]


def test_a_run_records_the_commit_of_its_code_wherever_it_is_started(tmp_path, monkeypatch):
    # the commit is that of the checkout the package runs from, not of the working directory
    import pathlib
    import subprocess

    import falcon_fwa

    root = pathlib.Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    except OSError:
        head = ""
    if not head or pathlib.Path(falcon_fwa.__file__).resolve().parent != root / "src" / "falcon_fwa":
        pytest.skip("the package is not imported from a git checkout")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not a git checkout
    out = tmp_path / "run"
    assert cli.main(["--model", "Falcon-1A.3", "--steps", "1", "--eval-every", "1", "--out", str(out),
                     "--no-progress", *SMALL, "--hidden-size", "16", "--num-hidden-layers", "1"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["commit"] == head
    # the metric note names the key results.json holds and this run's own OOD widths
    assert "best.mean_acc_ood = mean over widths 4..5" in res["metric"] and "mean_acc_ood" in res["best"]


@pytest.mark.parametrize("option", [["--rule", "2"], ["--window", "8"], ["--qk-norm", "l2"], ["--gate", "ctx-beta"],
                                    ["--lambda-scale", "0"]])
def test_fast_weight_options_are_refused_for_the_transformer(tmp_path, option):
    # the Transformer has no update rule: the option would be recorded in results.json but change nothing
    with pytest.raises(ValueError, match=f"^{option[0]}: model 'Transformer'"):
        cli.main(["--model", "Transformer", *option, "--steps", "1", "--out", str(tmp_path / "run"), *SMALL])
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv,message", [
    (["--model", "Falcon-1A.3", "--rule", "3"], r"^--rule 3: Falcon-1A\.3 is defined with rule 1A; .*--model falcon"),
    (["--model", "Falcon-3A.3", "--qk-norm", "l2"], r"^--qk-norm l2: Falcon-3A\.3 is defined with qk_norm rmsnorm"),
    (["--model", "Falcon-1A.3", "--lambda-scale", "0"],
     r"^--lambda-scale 0\.0: Falcon-1A\.3 is defined with lambda_scale 1\.0; .*--model falcon --lambda-scale 0\.0"),
    (["--model", "falcon", "--lambda-scale", "-0.5"], r"^--lambda-scale must be >= 0, got -0\.5"),
    (["--model", "falcon", "--lambda-scale", "nan"], r"^--lambda-scale must be a finite number >= 0, got nan"),
    (["--model", "falcon", "--lambda-scale", "inf"], r"^--lambda-scale must be a finite number >= 0, got inf"),
    (["--model", "Falcon-1A.3", "--window", "4"], r"^--window 4: model 'Falcon-1A\.3' \(rule 1A\) has no window"),
    (["--model", "falcon", "--rule", "2", "--window", "4"], r"^--window 4: model 'falcon' \(rule 2\) has no window"),
    (["--ood-widths", "3", "8"], r"^--train-widths 1 3 and --ood-widths 3 8: the training widths 1-3 and the "
                                 r"out-of-distribution widths 3-8 overlap"),
])
def test_a_run_is_what_it_is_named(tmp_path, argv, message):
    """A paper name trained with another rule would be recorded and plotted under that name; a window
    on a rule without one, or OOD widths among the training widths, would change nothing they say."""
    with pytest.raises(ValueError, match=message):
        cli.main(["--steps", "1", "--out", str(tmp_path / "run"), *SMALL, *argv])  # (argv's options last: they win)
    assert not (tmp_path / "run").exists()
    # the same rule spelt otherwise is the paper's model
    assert cli.main(["--model", "Falcon-3A.3", "--rule", "3a", "--steps", "1", "--eval-every", "1",
                     "--out", str(tmp_path / "ok"), "--no-progress", "--hidden-size", "16",
                     "--num-hidden-layers", "1", *SMALL]) == 0


def test_digit_positions_add_nothing_at_index_zero_and_train_with_the_embedding():
    from falcon_fwa.tasks.addition.lineup import DigitPositions, build_model, resolve_model
    torch.manual_seed(0)
    lm = build_model(resolve_model("Falcon-3A.3"), {"hidden_size": 16, "num_hidden_layers": 1, "num_heads": 2},
                     vocab_size=16)
    model = DigitPositions(lm, 8)
    ids = torch.randint(0, 16, (2, 9))
    index = torch.randint(1, 8, (2, 9))
    # the table starts at zero: the model starts as the LM on the tokens alone, at any index
    assert torch.allclose(model(ids, index).logits, lm(ids).logits, atol=1e-6)
    with torch.no_grad():
        model.index_embed.weight[1:].normal_()
    zero = torch.zeros_like(ids)
    assert torch.allclose(model(ids, zero).logits, lm(ids).logits, atol=1e-6)  # index 0 adds nothing
    out = model(ids, index).logits
    assert not torch.allclose(out, lm(ids).logits)
    out.square().sum().backward()
    g = model.index_embed.weight.grad
    assert g[0].abs().max() == 0 and g[1:].abs().max() > 0  # the padding row is never trained
    groups = model.param_groups(1e-3, 0.1)
    emb = next(gr for gr in groups if gr["name"] == "embedding")
    assert any(p is model.index_embed.weight for p in emb["params"])
    counted = [p for gr in groups for p in gr["params"]]
    assert len(counted) == len({id(p) for p in counted}) == len(list(model.parameters()))


def test_abacus_offset_reaches_the_model_the_results_and_the_default_names(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default folders are relative
    budget = [*TWO_STEPS, "--abacus-offset", "3", *SMALL]
    assert cli.main(["--model", "Falcon-1A.3", "--no-progress", *budget]) == 0
    run_dir = tmp_path / "runs/addition/tiny-abacus3/Falcon-1A.3/seed0"  # the default folder names the option
    res = json.loads((run_dir / "results.json").read_text())
    assert res["finished"] and res["abacus_offset"] == res["preset"]["abacus_offset"] == 3
    state = torch.load(run_dir / "best.pt", weights_only=False)["model"]
    # places up to the longest answer: training widths up to 3 plus the offset 3, OOD widths up to 5
    assert state["index_embed.weight"].shape == (3 + 3 + 1 + 1, 16)
    with pytest.raises(ValueError, match="abacus_offset"):  # no resuming without the digit positions
        cli.main(["--model", "Falcon-1A.3", "--steps", "3", "--out", str(run_dir), "--no-progress",
                  "--hidden-size", "16", "--num-hidden-layers", "1", "--num-heads", "2", *SMALL])
    with pytest.raises(ValueError, match="^--abacus-offset must be >= 0, got -1$"):  # named as typed
        cli.main(["--model", "Falcon-1A.3", "--no-progress", *TWO_STEPS, "--abacus-offset", "-1", *SMALL])


def test_lambda_scale_zero_trains_the_mixer_without_its_ridge(tmp_path):
    """``--model falcon --rule 3A --lambda-scale 0``: the run records the field and its model has no ridge
    projection (no decay); a restatement of Falcon-3A.3's own value (1) is that paper model, with the ridge."""
    runs = {}
    for name, argv in (("no_ridge", ["--model", "falcon", "--rule", "3A", "--lambda-scale", "0"]),
                       ("paper", ["--model", "Falcon-3A.3", "--lambda-scale", "1"])):
        out = tmp_path / name
        assert cli.main([*argv, "--no-progress", "--out", str(out), *TWO_STEPS, *SMALL]) == 0
        res = json.loads((out / "results.json").read_text())
        runs[name] = (res, torch.load(out / "best.pt", weights_only=False)["model"])
    (res, state), (paper_res, paper_state) = runs["no_ridge"], runs["paper"]
    assert res["model"] == "falcon" and res["config_fields"] == {"mixer": "falcon", "rule": "3A", "lambda_scale": 0.0}
    assert paper_res["model"] == "Falcon-3A.3" and "lambda_scale" not in paper_res["config_fields"]
    ridge = {k for k in paper_state if "lam_" in k}
    assert ridge and not any("lam_" in k for k in state) and set(state) == set(paper_state) - ridge


@pytest.mark.parametrize("argv,message", [
    # a baseline's paper name is that model: a rule, norm or gate would train another one under its name
    (["--model", "Mamba-2", "--rule", "2"], r"^--rule 2: Mamba-2 is defined with rule 1A; .*\(--model mamba2 --rule 2\)"),
    (["--model", "RetNet", "--gate", "ctx-beta"], r"^--gate ctx-beta: RetNet is defined with gate one; .*--model retnet"),
    (["--model", "Mamba-2", "--qk-norm", "rmsnorm"], r"^--qk-norm rmsnorm: Mamba-2 is defined with qk_norm none"),
    (["--model", "Falcon-3A.3", "--window", "8"], r"^--window 8: Falcon-3A\.3 is defined with window 4"),
    # a window on a mixer whose rule has none: the message names the model, not a rule it never chose
    (["--model", "mamba2", "--window", "4"], r"^--window 4: model 'mamba2' \(rule 1A\) has no window"),
    (["--model", "RetNet", "--window", "4"], r"^--window 4: model 'RetNet' \(rule 1A\) has no window"),
])
def test_a_paper_name_refuses_options_that_change_its_model(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        cli.main(["--steps", "1", "--out", str(tmp_path / "run"), "--no-progress", *SMALL, *argv])
    assert not (tmp_path / "run").exists()


def test_options_that_restate_a_paper_model_are_taken():
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    for argv in (["--model", "Falcon-3A.3", "--window", "4"], ["--model", "Falcon-1A.1", "--gate", "ctx-beta"],
                 ["--model", "RetNet", "--rule", "1a"], ["--model", "mamba2", "--rule", "2"]):  # a mixer takes any
        fields = cli.model_fields(parser.parse_args(argv))
        assert fields["mixer"] == resolve_model(argv[1])["mixer"], argv


def test_lr_must_be_finite(tmp_path):
    for value in ("inf", "nan", "-inf"):
        with pytest.raises(ValueError, match="^--lr must be a finite number > 0, got "):
            cli.main([f"--lr={value}", "--steps", "1", "--out", str(tmp_path / "run"), *SMALL])
        with pytest.raises(ValueError, match="^--lr must be a finite number > 0, got "):
            compare.main([f"--lr={value}", "--no-train", "--runs", str(tmp_path / "runs"), "--results",
                          str(tmp_path / "res"), *SMALL])
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="'lr' > 0"):  # the preset itself, for the Python API
        get_addition_preset("tiny").replace(lr=float("inf"))


@pytest.mark.parametrize("argv,message", [
    (["--jobs", "0"], r"^--jobs must be >= 1, got 0$"),  # nothing would ever start: a hang
    (["--jobs", "-2"], r"^--jobs must be >= 1, got -2$"),
    (["--deadline", "-5"], r"^--deadline must be > 0, got -5\.0$"),
    (["--deadline", "0"], r"^--deadline must be > 0, got 0\.0$"),
    (["--deadline", "nan"], r"^--deadline must be a finite number > 0, got nan$"),
    (["--models", "Transformer", "Mamba-2", "Transformer"], r"^--models: Transformer is given more than once"),
    (["--seeds", "0", "1", "0"], r"^--seeds: 0 is given more than once"),  # one run trained twice, counted twice
])
def test_compare_refuses_bad_jobs_deadline_and_repeated_runs(tmp_path, capsys, argv, message):
    from falcon_fwa import cli as top

    # --no-train on an empty --runs: without the check the command would only find nothing to summarize
    base = ["--no-train", "--models", "Transformer", "--runs", str(tmp_path / "runs"), "--results", str(tmp_path / "res"),
            *SMALL]
    with pytest.raises(ValueError, match=message):
        compare.main([*base, *argv])
    assert top.main(["addition-compare", *base, *argv]) == 2  # a one-line error, exit status 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa addition-compare: error: " + argv[0]) and not (tmp_path / "res").exists()


@pytest.mark.parametrize("argv,message", [
    (["--train-widths", "5", "1"], r"^--train-widths 5 1: give LO HI with 1 <= LO <= HI$"),
    (["--train-widths", "0", "3"], r"^--train-widths 0 3: give LO HI with 1 <= LO <= HI$"),
    (["--ood-widths", "9", "7"], r"^--ood-widths 9 7: give LO HI with 1 <= LO <= HI$"),
    # against the tiny preset's training widths 1-5 and out-of-distribution widths 6-8
    (["--ood-widths", "3", "9"], r"^--ood-widths 3 9: the training widths 1-5 and the out-of-distribution widths "
                                 r"3-9 overlap"),
    (["--train-widths", "1", "7"], r"^--train-widths 1 7: the training widths 1-7 and the out-of-distribution "
                                   r"widths 6-8 overlap"),
    (["--train-widths", "2", "4", "--ood-widths", "1", "2"], r"^--train-widths 2 4 and --ood-widths 1 2: "),
    (["--num-heads", "3"], r"^--num-heads 3: the width 64 is not a multiple of the number of heads 3$"),
    (["--hidden-size", "65"], r"^--hidden-size 65: the width 65 is not a multiple of the number of heads 2$"),
    (["--hidden-size", "30", "--num-heads", "4"], r"^--hidden-size 30 and --num-heads 4: the width 30 "),
])
def test_widths_and_heads_at_odds_are_refused_naming_the_options(tmp_path, argv, message):
    """Ranges and sizes that only the preset could check were refused naming its fields ('preset field
    train_widths', 'hidden_size'); both commands name the options given, the preset's value standing in
    for one left out, before anything is written."""
    base = ["--preset", "tiny", "--device", "cpu", "--steps", "1"]
    with pytest.raises(ValueError, match=message):
        cli.main([*base, "--out", str(tmp_path / "run"), *argv])
    with pytest.raises(ValueError, match=message):
        compare.main([*base, "--no-train", "--models", "Transformer", "--runs", str(tmp_path / "runs"),
                      "--results", str(tmp_path / "res"), *argv])
    assert not any(tmp_path.iterdir())
    ok = ["--train-widths", "2", "4", "--ood-widths", "5", "5", "--hidden-size", "48", "--num-heads", "3"]
    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    preset = cli.preset_from_args(parser.parse_args(["--preset", "tiny", *ok]))
    assert (preset.train_widths, preset.ood_widths, preset.hidden_size, preset.num_heads) == ((2, 4), (5, 5), 48, 3)
