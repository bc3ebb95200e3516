"""Addition task: generator, checker, batches and teacher-forced metrics."""
import random

import pytest
import torch

from falcon_fwa.tasks.addition.data import (
    END,
    VOCAB,
    AdditionSample,
    check_text,
    collate,
    decode,
    encode,
    make_sample,
    training_batch,
    width_set,
)
from falcon_fwa.tasks.addition.metrics import AccuracyTally, position_hits, score_logits, score_predictions


def schoolbook_reversed_sum(a: str, b: str) -> str:
    """Digit-by-digit addition with carries, least significant digit first (independent reference)."""
    out, carry = [], 0
    for da, db in zip(reversed(a), reversed(b)):
        s = int(da) + int(db) + carry
        out.append(str(s % 10))
        carry = s // 10
    out.append(str(carry))
    return "".join(out)


def test_samples_are_correct_sums_at_every_width():
    rng = random.Random(0)
    for width in list(range(1, 49)) * 5:
        s = make_sample(rng, width)
        prompt, answer_end = s.text.split("=")
        a, b = prompt.split("+")
        assert len(a) == len(b) == width and a.isdigit() and b.isdigit()
        assert answer_end == schoolbook_reversed_sum(a, b) + END
        assert len(s.text) == 3 * width + 4
        assert check_text(s.text)


def test_carry_chain_example():
    s = AdditionSample(a=999, b=1, width=3)
    assert s.text == "999+001=0001$"
    assert AdditionSample(a=57, b=968, width=3).text == "057+968=5201$"


def test_lsd_operand_order_by_hand():
    s = AdditionSample(a=57, b=968, width=3, operand_order="lsd")
    assert s.prompt == "750+869=" and s.text == "750+869=5201$"
    assert s.answer == AdditionSample(a=57, b=968, width=3).answer == "5201"
    assert check_text("750+869=5201$", "lsd") and not check_text("750+869=5201$")
    # a well-formed msd sample (12 + 34 = 46) whose reversed operands (21 + 43 = 64) do not sum to its answer
    assert check_text("12+34=640$") and not check_text("12+34=640$", operand_order="lsd")
    assert check_text("21+43=640$", "lsd")


def schoolbook_binary(a: str, b: str) -> str:
    """Bit-by-bit addition with carries, least significant bit first (independent reference)."""
    out, carry = [], 0
    for da, db in zip(reversed(a), reversed(b)):
        s = (da == "1") + (db == "1") + carry
        out.append("1" if s % 2 else "0")
        carry = s // 2
    out.append(str(carry))
    return "".join(out)


def test_binary_samples_by_hand_and_against_schoolbook():
    s = AdditionSample(a=5, b=3, width=3, base=2)  # 101 + 011 = 1000
    assert s.text == "101+011=0001$" and check_text(s.text, base=2) and not check_text(s.text)
    assert AdditionSample(a=5, b=3, width=3, operand_order="lsd", base=2).text == "101+110=0001$"
    assert AdditionSample(a=8, b=7, width=2, base=9).text == "08+07=610$"  # 8 + 7 = 15 = 16 in base 9
    rng = random.Random(3)
    for width in list(range(1, 49)) * 3:
        s = make_sample(rng, width, base=2)
        a, b = s.prompt[:-1].split("+")
        assert len(a) == len(b) == width and set(a + b) <= {"0", "1"}
        assert s.answer == schoolbook_binary(a, b) and check_text(s.text, base=2)
    assert not check_text("12+01=011$", base=2)  # a digit that is not binary
    assert check_text("2+2=11$", base=3) and not check_text("2+2=11$", base=2)


