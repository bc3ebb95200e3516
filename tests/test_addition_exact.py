"""Addition task against independent references: every base and operand order read back with Python's
integers, the seeded streams redrawn with the standard library in other processes, the widths' frequencies
against a chi-square bound, and the metrics' refusal of predictions that do not line up with the tokens."""
import json
import random
import subprocess
import sys

import pytest
import torch

from falcon_fwa.tasks.addition.data import (
    BASES,
    OPERAND_ORDERS,
    PAD_ID,
    AdditionSample,
    collate,
    decode,
    make_sample,
    training_batch,
    width_set,
)
from falcon_fwa.tasks.addition.metrics import position_hits, score_predictions
from falcon_fwa.tasks.addition.train import eval_batches


def _read_back(text: str, base: int, order: str):
    """``(n, a, b, answer)`` parsed from a sample's text by hand: ``n``-digit operands and the
    ``n + 1``-digit answer, the operands as Python integers."""
    prompt, rest = text.split("=")
    a, b = prompt.split("+")
    assert len(a) == len(b) and rest.endswith("$") and rest.count("$") == 1
    if order == "lsd":
        a, b = a[::-1], b[::-1]
    return len(a), int(a, base), int(b, base), rest[:-1]


def _reversed_digits(x: int, n: int, base: int) -> str:
    """``x`` as ``n`` base-``base`` digits, least significant first, by repeated division (``x`` must fit)."""
    out = []
    for _ in range(n):
        x, d = divmod(x, base)
        out.append(str(d))
    assert x == 0
    return "".join(out)


@pytest.mark.parametrize("base", BASES)
def test_training_batches_of_every_base_and_order_read_back_as_exact_sums(base):
    """Every row of mixed-width batches: operands of exactly n digits below the base, the answer the
    n + 1 digits of a + b least significant first, the loss mask on the answer and '$' only, the digit
    mask on the answer only, and padding after '$' alone; both orders hold the same sums."""
    for step in range(3):
        batches = {order: training_batch(11, step, 24, 1, 12, operand_order=order, base=base)
                   for order in OPERAND_ORDERS}
        for order, batch in batches.items():
            for i in range(batch.input_ids.shape[0]):
                ids = batch.input_ids[i].tolist()
                n = int(batch.widths[i])
                length = 3 * n + 4
                text = decode(ids[:length])
                width, a, b, answer = _read_back(text, base, order)
                assert width == n and set(text[: 2 * n + 1]) <= set("0123456789"[:base] + "+")
                assert answer == _reversed_digits(a + b, n + 1, base)
                assert ids[length:] == [PAD_ID] * (len(ids) - length)
                assert batch.loss_mask[i].nonzero().flatten().tolist() == list(range(2 * n + 2, length))
                assert batch.digit_mask[i].nonzero().flatten().tolist() == list(range(2 * n + 2, length - 1))
        msd, lsd = (torch.where(b.loss_mask, b.input_ids, -1) for b in batches.values())
        assert torch.equal(msd, lsd) and torch.equal(batches["msd"].widths, batches["lsd"].widths)


def test_operands_take_every_digit_in_the_leading_place():
    """The operands are uniform over [0, base^n): zero-padded, the leading digit is 0 as often as any
    other (about 1 in 10 in decimal, 1 in 2 in binary), not forced to be nonzero."""
    for base, per in ((10, 2000), (2, 400)):
        firsts = [s.prompt[0] for s in width_set(5, [4], per, base=base)[4]]
        counts = [firsts.count(str(d)) for d in range(base)]
        assert sum(counts) == per and min(counts) > 0.8 * per / base and max(counts) < 1.2 * per / base


def test_training_widths_are_uniform_over_the_range():
    """20 batches of 256 from widths 1-32: every width drawn, none outside, and Pearson's chi-square
    against the uniform counts below the 0.1 % point of chi-square with 31 degrees of freedom (61.1)."""
    widths = torch.cat([training_batch(3, step, 256, 1, 32).widths for step in range(20)])
    counts = torch.bincount(widths, minlength=33)
    assert counts[0] == 0 and (counts[1:] > 0).all() and widths.numel() == 20 * 256
    expected = widths.numel() / 32
    chi2 = float(((counts[1:].double() - expected) ** 2 / expected).sum())
    assert chi2 < 61.1
    narrow = torch.cat([training_batch(3, step, 64, 3, 7).widths for step in range(10)])
    assert set(narrow.tolist()) == {3, 4, 5, 6, 7}


# the documented recipe, in the standard library only: a string-seeded random.Random per batch (and per
# evaluation width), a width drawn inclusive, then a and b uniform below base**width
_REDRAW = """
import json, random, sys
seed, step, size, lo, hi, base, eval_seed, width, per = json.loads(sys.argv[1])
rng = random.Random(f"{seed}/train/{step}")
train = []
for _ in range(size):
    w = rng.randint(lo, hi)
    train.append([w, rng.randrange(base ** w), rng.randrange(base ** w)])
rng = random.Random(f"{eval_seed}/eval/{width}")
held = [[rng.randrange(base ** width), rng.randrange(base ** width)] for _ in range(per)]
print(json.dumps([train, held]))
"""


