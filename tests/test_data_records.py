"""What ``prepared.json`` records of the settings and inputs of ``falcon-fwa data``, so that a later run on the same
``--out`` reuses the shards exactly when they are what it would write: one spelling of a ``bpe:N`` tokenizer."""
import json
import os

import pytest
from test_data_sources import run_data, words

from falcon_fwa.data import DataSpec, prepare_dataset


def corpus(tmp_path, n=30):
    """A folder of ``n`` small text files."""
    folder = tmp_path / "c"
    folder.mkdir()
    for i, doc in enumerate(words(n, 3)):
        (folder / f"{i:02d}.txt").write_text(doc)
    return folder


def written(out):
    """When each file of a prepared folder was last written: a reuse rewrites none."""
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, names in os.walk(out) for f in names if f != ".prepare.lock"}


@pytest.mark.parametrize("first,second", [("bpe:\u0663\u0660\u0660", "bpe:300"), ("bpe:300", "bpe:\u0663\u0660\u0660"),
                                          ("bpe: 0300", "bpe:300 ")])
def test_spellings_of_one_bpe_size_reuse_one_folder(tmp_path, capsys, first, second):
    """``bpe:`` with Arabic-Indic digits, a leading zero or spaces is the vocabulary size 300 that ``int()`` reads:
    the record holds ``bpe:300`` whichever spelling came first, and the other reuses the shards unwritten."""
    src, out = corpus(tmp_path), tmp_path / "out"
    status, record, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", first, "--out", out)
    assert status == 0, err
    assert record["spec"]["tokenizer"] == "bpe:300"
    assert json.loads((out / "prepared.json").read_text())["spec"]["tokenizer"] == "bpe:300"
    before = written(out)
    status, again, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", second, "--out", out)
    assert status == 0, err
    assert again == record and written(out) == before
    status, _, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "bpe:301", "--out", out)
    assert status == 2 and "tokenizer 'bpe:300' there, 'bpe:301' here" in err  # another size is another setting


def test_a_recipe_spelling_is_recorded_as_the_command_s(tmp_path):
    """The Python and recipe route (``DataSpec``) records the same ``bpe:300``; a ``bpe:N`` that is no size stays
    as given, for its check to name."""
    assert DataSpec(train_source="x", tokenizer="bpe:\u0663\u0660\u0660").tokenizer == "bpe:300"
    assert DataSpec(train_source="x", tokenizer="byte").tokenizer == "byte"
    bad = DataSpec(train_source="x", tokenizer="bpe:\u00b3\u2070\u2070")  # superscripts, which int() refuses
    assert bad.tokenizer == "bpe:\u00b3\u2070\u2070"
    with pytest.raises(ValueError, match=r"^data\.tokenizer bpe:N needs an integer N"):
        bad.check()
    src = corpus(tmp_path)
    record = prepare_dataset(DataSpec(train_source=str(src), tokenizer="bpe:0300", val_every=5), str(tmp_path / "d"))
    assert record["spec"]["tokenizer"] == "bpe:300" and record["vocab_size"] <= 300
