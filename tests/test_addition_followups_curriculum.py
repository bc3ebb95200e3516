"""A curriculum longer than the run (``--curriculum-steps`` above ``--steps``) is refused by ``falcon-fwa
addition`` and ``addition-compare`` before anything is written, naming both options with their values (the
preset's where one is left out), and by the preset itself; a curriculum of exactly ``--steps`` reaches the top
of the training widths at the last step; the presets' own values pass the check."""
import argparse
import dataclasses

import pytest

from falcon_fwa.tasks.addition import cli, compare, presets
from falcon_fwa.tasks.addition.presets import PRESETS, get_addition_preset


def _args(argv, add=cli.add_arguments):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def _largest_width_by_hand(lo, hi, curriculum, step):
    """lo + ceil((hi - lo) * min(1, (step + 1) / curriculum)), in exact integers."""
    num, den = (hi - lo) * min(step + 1, curriculum), curriculum
    return lo + (num + den - 1) // den


def test_a_longer_curriculum_would_leave_the_widest_widths_untrained():
    """Why it is refused: widths 1-5, 10 steps, a 20-step curriculum reaches width 1 + ceil(4 * 10 / 20) = 3
    at the last step (step 9), so widths 4 and 5, validated at every evaluation, are never drawn."""
    assert _largest_width_by_hand(1, 5, 20, 9) == 3
    assert max(_largest_width_by_hand(1, 5, 20, s) for s in range(10)) == 3


def test_both_options_given_are_named_as_typed():
    with pytest.raises(ValueError, match=r"^--curriculum-steps 11 is more than --steps 10: ") as err:
        cli.preset_from_args(_args(["--steps", "10", "--curriculum-steps", "11"]))
    assert "give --curriculum-steps 10 or fewer, or --steps 11 or more" in str(err.value)
    assert "preset's" not in str(err.value)


def test_the_presets_steps_are_named_where_steps_is_left_out():
    steps = get_addition_preset("tiny").steps
    with pytest.raises(ValueError, match=rf"^--curriculum-steps {steps + 1} is more than --steps {steps} "
                                         r"\(the tiny preset's\): "):
        cli.preset_from_args(_args(["--curriculum-steps", str(steps + 1)]))
    steps = get_addition_preset("paper").steps
    with pytest.raises(ValueError, match=rf"^--curriculum-steps {steps + 1} is more than --steps {steps} "
                                         r"\(the paper preset's\): "):
        cli.preset_from_args(_args(["--preset", "paper", "--curriculum-steps", str(steps + 1)]))


def test_the_presets_curriculum_is_named_where_the_option_is_left_out(monkeypatch):
    """A preset with a 8-step curriculum over 10 steps, cut to --steps 6: the curriculum is the preset's."""
    slow = dataclasses.replace(get_addition_preset("tiny"), steps=10, curriculum_steps=8)
    monkeypatch.setitem(presets.PRESETS, "slow", slow)
    assert cli.preset_from_args(_args(["--preset", "slow", "--steps", "8"])).curriculum_steps == 8
    with pytest.raises(ValueError, match=r"^--curriculum-steps 8 \(the slow preset's\) is more than --steps 6: "):
        cli.preset_from_args(_args(["--preset", "slow", "--steps", "6"]))


def test_the_compare_command_takes_the_same_check():
    with pytest.raises(ValueError, match=r"^--curriculum-steps 5 is more than --steps 4: "):
        cli.preset_from_args(_args(["--steps", "4", "--curriculum-steps", "5"], add=compare.add_arguments))


def test_a_curriculum_of_the_whole_run_is_taken_and_reaches_the_top_at_the_last_step():
    p = cli.preset_from_args(_args(["--steps", "10", "--curriculum-steps", "10", "--train-widths", "1", "5"]))
    assert (p.steps, p.curriculum_steps) == (10, 10)
    # 1 + ceil(4 * (s + 1) / 10) for s = 0..9: ceil of 0.4 0.8 1.2 1.6 2.0 2.4 2.8 3.2 3.6 4.0
    by_hand = [2, 2, 3, 3, 3, 4, 4, 5, 5, 5]
    assert [_largest_width_by_hand(1, 5, 10, s) for s in range(10)] == by_hand
    assert [p.max_train_width(s) for s in range(10)] == by_hand


def test_the_preset_refuses_a_longer_curriculum_naming_its_fields():
    with pytest.raises(ValueError, match=r"curriculum_steps 1001 is more than steps 1000"):
        get_addition_preset("tiny").replace(curriculum_steps=1001)
    assert get_addition_preset("tiny").replace(curriculum_steps=1000).curriculum_steps == 1000


def test_the_presets_own_values_pass_the_check():
    """The tiny and paper presets train the whole range from the first step (the paper's setting)."""
    for name, preset in PRESETS.items():
        assert 0 <= preset.curriculum_steps <= preset.steps, name
    assert get_addition_preset("tiny").curriculum_steps == get_addition_preset("paper").curriculum_steps == 0


def test_nothing_is_written_before_the_refusal(tmp_path):
    out, runs, results = tmp_path / "run", tmp_path / "runs", tmp_path / "results"
    with pytest.raises(ValueError, match=r"^--curriculum-steps 3 is more than --steps 2"):
        cli.main(["--steps", "2", "--curriculum-steps", "3", "--device", "cpu", "--out", str(out)])
    with pytest.raises(ValueError, match=r"^--curriculum-steps 3 is more than --steps 2"):
        compare.main(["--steps", "2", "--curriculum-steps", "3", "--device", "cpu", "--runs", str(runs),
                      "--results", str(results), "--models", "Transformer"])
    assert list(tmp_path.iterdir()) == []
