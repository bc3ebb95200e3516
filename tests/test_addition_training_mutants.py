"""Addition training and comparison, by hand: the suffix loss and a training step against float64
references, the token weighting of the evaluation losses, the OOD summary over more than two widths, a
run's evaluation entries and best.pt, the presets against the paper, the lineup's Table 3, the summary
table's columns and seeds, the width plot's means and the reference rule's exact score."""
import contextlib
import json
import math
from types import SimpleNamespace

import pytest
import torch

from falcon_fwa.tasks.addition import train
from falcon_fwa.tasks.addition.data import VOCAB, AdditionSample, collate
from falcon_fwa.tasks.addition.metrics import AccuracyTally


def _tiny_transformer_run(tmp_path, *, steps, eval_every, val_per_width, train_widths):
    """``falcon-fwa addition`` with a one-layer Transformer of width 16 on the CPU, OOD widths 4-5; its folder."""
    from falcon_fwa.tasks.addition import cli

    out = tmp_path / "run"
    assert cli.main(["--model", "Transformer", "--steps", str(steps), "--eval-every", str(eval_every),
                     "--out", str(out), "--no-progress", "--hidden-size", "16", "--num-hidden-layers", "1",
                     "--num-heads", "2", "--preset", "tiny", "--device", "cpu", "--batch-size", "4",
                     "--val-per-width", str(val_per_width), "--ood-per-width", "2",
                     "--train-widths", *map(str, train_widths), "--ood-widths", "4", "5", "--threads", "1"]) == 0
    return out


V = len(VOCAB)


def test_suffix_loss_is_the_mean_next_token_loss_over_the_answer_and_end_marker():
    """Widths 1 and 2 in one right-padded batch, random logits everywhere: the loss is the float64 mean,
    over the tokens after '=' of each text, of -log softmax(logits[t - 1])[token t]; the prompt and the
    padding do not enter it."""
    samples = [AdditionSample(7, 5, 1, "msd", 10), AdditionSample(38, 64, 2, "msd", 10)]
    batch = collate(samples)
    logits = torch.randn(*batch.input_ids.shape, V, generator=torch.Generator().manual_seed(0))
    terms = []
    for i, s in enumerate(samples):
        text = s.text  # e.g. "7+5=21$": the suffix is "21$"
        for t in range(text.index("=") + 1, len(text)):
            row = logits[i, t - 1].double()
            terms.append(float(torch.logsumexp(row, 0) - row[VOCAB.index(text[t])]))
    assert len(terms) == (1 + 2) + (2 + 2)
    assert float(train.suffix_loss(logits, batch)) == pytest.approx(sum(terms) / len(terms), rel=1e-6)


class _WidthStub(torch.nn.Module):
    """Logit ``3 / width`` on the next token and 0 elsewhere: a loss per token that differs by width,
    ``log(1 + (V - 1) e^(-3/w))``, the same at every position of a sample."""

    def forward(self, input_ids):
        B, T = input_ids.shape
        width = (T - 4) // 3  # one width per evaluation batch, no padding
        logits = torch.zeros(B, T, V)
        logits[:, :-1] = (3.0 / width) * torch.nn.functional.one_hot(input_ids[:, 1:], V)
        return SimpleNamespace(logits=logits)


def _per_token(width):
    return math.log(1 + (V - 1) * math.exp(-3.0 / width))


def test_evaluate_counts_every_suffix_token_and_mean_loss_weights_widths_by_tokens():
    """5 samples per width: width w has 5 (w + 2) suffix tokens (w + 1 sum digits and the end marker);
    the loss over widths 1-3 is their token-weighted mean, not the mean of the widths' losses."""
    batches = train.eval_batches(0, range(1, 4), 5, 4)
    _, losses = train.evaluate(_WidthStub(), batches, torch.device("cpu"), contextlib.nullcontext)
    for w in (1, 2, 3):
        total, n = losses[w]
        assert n == 5 * (w + 2)
        assert total == pytest.approx(n * _per_token(w), rel=1e-5)
    by_hand = sum(5 * (w + 2) * _per_token(w) for w in (1, 2, 3)) / (15 + 20 + 25)
    assert train.mean_loss(losses, range(1, 4)) == pytest.approx(by_hand, rel=1e-5)
    assert train.mean_loss({1: (6.0, 3), 2: (2.0, 4)}, range(1, 3)) == pytest.approx(8 / 7)
    assert train.mean_loss({1: (6.0, 3), 2: (2.0, 4), 3: (9.0, 1)}, range(2, 4)) == pytest.approx(11 / 5)


