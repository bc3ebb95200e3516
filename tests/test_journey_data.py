"""``falcon-fwa data`` as a corpus is laid out in practice: the output folder holding the corpus it tokenizes
(``--out .`` beside the text files, or a project folder with the text in a subfolder), and option values that
name nothing (``hf:`` without a name, an empty ``--out``) refused in one line naming the option. Shards are
checked against the UTF-8 bytes of the files, worked out here."""
import json
import logging
import os
import sys

import numpy as np
import pytest
from conftest import needs_datasets

from falcon_fwa.cli import main
from falcon_fwa.data import TokenShards

EOS = 256


def run_data(capsys, *argv):
    """(exit status, stdout record or None, stderr) of ``falcon-fwa data ARGV``."""
    for handler in logging.getLogger("datasets").handlers:  # (a handler bound to an earlier test's stderr)
        if type(handler) is logging.StreamHandler:
            handler.stream = sys.stderr
    status = main(["data", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, (json.loads(out) if status == 0 else None), err


def shard_tokens(folder):
    """The token stream of a one-shard split folder, read from its files as raw uint16."""
    return np.fromfile(os.path.join(folder, "tokens-00000.bin"), dtype=np.uint16).astype(np.int64)


def expected(*texts):
    """``[eos] + utf-8 bytes`` of each document, joined."""
    return np.concatenate([np.concatenate([[EOS], np.frombuffer(t.encode(), np.uint8)]) for t in texts])


@pytest.mark.parametrize("layout", ["beside", "subfolder", "subfolder-dir", "subfolder-glob"])
def test_an_output_folder_holding_the_corpus_tokenizes_it(tmp_path, capsys, monkeypatch, layout):
    """``--out`` may be the folder the corpus lies in (``--out .``) or above it: the files the user names are the
    corpus, not the output's own files; a second run reuses the folder."""
    monkeypatch.chdir(tmp_path)
    raw = tmp_path if layout == "beside" else tmp_path / "raw"
    raw.mkdir(exist_ok=True)
    (raw / "train.txt").write_text("first train document\n")
    (raw / "val.txt").write_text("held out")
    (raw / "more").mkdir()
    (raw / "more" / "b.txt").write_text("second")
    train, val = {"beside": ("train.txt", "val.txt"), "subfolder": ("raw/train.txt", "raw/val.txt"),
                  "subfolder-dir": ("raw/more", "raw/val.txt"), "subfolder-glob": ("raw/*.txt", None)}[layout]
    argv = ["--train", train, "--out", "."] + (["--val", val] if val else ["--val-every", "2"])
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    want = {"beside": (["first train document\n"], ["held out"]),
            "subfolder": (["first train document\n"], ["held out"]),
            "subfolder-dir": (["second"], ["held out"]),
            "subfolder-glob": (["first train document\n"], ["held out"])}[layout]  # train.txt, val.txt sorted
    assert np.array_equal(shard_tokens(tmp_path / "train"), expected(*want[0]))
    assert np.array_equal(shard_tokens(tmp_path / "val"), expected(*want[1]))
    assert record["counts"]["train"]["n_docs"] == len(want[0])
    status, again, err = run_data(capsys, *argv)
    assert (status, again) == (0, record), err


def test_a_source_folder_that_is_the_output_folder_still_skips_the_outputs_files(tmp_path, capsys):
    """``--train DIR --out DIR``: the tokenizer's and the shards' JSON files are no documents."""
    for n in range(4):
        (tmp_path / f"{n}.txt").write_text(f"doc {n}")
    status, record, err = run_data(capsys, "--train", tmp_path, "--val-every", "2", "--out", tmp_path)
    assert status == 0, err
    assert np.array_equal(shard_tokens(tmp_path / "train"), expected("doc 0", "doc 2"))
    assert np.array_equal(shard_tokens(tmp_path / "val"), expected("doc 1", "doc 3"))
    assert sorted(record["files"]["train"]) == [str(tmp_path / f"{n}.txt") for n in range(4)]
    status, again, err = run_data(capsys, "--train", tmp_path, "--val-every", "2", "--out", tmp_path)
    assert (status, again) == (0, record), err  # its own record and shards are no new file of the corpus
    (tmp_path / "4.txt").write_text("doc 4")
    status, _, err = run_data(capsys, "--train", tmp_path, "--val-every", "2", "--out", tmp_path)
    assert status == 2 and "4.txt is new" in err
    status, _, err = run_data(capsys, "--train", tmp_path, "--val-every", "2", "--out", tmp_path, "--overwrite")
    assert status == 0, err
    assert np.array_equal(shard_tokens(tmp_path / "train"), expected("doc 0", "doc 2", "doc 4"))


@pytest.mark.parametrize("source", ["hf:", "hf::config"])
def test_an_hf_source_without_a_name_is_named_by_its_option(tmp_path, capsys, source):
    status, _, err = run_data(capsys, "--train", source, "--out", tmp_path / "d")
    assert status == 2
    assert "--train" in err and "hf:NAME" in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()


def test_an_empty_output_folder_name_is_named_by_its_option(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.txt").write_text("text")
    status, _, err = run_data(capsys, "--train", tmp_path / "t.txt", "--val-every", "2", "--out", "")
    assert status == 2 and "--out" in err, err
    assert sorted(os.listdir(tmp_path)) == ["t.txt"]


def test_the_documented_byte_record_of_two_files_matches_their_bytes(tmp_path, capsys):
    """Non-UTF-8 bytes, no final newline, CRLF line ends and a BOM: each file is one document of its text as
    Python's text mode with errors='replace' reads it, after an end-of-text."""
    (tmp_path / "t.txt").write_bytes(b"\xef\xbb\xbfcaf\xe9\r\nline two\rthree")
    (tmp_path / "v.txt").write_bytes(b"\n\nx\n")
    status, record, err = run_data(capsys, "--train", tmp_path / "t.txt", "--val", tmp_path / "v.txt",
                                   "--out", tmp_path / "d")
    assert status == 0, err
    assert np.array_equal(shard_tokens(tmp_path / "d" / "train"), expected("caf\ufffd\nline two\nthree"))
    assert np.array_equal(shard_tokens(tmp_path / "d" / "val"), expected("\n\nx\n"))
    assert record["counts"] == {"train": {"n_tokens": 1 + len("caf\ufffd\nline two\nthree".encode()), "n_docs": 1},
                                "val": {"n_tokens": 5, "n_docs": 1}}
    assert TokenShards(str(tmp_path / "d" / "train")).shards[0].doc_starts.tolist() == [0]


@needs_datasets
def test_a_local_hf_dataset_folder_changed_since_is_refused_not_reused(tmp_path, capsys):
    """``hf:/path`` is a local source: a record added to its train file since is refused as a file of another
    size, not reused from the old shards; ``--overwrite`` then tokenizes the new record. One folder gives both
    splits (its train and validation files): no file is in both."""
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {n}"}) + "\n" for n in range(3)))
    (ds / "validation.jsonl").write_text(json.dumps({"text": "held"}) + "\n")
    argv = ["--train", f"hf:{ds}", "--val", f"hf:{ds}", "--out", tmp_path / "d"]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    assert np.array_equal(shard_tokens(tmp_path / "d" / "train"), expected("doc 0", "doc 1", "doc 2"))
    assert np.array_equal(shard_tokens(tmp_path / "d" / "val"), expected("held"))
    size = (ds / "train.jsonl").stat().st_size
    assert run_data(capsys, *argv)[:2] == (0, record)
    with open(ds / "train.jsonl", "a") as f:
        f.write(json.dumps({"text": "doc 3"}) + "\n")
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and f"train.jsonl held {size:,} bytes, now {(ds / 'train.jsonl').stat().st_size:,}" in err
    status, _, err = run_data(capsys, *argv, "--overwrite")
    assert status == 0, err
    assert np.array_equal(shard_tokens(tmp_path / "d" / "train"), expected("doc 0", "doc 1", "doc 2", "doc 3"))


@needs_datasets
def test_a_local_hf_dataset_folder_with_a_link_back_into_itself_records_each_file_once(tmp_path, capsys):
    """A dataset folder holding a link to itself (a loop when followed) and a broken link: its two files are
    recorded once each, by the paths under the folder, and a second run reuses the folder."""
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {n}"}) + "\n" for n in range(2)))
    (ds / "validation.jsonl").write_text(json.dumps({"text": "held"}) + "\n")
    (ds / "again").symlink_to(".")
    (ds / "gone.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    argv = ["--train", f"hf:{ds}", "--val", f"hf:{ds}", "--out", tmp_path / "d"]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    sizes = {str(ds / name): (ds / name).stat().st_size for name in ("train.jsonl", "validation.jsonl")}
    assert record["files"] == {"train": sizes, "val": sizes}
    assert np.array_equal(shard_tokens(tmp_path / "d" / "train"), expected("doc 0", "doc 1"))
    assert run_data(capsys, *argv)[:2] == (0, record)


@needs_datasets
def test_a_folder_whose_record_holds_no_files_of_an_hf_source_is_reused(tmp_path, capsys):
    """A record that lists no files for an ``hf:`` split (as written before such files were listed) is reused."""
    ds = tmp_path / "ds"
    ds.mkdir()
    (ds / "train.jsonl").write_text("".join(json.dumps({"text": f"doc {n}"}) + "\n" for n in range(4)))
    argv = ["--train", f"hf:{ds}", "--val-every", "2", "--out", tmp_path / "d"]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    record["files"] = {"train": None, "val": None}
    (tmp_path / "d" / "prepared.json").write_text(json.dumps(record))
    assert run_data(capsys, *argv)[:2] == (0, record)


@pytest.mark.parametrize("spec", ["bpe:\u00b2", "bpe:3\u00b9\u2070", "bpe:\u2460"])  # superscripts, a circled one
def test_a_bpe_size_of_digit_signs_that_are_no_decimal_number_is_named(tmp_path, capsys, spec):
    """Characters that ``str.isdigit`` takes but ``int`` does not are refused as no integer N, naming the option."""
    (tmp_path / "t.txt").write_text("text")
    status, _, err = run_data(capsys, "--train", tmp_path / "t.txt", "--tokenizer", spec, "--out", tmp_path / "d")
    assert status == 2
    assert f"--tokenizer bpe:N needs an integer N (the vocabulary size), got {spec!r}" in err
    assert not (tmp_path / "d").exists()
