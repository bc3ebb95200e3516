"""What a prepared folder, the sources and the op's argument checks promise, held to files written in the test and
values worked out by hand: a source that has lost one of its files since is reused (its tokens are in the folder),
a prepared folder whose ``tokenizer/`` holds no tokenizer file any more is refused by name, a ``val_source`` file
that a training folder named through a link holds is refused as a file both sources read (not as a copy), and
``as_float`` keeps the sign of an integer past a float's range; a ``prepared.json`` whose ``spec`` is no
object is named as no record of a preparation; an op called with a misspelt keyword and an unknown one hints the
first and lists every argument the op takes; ``prepared.json`` keeps as its modification time the moment taken
before its stamps were; a batch of no rows with a ``log_gate`` has its values checked as none (an empty
output, not an error of the reduction); ``eps`` given as a bool is refused by name; a search from inside the output folder passes over the
split folders' temporary and set-aside names (``val.old`` ...) and keeps a folder of another name; a source whose every file lies where the output is written is refused
naming the output by the caller's name for it; a setting that names no path (``text_field``) is compared as given,
not as a path; a source of broken links names the first and counts the others."""
import inspect
import json
import math
import os
import re
import types

import numpy as np
import pytest
import torch

import falcon_fwa.data.prepare as prepare_module
from falcon_fwa.data import DataSpec, prepare_dataset
from falcon_fwa.data.sources import list_files
from falcon_fwa.ops import falcon_attention
from falcon_fwa.ops.validate import as_float


def corpus(folder, texts):
    """Text files ``0.txt``, ``1.txt`` ... of ``texts`` in ``folder``; their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for n, text in enumerate(texts):
        path = folder / f"{n}.txt"
        path.write_text(text)
        paths.append(path)
    return paths


def test_a_source_that_lost_one_of_its_files_is_reused(tmp_path):
    """Four documents in four files, one held out (``val_every=4``); one file deleted since: the folder is reused
    with the counts it recorded (its tokens are there), not refused as a changed corpus."""
    paths = corpus(tmp_path / "c", ["alpha", "beta", "gamma", "delta"])
    spec = DataSpec(train_source=str(tmp_path / "c"), val_every=4)
    out = str(tmp_path / "out")
    record = prepare_dataset(spec, out)
    # byte tokens: [eos] + one per byte; 3.txt (the 4th document) held out
    assert record["counts"] == {"train": {"n_tokens": 6 + 5 + 6, "n_docs": 3}, "val": {"n_tokens": 6, "n_docs": 1}}
    paths[1].unlink()
    again = prepare_dataset(spec, out)
    assert again["counts"] == record["counts"]


def test_a_folder_whose_tokenizer_files_are_gone_is_refused_by_name(tmp_path):
    """The prepared ``tokenizer/`` emptied by hand (the folder left): the reuse names the folder's lost tokenizer."""
    corpus(tmp_path / "c", ["one", "two", "three"])
    spec = DataSpec(train_source=str(tmp_path / "c"), val_every=3)
    out = tmp_path / "out"
    prepare_dataset(spec, str(out))
    saved = sorted(os.listdir(out / "tokenizer"))
    assert saved
    for name in saved:
        os.remove(out / "tokenizer" / name)
    copy = str(out / "tokenizer")
    with pytest.raises(ValueError, match=re.escape(f"has lost its tokenizer ({copy!r} holds no tokenizer files)")):
        prepare_dataset(spec, str(out))


def test_a_val_file_of_a_training_folder_named_through_a_link_is_one_file_both_read(tmp_path):
    """``train_source`` a link to a folder, ``val_source`` an empty file of that folder by its own path: the same file
    both sources read (by its real path), refused as such, though an empty copy of a training file would pass."""
    corpus(tmp_path / "c", ["", "some training text", "more training text"])
    os.symlink(tmp_path / "c", tmp_path / "linked")
    val = str(tmp_path / "c" / "0.txt")
    spec = DataSpec(train_source=str(tmp_path / "linked"), val_source=val)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=re.escape(f"data.val_source file {val!r} is also read by "
                                                   f"data.train_source {str(tmp_path / 'linked')!r}")):
        prepare_dataset(spec, str(out))
    assert not out.exists()


@pytest.mark.parametrize("sign", [1, -1])
def test_an_integer_past_a_floats_range_keeps_its_sign(sign):
    """``10**400`` overflows a float: as large as the largest float, of its own sign."""
    assert as_float(sign * 10**400) == sign * math.inf
    assert as_float(sign * (2**1024)) == sign * math.inf
    assert as_float(sign * (2**1023)) == sign * 2.0**1023


@pytest.mark.parametrize("held", [None, ["train_source"], "byte"])
def test_a_record_whose_spec_is_no_object_is_no_record(tmp_path, held):
    """A ``prepared.json`` written by hand whose ``spec`` is null, a list or text: refused, naming the record."""
    corpus(tmp_path / "c", ["one", "two"])
    out = tmp_path / "out"
    out.mkdir()
    record = out / "prepared.json"
    record.write_text(json.dumps({"spec": held, "counts": {}}))
    with pytest.raises(ValueError, match=re.escape(f"{str(record)!r} is no record of a preparation "
                                                   "(no \"spec\" of settings)")):
        prepare_dataset(DataSpec(train_source=str(tmp_path / "c"), val_every=2), str(out))