def test_summary_of_three_ood_widths_names_the_first_and_last():
    """Validation width 1, OOD widths 2-4 (exact 100, 50, 0 %; digits 100, 50, 30 %): the keys name widths
    2 and 4, and the OOD means average all three widths."""
    tally = AccuracyTally()
    rows = {1: [[1, 1]], 2: [[1, 1, 1]] * 2, 3: [[1, 1, 1, 1], [0, 0, 0, 0]], 4: [[1, 1, 0, 0, 0], [0, 0, 0, 0, 1]]}
    for w, hits in rows.items():
        hits = torch.tensor(hits)
        tally.add(torch.full((len(hits),), w), hits.sum(1), torch.full((len(hits),), w + 1), positions=hits)
    s = train._summary(tally, range(1, 2), range(2, 5))
    assert s["acc_d2"] == 100.0 and s["acc_d4"] == 0.0 and "acc_d3" not in s
    assert s["digit_acc_d2"] == 100.0 and s["digit_acc_d4"] == 30.0
    assert s["mean_acc_ood"] == pytest.approx((100.0 + 50.0 + 0.0) / 3)
    assert s["digit_mean_acc_ood"] == pytest.approx((100.0 + 50.0 + 30.0) / 3)


def test_a_run_evaluates_on_schedule_with_its_losses_lr_and_sets(tmp_path, monkeypatch):
    """5 steps, an evaluation every 2 (steps 2 and 4) and at the last step (5), training widths 2-3 and
    OOD widths 4-5 (3 and 2 samples per width). The training loss of each step is scripted (step k: k), the
    per-width evaluation losses too (width w: w per token): by hand the entries' train_loss is the mean
    since the last evaluation (1.5, 3.5, 5), val_loss the token-weighted mean over widths 2-3
    ((2 * 3 * 4 + 3 * 3 * 5) / 27), ood_loss over 4-5 ((4 * 2 * 6 + 5 * 2 * 7) / 26); the optimizer runs at lr 3e-3 * (s + 1) / 100 (the tiny preset's warmup) times each group's
    multiplier, and the entries record the lr of their last step."""
    steps_lr, sets, drawn = [], [], []
    real_step, real_eval, real_batch = train.train_step, train.evaluate, train.training_batch

    def step(model, optimizer, batch, grad_clip, autocast, *, label):
        steps_lr.append([(g["lr"], g.get("lr_multiplier", 1.0)) for g in optimizer.param_groups])
        real_step(model, optimizer, batch, grad_clip, autocast, label=label)
        return torch.tensor(float(len(steps_lr)))

    def evaluate(model, batches, device, autocast):
        sets.append({w: sum(len(b.widths) for b in group) for w, group in batches.items()})
        tally, losses = real_eval(model, batches, device, autocast)
        return tally, {w: (float(w) * n, n) for w, (_, n) in losses.items()}

    def batch(seed, step, batch_size, min_width, max_width, **kw):
        b = real_batch(seed, step, batch_size, min_width, max_width, **kw)
        drawn.append((min_width, max_width, int(b.widths.min())))
        return b

    monkeypatch.setattr(train, "train_step", step)
    monkeypatch.setattr(train, "evaluate", evaluate)
    monkeypatch.setattr(train, "training_batch", batch)
    out = _tiny_transformer_run(tmp_path, steps=5, eval_every=2, val_per_width=3, train_widths=(2, 3))
    res = json.loads((out / "results.json").read_text())
    hist = res["history"]
    assert [h["step"] for h in hist] == [2, 4, 5]
    assert [h["train_loss"] for h in hist] == pytest.approx([1.5, 3.5, 5.0])
    assert all(h["val_loss"] == pytest.approx(69 / 27) and h["ood_loss"] == pytest.approx(118 / 26) for h in hist)
    assert [h["lr"] for h in hist] == pytest.approx([3e-3 * 2 / 100, 3e-3 * 4 / 100, 3e-3 * 5 / 100])
    assert len(steps_lr) == 5
    for s, groups in enumerate(steps_lr):
        assert all(lr == pytest.approx(3e-3 * (s + 1) / 100 * mult) for lr, mult in groups), s
    assert sets == [{2: 3, 3: 3, 4: 2, 5: 2}] * 3
    assert all(lo == 2 and hi == 3 and widest >= 2 for lo, hi, widest in drawn) and len(drawn) == 5


