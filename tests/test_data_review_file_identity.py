"""A prepared folder is reused only while its inputs hold the bytes it was written from: a source or tokenizer file
rewritten since with other bytes of the same size is refused, as a file of another size is, and ``--overwrite``
then tokenizes the files as they are now; a file written again with the same bytes is no change."""
import json
import os
import re

from test_data_sources import run_data, words
from transformers import AutoTokenizer

from falcon_fwa.data import TokenShards
from falcon_fwa.data.tokenizer import train_bpe_tokenizer


def written(out):
    """When each file of a prepared folder was last written: a refusal or a reuse rewrites none."""
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, names in os.walk(out) for f in names if f != ".prepare.lock"}


def stored(folder):
    """The documents of a shard folder, each a list of token ids (end-of-text first)."""
    return [d.tolist() for d in TokenShards(str(folder)).documents()]


def later(path, seconds=2):
    """Set ``path``'s modification time ``seconds`` past what it is: a write that came later (a file's clock ticks
    in steps of milliseconds, so two writes in one test may otherwise share a time)."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def test_a_source_file_rewritten_to_the_same_size_is_refused_then_rebuilt(tmp_path, capsys):
    src, out, val = tmp_path / "c", tmp_path / "out", tmp_path / "v.txt"
    src.mkdir()
    texts = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]
    for i, text in enumerate(texts):
        (src / f"{i}.txt").write_text(text)
    val.write_text("kappa lambda")
    argv = ["--train", src, "--val", val, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    assert stored(out / "train") == [[256] + list(t.encode()) for t in texts]
    before = written(out)

    edited = "DELTA EPSILON"  # the same 13 bytes, other tokens
    assert len(edited.encode()) == len(texts[1].encode())
    (src / "1.txt").write_text(edited)
    later(src / "1.txt")
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and written(out) == before
    assert "other source files" in err and str(src / "1.txt") in err and "--overwrite" in err

    status, rebuilt, err = run_data(capsys, *argv, "--overwrite")
    assert status == 0, err
    assert stored(out / "train") == [[256] + list(t.encode()) for t in (texts[0], edited, texts[2])]
    assert rebuilt["counts"] == record["counts"]  # (the same sizes: the same counts, other tokens)
    after = written(out)
    status, again, err = run_data(capsys, *argv)  # as recorded now: reused unwritten
    assert (status, again) == (0, rebuilt) and written(out) == after, err
    (src / "1.txt").write_text(edited)  # written again, later, with the same bytes: no change
    later(src / "1.txt", 4)
    status, again, err = run_data(capsys, *argv)  # the record alone is written again, keeping the file's new time
    assert status == 0 and {**again, "stamps": None} == {**rebuilt, "stamps": None}, err
    assert again["stamps"]["train"][str(src / "1.txt")][0] == os.stat(src / "1.txt").st_mtime_ns
    record = str(out / "prepared.json")
    assert {k: v for k, v in written(out).items() if k != record} == {k: v for k, v in after.items() if k != record}
    after = written(out)

    val.write_text("KAPPA LAMBDA")  # the validation source counts the same way
    later(val)
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and str(val) in err and written(out) == after


def swap_ids(text, a, b):
    """``tokenizer.json`` text with the vocabulary ids ``a`` and ``b`` (of as many digits) exchanged: the same
    merges, the same size, other ids for two tokens."""
    pattern = {n: re.compile(rf'": {n}(,?\n)') for n in (a, b)}
    assert all(len(p.findall(text)) == 1 for p in pattern.values())
    text = pattern[a].sub(r'": @A\1', text)
    text = pattern[b].sub(rf'": {a}\1', text)
    return text.replace("@A", str(b))


def test_a_tokenizer_file_with_other_bytes_of_the_same_size_is_refused_then_rebuilt(tmp_path, capsys):
    src, out, tok = tmp_path / "c", tmp_path / "out", tmp_path / "tok"
    src.mkdir()
    docs = words(30, 3)
    for i, doc in enumerate(docs):
        (src / f"{i:02d}.txt").write_text(doc)
    train_bpe_tokenizer(words(80, 4), 300).save_pretrained(tok)
    argv = ["--train", src, "--val-every", 5, "--tokenizer", tok, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    train_docs = [d for i, d in enumerate(docs) if i % 5 != 4]
    first = AutoTokenizer.from_pretrained(str(tok))
    encode = lambda t: [[t.eos_token_id] + t(d, add_special_tokens=False)["input_ids"] for d in train_docs]  # noqa
    assert stored(out / "train") == encode(first)
    before = written(out)

    # the same file rewritten with the same bytes (a copy, a save of the same tokenizer): no change
    later(tok / "tokenizer.json")
    status, again, err = run_data(capsys, *argv)  # the record alone is written again, keeping the file's new time
    assert status == 0 and {**again, "stamps": None} == {**record, "stamps": None}, err
    kept = str(out / "prepared.json")
    assert {k: v for k, v in written(out).items() if k != kept} == {k: v for k, v in before.items() if k != kept}
    before = written(out)

    path = tok / "tokenizer.json"
    text = path.read_text()
    used = sorted({i for d in encode(first) for i in d if i >= 257})
    path.write_text(swap_ids(text, used[0], used[1]))
    later(path)
    assert os.path.getsize(path) == len(text.encode())
    edited = AutoTokenizer.from_pretrained(str(tok))
    assert encode(edited) != encode(first)  # the edit changes the tokens of this corpus
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and written(out) == before
    assert f"another --tokenizer '{tok}'" in err and str(path) in err and "--overwrite" in err

    status, rebuilt, err = run_data(capsys, *argv, "--overwrite")
    assert status == 0, err
    assert stored(out / "train") == encode(edited)
    assert json.loads((out / "prepared.json").read_text()) == rebuilt
