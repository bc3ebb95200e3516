"""Perplexity against a direct reference on a tiny float64 Falcon: every scored token predicted by its
own forward pass over exactly the context the module documents (the window's tokens since the later of
the window's start and the last end-of-text), torch.log_softmax, exp of the mean; counts, buckets,
batch sizes, --max-windows, bf16 autocast and the command's JSON and printed table."""
import json
import math

import numpy as np
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.eval import bucket_report, position_nll, windows

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 256  # the byte tokenizer's end-of-text id


def _model(dtype=torch.float64):
    torch.manual_seed(0)
    return FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5)).to(dtype).eval()


def _stream(lengths, seed=0):
    """Documents of the given lengths, each opened by end-of-text (as token_stream makes them)."""
    rng = np.random.default_rng(seed)
    return np.concatenate([np.concatenate([[EOS], rng.integers(97, 123, n)]) for n in lengths]).astype(np.int64)


def _reference(model, tokens, seq_len, n_windows, *, reset, autocast=False):
    """Per-position NLL sums and counts (float64): target ``tokens[s + j + 1]`` of window ``s`` is predicted
    by one forward pass over its context alone; under ``reset`` the context starts at the last end-of-text
    at or after the window's start, and an end-of-text target is not scored."""
    total = torch.zeros(seq_len, dtype=torch.float64)
    count = torch.zeros(seq_len, dtype=torch.float64)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.autocast("cpu", enabled=False)
    for w in range(n_windows):
        s = w * seq_len
        for j in range(seq_len):
            i, target = s + j, int(tokens[s + j + 1])
            start = s
            if reset:
                if target == EOS:
                    continue
                start = max([s] + [k for k in range(s, i + 1) if tokens[k] == EOS])
            with torch.no_grad(), ctx:
                logits = model(input_ids=torch.as_tensor(tokens[None, start:i + 1]), use_cache=False).logits
            logp = torch.log_softmax(logits[0, -1].double(), -1)
            total[i - start] -= logp[target]
            count[i - start] += 1
    return total, count