def _reference_loss(table, samples):
    """The suffix loss in float64, from the texts: token t of each answer (after '=') read off row t - 1."""
    terms = []
    for s in samples:
        ids = [VOCAB.index(c) for c in s.text]
        for t in range(s.text.index("=") + 1, len(ids)):
            row = table[ids[t - 1]]
            terms.append(torch.logsumexp(row, 0) - row[ids[t]])
    return sum(terms) / len(terms)


class _Bigram(torch.nn.Module):
    """Logits of token t are row ``input_ids[t]`` of a table: the loss has a gradient computable by hand."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(V, V, generator=torch.Generator().manual_seed(1)))

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])


def test_train_step_takes_the_clipped_gradient_of_this_batch_only():
    """Plain SGD at lr 1 and grad_clip 0.05 (below the gradient norm): each of two steps moves the
    weights by exactly -g * 0.05 / |g|, g the float64 gradient of that step's loss at the weights
    before it (none of the first step's gradient carried into the second)."""
    samples = [AdditionSample(7, 5, 1, "msd", 10), AdditionSample(38, 64, 2, "msd", 10)]
    batch = collate(samples)
    model = _Bigram()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for k in range(2):
        before = model.table.detach().double().clone().requires_grad_(True)
        ref = _reference_loss(before, samples)
        (g,) = torch.autograd.grad(ref, before)
        assert float(g.norm()) > 0.05
        loss = train.train_step(model, opt, batch, 0.05, contextlib.nullcontext,
                                label=f"step {k}")
        assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
        moved = model.table.detach().double() - before.detach()
        assert torch.allclose(moved, -g * 0.05 / g.norm(), rtol=1e-4, atol=1e-7), k


def test_train_step_refuses_a_non_finite_loss_before_any_update():
    model = _Bigram()
    with torch.no_grad():
        model.table[VOCAB.index("=")] = float("nan")  # the logits of the first answer digit
    held = model.table.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(FloatingPointError, match="step 7"):
        train.train_step(model, opt, collate([AdditionSample(7, 5, 1, "msd", 10)]), 1.0,
                         contextlib.nullcontext, label="step 7")
    assert torch.allclose(model.table.detach(), held, equal_nan=True)


def test_evaluate_gives_back_the_mode_it_found():
    batches = train.eval_batches(0, range(1, 2), 2, 2)
    for mode in (True, False):
        stub = _WidthStub().train(mode)
        train.evaluate(stub, batches, torch.device("cpu"), contextlib.nullcontext)
        assert stub.training is mode


def test_paper_preset_schedule_and_optimizer_by_hand():
    """The paper preset: lr 1e-3, 100 warmup steps, cosine to 0.1 of it at step 2000; AdamW betas
    (0.9, 0.95), weight decay 0.1 on the matrices and the embedding, none on vectors."""
    from falcon_fwa.tasks.addition.lineup import build_model
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    p = get_addition_preset("paper")
    assert train.lr_at(0, p) == pytest.approx(1e-5) and train.lr_at(99, p) == pytest.approx(1e-3)
    assert train.lr_at(100 + 950, p) == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5))
    assert train.lr_at(2000, p) == pytest.approx(1e-4)
    small = p.replace(hidden_size=16, num_heads=2, num_hidden_layers=1)
    opt = train.make_optimizer(build_model({"mixer": "transformer"}, small.size(), vocab_size=V), small)
    assert all(g["betas"] == (0.9, 0.95) for g in opt.param_groups)
    decay = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert decay["matrices"] == decay["embedding"] == 0.1 and decay["vectors"] == 0.0


def test_best_pt_holds_the_weights_of_the_best_step_not_the_last(tmp_path, monkeypatch):
    """Scripted validation accuracies 10, 30, 20 over three evaluations: best.pt holds the weights the
    model had at step 2 (copied when step 2 was evaluated), which step 3 then changed."""
    script, snapshots = iter([10.0, 30.0, 20.0]), {}
    real_summary, real_record = train._summary, train._record

    def scripted(*args):
        return {**real_summary(*args), "val_acc": next(script)}

    def record(entry, results, model, *args, **kw):
        snapshots[entry["step"]] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return real_record(entry, results, model, *args, **kw)

    monkeypatch.setattr(train, "_summary", scripted)
    monkeypatch.setattr(train, "_record", record)
    out = _tiny_transformer_run(tmp_path, steps=3, eval_every=1, val_per_width=2, train_widths=(1, 3))
    best = torch.load(out / "best.pt", weights_only=False)
    assert best["step"] == 2
    assert set(best["model"]) == set(snapshots[2])
    assert all(torch.equal(best["model"][k], snapshots[2][k]) for k in snapshots[2])
    assert not all(torch.equal(best["model"][k], snapshots[3][k]) for k in snapshots[3])


