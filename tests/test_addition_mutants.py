"""Addition task against what docs/addition.md states and against Python's integers: an evaluation set of a
width that does not depend on the other widths asked, abacus offsets that change with the step and not with
the base or operand order, a checker that refuses padded texts, per-width accuracies under their own names,
guessing's digit score pooled over mixed bases, the default training widths 1-32, the presets' documented
values, the lineup's names as the paper builds them, and what the plots draw: the width curves in numeric
order over the shaded training widths, guessing at 1/base, each width's panel named, the heat map's lines."""
import random

import pytest
import torch

from falcon_fwa.tasks.addition.data import (
    AdditionSample,
    check_text,
    collate,
    encode,
    training_batch,
    width_set,
)
from falcon_fwa.tasks.addition.metrics import AccuracyTally, score_predictions


def test_an_evaluation_width_holds_the_same_sums_whatever_other_widths_are_asked():
    """Validation (training widths) and the OOD test (other widths) are built by separate calls: each
    width's samples come from its own stream, so width 40 is the same set asked alone, after width 3 or
    before it, and its draws are a, b uniform below 10^40 from random.Random('{seed}/eval/40')."""
    alone = width_set(9, [40], 6)[40]
    assert width_set(9, [3, 40], 6)[40] == alone == width_set(9, [40, 3], 6)[40]
    assert width_set(9, [40, 3], 6)[3] == width_set(9, [3], 6)[3]
    rng = random.Random("9/eval/40")
    assert [(s.a, s.b) for s in alone] == [(rng.randrange(10 ** 40), rng.randrange(10 ** 40)) for _ in range(6)]


def _offsets(batch, plain):
    """One offset per sample: the shift of its digits' indices from the unshifted batch's."""
    out = []
    for shifted, base, digits in zip(batch.digit_index, plain.digit_index, plain.digit_index > 0):
        values = set((shifted - base)[digits].tolist())
        assert len(values) == 1
        out.append(values.pop())
    return out


def test_abacus_offsets_change_with_the_step_and_not_with_the_base_or_operand_order():
    """The offsets are drawn per training step from a stream of their own: the 32 offsets of one step
    differ from the next step's, and one step's offsets are the same in decimal and binary, msd and lsd
    (whose sums consume the step's sample stream differently)."""
    K = 9
    by_step = [_offsets(training_batch(2, step, 32, 1, 32, abacus_offset=K), training_batch(2, step, 32, 1, 32))
               for step in range(3)]
    assert all(0 <= o <= K for offsets in by_step for o in offsets)
    assert by_step[0] != by_step[1] and by_step[1] != by_step[2]
    for base, order in ((2, "msd"), (10, "lsd"), (3, "lsd")):
        shifted = training_batch(2, 0, 32, 1, 32, operand_order=order, base=base, abacus_offset=K)
        plain = training_batch(2, 0, 32, 1, 32, operand_order=order, base=base)
        assert _offsets(shifted, plain) == by_step[0], (base, order)


def test_the_checker_refuses_padding_after_the_answer():
    """With or without the end marker, nothing else: a padded batch row is not a sample's text."""
    assert check_text("057+968=5201$") and check_text("057+968=5201")
    for bad in ("057+968=5201_", "057+968=5201__", "057+968=5201$_", "_057+968=5201$"):
        assert not check_text(bad), bad


def test_per_width_names_each_accuracy_as_the_docs_example():
    """docs/addition.md: two width-2 samples, the first sum digit of sample 0 wrong: 5 of 6 digits
    (83.3 %), 1 of 2 whole answers (50 %), under 'digit' and 'exact'."""
    samples = [AdditionSample(38, 64, 2), AdditionSample(11, 22, 2)]  # answers "201" and "330"
    batch = collate(samples)
    pred = batch.input_ids[:, 1:].clone()
    pred[0, 2 * 2 + 2 - 1] = encode("3")[0]  # "3" for the units digit "2"
    tally = AccuracyTally()
    tally.add(batch.widths, *score_predictions(pred, batch))
    per = tally.per_width()
    assert per[2]["digit"] == pytest.approx(500 / 6) and per[2]["exact"] == 50.0
    assert set(per) == {2} and set(per[2]) == {"digit", "exact"}