def test_invalid_base_is_rejected():
    for bad in (1, 11, 0, 2.0, True, "2"):
        for call in (lambda: AdditionSample(1, 1, 1, base=bad), lambda: check_text("1+1=01", base=bad),
                     lambda: make_sample(random.Random(0), 2, base=bad),
                     lambda: training_batch(0, 0, 2, base=bad), lambda: width_set(0, [2], 2, base=bad)):
            with pytest.raises(ValueError, match="base"):
                call()
    with pytest.raises(ValueError, match="fit"):
        AdditionSample(8, 0, 3, base=2).prompt  # 8 needs four bits


def test_invalid_operand_order_is_rejected():
    for call in (lambda: AdditionSample(1, 2, 1, "rev"), lambda: check_text("1+2=30", "MSD"),
                 lambda: make_sample(random.Random(0), 2, operand_order="backwards"),
                 lambda: training_batch(0, 0, 2, operand_order=""), lambda: width_set(0, [2], 2, operand_order="x")):
        with pytest.raises(ValueError, match="operand_order"):
            call()


@pytest.mark.parametrize("order", ["msd", "lsd"])
def test_generated_samples_pass_the_checker_of_their_order(order):
    rng = random.Random(1)
    other = {"msd": "lsd", "lsd": "msd"}[order]
    disagree = 0
    for width in list(range(1, 33)) * 4:
        s = make_sample(rng, width, operand_order=order)
        assert s.operand_order == order and check_text(s.text, order)
        disagree += not check_text(s.text, other)
    assert disagree > 100  # the other reading is wrong for almost every sample of width >= 2
    for samples in width_set(2, [3, 17], 5, operand_order=order).values():
        assert all(check_text(s.text, order) for s in samples)


def test_lsd_training_batches_reverse_only_the_operands():
    msd, lsd = training_batch(4, 9, 32, 1, 12), training_batch(4, 9, 32, 1, 12, operand_order="lsd")
    for name in ("loss_mask", "digit_mask", "widths"):
        assert torch.equal(getattr(msd, name), getattr(lsd, name)), name
    suffix = msd.loss_mask | (msd.input_ids == encode("_")[0])
    assert torch.equal(msd.input_ids[suffix], lsd.input_ids[suffix])  # answers, end markers and padding
    for m, l, w in zip(msd.input_ids, lsd.input_ids, msd.widths.tolist()):
        a, b = decode(m[: 2 * w + 1]).split("+")
        assert decode(l[: 2 * w + 2]) == a[::-1] + "+" + b[::-1] + "="
    assert not torch.equal(msd.input_ids, lsd.input_ids)


def test_checker_rejects_wrong_and_malformed_texts():
    assert check_text("057+968=5201$") and check_text("057+968=5201")
    for bad in ["057+968=5211$", "057+968=1025$", "57+968=5201$", "057+968=520$", "057968=5201$",
                "057+968=52a1$", "+=0", ""]:
        assert not check_text(bad), bad


def test_checker_rejects_extra_digits_and_extra_or_misplaced_markers():
    # 57 + 968 = 1025: the end marker is optional, nothing else may be added or moved
    assert check_text("057+968=5201$") and check_text("057+968=5201")
    for bad in ["057+968=52010$", "057+968=52010", "057+968=520100$",  # over-long: still 1025 when read as a number
                "057+968+000=5201$", "057+968=52+01$", "+057+968=5201$",  # a second "+"
                "057+968==5201$", "057+968=5201=$", "057=968=5201$", "057+968=5201=5201$",  # a second "="
                "057+968=5201$$", "057+968=52$01$", "057+968=5201$0", "$057+968=5201"]:  # end marker not last
        assert not check_text(bad), bad


def test_generator_is_deterministic_and_seeded():
    b1, b2 = training_batch(3, 17, 16), training_batch(3, 17, 16)
    assert torch.equal(b1.input_ids, b2.input_ids)
    assert not torch.equal(training_batch(3, 18, 16).input_ids[:, :4], b1.input_ids[:, :4])
    assert width_set(0, [5, 40], 3) == width_set(0, [5, 40], 3)
    assert width_set(0, [5], 3) != width_set(1, [5], 3)
    widths = training_batch(0, 0, 512, 1, 32).widths
    assert widths.min() == 1 and widths.max() == 32


