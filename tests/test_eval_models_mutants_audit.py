"""The harness model ``falcon-fwa``'s ``tok_batch_encode`` with right padding, on a tiny random model with the
byte tokenizer: each row is end-of-text + the text's ids followed by pads, its mask 1 over those real tokens
and 0 over the pads after them (also after left truncation, which keeps each row's last tokens, the opening
among them only where it fits), and the model's forward on that batch with that mask gives each row's
log-probabilities and the mean next-token loss over its real targets, as a float64 computation of each row
alone does. The model's loss never reads ``labels[:, 0]``: any value there gives the loss of ``labels[:, 1:]``."""
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
lm_eval = pytest.importorskip("lm_eval")


def _lm(tmp_path):
    """(harness model, float64 model, tokenizer) of a tiny Falcon saved with the byte tokenizer."""
    from falcon_fwa.eval.harness import lm_class

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5)).double().eval()
    tok = byte_tokenizer()
    folder = str(tmp_path / "m")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    lm = lm_class()(pretrained=folder, device="cpu", trust_remote_code=False, dtype="float64")
    return lm, model, tok


def _pad(tok):
    return tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id


def test_right_padded_batches_mark_the_real_tokens_first(tmp_path):
    lm, model, tok = _lm(tmp_path)
    eos, pad = tok.eos_token_id, _pad(tok)
    ids, mask = lm.tok_batch_encode(["ab", "abcd"], padding_side="right")
    assert ids.tolist() == [[eos, 97, 98, pad, pad], [eos, 97, 98, 99, 100]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    # left truncation keeps the last tokens of each row (the opening of the short one fits, the long one's not)
    ids, mask = lm.tok_batch_encode(["ab", "abcdef"], padding_side="right", left_truncate_len=4)
    assert ids.tolist() == [[eos, 97, 98, pad], [99, 100, 101, 102]]
    assert mask.tolist() == [[1, 1, 1, 0], [1] * 4]
    # the left-padded form of the same batch holds the same real tokens, its mask 1 over them
    left, left_mask = lm.tok_batch_encode(["ab", "abcd"])
    assert left_mask.tolist() == [[0, 0, 1, 1, 1], [1] * 5] and left[0, 2:].tolist() == [eos, 97, 98]


def test_the_forward_on_a_right_padded_batch_scores_each_row_as_alone(tmp_path):
    """Log-probabilities at the real tokens, and the loss with ``labels = input_ids``, equal those of each row
    run alone (float64 log-softmax of its own full-forward logits; the loss the mean NLL of every real target
    predicted from the real token before it)."""
    lm, model, tok = _lm(tmp_path)
    texts = ["the gate", "a", "fast weights"]
    ids, mask = lm.tok_batch_encode(texts, padding_side="right")
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    lp = out.logits.double().log_softmax(-1)
    nll, n = 0.0, 0
    for r, text in enumerate(texts):
        row = [tok.eos_token_id, *text.encode()]
        k = len(row)
        assert ids[r, :k].tolist() == row and mask[r].tolist() == [1] * k + [0] * (ids.shape[1] - k)
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([row]), use_cache=False).logits[0].double().log_softmax(-1)
        torch.testing.assert_close(lp[r, :k], alone, rtol=0, atol=1e-9)
        nll -= sum(float(alone[t - 1, row[t]]) for t in range(1, k))
        n += k - 1
    assert float(out.loss) == pytest.approx(nll / n, rel=1e-9, abs=0)


def test_the_first_column_of_labels_is_never_read(tmp_path):
    """``labels[:, 0]`` is no target (column ``t`` is scored against the logits of column ``t - 1``): any value
    there, one outside the vocabulary too, gives the loss of ``labels[:, 1:]`` alone, computed here in float64
    from the full-forward logits; a value outside it in a scored column is refused by name."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5)).double().eval()
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        lp = model(input_ids=ids, use_cache=False).logits.double().log_softmax(-1)
    want = -float(lp[:, :-1].gather(-1, ids[:, 1:, None]).mean())
    for first in (-1, -7, 320, 10 ** 6):
        labels = ids.clone()
        labels[:, 0] = first
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        assert float(loss) == pytest.approx(want, rel=1e-9, abs=0)
    labels = ids.clone()
    labels[1, 3] = 320
    with pytest.raises(ValueError, match=r"labels holds token id 320, outside the vocabulary \[0, 320\)"):
        model(input_ids=ids, labels=labels, use_cache=False)
