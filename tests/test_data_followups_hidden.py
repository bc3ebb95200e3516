"""A source folder's hidden names (starting with ``.``: a notebook's ``.ipynb_checkpoints/``, ``.git/``, ``.DS_Store``)
are no documents: a folder edited in Jupyter holds a checkpoint copy of each file it saved, whose documents would be
tokenized twice. A hidden file named directly, or a source folder that is itself hidden, is read."""
import json
import os

from conftest import needs_datasets
from test_data_sources import run_data, stored

from falcon_fwa.data.sources import iter_documents, list_files


def notebook_folder(tmp_path):
    """A corpus folder with two visible files (one in a subfolder) and the hidden copies and files an editor, git and
    a file browser leave beside them; ``(folder, {visible path: text})``."""
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    visible = {folder / "notes.txt": "alpha beta", folder / "sub" / "more.md": "gamma delta epsilon"}
    for path, text in visible.items():
        path.write_text(text)
    hidden = {folder / ".ipynb_checkpoints" / "notes-checkpoint.txt": "alpha beta",  # a duplicate of notes.txt
              folder / "sub" / ".ipynb_checkpoints" / "more-checkpoint.md": "gamma delta epsilon",
              folder / ".git" / "description.txt": "git's own text",
              folder / ".DS_Store.txt": "finder",
              folder / "sub" / ".draft.txt": "a hidden draft"}
    for path, text in hidden.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (folder / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    return folder, visible


def test_a_folder_walk_passes_over_hidden_files_and_folders(tmp_path):
    folder, visible = notebook_folder(tmp_path)
    assert list_files(str(folder)) == sorted(str(p) for p in visible)
    assert list(iter_documents(str(folder))) == [visible[folder / "notes.txt"], visible[folder / "sub" / "more.md"]]
    # a glob's wildcards pass hidden names the same way (Python's glob, as before)
    assert list_files(str(folder / "**" / "*.txt")) == [str(folder / "notes.txt")]


def test_a_hidden_file_named_directly_or_a_hidden_source_folder_is_read(tmp_path, monkeypatch):
    folder, _ = notebook_folder(tmp_path)
    draft = folder / "sub" / ".draft.txt"
    assert list_files(str(draft)) == [str(draft)]
    assert list(iter_documents(str(draft))) == ["a hidden draft"]
    checkpoints = folder / ".ipynb_checkpoints"  # a hidden folder named as the source: its files are searched
    assert list(iter_documents(str(checkpoints))) == ["alpha beta"]
    hidden_root = tmp_path / ".corpus"
    hidden_root.mkdir()
    (hidden_root / "a.txt").write_text("one")
    assert list(iter_documents(str(hidden_root))) == ["one"]
    monkeypatch.chdir(hidden_root)  # "." is a name that starts with a dot too
    assert list_files(".") == [os.path.join(".", "a.txt")]


def test_the_data_command_tokenizes_no_checkpoint_copy(tmp_path, capsys):
    folder, visible = notebook_folder(tmp_path)
    val = tmp_path / "val.txt"
    val.write_text("zeta eta")
    out = tmp_path / "out"
    status, record, err = run_data(capsys, "--train", folder, "--val", val, "--out", out)
    assert status == 0, err
    texts = [visible[folder / "notes.txt"], visible[folder / "sub" / "more.md"]]
    assert stored(out / "train") == [(256, t.encode()) for t in texts]  # byte tokenizer: [eos] + UTF-8 bytes
    assert record["counts"]["train"] == {"n_docs": 2, "n_tokens": sum(len(t.encode()) + 1 for t in texts)}
    assert sorted(record["files"]["train"]) == sorted(str(p) for p in visible)

    # a checkpoint saved since (a new hidden file) is no new source file: the folder is reused
    (folder / ".ipynb_checkpoints" / "late-checkpoint.txt").write_text("a later checkpoint")
    status, again, err = run_data(capsys, "--train", folder, "--val", val, "--out", out)
    assert (status, again) == (0, record), err
    # a visible file is (the record counts it as before)
    (folder / "late.txt").write_text("a later file")
    status, _, err = run_data(capsys, "--train", folder, "--val", val, "--out", out)
    assert status == 2 and f"{folder / 'late.txt'} is new" in err


@needs_datasets
def test_an_hf_folder_records_no_hidden_file(tmp_path, capsys):
    """``datasets`` reads no hidden file of a dataset folder (``.cache/`` of a download, ``.git/``): the record of
    the folder's files leaves them out, so one written since refuses no reuse."""
    hub, out = tmp_path / "hub", tmp_path / "out"
    hub.mkdir()
    docs, val = ["one two", "three four five"], ["six"]
    (hub / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (hub / "validation.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in val))
    (hub / ".cache").mkdir()
    (hub / ".cache" / "train.jsonl.metadata").write_text("etag 1")
    argv = ["--train", f"hf:{hub}", "--val", f"hf:{hub}", "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    assert stored(out / "train") == [(256, d.encode()) for d in docs]
    assert sorted(record["files"]["train"]) == [str(hub / "train.jsonl"), str(hub / "validation.jsonl")]
    (hub / ".cache" / "train.jsonl.metadata").write_text("etag 22")  # rewritten by a later download
    (hub / ".cache" / "validation.jsonl.metadata").write_text("etag 3")
    status, again, err = run_data(capsys, *argv)
    assert (status, again) == (0, record), err