def test_perplexity_is_exp_of_the_mean_nll_of_the_documented_tokens():
    model, seq_len = _model(), 12
    tokens = _stream([5, 9, 2, 17, 1, 7, 3])  # 51 tokens: 4 windows of 12 (+1), ends inside windows
    rows = windows(tokens, seq_len)
    assert rows.shape == (4, 13) and torch.equal(rows[1:, 0], rows[:-1, -1])  # each token predicted once
    for reset in (False, True):
        want_total, want_count = _reference(model, tokens, seq_len, 4, reset=reset)
        eos_id = EOS if reset else None
        got = {b: position_nll(model, rows, batch_size=b, progress=False, eos_id=eos_id) for b in (1, 3, 4)}
        for b, (total, count) in got.items():
            assert total.dtype == count.dtype == torch.float64
            torch.testing.assert_close(count, want_count, rtol=0, atol=0)
            torch.testing.assert_close(total, want_total, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(total, got[1][0], rtol=1e-12, atol=1e-12)  # batch size invariance
        n_eos_targets = int((rows[:, 1:] == EOS).sum())
        assert int(want_count.sum()) == 4 * seq_len - (n_eos_targets if reset else 0)
        edges = [0, 2, 5, seq_len]
        rep = bucket_report(*got[4], edges, windows=4)
        assert rep["tokens"] == int(want_count.sum()) and rep["windows"] == 4
        assert rep["ppl"] == pytest.approx(math.exp(float(want_total.sum() / want_count.sum())), rel=1e-12)
        for b, (lo, hi) in zip(rep["buckets"], zip(edges[:-1], edges[1:])):
            n = float(want_count[lo:hi].sum())
            assert b["tokens"] == int(n) and b["ppl"] == pytest.approx(math.exp(float(want_total[lo:hi].sum()) / n),
                                                                       rel=1e-12)
    # the first windows alone: --max-windows takes a prefix of the same windows
    total2, count2 = position_nll(model, windows(tokens, seq_len, max_windows=2), progress=False, eos_id=EOS)
    want2 = _reference(model, tokens, seq_len, 2, reset=True)
    torch.testing.assert_close((total2, count2), want2, rtol=1e-10, atol=1e-10)


def test_bf16_autocast_scores_its_own_logits_in_float():
    """Under bf16 autocast the logits are scored in float32 and summed in float64: the result equals the
    autocast forwards' logits scored in float64, and differs from the float32 evaluation (autocast ran)."""
    model, seq_len = _model(torch.float32), 12
    tokens = _stream([5, 9, 2, 17, 1, 7, 3])
    rows = windows(tokens, seq_len, max_windows=2)
    for reset in (False, True):
        total, count = position_nll(model, rows, batch_size=2, progress=False, bf16=True,
                                    eos_id=EOS if reset else None)
        want_total, want_count = _reference(model, tokens, seq_len, 2, reset=reset, autocast=True)
        torch.testing.assert_close(count, want_count, rtol=0, atol=0)
        torch.testing.assert_close(total, want_total, rtol=1e-4, atol=1e-4)
        fp32_total, _ = position_nll(model, rows, batch_size=2, progress=False, eos_id=EOS if reset else None)
        assert float((total - fp32_total).abs().max()) > 1e-2


def test_position_nll_names_a_bad_batch_size():
    model = _model()
    rows = windows(_stream([20]), 8)
    with pytest.raises(ValueError, match="batch_size"):
        position_nll(model, rows, batch_size=0, progress=False)


@pytest.mark.parametrize("documents", ["reset", "carry"])
def test_ppl_command_reports_the_reference_figures(tmp_path, capsys, documents):
    """``falcon-fwa ppl`` on a text file (paragraphs as documents): the JSON's loss, perplexity, token
    counts and buckets, and the printed table, are those of the direct reference; --max-windows limits."""
    from falcon_fwa.cli import main
    from falcon_fwa.eval import token_stream

    model, tok = _model(torch.float32), byte_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    text = tmp_path / "held.txt"
    text.write_text("\n\n".join(["the state", "memory key value", "a", "fast weight attention reads",
                                 "gate decay token value read write"] * 2) + "\n")
    out = tmp_path / "ppl.json"
    assert main(["ppl", "--model", str(tmp_path / "m"), "--data", str(text), "--text-split", "paragraph",
                 "--seq-len", "16", "--buckets", "0,4,16", "--max-windows", "3", "--batch-size", "2",
                 "--documents", documents, "--device", "cpu", "--out", str(out)]) == 0
    rep = json.load(open(out))
    tokens = token_stream([str(text)], tok, text_split="paragraph")
    assert len(tokens) > 3 * 16 + 1 and int((tokens == EOS).sum()) == 10
    want_total, want_count = _reference(model.double(), tokens, 16, 3, reset=documents == "reset")
    loss = float(want_total.sum() / want_count.sum())
    assert rep["windows"] == 3 and rep["documents"] == documents and rep["tokens"] == int(want_count.sum())
    assert rep["loss"] == pytest.approx(loss, rel=1e-5) and rep["ppl"] == pytest.approx(math.exp(loss), rel=1e-5)
    for b, (lo, hi) in zip(rep["buckets"], [(0, 4), (4, 16)]):
        assert (b["start"], b["end"], b["tokens"]) == (lo, hi, int(want_count[lo:hi].sum()))
        assert b["loss"] == pytest.approx(float(want_total[lo:hi].sum() / want_count[lo:hi].sum()), rel=1e-5)
    printed = capsys.readouterr().out
    assert f"perplexity {rep['ppl']:.4f} (loss {rep['loss']:.4f}) over {rep['tokens']} predictions, 3 windows" in printed
    for b in rep["buckets"]:
        assert f"{b['start']:>11}-{b['end']:<8} {b['tokens']:>10} {b['loss']:>8.4f} {b['ppl']:>10.4f}" in printed