def _redrawn(hash_seed: str, *params):
    out = subprocess.run([sys.executable, "-c", _REDRAW, json.dumps(params)], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": hash_seed})
    return json.loads(out.stdout)


def _sums(batch):
    return [list(_read_back(decode(row[: 3 * int(w) + 4]), 10, "msd")[:3])
            for row, w in zip(batch.input_ids.tolist(), batch.widths)]


def test_the_streams_are_the_documented_recipe_in_any_process():
    """The training batch of a step and an evaluation set are the draws of random.Random seeded by the
    strings '{seed}/train/{step}' and '{eval_seed}/eval/{width}', redrawn here by the standard library in
    two other processes under other hash seeds: the same sums on every machine."""
    params = (7, 13, 20, 1, 32, 10, 1234, 40, 5)
    first, second = _redrawn("1", *params), _redrawn("2", *params)
    assert first == second
    train, held = first
    assert _sums(training_batch(7, 13, 20, 1, 32)) == train
    assert [[s.a, s.b] for s in width_set(1234, [40], 5)[40]] == held


def test_samples_do_not_depend_on_order_global_state_batch_size_or_evaluation_batching():
    """A resumed run draws the batch of step k without the steps before it, whatever the global torch
    and Python random states; a larger batch extends a smaller one; evaluation batches of any size hold
    the same samples; other seeds, and the training and evaluation streams, differ."""
    torch.manual_seed(0)
    random.seed(0)
    late = training_batch(5, 9, 32, 1, 32, operand_order="lsd", base=3, abacus_offset=4)
    torch.manual_seed(1)
    random.seed(1)
    for step in range(9):
        training_batch(5, step, 32, 1, 32)
    again = training_batch(5, 9, 32, 1, 32, operand_order="lsd", base=3, abacus_offset=4)
    assert all(torch.equal(x, y) for x, y in zip(vars(late).values(), vars(again).values()))
    assert _sums(training_batch(5, 9, 8)) == _sums(training_batch(5, 9, 32))[:8]
    assert width_set(5, [6], 4)[6] == width_set(5, [6], 10)[6][:4]
    texts = lambda batches: [decode(row) for bs in batches.values() for b in bs for row in b.input_ids.tolist()]  # noqa: E731
    assert texts(eval_batches(1234, range(1, 4), 7, 2)) == texts(eval_batches(1234, range(1, 4), 7, 256))
    assert _sums(training_batch(5, 9, 8)) != _sums(training_batch(6, 9, 8))
    held = [[s.a, s.b] for s in width_set(5, [8], 8)[8]]
    assert held != [[s.a, s.b] for s in width_set(6, [8], 8)[8]]
    assert held != [[a, b] for w, a, b in _sums(training_batch(5, 0, 64, 8, 8))][:8]


def test_samples_refuse_operands_and_widths_without_an_n_digit_text():
    """A width below 1 wrote '+=0$'; an operand of n + 1 digits or a negative one failed only when its
    text was asked for, naming an 'x'; a boolean read as 1. Each is refused at construction, named."""
    for args, name in (((0, 0, 0), "width"), ((1, 1, 2.0), "width"), ((1, 1, True), "width"),
                       ((-1, 2, 1), "a"), ((10, 2, 1), "a"), ((True, 1, 1), "a"), ((3, 8, 3, "msd", 2), "b")):
        with pytest.raises(ValueError, match=rf"^{name} must be an integer"):
            AdditionSample(*args)
    assert AdditionSample(7, 7, 3, base=2).text == "111+111=0111$"  # the largest operands fit
    with pytest.raises(ValueError, match="width"):
        make_sample(random.Random(0), 0)


def test_predictions_that_do_not_line_up_with_the_tokens_are_refused():
    """pred_ids[b, t] predicts token t + 1: [B, T - 1], or [B, T] with the prediction after the last
    token. A wider one (predictions of a longer text, or a leading column) was cut silently and scored
    against the wrong tokens; it is refused naming pred_ids, as are other batch sizes and ranks."""
    batch = collate([AdditionSample(57, 968, 3), AdditionSample(4, 9, 1)])
    B, T = batch.input_ids.shape
    gold = batch.input_ids[:, 1:]
    for ok in (gold, torch.cat([gold, gold[:, :1]], 1)):
        correct, total = score_predictions(ok, batch)
        assert correct.tolist() == total.tolist() == [4, 2]
        assert position_hits(ok, batch).tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    # the gold tokens with one leading column: every sum digit read one place late
    shifted = torch.cat([torch.full((B, 1), PAD_ID), gold], 1)
    assert shifted.shape == (B, T)  # a [B, T] prediction is taken as documented: here all wrong
    assert score_predictions(shifted, batch)[0].tolist() == [0, 0]
    for bad in (torch.cat([shifted, gold[:, :1]], 1), gold[:, :-1], gold[:1], gold.flatten(),
                torch.nn.functional.one_hot(gold, 14)):
        for fn in (score_predictions, position_hits):
            with pytest.raises(ValueError, match=r"^pred_ids: shape"):
                fn(bad, batch)
    all_pads = torch.full((B, T - 1), PAD_ID)
    assert score_predictions(all_pads, batch)[0].tolist() == [0, 0]