# Table 3 of the paper, as printed: (best step, val. acc., mean acc., Acc@d33, Acc@d48) and the model's label
PAPER_TABLE = {
    "Transformer": (2000, 100.0, 65.8, 97.0, 49.0, "Transformer (w. RoPE)"),
    "RetNet": (2000, 99.7, 82.9, 99.0, 63.0, "RetNet/LightningAttn"),
    "Mamba-2": (2000, 100.0, 75.2, 100.0, 51.0, "Mamba-2"),
    "Falcon-1A.1": (1900, 100.0, 80.6, 100.0, 59.0, "QK-l2-norm, ctx-beta"),
    "Falcon-1A.2": (2000, 100.0, 85.2, 100.0, 63.0, "QK-l2-norm, ctx-eta"),
    "Falcon-1A.3": (1900, 99.8, 85.9, 100.0, 69.0, "QK-RMSNorm, ctx-eta"),
    "Falcon-3A.3": (2000, 99.9, 87.2, 100.0, 69.0, "QK-RMSNorm, ctx-eta"),
}


def test_the_lineup_holds_table_3_and_its_models_as_the_paper_labels_them():
    from falcon_fwa.tasks.addition.lineup import PAPER_TABLE3, resolve_model

    for name, (step, val, mean, d33, d48, label) in PAPER_TABLE.items():
        assert PAPER_TABLE3[name] == {"best_step": step, "val_acc": val, "mean_acc_33_48": mean,
                                      "acc_d33": d33, "acc_d48": d48}, name
        if name.startswith("Falcon-"):
            norm, gate = label.split(", ")
            assert resolve_model(name) == {"mixer": "falcon", "rule": name[len("Falcon-"):].split(".")[0],
                                           "qk_norm": {"QK-l2-norm": "l2", "QK-RMSNorm": "rmsnorm"}[norm],
                                           "gate": gate}, name


def _run(seed, best_step, val, mean_ood, d4, d5):
    best = {"step": best_step, "val_acc": val, "val_digit_acc": 99.0, "mean_acc_ood": mean_ood, "acc_d4": d4,
            "acc_d5": d5, "digit_mean_acc_ood": 90.0 + seed, "digit_acc_d4": 95.0, "digit_acc_d5": 85.0}
    return {"seed": seed, "best": best, "wall_time_s": 1.0, "steps_done": 40, "preset": {"ood_widths": [4, 5]},
            "config_fields": {"mixer": "transformer"}, "parameters": 10}


def test_the_markdown_row_puts_each_figure_in_its_column():
    """Two seeds of the Transformer (best steps 30 and 40, validation 90 and 100, OOD means 50 and 70, acc
    at d4 80 and 100, at d5 20 and 40): by hand each column of the row, and the paper's figures
    (2000, 100, 65.8, 97/49) in its own columns; the header of the same layout; the row of another
    model in the verdict, behind the target by the difference of their means."""
    from falcon_fwa.tasks.addition import compare

    rows = compare.summarize({"Transformer": [_run(0, 30, 90.0, 50.0, 80.0, 20.0), _run(1, 40, 100.0, 70.0, 100.0, 40.0)],
                              "Falcon-3A.3": [_run(0, 40, 100.0, 80.0, 100.0, 60.0), _run(1, 40, 100.0, 80.0, 100.0, 60.0)]})
    meta = {"preset_name": "x", "train_widths": [1, 3], "ood_widths": [4, 5], "size": {}, "steps": 40,
            "batch_size": 4, "lr": 1e-3, "val_per_width": 2, "ood_per_width": 2, "seeds": [0, 1], "device": "cpu",
            "wall_time_s": 1.0, "command": "c", "commit": "x"}
    lines = compare.markdown(rows, meta).splitlines()
    sd = math.sqrt(50)  # the sample standard deviation of two values 10 apart
    assert ("| model | steps run | best step | val. acc | mean acc | Acc@d4/d5 | digits: mean / d4 / d5 | "
            "paper: best step | val. acc | mean acc | Acc@d33/d48 |") in lines
    assert (f"| Transformer | 40/40 | 35 ± {sd:.0f} | 95.0 ± {sd:.1f} | 60.0 ± {2 * sd:.1f} | 90.0/30.0 | "
            f"90.5 ± {math.sqrt(0.5):.1f} / 95.0 / 85.0 | 2000 | 100 | 65.8 | 97/49 |") in lines
    assert "- vs Transformer (baseline): 60.0, Falcon-3A.3 ahead by 20.0." in lines


