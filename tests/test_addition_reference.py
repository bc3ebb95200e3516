"""Reference rules for the addition scores: hand-computed answers and the exact-sum limit."""
import random

import pytest

from falcon_fwa.tasks.addition.data import AdditionSample, check_text, make_sample, width_set
from falcon_fwa.tasks.addition.reference import reference_scores, short_carry_answer


def test_short_carry_answers_by_hand():
    # 999 + 001 = 1000: every place carries, so each window gets one more place right from the bottom
    s = AdditionSample(a=999, b=1, width=3)
    assert [short_carry_answer(s, w) for w in range(5)] == ["0990", "0090", "0000", "0001", "0001"]
    # binary 101 + 011 = 1000 (5 + 3 = 8)
    s = AdditionSample(a=5, b=3, width=3, base=2)
    assert [short_carry_answer(s, w) for w in range(4)] == ["0110", "0010", "0000", "0001"]
    with pytest.raises(ValueError, match="window"):
        short_carry_answer(s, -1)


@pytest.mark.parametrize("base", [2, 3, 10])
@pytest.mark.parametrize("order", ["msd", "lsd"])
def test_a_window_as_long_as_the_operands_gives_the_sum(base, order):
    rng = random.Random(base)
    for width in list(range(1, 25)) * 3:
        s = make_sample(rng, width, operand_order=order, base=base)
        answer = short_carry_answer(s, width)
        assert answer == s.answer
        assert check_text(s.prompt + answer, order, base)


def test_reference_scores_by_hand():
    scores = reference_scores([AdditionSample(a=999, b=1, width=3)], windows=(0, 3))
    assert scores["carry_window_0"] == {"digit": 25.0, "exact": 0.0}  # only the units digit of "0990"
    assert scores["carry_window_3"] == {"digit": 100.0, "exact": 100.0}
    assert scores["uniform"]["digit"] == pytest.approx(10.0)
    assert scores["uniform"]["exact"] == pytest.approx(100 * 10.0 ** -4)
    binary = reference_scores([AdditionSample(a=5, b=3, width=3, base=2), AdditionSample(a=1, b=0, width=1, base=2)],
                              windows=(1,))
    # "0010" against "0001" (2 of 4 right), and 1 + 0 = "10", no carry: right at any window (2 of 2)
    assert binary["carry_window_1"] == {"digit": 100 * 4 / 6, "exact": 50.0}
    assert binary["uniform"]["digit"] == pytest.approx(50.0)
    with pytest.raises(ValueError, match="samples"):
        reference_scores([])
    with pytest.raises(TypeError, match="samples"):
        reference_scores([3, 4])


def test_reference_scores_take_a_width_set():
    sets = width_set(5, [3, 7], 4, base=3)
    assert reference_scores(sets) == reference_scores(sets[3] + sets[7])
