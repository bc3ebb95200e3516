"""What a preparation writes is no data of an ``hf:`` dataset folder either (``--out`` inside it, or the folder
itself, or an earlier preparation there), as it is none of a plain source folder; a source file that is a link to
nothing is refused before anything is written, naming the option, the link and its target."""
import json
import os

import pytest
from conftest import needs_datasets

from falcon_fwa.data.prepare import DataSpec, prepare_dataset
from falcon_fwa.data.sources import hf_split_files, iter_documents, list_files
from test_data_sources import run_data, stored


TRAIN = ["one two three", "four five", "six seven eight nine", "ten", "eleven twelve"]
VAL = ["thirteen fourteen", "fifteen"]


def hub_folder(folder):
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in TRAIN))
    (folder / "validation.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in VAL))
    return folder


def expected_counts():  # byte tokenizer: one token a byte, plus the end-of-text opening each document
    return {"train": {"n_docs": len(TRAIN), "n_tokens": sum(len(d.encode()) + 1 for d in TRAIN)},
            "val": {"n_docs": len(VAL), "n_tokens": sum(len(d.encode()) + 1 for d in VAL)}}


@needs_datasets
@pytest.mark.parametrize("inside", ["prep", "."])
def test_an_hf_folder_holding_out_reads_its_own_files_only(tmp_path, capsys, inside):
    """``--out`` inside the dataset folder (or the folder itself): ``datasets`` is given the folder's files without
    the record, shards, tokenizer and temporaries the preparation writes there, on a fresh preparation (its
    temporaries already there) and on a rebuild (a finished preparation there, whose ``train/`` and ``val/`` are
    split names to ``datasets``)."""
    hub = hub_folder(tmp_path / "hub")
    out = hub / inside
    files = sorted([str(hub / "train.jsonl"), str(hub / "validation.jsonl")])
    for extra in ([], ["--overwrite"]):
        status, record, err = run_data(capsys, "--train", f"hf:{hub}", "--val", f"hf:{hub}", "--out", out, *extra)
        assert status == 0, err
        assert record["counts"] == expected_counts()
        assert stored(out / "train") == [(256, d.encode()) for d in TRAIN]
        assert stored(out / "val") == [(256, d.encode()) for d in VAL]
        assert sorted(record["files"]["train"]) == sorted(record["files"]["val"]) == files
    # the split files as the disjointness check sees them, the finished preparation there
    assert hf_split_files(f"hf:{hub}", "train", str(out)) == [str(hub / "train.jsonl")]
    assert hf_split_files(f"hf:{hub}", "validation", str(out)) == [str(hub / "validation.jsonl")]
    # reused: nothing recorded has changed, the preparation's own files are none of the corpus
    status, again, err = run_data(capsys, "--train", f"hf:{hub}", "--val", f"hf:{hub}", "--out", out)
    assert (status, again) == (0, record), err


@needs_datasets
def test_an_hf_folder_holding_an_earlier_preparation_reads_the_dataset_beside_it(tmp_path, capsys):
    hub = hub_folder(tmp_path / "hub")
    (tmp_path / "other.txt").write_text("alpha\nbeta\ngamma\ndelta\n")
    prepare_dataset(DataSpec(train_source=str(tmp_path / "other.txt"), text_split="line", val_every=2),
                    str(hub / "old"))
    assert list(iter_documents(f"hf:{hub}", exclude=str(tmp_path / "out"))) == TRAIN
    status, record, err = run_data(capsys, "--train", f"hf:{hub}", "--val", f"hf:{hub}", "--out", tmp_path / "out")
    assert status == 0, err
    assert record["counts"] == expected_counts()
    assert sorted(record["files"]["train"]) == [str(hub / "train.jsonl"), str(hub / "validation.jsonl")]


@needs_datasets
def test_an_hf_folder_of_nothing_but_a_preparation_is_refused_before_writing(tmp_path, capsys):
    (tmp_path / "c.txt").write_text("one\ntwo\nthree\nfour\n")
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c.txt"), text_split="line", val_every=2),
                    str(tmp_path / "old"))
    status, _, err = run_data(capsys, "--train", f"hf:{tmp_path / 'old'}", "--out", tmp_path / "new")
    assert status == 2 and not (tmp_path / "new").exists(), err
    assert f"--train: data source 'hf:{tmp_path / 'old'}' holds no data files but what a preparation writes" in err


def test_a_broken_link_in_a_source_is_refused_naming_option_link_and_target(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("first document")
    (corpus / "b.txt").symlink_to(tmp_path / "moved" / "b.txt")
    (tmp_path / "val.txt").write_text("held out")
    out = tmp_path / "out"
    link, target = str(corpus / "b.txt"), str(tmp_path / "moved" / "b.txt")
    for argv, option in [(["--train", corpus, "--val", tmp_path / "val.txt"], "--train"),
                         (["--train", f"{corpus}/*.txt", "--val", tmp_path / "val.txt"], "--train"),
                         (["--train", tmp_path / "val.txt", "--val", corpus / "b.txt"], "--val"),
                         (["--train", tmp_path / "val.txt", "--val", corpus], "--val")]:
        status, _, err = run_data(capsys, *argv, "--out", out)
        assert status == 2 and not out.exists(), err
        line = [line for line in err.splitlines() if "error:" in line][0]
        assert f"{option}: data source" in line and f"the link {link!r} to {target!r}, which does not exist" in line
    with pytest.raises(FileNotFoundError, match="link .*b.txt' to .*moved/b.txt'"):
        next(iter_documents(str(corpus)))
    # its target back: read as any file
    (tmp_path / "moved").mkdir()
    (tmp_path / "moved" / "b.txt").write_text("second document")
    assert list(iter_documents(str(corpus))) == ["first document", "second document"]


def test_broken_links_a_search_passes_over_are_no_obstacle(tmp_path):
    """A hidden name and one of no data suffix are passed over, link or not."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("kept")
    (corpus / ".hidden.txt").symlink_to(tmp_path / "nothing")
    (corpus / "image.png").symlink_to(tmp_path / "nothing")
    assert list_files(str(corpus), exclude=str(tmp_path / "out")) == [str(corpus / "a.txt")]
    assert os.path.islink(corpus / "image.png") and not os.path.exists(corpus / "image.png")