def test_tokenizer_round_trip_and_errors():
    text = "0123456789+=$_"
    assert decode(encode(text)) == text
    assert VOCAB[0] == "_" and len(set(VOCAB)) == len(VOCAB)
    with pytest.raises(ValueError, match="text"):
        encode("12-3")


def test_collate_masks_cover_the_target_suffix_only():
    samples = [AdditionSample(57, 968, 3), AdditionSample(4, 9, 1)]
    batch = collate(samples)
    assert batch.input_ids.shape == (2, 13)
    assert decode(batch.input_ids[1]) == "4+9=31$" + "_" * 6
    for i, s in enumerate(samples):
        assert decode(batch.input_ids[i][batch.loss_mask[i]]) == s.answer + END
        assert decode(batch.input_ids[i][batch.digit_mask[i]]) == s.answer
    assert batch.widths.tolist() == [3, 1]


def _one_hot_logits(pred: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(pred, len(VOCAB)).float() * 5.0


def test_accuracy_on_hand_made_predictions():
    # widths 3 and 1: answers "5201" (4 digits) and "31" (2 digits)
    batch = collate([AdditionSample(57, 968, 3), AdditionSample(4, 9, 1)])
    gold_next = batch.input_ids[:, 1:]
    pred = gold_next.clone()
    # sample 0: one wrong sum digit (the third, position 10 of the text) -> 3/4, not exact
    pred[0, 10 - 1] = encode("7")[0]
    # sample 1: wrong prompt prediction and wrong end marker -> not scored, still exact
    pred[1, 0] = encode("9")[0]
    pred[1, 6 - 1] = encode("0")[0]
    correct, total = score_predictions(pred, batch)
    assert correct.tolist() == [3, 2] and total.tolist() == [4, 2]
    assert torch.equal(torch.stack(score_logits(_one_hot_logits(torch.cat([pred, pred[:, :1]], 1)), batch)),
                       torch.stack([correct, total]))

    tally = AccuracyTally()
    tally.add(batch.widths, correct, total)
    # a second batch at width 3, every digit wrong
    b3 = collate([AdditionSample(1, 2, 3)])
    tally.add(b3.widths, *score_predictions((b3.input_ids[:, 1:] + 1) % len(VOCAB), b3))
    assert tally.digit_acc([3]) == pytest.approx(100 * 3 / 8)
    assert tally.exact_acc([3]) == 0.0
    assert tally.exact_acc([1]) == 100.0
    assert tally.digit_acc([1, 3]) == pytest.approx(100 * 5 / 10)
    assert tally.exact_acc([1, 3]) == pytest.approx(100 / 3)
    assert tally.per_width()[1] == {"digit": 100.0, "exact": 100.0}


def test_position_hits_on_hand_made_predictions():
    # widths 3 and 1: answers "5201" and "31"; sample 0 wrong at its third sum digit (answer position 2)
    batch = collate([AdditionSample(57, 968, 3), AdditionSample(4, 9, 1)])
    pred = batch.input_ids[:, 1:].clone()
    pred[0, 10 - 1] = encode("7")[0]
    pred[1, 0] = encode("9")[0]  # a prompt token: not an answer position
    hits = position_hits(pred, batch)
    assert hits.tolist() == [[1, 1, 0, 1], [1, 1, 0, 0]]  # zeros past the 2 digits of width 1

    tally = AccuracyTally()
    tally.add(batch.widths, *score_predictions(pred, batch), positions=hits)
    b3 = collate([AdditionSample(1, 2, 3)])
    wrong = (b3.input_ids[:, 1:] + 1) % len(VOCAB)
    tally.add(b3.widths, *score_predictions(wrong, b3), positions=position_hits(wrong, b3))
    assert tally.per_position() == {1: [100.0, 100.0], 3: [50.0, 50.0, 0.0, 50.0]}
    # a batch added without positions counts for the widths' accuracies, not for the positions
    tally.add(b3.widths, *score_predictions(wrong, b3))
    assert tally.per_position()[3] == [50.0, 50.0, 0.0, 50.0]
    assert tally.digit_acc([3]) == pytest.approx(100 * 3 / 12)


def test_position_hits_sum_to_the_sample_scores():
    rng = random.Random(3)
    samples = [make_sample(rng, w) for w in (1, 4, 2, 7, 7, 3)]
    for order in ("msd", "lsd"):
        batch = collate([make_sample(rng, s.width, operand_order=order) for s in samples])
        gen = torch.Generator().manual_seed(5)
        # predictions right about half the time, anywhere in the text
        noise = torch.randint(0, len(VOCAB), batch.input_ids[:, 1:].shape, generator=gen)
        keep = torch.rand(noise.shape, generator=gen) < 0.5
        pred = torch.where(keep, batch.input_ids[:, 1:], noise)
        hits = position_hits(pred, batch)
        correct, total = score_predictions(pred, batch)
        assert torch.equal(hits.sum(1), correct)
        for b in range(len(samples)):  # each position is the digit written k-th after "="
            w = int(batch.widths[b])
            digits = batch.digit_mask[b, 1:].nonzero().flatten()
            assert digits.numel() == total[b] == w + 1
            expected = (pred[b, digits] == batch.input_ids[b, 1:][digits]).long()
            assert torch.equal(hits[b, : w + 1], expected) and not hits[b, w + 1:].any()


def test_digit_index_counts_places_from_the_units_in_either_operand_order():
    from falcon_fwa.tasks.addition.data import AdditionSample, digit_index
    msd = AdditionSample(57, 968, 3)  # "057+968=5201$"
    assert msd.text == "057+968=5201$"
    assert digit_index(msd) == [3, 2, 1, 0, 3, 2, 1, 0, 1, 2, 3, 4, 0]
    lsd = AdditionSample(57, 968, 3, operand_order="lsd")  # "750+869=5201$"
    assert lsd.text == "750+869=5201$"
    assert digit_index(lsd) == [1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0]
    # in a batch: right-padded with index 0, and an offset moves the digits only
    b = collate([msd, AdditionSample(1, 2, 1)], offsets=[0, 5])
    assert b.digit_index[0].tolist() == digit_index(msd)
    assert b.digit_index[1].tolist() == [6, 0, 6, 0, 6, 7, 0] + [0] * 6  # "1+2=30$" then padding
    with pytest.raises(ValueError, match="offsets"):
        collate([msd], offsets=[1, 2])


def test_abacus_offsets_shift_the_indices_and_leave_the_sums_alone():
    plain = training_batch(7, 3, 64, 1, 6)
    shifted = training_batch(7, 3, 64, 1, 6, abacus_offset=4)
    assert torch.equal(plain.input_ids, shifted.input_ids)  # the same sums
    assert torch.equal(shifted.digit_index, training_batch(7, 3, 64, 1, 6, abacus_offset=4).digit_index)
    digits = plain.digit_index > 0
    assert torch.equal(shifted.digit_index > 0, digits)  # non-digits and padding stay at 0
    offset = shifted.digit_index - plain.digit_index  # one offset per sample, on all its digits
    per_sample = [set(o[d].tolist()) for o, d in zip(offset, digits)]
    assert all(len(s) == 1 for s in per_sample)
    drawn = {next(iter(s)) for s in per_sample}
    assert drawn == set(range(5))  # 64 draws reach both ends of [0, 4]
    assert torch.equal(training_batch(7, 3, 64, 1, 6, abacus_offset=0).digit_index, plain.digit_index)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="abacus_offset"):
            training_batch(0, 0, 2, abacus_offset=bad)