def test_paper_preset_widths_and_evaluation_steps_are_the_papers():
    """The paper trains on widths 1-32, reports the mean over 33-48, and best steps 1900 and 2000 of a
    2000-step budget: evaluations fall on both."""
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    p = get_addition_preset("paper")
    assert p.train_widths == (1, 32) and p.ood_widths == (33, 48) and p.steps == 2000
    assert 1900 % p.eval_every == 0 and p.curriculum_steps == 0


def test_curriculum_from_a_lowest_width_above_one():
    """Widths 3-7 over 4 steps: 3 + ceil(4 (s + 1) / 4) = 4, 5, 6, 7, then 7; over 3 steps 3 + ceil(4 (s + 1) / 3)
    = 5, 6 (ceil(8/3) = 3), 7."""
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    p = get_addition_preset("tiny").replace(train_widths=(3, 7), ood_widths=(8, 9), curriculum_steps=4)
    assert [p.max_train_width(s) for s in range(6)] == [4, 5, 6, 7, 7, 7]
    assert [p.replace(curriculum_steps=3).max_train_width(s) for s in range(4)] == [5, 6, 7, 7]


def test_digit_index_rows_cover_the_largest_index_of_training_and_evaluation():
    """A sum of width n has digit indices up to n + 1, shifted in training by up to the offset K: the
    table needs max(hi + 1 + K, ood_hi + 1) + 1 rows (index 0 included)."""
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    p = get_addition_preset("tiny").replace(train_widths=(1, 5), ood_widths=(6, 8))
    assert p.replace(abacus_offset=4).num_digit_indices() == 5 + 1 + 4 + 1  # training reaches further
    assert p.replace(abacus_offset=1).num_digit_indices() == 8 + 1 + 1  # evaluation reaches further
    assert p.replace(abacus_offset=0).num_digit_indices() == 8 + 1 + 1


def test_ood_widths_touching_the_training_widths_are_refused():
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    p = get_addition_preset("tiny").replace(train_widths=(1, 5), ood_widths=(6, 8))
    for ood in ((5, 8), (1, 1), (3, 4)):
        with pytest.raises(ValueError, match="ood_widths"):
            p.replace(ood_widths=ood)
    assert p.replace(ood_widths=(6, 6)).ood_widths == (6, 6)


def test_the_width_plot_averages_the_seeds():
    from falcon_fwa.tasks.addition.plot import width_curve

    def run(e1, e2):
        return {"best": {"per_width": {"2": {"exact": e2, "digit": 90.0}, "1": {"exact": e1, "digit": 100.0}}}}

    runs = [run(100.0, 40.0), run(50.0, 0.0), run(90.0, 20.0)]
    assert width_curve(runs, "exact") == {1: 80.0, 2: 20.0}
    assert list(width_curve(runs, "digit").items()) == [(1, 100.0), (2, 90.0)]


def test_the_digit_index_row_of_the_non_digits_gets_no_gradient():
    """Index 0 (the '+', '=', '$' and padding tokens of a real batch) is the padding row: a loss over
    tokens at index 0 and above leaves its gradient at zero, and the rows of the indices used get one."""
    from falcon_fwa.tasks.addition.lineup import DigitPositions, build_model

    torch.manual_seed(0)
    lm = build_model({"mixer": "transformer"}, {"hidden_size": 16, "num_hidden_layers": 1, "num_heads": 2},
                     vocab_size=V)
    batch = collate([AdditionSample(7, 5, 1, "msd", 10), AdditionSample(38, 64, 2, "msd", 10)], offsets=[0, 2])
    assert (batch.digit_index == 0).any()
    model = DigitPositions(lm, 8)
    model(batch.input_ids, batch.digit_index).logits.square().sum().backward()
    g = model.index_embed.weight.grad
    used = sorted(set(batch.digit_index.flatten().tolist()) - {0})
    assert g[0].abs().max() == 0 and all(g[i].abs().max() > 0 for i in used)


