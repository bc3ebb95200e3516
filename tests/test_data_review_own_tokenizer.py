"""``--tokenizer DIR/tokenizer --out DIR --overwrite`` (tokenize again with the tokenizer a preparation saved, e.g.
after the corpus changed) records that folder as the preparation left it, once it saved the tokenizer there: a
later run with the same options reuses the shards, rather than finding the folder it rewrote changed."""
import os

from test_data_sources import run_data, words
from transformers import AutoTokenizer

from falcon_fwa.data import TokenShards


def written(out):
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, names in os.walk(out) for f in names if f != ".prepare.lock"}


def test_the_output_s_own_tokenizer_folder_tokenizes_again_and_is_reused(tmp_path, capsys):
    src, out = tmp_path / "c", tmp_path / "out"
    src.mkdir()
    docs = words(30, 3)
    for i, doc in enumerate(docs[:20]):
        (src / f"{i:02d}.txt").write_text(doc)
    status, first, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "bpe:300", "--out", out)
    assert status == 0, err
    reference = AutoTokenizer.from_pretrained(str(out / "tokenizer"))  # the tokenizer the shards were written with

    for i, doc in enumerate(docs[20:], 20):  # the corpus grows: tokenize it again with the same tokenizer
        (src / f"{i:02d}.txt").write_text(doc)
    argv = ["--train", src, "--val-every", 5, "--tokenizer", out / "tokenizer", "--out", out]
    status, record, err = run_data(capsys, *argv, "--overwrite")
    assert status == 0, err
    assert record["vocab_size"] == first["vocab_size"] and record["counts"]["train"]["n_docs"] == 24
    train = [d for i, d in enumerate(docs) if i % 5 != 4]
    expected = [[reference.eos_token_id] + reference(d, add_special_tokens=False)["input_ids"] for d in train]
    assert [d.tolist() for d in TokenShards(str(out / "train")).documents()] == expected
    before = written(out)
    status, again, err = run_data(capsys, *argv)
    assert (status, again) == (0, record) and written(out) == before, err
