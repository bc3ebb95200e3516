"""Addition samples and accuracies by hand: operands reach every value of [0, base^n), the largest too; the
per-position accuracies average over the samples that came with positions only."""
import pytest
import torch

from falcon_fwa.tasks.addition.data import AdditionSample, collate, width_set
from falcon_fwa.tasks.addition.metrics import AccuracyTally, position_hits, score_predictions


@pytest.mark.parametrize("base, width", [(10, 1), (2, 3), (3, 2)])
def test_operands_take_every_value_up_to_the_largest(base, width):
    samples = width_set(7, [width], 60 * base ** width, base=base)[width]
    top = base ** width
    for name in ("a", "b"):
        assert sorted({getattr(s, name) for s in samples}) == list(range(top))


def test_per_position_averages_the_samples_that_came_with_positions():
    """Two width-2 batches, the first added with positions (one sample, every digit right), the second
    without (one sample, every digit wrong): digit accuracy pools both (50 %), per_position only the first."""
    right = collate([AdditionSample(45, 67, 2)])  # "45+67=211$"
    pred = right.input_ids[:, 1:]
    tally = AccuracyTally()
    tally.add(right.widths, *score_predictions(pred, right), positions=position_hits(pred, right))
    wrong = collate([AdditionSample(12, 34, 2)])
    tally.add(wrong.widths, *score_predictions(wrong.input_ids[:, 1:] * 0, wrong))
    assert tally.digit_acc([2]) == pytest.approx(50.0) and tally.exact_acc([2]) == pytest.approx(50.0)
    assert tally.per_position() == {2: [100.0, 100.0, 100.0]}
    tally.add(wrong.widths, *score_predictions(wrong.input_ids[:, 1:] * 0, wrong),
              positions=position_hits(wrong.input_ids[:, 1:] * 0, wrong))
    assert tally.per_position() == {2: [50.0, 50.0, 50.0]}
    assert torch.equal(position_hits(pred, right), torch.tensor([[1, 1, 1]]))


def test_to_digits_by_hand_and_refuses_a_number_too_wide():
    from falcon_fwa.tasks.addition.data import to_digits

    assert to_digits(57, 3) == "057" and to_digits(999, 3) == "999" and to_digits(5, 3, base=2) == "101"
    assert to_digits(0, 1) == "0" and to_digits(8, 4, base=3) == "0022"
    for x, width, base in ((1000, 3, 10), (8, 3, 2), (9, 2, 3)):
        with pytest.raises(ValueError, match=f"{width} base-{base} digits"):
            to_digits(x, width, base)