def test_the_summary_keeps_each_seed_and_the_verdict_reads_the_widths_and_a_tie():
    """Per-seed figures are the runs' own; Falcon-3A.3 at exactly the paper's 87.2 meets the target; a run
    of other widths than 1-32 / 33-48 is not set against the paper's figure."""
    from falcon_fwa.tasks.addition import compare

    def run(seed, mean_ood, val, step):
        r = _run(seed, step, val, mean_ood, 100.0, 60.0)
        r["preset"] = {"ood_widths": [33, 48]}
        r["best"].update(acc_d33=r["best"].pop("acc_d4"), acc_d48=r["best"].pop("acc_d5"),
                         digit_acc_d33=r["best"].pop("digit_acc_d4"), digit_acc_d48=r["best"].pop("digit_acc_d5"))
        return r

    rows = compare.summarize({"Falcon-3A.3": [run(3, 87.2, 99.0, 1900)]})
    assert rows[0]["per_seed"] == [{"seed": 3, "best_step": 1900, "mean_acc_ood": 87.2, "val_acc": 99.0,
                                    "wall_time_s": 1.0}]
    meta = {"preset_name": "paper", "train_widths": [1, 32], "ood_widths": [33, 48], "size": {}, "steps": 2000,
            "batch_size": 4, "lr": 1e-3, "val_per_width": 2, "ood_per_width": 2, "seeds": [3], "device": "cpu",
            "wall_time_s": 1.0, "command": "c", "commit": "x"}
    table = compare.markdown(rows, meta)
    assert "Falcon-3A.3 mean exact-match accuracy 87.2 vs the paper's 87.2: target met (+0.0)." in table
    assert "87.2 ±" not in table  # one seed: no spread
    other = compare.markdown(rows, {**meta, "train_widths": [1, 16]})
    assert "vs the paper's" not in other and "this run has other widths" in other


def test_reference_exact_score_needs_every_digit():
    """15 + 07 = 22 ("220" least significant first): without carries the rule answers "210", two of
    three digits (66.7 % digits, 0 % exact); with the carry from one place below it is right."""
    from falcon_fwa.tasks.addition.reference import reference_scores, short_carry_answer

    s = AdditionSample(15, 7, 2, "msd", 10)
    assert s.answer == "220" and short_carry_answer(s, 0) == "210"
    scores = reference_scores([s], windows=(0, 1))
    assert scores["carry_window_0"] == pytest.approx({"digit": 200 / 3, "exact": 0.0})
    assert scores["carry_window_1"] == {"digit": 100.0, "exact": 100.0}


def test_the_table_averages_only_the_seeds_every_model_has(tmp_path, monkeypatch, capsys):
    """Seed 0 of Falcon-3A.3 and the Transformer (the record's runs) and a seed 1 of Falcon-3A.3 alone: the
    table uses seed 0 only, so that both rows average the same seeds."""
    from pathlib import Path

    from falcon_fwa.tasks.addition import compare

    record = Path(__file__).resolve().parents[1] / "results" / "addition" / "paper_runs"
    runs = tmp_path / "runs"
    for model, seed in (("Falcon-3A.3", 0), ("Transformer", 0), ("Falcon-3A.3", 1)):
        held = json.loads((compare._run_dir(record, model, 0) / "results.json").read_text())
        held["seed"] = seed
        compare._run_dir(runs, model, seed).mkdir(parents=True)
        (compare._run_dir(runs, model, seed) / "results.json").write_text(json.dumps(held))
    monkeypatch.setattr(compare, "_ood_reference", lambda *a: {})
    assert compare.main(["--preset", "paper", "--device", "cpu", "--models", "Falcon-3A.3", "Transformer",
                         "--seeds", "0", "1", "--no-train", "--partial", "--runs", str(runs),
                         "--results", str(tmp_path), "--name", "t"]) == 0
    capsys.readouterr()
    rows = json.loads((tmp_path / "t.json").read_text())
    assert [(r["model"], r["seeds"]) for r in rows] == [("Falcon-3A.3", [0]), ("Transformer", [0])]
    assert json.loads((tmp_path / "t_meta.json").read_text())["seeds"] == [0]
