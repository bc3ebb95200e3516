"""Addition task properties held against Python's integers and hand-made cases: the checker takes a sum only
with its n + 1 digits, the final carry digit included even where it is 0; the Scale of an ``addition-compare``
summary is what the short-carry rules and uniform guessing score on the runs' own OOD set (the OOD count per
width, the evaluation seed's stream), against the rules recomputed with integers."""
import pytest

from falcon_fwa.tasks.addition.data import AdditionSample, check_text


def _text(a: int, b: int, n: int, answer_digits: int) -> str:
    """``a + b`` at width ``n`` with the sum written in ``answer_digits`` digits, least significant first."""
    return f"{a:0{n}d}+{b:0{n}d}={str(a + b).zfill(answer_digits)[::-1]}$"


def test_the_checker_needs_all_n_plus_1_sum_digits_even_without_a_final_carry():
    """A sum that fits in n digits is still written with n + 1, its last (the final carry) a 0: the same
    answer short of that digit reads as the right number, yet is not a well-formed sample."""
    for a, b, n in ((57, 68, 3), (0, 0, 1), (12, 34, 2), (499, 500, 3)):
        assert a + b < 10 ** n
        full, short = _text(a, b, n, n + 1), _text(a, b, n, n)
        assert full == AdditionSample(a, b, n).text and full.endswith("0$")
        assert check_text(full) and check_text(full[:-1])
        assert not check_text(short), short
        assert not check_text(short[:-1]), short[:-1]
    assert not check_text("750+860=521$", operand_order="lsd")  # 57 + 68 = 125 at n = 3, operands lsd first
    assert check_text("750+860=5210$", operand_order="lsd")
    assert not check_text("10+01=11$", base=2) and check_text("10+01=110$", base=2)  # 2 + 1 = 3 in binary


def _short_carry_digits(a: int, b: int, n: int, window: int) -> str:
    """The rule of docs/addition.md's Scale with integers: the carry into place ``p`` is that of the sum of the
    operands' places ``p - window .. p - 1`` alone (a carry out of them), and digit ``p`` is
    ``(a_p + b_p + carry) mod 10``; the ``n + 1`` digits, least significant first."""
    out = []
    for p in range(n + 1):
        s = max(0, p - window)
        low_a, low_b = (a // 10 ** s) % 10 ** (p - s), (b // 10 ** s) % 10 ** (p - s)
        carry = int(low_a + low_b >= 10 ** (p - s)) if p > s else 0
        out.append(str((a // 10 ** p % 10 + b // 10 ** p % 10 + carry) % 10))
    return "".join(out)


def test_the_summarys_scale_is_scored_on_the_ood_samples_of_the_runs_eval_seed(tmp_path, monkeypatch):
    """The Scale of an ``addition-compare`` summary (its ``_meta.json``'s ``reference``) is what the rules score
    on the runs' own OOD set: ``--ood-per-width`` samples (not ``--val-per-width``) of each OOD width, drawn
    from the ``--eval-seed`` stream ``"{seed}/eval/{width}"``; here 2 samples of widths 4 and 5, evaluation
    seed 7, 3 validation samples per width."""
    import json
    import random

    from falcon_fwa.tasks.addition import cli, compare

    monkeypatch.chdir(tmp_path)
    setup = ["--preset", "tiny", "--device", "cpu", "--batch-size", "4", "--val-per-width", "3",
             "--ood-per-width", "2", "--train-widths", "1", "3", "--ood-widths", "4", "5", "--threads", "1",
             "--steps", "1", "--eval-every", "1", "--hidden-size", "16", "--num-hidden-layers", "1",
             "--num-heads", "2", "--eval-seed", "7"]
    assert cli.main(["--model", "Transformer", "--no-progress", "--seed", "0",
                     "--out", str(tmp_path / "runs" / "Transformer" / "seed0"), *setup]) == 0
    assert compare.main(["--models", "Transformer", "--seeds", "0", "--no-train", "--runs", str(tmp_path / "runs"),
                         "--results", str(tmp_path), "--name", "t", *setup]) == 0
    reference = json.loads((tmp_path / "t_meta.json").read_text())["reference"]

    sums = []
    for n in (4, 5):
        rng = random.Random(f"7/eval/{n}")
        sums += [(rng.randrange(10 ** n), rng.randrange(10 ** n), n) for _ in range(2)]
    digits = sum(n + 1 for _, _, n in sums)
    assert reference["uniform"]["digit"] == pytest.approx(10.0)
    assert reference["uniform"]["exact"] == pytest.approx((2 * 10.0 ** -5 + 2 * 10.0 ** -6) / 4 * 100)
    assert sorted(reference) == ["carry_window_0", "carry_window_1", "carry_window_2", "carry_window_3", "uniform"]
    for window in (0, 1, 2, 3):
        right = exact = 0
        for a, b, n in sums:
            true = str(a + b).zfill(n + 1)[::-1]
            hits = sum(x == y for x, y in zip(_short_carry_digits(a, b, n, window), true))
            right, exact = right + hits, exact + (hits == n + 1)
        got = reference[f"carry_window_{window}"]
        assert got["digit"] == pytest.approx(100.0 * right / digits), window
        assert got["exact"] == pytest.approx(100.0 * exact / len(sums)), window