def test_a_misspelt_keyword_beside_an_unknown_one_lists_what_the_op_takes():
    """``lamda`` (close to ``lam``) and ``xyz`` (close to nothing): the first is hinted, and as the second is not,
    the message lists every argument of the op."""
    q = torch.zeros(1, 2, 1, 2)
    with pytest.raises(TypeError) as err:
        falcon_attention(q, q, q, torch.ones(1, 2, 1), torch.ones(1, 2, 1), lamda=1.0, xyz=2)
    takes = ", ".join(inspect.signature(falcon_attention).parameters)
    assert str(err.value) == ("falcon_attention() got unexpected keyword arguments 'lamda' (did you mean 'lam'?), "
                              f"'xyz'; it takes {takes}")


def test_the_record_is_kept_with_the_time_taken_before_its_stamps(tmp_path, monkeypatch):
    """The preparation's clock read as a fixed moment (2001-09-09): ``prepared.json`` carries that moment as its
    modification time, not the later one of its write, so that a file whose time is clearly older vouches for it."""
    moment = 10**18
    monkeypatch.setattr(prepare_module, "time", types.SimpleNamespace(time_ns=lambda: moment))
    corpus(tmp_path / "c", ["one", "two"])
    out = tmp_path / "out"
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c"), val_every=2), str(out))
    assert os.stat(out / "prepared.json").st_mtime_ns == moment


@pytest.mark.parametrize("form", ["recurrent", "parallel", "chunk"])
def test_a_batch_of_no_rows_with_a_log_gate_gives_an_empty_output(form):
    """``B = 0`` with ``log_gate``: nothing to check (no value out of range), the output of shape ``[0, T, H, V]``."""
    q, v = torch.zeros(0, 3, 2, 4), torch.zeros(0, 3, 2, 5)
    out = falcon_attention(q, q, v, torch.ones(0, 3, 2), torch.ones(0, 3, 2), log_gate=torch.zeros(0, 3, 2),
                           form=form)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == (0, 3, 2, 5)


@pytest.mark.parametrize("flag", [True, False, np.bool_(True)])
def test_eps_given_as_a_bool_is_refused_by_name(flag):
    """``eps=True`` is no number (though ``True == 1``): a ``ValueError`` naming ``eps`` and the value."""
    q, v = torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 3)
    with pytest.raises(ValueError, match=re.escape(f"eps must be a number, got {flag!r}")):
        falcon_attention(q, q, v, torch.ones(1, 2, 1), torch.ones(1, 2, 1), eps=flag)


@pytest.mark.parametrize("entry", ["train", "val", "tokenizer", "train.tmp", "train.old", "val.tmp", "val.old"])
def test_a_search_of_the_output_folder_passes_over_what_a_preparation_writes(tmp_path, entry):
    """``--out .`` beside the corpus: a JSON Lines file in a folder a preparation writes (``val.old``, set aside by a
    rebuild) is none of the corpus; the same file in a folder of another name (``notes``) is."""
    corpus(tmp_path, ["one", "two"])
    for folder in (entry, "notes"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "part.jsonl").write_text('{"text": "held aside"}\n')
    found = list_files(str(tmp_path), exclude=str(tmp_path))
    assert found == [str(tmp_path / "0.txt"), str(tmp_path / "1.txt"), str(tmp_path / "notes" / "part.jsonl")]


def test_a_source_inside_the_outputs_train_folder_is_refused_naming_the_output_setting(tmp_path):
    """``--train mydata/train --out mydata`` (in a recipe's words): refused naming ``data.out_dir``, not a bare
    ``out_dir``, and nothing written."""
    corpus(tmp_path / "mydata" / "train", ["some text"])
    source, out = str(tmp_path / "mydata" / "train"), str(tmp_path / "mydata")
    expected = (f"data.train_source: data source {source!r} holds files only where data.out_dir {out!r} is written "
                f"({str(tmp_path / 'mydata' / 'train' / '0.txt')!r}; a preparation writes its train, val and "
                "tokenizer there): give data.out_dir a folder apart from the sources")
    with pytest.raises(FileNotFoundError) as err:
        prepare_dataset(DataSpec(train_source=source), out)
    assert str(err.value) == expected
    assert sorted(os.listdir(out)) == ["train"]


def test_a_text_field_spelt_as_another_path_is_another_setting(tmp_path, monkeypatch):
    """``text_field`` ``./text`` is no spelling of ``text`` (a field name, not a path): the folder prepared with
    ``text`` is refused for it, naming both; the source by another spelling of its path is the same source."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=2), "out")
    assert prepare_dataset(DataSpec(train_source="./c.jsonl", val_every=2), "out")["counts"]["val"]["n_docs"] == 1
    with pytest.raises(ValueError, match=re.escape("(text_field 'text' there, './text' here)")):
        prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=2, text_field="./text"), "out")


@pytest.mark.parametrize("broken", [1, 2, 3])
def test_broken_links_are_named_first_and_the_others_counted(tmp_path, broken):
    """A folder of one text file and ``broken`` links to files gone: the first link named with its target, the
    others counted (none with one link)."""
    corpus(tmp_path / "c", ["text"])
    for n in range(broken):
        os.symlink(tmp_path / f"gone{n}.txt", tmp_path / "c" / f"link{n}.txt")
    source, first = str(tmp_path / "c"), str(tmp_path / "c" / "link0.txt")
    also = f" ({broken - 1} more like it)" if broken > 1 else ""
    with pytest.raises(FileNotFoundError) as err:
        list_files(source)
    assert str(err.value) == (f"data source {source!r} names the link {first!r} to {str(tmp_path / 'gone0.txt')!r}, "
                              f"which does not exist{also}: restore what it links to, or remove the link")