def test_guessings_digit_score_pools_the_digits_of_mixed_bases():
    """A binary width-3 sample (4 sum digits, 1/2 each) and a decimal width-1 sample (2 digits, 1/10
    each): guessing expects 4 * 0.5 + 2 * 0.1 = 2.2 of the 6 digits (36.7 %), and 0.5^4 and 0.1^2
    as exact scores (mean 3.625 %)."""
    from falcon_fwa.tasks.addition.reference import reference_scores

    scores = reference_scores([AdditionSample(5, 3, 3, base=2), AdditionSample(4, 9, 1)], windows=())
    assert scores["uniform"]["digit"] == pytest.approx(100 * 2.2 / 6)
    assert scores["uniform"]["exact"] == pytest.approx(100 * (0.5 ** 4 + 0.1 ** 2) / 2)


def test_training_widths_default_to_the_papers_1_to_32():
    widths = set(torch.cat([training_batch(4, step, 256).widths for step in range(4)]).tolist())
    assert widths == set(range(1, 33))


def test_presets_hold_the_documented_values():
    """docs/addition.md, Presets: tiny d=64, 2 layers, 2 heads, 1,000 steps of 64 at lr 3e-3, widths 1-5 / 6-8,
    on one CPU thread; paper d=256, 4 layers, 4 heads, 2,000 steps of 128 at lr 1e-3, TF32 products, widths
    1-32 / 33-48, 100 OOD samples per width. Both: weight decay 0.1, 100 warm-up steps, cosine to a tenth,
    clipping at 1.0, betas (0.9, 0.95), the fan-in initialization, decimal msd operands, no curriculum and
    no digit places (the paper's setting)."""
    from falcon_fwa.tasks.addition.presets import PRESETS, get_addition_preset

    assert set(PRESETS) == {"tiny", "paper"}
    tiny, paper = get_addition_preset("tiny"), get_addition_preset("paper")
    assert (tiny.hidden_size, tiny.num_hidden_layers, tiny.num_heads) == (64, 2, 2)
    assert (tiny.steps, tiny.batch_size, tiny.lr) == (1000, 64, 3e-3)
    assert (tiny.train_widths, tiny.ood_widths, tiny.cpu_threads) == ((1, 5), (6, 8), 1)
    assert (paper.hidden_size, paper.num_hidden_layers, paper.num_heads) == (256, 4, 4)
    assert (paper.steps, paper.batch_size, paper.lr, paper.matmul_precision) == (2000, 128, 1e-3, "high")
    assert (paper.train_widths, paper.ood_widths, paper.ood_per_width) == ((1, 32), (33, 48), 100)
    for p in (tiny, paper):
        assert (p.weight_decay, p.warmup, p.min_lr_ratio, p.grad_clip, p.betas) == (0.1, 100, 0.1, 1.0, (0.9, 0.95))
        assert p.size()["initializer_range"] == pytest.approx(1 / p.hidden_size ** 0.5)
        assert (p.operand_order, p.base, p.curriculum_steps, p.abacus_offset) == ("msd", 10, 0, None)


@pytest.mark.parametrize("name", ["hidden_size", "num_hidden_layers", "num_heads", "steps", "batch_size",
                                  "eval_every", "val_per_width", "ood_per_width"])
def test_a_preset_count_of_zero_is_refused_naming_the_field(name):
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    with pytest.raises(ValueError, match=f"'{name}' must be >= 1, got 0"):
        get_addition_preset("tiny").replace(**{name: 0})


def test_ood_widths_below_the_training_widths_are_taken():
    """Out-of-distribution widths must lie outside the training widths, on either side."""
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    p = get_addition_preset("tiny").replace(train_widths=(4, 6), ood_widths=(1, 3))
    assert p.ood_widths == (1, 3) and p.train_widths == (4, 6)
    with pytest.raises(ValueError, match="ood_widths"):
        p.replace(ood_widths=(1, 4))


