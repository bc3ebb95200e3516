"""Perplexity's building blocks by hand: windows of a stream (also one whose length is a whole number of
windows, and one too short for any), the held-out stream of a text file (end-of-text opening each
document, --max-windows' cut and its refusal below 1), bucket edges (their default and their checks), buckets straddling the
training length or holding no prediction, and ``ppl --dtype bf16`` running under autocast."""
import json
import math

import numpy as np
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.eval import bucket_report, default_edges, position_nll, token_stream, windows
from falcon_fwa.eval.perplexity import check_edges

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 256


@pytest.mark.parametrize("length, want", [(13, 3), (12, 2), (11, 2), (9, 2), (8, 1), (5, 1)])
def test_windows_overlap_by_one_token_and_leave_out_the_tail(length, want):
    """N = (len - 1) // seq_len windows of seq_len + 1 tokens, window i starting at i * seq_len: a stream of
    12 tokens has 11 predictions, two whole windows of 4, and the tokens after position 8 are in none."""
    tokens = np.arange(length, dtype=np.int64) + 100
    rows = windows(tokens, 4)
    assert rows.shape == (want, 5) and rows.dtype == torch.int64
    for i in range(want):
        assert rows[i].tolist() == list(range(100 + 4 * i, 100 + 4 * i + 5))
    assert windows(tokens, 4, max_windows=1).tolist() == [[100, 101, 102, 103, 104]]


@pytest.mark.parametrize("length", [1, 2, 4])
def test_a_stream_too_short_for_one_window_is_refused_naming_seq_len(length):
    with pytest.raises(ValueError, match="seq_len=4"):
        windows(np.arange(length, dtype=np.int64), 4)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_windows_below_one_or_no_integer_is_refused_by_its_name(bad):
    """``max_windows`` 0 gave "N held-out tokens are fewer than one window" for a stream of many windows; now
    the refusal names ``max_windows`` (or the option the caller's ``name`` maps it to)."""
    with pytest.raises(ValueError, match=r"^max_windows must be an integer >= 1"):
        windows(np.arange(100, dtype=np.int64), 4, max_windows=bad)
    with pytest.raises(ValueError, match=r"^--max-windows must be"):
        windows(np.arange(100, dtype=np.int64), 4, max_windows=bad, name=lambda f: "--" + f.replace("_", "-"))
    assert windows(np.arange(100, dtype=np.int64), 4, max_windows=30).shape == (24, 5)  # more than there are


def test_the_stream_of_a_text_file_opens_every_document_with_end_of_text(tmp_path):
    text = tmp_path / "held.txt"
    text.write_text("ab\n\ncd\n\n\u00e9\n")
    tok = byte_tokenizer()
    want = [EOS, 97, 98, EOS, 99, 100, EOS, 0xC3, 0xA9, 10]
    assert token_stream([str(text)], tok, text_split="paragraph").tolist() == want
    for n in (1, 3, 4, 6, 7, 10, 50):  # a cut inside a document, at its end and past the stream
        assert token_stream([str(text)], tok, text_split="paragraph", max_tokens=n).tolist() == want[:n]
    assert token_stream([str(text)], tok, text_split="file").tolist() == [EOS] + list("ab\n\ncd\n\n\u00e9\n".encode())


def test_default_edges_double_from_first_and_end_at_seq_len():
    assert default_edges(256, first=64) == [0, 64, 128, 256]
    assert default_edges(64, first=64) == [0, 64]
    assert default_edges(65, first=64) == [0, 64, 65]
    assert default_edges(10, first=64) == [0, 10]
    for seq_len in (1, 64, 100, 128, 1024, 1500):
        check_edges(default_edges(seq_len), seq_len)


@pytest.mark.parametrize("edges", [[2, 5, 12], [0, 4, 4, 12], [0, 5, 4, 12], [0, 4, 11], [0, 4, 13], [], [0]])
def test_edges_that_do_not_rise_strictly_from_zero_to_seq_len_are_refused(edges):
    with pytest.raises(ValueError, match="seq_len=12"):
        check_edges(edges, 12)
    with pytest.raises(ValueError, match="seq_len=12"):
        bucket_report(torch.ones(12, dtype=torch.float64), 1, edges)


def test_buckets_by_hand_straddling_the_training_length_and_empty():
    """A bucket is beyond the training length when it starts at or after it: [3, 8) holds positions 3 < 4
    and is not. A bucket without predictions reports no loss; the overall figures pool the others."""
    total = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    count = torch.tensor([1.0, 1.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    rep = bucket_report(total, count, [0, 2, 3, 4, 8], train_len=3, windows=2)
    b = rep["buckets"]
    assert [x["beyond_train_len"] for x in b] == [False, False, True, True]
    assert [x["tokens"] for x in b] == [2, 2, 0, 0]
    assert b[0]["loss"] == pytest.approx(1.5) and b[1]["loss"] == pytest.approx(1.5)
    assert b[0]["ppl"] == pytest.approx(math.exp(1.5))
    assert b[2]["loss"] is None and b[2]["ppl"] is None and b[3]["loss"] is None
    assert rep["tokens"] == 4 and rep["loss"] == pytest.approx(6.0 / 4) and rep["windows"] == 2
    straddle = bucket_report(total, count, [0, 3, 8], train_len=4)["buckets"]
    assert [x["beyond_train_len"] for x in straddle] == [False, False]
    with pytest.raises(ValueError, match="no predictions"):
        bucket_report(torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), [0, 4])


def test_ppl_dtype_bf16_scores_under_autocast(tmp_path):
    """``--dtype bf16``: the report is position_nll's under bf16 autocast, not the float32 one."""
    from falcon_fwa.cli import main

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5)).eval()
    tok = byte_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    text = tmp_path / "held.txt"
    text.write_text("fast weight attention reads the state memory and writes a value\n" * 3)
    rows = windows(token_stream([str(text)], tok), 16, max_windows=2)
    reports = {}
    for dtype in ("fp32", "bf16"):
        out = tmp_path / f"{dtype}.json"
        assert main(["ppl", "--model", str(tmp_path / "m"), "--data", str(text), "--seq-len", "16",
                     "--buckets", "0,16", "--max-windows", "2", "--documents", "carry", "--dtype", dtype,
                     "--device", "cpu", "--out", str(out)]) == 0
        reports[dtype] = json.load(open(out))
        total, count = position_nll(model, rows, batch_size=1, progress=False, bf16=dtype == "bf16")
        assert reports[dtype]["loss"] == pytest.approx(float(total.sum() / count.sum()), rel=1e-6)
    assert abs(reports["bf16"]["loss"] - reports["fp32"]["loss"]) > 1e-4
