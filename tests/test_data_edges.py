"""Edges of the data pipeline: Parquet strings that are no UTF-8, folders reached through links, a saved
``DatasetDict``, sources named by the setting that gives them, and a prepared folder damaged by hand."""
import json
import os
import re

import numpy as np
import pytest
from test_data_sources import run_data, stored

from falcon_fwa.data import DataSpec, iter_documents, prepare_dataset


@pytest.mark.parametrize("kind,offsets", [("string", np.int32), ("large_string", np.int64)])
def test_parquet_strings_of_bytes_that_are_no_utf8_become_replacement_characters(tmp_path, kind, offsets):
    """Arrow checks no UTF-8 on reading a Parquet file: such bytes become U+FFFD, as in text and JSON files
    (they were a UnicodeDecodeError naming no file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = b"ok" + b"caf\xc3\xa9 \xff\xfe end" + b"x\x80"  # three strings: valid, two bad bytes, one bad byte
    ends = np.array([0, 2, 2 + 12, 2 + 12 + 2], dtype=offsets)
    column = pa.Array.from_buffers(getattr(pa, kind)(), 3, [None, pa.py_buffer(ends.tobytes()), pa.py_buffer(data)])
    pq.write_table(pa.table({"text": column}), tmp_path / "c.parquet")
    assert list(iter_documents(str(tmp_path / "c.parquet"))) == ["ok", "café \ufffd\ufffd end", "x\ufffd"]


def test_a_folder_reached_through_a_link_is_read_once(tmp_path):
    """A source folder is searched into linked folders (a corpus linked in from elsewhere was silently
    left out); a link back to a folder already searched adds nothing and does not loop."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.txt").write_text("linked in")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("first")
    (src / "sub" / "c.txt").write_text("nested")
    os.symlink(elsewhere, src / "linked")
    os.symlink(src, src / "sub" / "loop")  # back to the top
    assert list(iter_documents(str(src))) == ["first", "linked in", "nested"]


def test_a_saved_dataset_dict_is_an_hf_source_of_its_splits(tmp_path):
    """``hf:FOLDER`` of ``DatasetDict.save_to_disk`` (arrow shards): each split's records in order."""
    from datasets import Dataset, DatasetDict

    train = [f"record {n} " + "é" * (n % 3) for n in range(40)]
    DatasetDict({"train": Dataset.from_dict({"text": train, "n": list(range(40))}),
                 "validation": Dataset.from_dict({"text": ["held", None, "out"]})}).save_to_disk(
        str(tmp_path / "saved"), num_shards={"train": 3, "validation": 1})
    assert list(iter_documents(f"hf:{tmp_path / 'saved'}")) == train
    assert list(iter_documents(f"hf:{tmp_path / 'saved'}", split="validation")) == ["held", "out"]


def bad_sources(tmp_path):
    (tmp_path / "ok.txt").write_text("fine")
    (tmp_path / "rows.csv").write_text("text\nnot read\n")


@pytest.mark.parametrize("val,message", [
    ("rows.csv", r"is no \.txt/\.md/\.rst/\.text/\.jsonl/\.json/\.parquet file \(files are read by their suffix\)$"),
    ("missing.txt", r"does not exist$"),
])
def test_a_source_that_names_no_file_is_named_by_its_setting(tmp_path, capsys, val, message):
    """The error names the option (the data command) or the recipe field that gave the source."""
    bad_sources(tmp_path)
    source = str(tmp_path / val)
    status, _, err = run_data(capsys, "--train", tmp_path / "ok.txt", "--val", source, "--out", tmp_path / "out")
    assert status == 2, err
    line = err.split("falcon-fwa data: error: ")[1].splitlines()[0]
    assert line.startswith(f"--val: data source '{source}' ") and re.search(message, line), line
    with pytest.raises(FileNotFoundError, match=rf"^data\.train_source: data source '{source}' "):
        prepare_dataset(DataSpec(train_source=source, val_source=str(tmp_path / "ok.txt")), str(tmp_path / "o2"))
    assert not (tmp_path / "out" / "train").exists() and not (tmp_path / "o2" / "train").exists()


def test_a_prepared_folder_damaged_by_hand_is_named_not_reused(tmp_path):
    """A prepared.json that is no record, or a split folder removed since, is an error naming it (the first a
    bare JSONDecodeError, the second a reuse that failed later, at opening the split); --overwrite rebuilds."""
    docs = [f"document {n}" for n in range(12)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    spec = DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=4)
    out = tmp_path / "d"
    prepare_dataset(spec, str(out))
    record = (out / "prepared.json").read_text()
    for damaged in ('{"spec": {"train_source"', "[]"):
        (out / "prepared.json").write_text(damaged)
        with pytest.raises(ValueError, match=rf"^'{out / 'prepared.json'}' is no record of a preparation .*overwrite"):
            prepare_dataset(spec, str(out))
    (out / "prepared.json").write_text(record)
    for name in ("meta.json", "tokens-00000.bin", "docs-00000.npy"):
        os.remove(out / "val" / name)
    os.rmdir(out / "val")
    with pytest.raises(ValueError, match=rf"^data folder '{out}' has lost its val split .*--overwrite\)$"):
        prepare_dataset(spec, str(out))
    prepare_dataset(spec, str(out), overwrite=True)
    assert stored(out / "val") == [(256, d.encode()) for i, d in enumerate(docs) if i % 4 == 3]
