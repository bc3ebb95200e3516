"""A ``--tokenizer`` folder named by a relative path is the folder it names from the working folder of the command
that named it: ``prepared.json`` records its absolute path (and its files' absolute paths), so that a later command
run from another folder finds the same record for the same folder, and a record of one folder never stands for
another folder that one relative spelling names from elsewhere."""
import json
import os

from test_data_sources import run_data, words

from falcon_fwa.data import DataSpec, TokenShards
from falcon_fwa.data.tokenizer import train_bpe_tokenizer


def written(out):
    """When each file of a prepared folder was last written: a reuse rewrites none."""
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, names in os.walk(out) for f in names if f != ".prepare.lock"}


def layout(tmp_path):
    """``c/`` (a corpus of 30 files), ``a/tok`` and ``b/tok``: two tokenizers of 300 tokens trained on other texts."""
    src = tmp_path / "c"
    src.mkdir()
    for i, doc in enumerate(words(30, 3)):
        (src / f"{i:02d}.txt").write_text(doc)
    for sub, seed in (("a", 4), ("b", 5)):
        (tmp_path / sub).mkdir()
        train_bpe_tokenizer(words(80, seed), 300).save_pretrained(tmp_path / sub / "tok")
    return src


def test_a_relative_tokenizer_folder_is_recorded_by_its_absolute_path(tmp_path, monkeypatch, capsys):
    src, out = layout(tmp_path), tmp_path / "out"
    a, b = tmp_path / "a" / "tok", tmp_path / "b" / "tok"
    monkeypatch.chdir(tmp_path / "a")
    status, record, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "./tok/", "--out", out)
    assert status == 0, err
    assert record["spec"]["tokenizer"] == str(a)
    assert json.loads((out / "prepared.json").read_text())["spec"]["tokenizer"] == str(a)
    assert sorted(record["files"]["tokenizer"]) == sorted(str(a / f) for f in os.listdir(a))
    before = written(out)

    monkeypatch.chdir(tmp_path)  # the same folder, named from its parent: the shards are reused unwritten
    status, again, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "a/tok", "--out", out)
    assert status == 0, err
    assert again == record and written(out) == before

    # the same spelling from another folder names another tokenizer: another setting, named by both folders
    monkeypatch.chdir(tmp_path / "b")
    status, _, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "tok", "--out", out)
    assert status == 2 and f"tokenizer {str(a)!r} there, {str(b)!r} here" in err
    assert written(out) == before


def test_the_recipe_route_resolves_the_folder_too(tmp_path, monkeypatch):
    """``DataSpec`` (a recipe's ``data`` section) holds the absolute folder; a name that is no local folder (a Hub
    name, ``byte``) stays as given."""
    layout(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert DataSpec(train_source="c", tokenizer="a/../a/tok/").tokenizer == str(tmp_path / "a" / "tok")
    assert DataSpec(train_source="c", tokenizer="byte").tokenizer == "byte"
    assert DataSpec(train_source="c", tokenizer="owner/name").tokenizer == "owner/name"


def test_a_record_of_a_relative_folder_written_earlier_is_reused_from_its_folder(tmp_path, monkeypatch, capsys):
    """A ``prepared.json`` that recorded the folder relative (``tok``, its files as ``tok/...``) is reused by the
    command run from the folder it was recorded from, as it was before the paths were resolved."""
    src, out = layout(tmp_path), tmp_path / "out"
    a = tmp_path / "a" / "tok"
    monkeypatch.chdir(tmp_path / "a")
    status, record, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "tok", "--out", out)
    assert status == 0, err
    old = json.loads((out / "prepared.json").read_text())
    old["spec"]["tokenizer"] = "tok"
    old["files"]["tokenizer"] = {os.path.join("tok", os.path.relpath(p, a)): n
                                 for p, n in old["files"]["tokenizer"].items()}
    (out / "prepared.json").write_text(json.dumps(old))
    before = written(out)
    status, again, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "tok", "--out", out)
    assert status == 0 and again["counts"] == record["counts"] and written(out) == before, err


def test_byte_stays_the_byte_tokenizer_beside_a_folder_named_byte(tmp_path, monkeypatch, capsys):
    """``--tokenizer byte`` run from a folder that holds a folder ``byte`` (an earlier ``--out byte``) is the byte
    tokenizer: recorded as ``byte``, ids the UTF-8 bytes and end-of-text 256."""
    src = layout(tmp_path)
    monkeypatch.chdir(tmp_path)
    status, _, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "byte", "--out", "byte")
    assert status == 0, err
    assert DataSpec(train_source="c", tokenizer="byte").tokenizer == "byte"
    status, record, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "byte", "--out", "again")
    assert status == 0, err
    assert record["spec"]["tokenizer"] == "byte" and (record["vocab_size"], record["eos_token_id"]) == (257, 256)
    first = (src / "00.txt").read_text().encode()
    assert next(TokenShards(str(tmp_path / "again" / "train")).documents()).tolist() == [256, *first]