def test_the_tiny_falcon_has_the_documented_118k_parameters():
    from falcon_fwa.tasks.addition.data import VOCAB
    from falcon_fwa.tasks.addition.lineup import build_model, resolve_model
    from falcon_fwa.tasks.addition.presets import get_addition_preset

    model = build_model(resolve_model("Falcon-3A.3"), get_addition_preset("tiny").size(), vocab_size=len(VOCAB))
    assert round(sum(p.numel() for p in model.parameters()) / 1000) == 118


# the paper's labels of its Falcon variants, by the suffix of the name: (qk_norm, gate)
_SUFFIX = {"1": ("l2", "ctx-beta"), "2": ("l2", "ctx-eta"), "3": ("rmsnorm", "ctx-eta")}


def test_every_lineup_name_is_the_model_the_paper_names():
    """docs/addition.md: the whole table is eight models, Falcon-3A.3, Falcon-1A.3, Falcon-1.3, Transformer,
    Mamba-2, RetNet, Falcon-1A.1 and Falcon-1A.2. 'Falcon-<rule>.<k>' is that rule with the QK norm and gate of
    variant k (.1 QK-l2-norm ctx-beta, .2 QK-l2-norm ctx-eta, .3 QK-RMSNorm ctx-eta); the three baselines are
    their own mixers."""
    from falcon_fwa.tasks.addition.lineup import BASELINES, LINEUP, PAPER_TABLE3, resolve_model

    assert set(LINEUP) == set(PAPER_TABLE3) == {"Falcon-3A.3", "Falcon-1A.3", "Falcon-1.3", "Transformer", "Mamba-2",
                                                 "RetNet", "Falcon-1A.1", "Falcon-1A.2"}
    assert set(BASELINES) == {"Transformer", "Mamba-2", "RetNet"}
    for name in LINEUP:
        if name.startswith("Falcon-"):
            rule, k = name[len("Falcon-"):].split(".")
            qk_norm, gate = _SUFFIX[k]
            assert resolve_model(name) == {"mixer": "falcon", "rule": rule, "qk_norm": qk_norm, "gate": gate}, name
    assert [resolve_model(n) for n in BASELINES] == [{"mixer": "transformer"}, {"mixer": "mamba2"}, {"mixer": "retnet"}]
    assert resolve_model("retnet") == {"mixer": "retnet"}  # a mixer name alone: its own defaults
    # Falcon-1.3's row is from an earlier version of the paper: 68.8, 100/48, no best step or validation
    assert PAPER_TABLE3["Falcon-1.3"] == {"best_step": None, "val_acc": None, "mean_acc_33_48": 68.8,
                                          "acc_d33": 100.0, "acc_d48": 48.0}


def test_the_width_curve_runs_in_numeric_width_order():
    """Widths are keys as strings in results.json: '10' comes after '9', not after '1'."""
    from falcon_fwa.tasks.addition.plot import width_curve

    per = {str(w): {"exact": float(w), "digit": 100.0} for w in (10, 2, 9, 1)}
    runs = [{"best": {"per_width": per}}, {"best": {"per_width": {w: {"exact": 0.0, "digit": 50.0} for w in per}}}]
    curve = width_curve(runs, "exact")
    assert list(curve) == [1, 2, 9, 10] and curve == {1: 0.5, 2: 1.0, 9: 4.5, 10: 5.0}


def test_a_digit_index_table_needs_a_row_past_the_non_digits():
    """Row 0 is the non-digits' (it adds nothing); a table of that row alone has no place for any digit."""
    from falcon_fwa.tasks.addition.lineup import DigitPositions, build_model

    lm = build_model({"mixer": "transformer"}, {"hidden_size": 8, "num_hidden_layers": 1, "num_heads": 2},
                     vocab_size=14)
    for bad in (0, 1):
        with pytest.raises(ValueError, match="num_indices"):
            DigitPositions(lm, bad)
    assert DigitPositions(lm, 2).index_embed.weight.shape == (2, 8)


