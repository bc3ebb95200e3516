"""A ``--val`` file that holds the same bytes as a ``--train`` file is refused as a copy only where it holds a
document as the settings read it: copies that hold none (blank lines, a JSON ``[]``, records of blank text) add
nothing to either split and pass; a copy that holds one is refused whatever else the sources hold."""
import json

import pytest

from test_data_sources import run_data, stored


@pytest.mark.parametrize("name,content,args", [
    ("blank.txt", "\n", ()),
    ("blank.txt", "  \n\n\t\n", ("--text-split", "paragraph")),
    ("none.json", "[]", ()),
    ("none.jsonl", json.dumps({"text": "   "}) + "\n" + json.dumps({"text": None}) + "\n", ()),
    ("other.jsonl", json.dumps({"text": ""}) + "\n", ("--text-field", "text")),
])
def test_copies_that_hold_no_document_pass(tmp_path, capsys, name, content, args):
    train, val = tmp_path / "train", tmp_path / "val"
    train.mkdir()
    val.mkdir()
    (train / "doc.txt").write_text("the training document")
    (val / "doc.txt").write_text("held out")
    (train / name).write_text(content)
    (val / name).write_text(content)
    status, record, err = run_data(capsys, "--train", train, "--val", val, "--out", tmp_path / "out", *args)
    assert status == 0, err
    assert record["counts"]["train"]["n_docs"] == 1 and record["counts"]["val"]["n_docs"] == 1
    assert stored(tmp_path / "out" / "val") == [(256, b"held out")]


def test_a_copy_that_holds_a_document_by_the_settings_is_refused(tmp_path, capsys):
    train, val = tmp_path / "train", tmp_path / "val"
    train.mkdir()
    val.mkdir()
    (train / "doc.txt").write_text("the training document")
    (val / "doc.txt").write_text("held out")
    records = json.dumps({"text": "", "body": "a document"}) + "\n"
    (train / "r.jsonl").write_text(records)
    (val / "r.jsonl").write_text(records)
    status, _, err = run_data(capsys, "--train", train, "--val", val, "--out", tmp_path / "out")
    assert status == 0, err  # no document in the field read
    status, _, err = run_data(capsys, "--train", train, "--val", val, "--out", tmp_path / "o2", "--text-field", "body")
    assert status == 2 and f"--val file {str(val / 'r.jsonl')!r} holds the same bytes as" in err, err
    assert not (tmp_path / "o2").exists()
