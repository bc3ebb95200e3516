"""A source or tokenizer file whose modification time changed but whose bytes did not (``touch``, a checkout, a copy
written again) is read once, by the reuse that finds its SHA-256 the recorded one: ``prepared.json`` then keeps its
new time, so the reuses after it take the file by its time again, reading none of its bytes."""
import json
import os

from test_data_sources import run_data, words

import falcon_fwa.data.prepare as prepare
from falcon_fwa.data.tokenizer import train_bpe_tokenizer


def later(path, seconds=3):
    """Set ``path``'s modification time ``seconds`` past what it is, its bytes untouched (``touch``)."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def hashed(monkeypatch):
    """The paths whose SHA-256 the data command computes from now on, in order (the hash itself unchanged)."""
    calls, real = [], prepare._sha256

    def counting(path):
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(prepare, "_sha256", counting)
    return calls


def corpus(tmp_path):
    src, val = tmp_path / "c", tmp_path / "v.txt"
    src.mkdir()
    for i, text in enumerate(["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]):
        (src / f"{i}.txt").write_text(text)
    val.write_text("kappa lambda")
    age(src / "0.txt", src / "1.txt", src / "2.txt", val)
    return src, val


def age(*paths):
    for path in paths:
        os.utime(path, ns=(0, os.stat(path).st_mtime_ns - 3600 * 10**9))


def kept_times(out):
    """``{path: recorded modification time}`` of every stamped file of ``out``'s record."""
    stamps = json.loads((out / "prepared.json").read_text())["stamps"]
    return {path: stamp[0] for paths in stamps.values() if paths for path, stamp in paths.items()}


def test_a_touched_source_file_is_read_by_one_reuse_only(tmp_path, capsys, monkeypatch):
    src, val = corpus(tmp_path)
    out = tmp_path / "out"
    argv = ["--train", src, "--val", val, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    touched = src / "1.txt"
    later(touched)
    now = os.stat(touched).st_mtime_ns
    assert kept_times(out)[str(touched)] != now

    calls = hashed(monkeypatch)
    status, first, err = run_data(capsys, *argv)
    assert status == 0, err
    assert calls == [str(touched)]  # the touched file alone is read, to find its bytes the same
    calls.clear()
    status, second, err = run_data(capsys, *argv)
    assert status == 0, err
    assert calls == []  # the next reuse reads no file: ...
    assert second == first and first["counts"] == record["counts"]
    assert first["stamps"]["train"][str(touched)] == [now, _digest(touched)]
    assert kept_times(out)[str(touched)] == now  # ... the record keeps its new time
    assert json.loads((out / "prepared.json").read_text()) == first
    assert sorted(os.listdir(out)) == [".prepare.lock", "prepared.json", "tokenizer", "train", "val"]  # (no temporary)
    val_time = os.stat(val).st_mtime_ns
    later(val)  # the validation source counts the same way
    status, third, err = run_data(capsys, *argv)
    assert status == 0 and calls == [str(val)], err
    assert third["stamps"]["val"][str(val)][0] == val_time + 3 * 10**9

    # the record still holds the bytes' SHA-256: other bytes of the same size are refused, whatever their time
    touched.write_text("DELTA EPSILON")
    later(touched, 5)
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and "other source files" in err and str(touched) in err


def _digest(path):
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_touched_tokenizer_file_is_read_by_one_reuse_only(tmp_path, capsys, monkeypatch):
    src, val = corpus(tmp_path)
    out, tok = tmp_path / "out", tmp_path / "tok"
    train_bpe_tokenizer(words(80, 4), 300).save_pretrained(tok)
    age(*(tok / n for n in os.listdir(tok)))
    argv = ["--train", src, "--val", val, "--tokenizer", tok, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    later(tok / "tokenizer.json")
    calls = hashed(monkeypatch)
    status, first, err = run_data(capsys, *argv)
    assert status == 0 and calls == [str(tok / "tokenizer.json")], err
    calls.clear()
    status, second, err = run_data(capsys, *argv)
    assert (status, calls) == (0, []), err
    assert second == first and first["counts"] == record["counts"]
    assert first["stamps"]["tokenizer"][str(tok / "tokenizer.json")][0] == os.stat(tok / "tokenizer.json").st_mtime_ns


def test_a_record_the_disk_refuses_to_write_leaves_the_reuse_as_it_was(tmp_path, capsys, monkeypatch):
    """The new times are kept only as a saving: where ``prepared.json`` cannot be written (a full disk), the reuse
    goes on, the record on disk and the one printed stay the ones read, and the next reuse reads the file again."""
    src, val = corpus(tmp_path)
    out = tmp_path / "out"
    argv = ["--train", src, "--val", val, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    kept = (out / "prepared.json").read_text()
    later(src / "0.txt")

    def full(path, obj, **kwargs):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(prepare, "write_json", full)
    calls = hashed(monkeypatch)
    for _ in range(2):
        status, again, err = run_data(capsys, *argv)
        assert (status, again) == (0, record), err
    assert calls == [str(src / "0.txt")] * 2
    assert (out / "prepared.json").read_text() == kept