class _Spy:
    """Records the calls of some ``matplotlib.axes.Axes`` methods, which still draw."""

    def __init__(self, monkeypatch, *names):
        import matplotlib.axes

        self.calls = {name: [] for name in names}
        for name in names:
            original = getattr(matplotlib.axes.Axes, name)

            def spy(ax, *args, _name=name, _original=original, **kwargs):
                self.calls[_name].append(args)
                return _original(ax, *args, **kwargs)

            monkeypatch.setattr(matplotlib.axes.Axes, name, spy)


def _run(per_width=None, per_position=None, base=10, train_widths=(3, 5)):
    return {"model": "m", "preset": {"train_widths": list(train_widths), "base": base},
            "best": {"step": 1, "per_width": per_width or {}, "per_position": per_position or {}}}


def test_the_width_plot_draws_each_models_mean_in_both_panels_over_the_shaded_training_widths(tmp_path,
                                                                                            monkeypatch):
    pytest.importorskip("matplotlib")
    from falcon_fwa.tasks.addition.plot import plot_accuracy_vs_width

    spy = _Spy(monkeypatch, "plot", "axvspan")
    per = lambda e, d: {"3": {"exact": e, "digit": d}, "6": {"exact": e / 2, "digit": d / 2}}  # noqa: E731
    runs = {"A": [_run(per(100.0, 80.0)), _run(per(50.0, 60.0))], "B": [_run(per(10.0, 20.0))]}
    assert plot_accuracy_vs_width(runs, tmp_path / "w.png").stat().st_size > 0
    lines = [(list(x), list(y)) for x, y in spy.calls["plot"]]
    assert lines == [([3, 6], [75.0, 37.5]), ([3, 6], [10.0, 5.0]),  # exact match, then digits
                     ([3, 6], [70.0, 35.0]), ([3, 6], [20.0, 10.0])]
    assert spy.calls["axvspan"] == [(2.5, 5.5)] * 2  # widths 3-5, whole cells


def test_the_lineup_position_plot_dots_guessing_at_one_over_the_base_and_names_each_width(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from falcon_fwa.tasks.addition.plot import plot_lineup_positions

    spy = _Spy(monkeypatch, "plot", "axhline", "set_title")
    per = {str(w): [100.0] * (w + 1) for w in (2, 4, 7)}
    half = {str(w): [0.0] * (w + 1) for w in (2, 4, 7)}
    runs = {"A": [_run(per_position=per, base=2), _run(per_position=half, base=2)]}
    assert plot_lineup_positions(runs, tmp_path / "p.png", widths=[2, 4, 7]).stat().st_size > 0
    assert [(list(x), list(y)) for x, y in spy.calls["plot"]] == [(list(range(w + 1)), [50.0] * (w + 1))
                                                                  for w in (2, 4, 7)]
    assert spy.calls["axhline"] == [(50.0,)] * 3  # binary: guessing gets half the digits
    assert [c[0] for c in spy.calls["set_title"]] == ["width 2 (out of distribution)", "width 4 (training)",
                                                      "width 7 (out of distribution)"]


def test_the_heat_maps_dashed_lines_follow_the_last_training_width(tmp_path, monkeypatch):
    """Training widths 3-5: the last answer position trained is k = 5 and the last width 5, so both lines
    lie between cells 5 and 6."""
    pytest.importorskip("matplotlib")
    from falcon_fwa.tasks.addition.plot import plot_accuracy_by_position

    spy = _Spy(monkeypatch, "axvline", "axhline")
    per = {str(w): [50.0] * (w + 1) for w in range(3, 8)}
    assert plot_accuracy_by_position(_run(per_position=per), tmp_path / "h.png").stat().st_size > 0
    assert spy.calls["axvline"] == [(5.5,)] and spy.calls["axhline"] == [(5.5,)]
