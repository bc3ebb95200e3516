"""What ``prepared.json`` records of the settings and inputs of ``falcon-fwa data``, so that a later run on the same
``--out`` reuses the shards exactly when they are what it would write: one spelling of a ``bpe:N`` tokenizer, the
files of a tokenizer folder."""
import json
import os
import shutil

import pytest
from test_data_sources import run_data, words

from falcon_fwa.data import DataSpec, prepare_dataset
from falcon_fwa.data.tokenizer import train_bpe_tokenizer


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


def tokenizer_folder(folder, size):
    """A byte-level BPE of ``size`` tokens, trained on a small corpus and saved as a tokenizer folder."""
    train_bpe_tokenizer(words(80, 4), size).save_pretrained(folder)
    return {str(folder / f): os.path.getsize(folder / f) for f in sorted(os.listdir(folder))}


def test_a_tokenizer_folder_changed_since_is_refused_naming_the_option(tmp_path, capsys):
    """The files of a ``--tokenizer`` folder are recorded with their sizes, as an ``hf:`` dataset folder's are: one
    that changed (its vocabulary retrained), is new or is gone, while the folder is there, is named with
    ``--tokenizer`` and the shards stay as they were; the same files again reuse them, ``--overwrite`` tokenizes
    with the folder as it is now, and a folder gone whole leaves the shards usable (their tokenizer is saved)."""
    src, out, tok = corpus(tmp_path), tmp_path / "out", tmp_path / "tok"
    first = tokenizer_folder(tok, 300)
    assert str(tok / "tokenizer.json") in first
    argv = ["--train", src, "--val-every", 5, "--tokenizer", tok, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    assert record["files"]["tokenizer"] == first and record["vocab_size"] == 300
    before = written(out)
    status, again, err = run_data(capsys, *argv)
    assert (status, again) == (0, record) and written(out) == before, err

    tokenizer_folder(tmp_path / "small", 280)  # another vocabulary, in a tokenizer.json of another size
    old, new = first[str(tok / "tokenizer.json")], os.path.getsize(tmp_path / "small" / "tokenizer.json")
    assert old != new
    shutil.copy(tmp_path / "small" / "tokenizer.json", tok / "tokenizer.json")
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and written(out) == before
    assert f"prepared with another --tokenizer '{tok}': its files have changed since" in err
    assert f"{tok / 'tokenizer.json'} held {old:,} bytes, now {new:,}" in err

    shutil.copy(tmp_path / "small" / "tokenizer.json", tmp_path / "keep.json")
    tokenizer_folder(tok, 300)  # trained again as at first: the same files, the same sizes
    status, again, err = run_data(capsys, *argv)  # reused: the record alone is written, with the files' new times
    assert status == 0 and {**again, "stamps": None} == {**record, "stamps": None}, err
    assert {k: v for k, v in written(out).items() if k != str(out / "prepared.json")} == \
        {k: v for k, v in before.items() if k != str(out / "prepared.json")}
    (tok / "added_tokens.json").write_text("{}")
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and f"{tok / 'added_tokens.json'} is new" in err
    (tok / "added_tokens.json").unlink()
    (tok / "tokenizer_config.json").unlink()
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and f"{tok / 'tokenizer_config.json'} is gone" in err and "--tokenizer" in err

    tokenizer_folder(tok, 300)
    shutil.copy(tmp_path / "keep.json", tok / "tokenizer.json")
    for f in src.iterdir():  # a corpus gone since hides no change of the tokenizer
        f.unlink()
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and f"{tok / 'tokenizer.json'} held {old:,} bytes, now {new:,}" in err
    for i, doc in enumerate(words(30, 3)):
        (src / f"{i:02d}.txt").write_text(doc)
    status, rebuilt, err = run_data(capsys, *argv, "--overwrite")
    assert status == 0 and rebuilt["vocab_size"] == 280, err
    assert rebuilt["files"]["tokenizer"] == {str(tok / f): os.path.getsize(tok / f) for f in sorted(os.listdir(tok))}

    shutil.rmtree(tok)
    status, again, err = run_data(capsys, *argv)
    assert (status, again) == (0, rebuilt), err


def test_the_recipe_route_names_data_tokenizer_and_other_tokenizers_record_no_folder(tmp_path):
    """Through ``prepare_dataset`` (a recipe) the changed folder is named as ``data.tokenizer``; ``byte`` and
    ``bpe:N`` record no tokenizer files (there is no folder to change)."""
    src, tok = corpus(tmp_path), tmp_path / "tok"
    tokenizer_folder(tok, 300)
    spec = DataSpec(train_source=str(src), tokenizer=str(tok), val_every=5)
    prepare_dataset(spec, str(tmp_path / "d"))
    tokenizer_folder(tok, 280)
    with pytest.raises(ValueError, match=r"prepared with another data\.tokenizer '.*tok': its files have changed since "
                                         r"\(.*tokenizer\.json held [\d,]+ bytes, now [\d,]+\)"):
        prepare_dataset(spec, str(tmp_path / "d"))
    for name in ("byte", "bpe:300"):
        record = prepare_dataset(DataSpec(train_source=str(src), tokenizer=name, val_every=5), str(tmp_path / name[:3]))
        assert sorted(record["files"]) == ["train", "val"]


def test_a_folder_recorded_with_another_spelling_is_reused(tmp_path, capsys):
    """A folder whose record spells the size otherwise (``bpe:0300``, as preparations wrote it before the record
    held one spelling) is the same tokenizer: any spelling of 300 reuses it unwritten, another size is refused."""
    src, out = corpus(tmp_path), tmp_path / "out"
    status, record, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "bpe:300", "--out", out)
    assert status == 0, err
    held = json.loads((out / "prepared.json").read_text())
    held["spec"]["tokenizer"] = "bpe:0300"
    (out / "prepared.json").write_text(json.dumps(held))
    before = written(out)
    for spelling in ("bpe:0300", "bpe:300", "bpe:\u0663\u0660\u0660"):
        status, again, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", spelling, "--out", out)
        assert status == 0, err
        assert again["counts"] == record["counts"] and written(out) == before
    status, _, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "bpe:301", "--out", out)
    assert status == 2 and "tokenizer 'bpe:300' there, 'bpe:301' here" in err


def opened_files(folder, load):
    """The files below ``folder`` that ``load()`` opens (Python's ``open`` audit event; the hook stays installed,
    idle, once the call is over), as paths inside ``folder``."""
    import sys

    root, seen, active = os.path.realpath(folder) + os.sep, set(), [True]

    def hook(event, args):
        if active[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(root):
                seen.add(os.path.relpath(path, root))

    sys.addaudithook(hook)
    try:
        load()
    finally:
        active[0] = False
    return seen


def test_a_model_folder_records_the_files_the_tokenizer_load_reads(tmp_path, capsys):
    """A ``--tokenizer`` given as a model folder (the tokenizer saved beside a model's weights and configs, as a run
    exports one) records the files loading the tokenizer opens there, ``config.json`` excepted (the model's, read for
    the model type), and no other: new weights, another ``config.json``, a README or weights deleted since reuse the
    shards; a tokenizer file changed or new since (a chat template the load reads) is refused naming
    ``--tokenizer`` and the file."""
    import transformers
    from conftest import save_tiny_falcon

    from falcon_fwa import FalconForCausalLM, get_preset
    from falcon_fwa.data.tokenizer import byte_tokenizer, load_tokenizer

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 reads tokenizer.json from Rust, where Python's audit hook sees no open")

    src, out, tok = corpus(tmp_path), tmp_path / "out", tmp_path / "model"
    save_tiny_falcon(tok)
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= set(os.listdir(tok))
    read = opened_files(tok, lambda: load_tokenizer(str(tok)))
    assert "tokenizer.json" in read and "config.json" in read
    byte_tokenizer().save_pretrained(tmp_path / "alone")  # the files of the tokenizer saved by itself
    assert read - {"config.json"} == set(os.listdir(tmp_path / "alone"))
    argv = ["--train", src, "--val-every", 5, "--tokenizer", tok, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0 and record["vocab_size"] == 257, err
    assert record["files"]["tokenizer"] == {str(tok / f): os.path.getsize(tok / f) for f in sorted(read - {"config.json"})}
    before = written(out)

    held = os.path.getsize(tok / "model.safetensors"), os.path.getsize(tok / "config.json")
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=384, num_hidden_layers=1)).save_pretrained(tok)  # weights trained on
    assert (os.path.getsize(tok / "model.safetensors"), os.path.getsize(tok / "config.json")) != held
    (tok / "README.md").write_text("a tiny model\n")
    (tok / "generation_config.json").unlink()
    status, again, err = run_data(capsys, *argv)
    assert (status, again) == (0, record) and written(out) == before, err
    (tok / "model.safetensors").unlink()
    status, again, err = run_data(capsys, *argv)
    assert (status, again) == (0, record) and written(out) == before, err

    templates = tok / "additional_chat_templates"
    templates.mkdir()
    (templates / "plain.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    read = opened_files(tok, lambda: load_tokenizer(str(tok)))
    assert os.path.join("additional_chat_templates", "plain.jinja") in read  # the load reads it
    assert load_tokenizer(str(tok)).chat_template == {"plain": (templates / "plain.jinja").read_text()}
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and written(out) == before
    assert f"prepared with another --tokenizer '{tok}': its files have changed since ({templates / 'plain.jinja'} is new)" in err
    shutil.rmtree(templates)

    old = os.path.getsize(tok / "tokenizer.json")
    train_bpe_tokenizer(words(80, 4), 300).save_pretrained(tok)  # another vocabulary, saved over the byte one
    new = os.path.getsize(tok / "tokenizer.json")
    assert new != old
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and written(out) == before
    assert f"--tokenizer '{tok}': its files have changed since ({tok / 'tokenizer.json'} held {old:,} bytes, now {new:,}" in err


def test_a_record_of_every_file_of_the_folder_counts_its_tokenizer_files(tmp_path, capsys):
    """A record that holds every file of the tokenizer folder (as preparations wrote it before the record held the
    tokenizer's files alone) is compared by its tokenizer files: the model's files there, resized or gone since,
    reuse the shards; its tokenizer files changed since are refused."""
    from conftest import save_tiny_falcon

    src, out, tok = corpus(tmp_path), tmp_path / "out", tmp_path / "model"
    save_tiny_falcon(tok)
    argv = ["--train", src, "--val-every", 5, "--tokenizer", tok, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    held = json.loads((out / "prepared.json").read_text())
    every = {str(tok / f): os.path.getsize(tok / f) for f in sorted(os.listdir(tok))}
    assert set(every) - set(held["files"]["tokenizer"]) == {str(tok / f) for f in
                                                             ("config.json", "generation_config.json", "model.safetensors")}
    held["files"]["tokenizer"] = every
    (out / "prepared.json").write_text(json.dumps(held))
    before = written(out)
    (tok / "model.safetensors").write_bytes(b"0" * 10)
    (tok / "generation_config.json").unlink()
    status, again, err = run_data(capsys, *argv)
    assert status == 0 and again["counts"] == record["counts"] and written(out) == before, err
    (tok / "tokenizer_config.json").unlink()
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and f"{tok / 'tokenizer_config.json'} is gone" in err and "--tokenizer" in err


@pytest.mark.parametrize("first,second", [("./tok", "tok"), ("tok/", "./tok/."), ("tok", "sub/../tok")])
def test_spellings_of_one_tokenizer_folder_reuse_one_folder(tmp_path, monkeypatch, capsys, first, second):
    """A local tokenizer folder given as ``./tok``, ``tok/`` or ``sub/../tok`` is the one folder: recorded as
    ``tok`` (with its files under that name), and another spelling reuses the shards unwritten; another folder
    with the same files is another setting."""
    monkeypatch.chdir(tmp_path)
    src = corpus(tmp_path)
    tokenizer_folder(tmp_path / "tok", 300)
    (tmp_path / "sub").mkdir()
    status, record, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", first, "--out", "out")
    assert status == 0, err
    assert record["spec"]["tokenizer"] == str(tmp_path / "tok")
    assert sorted(record["files"]["tokenizer"]) == sorted(str(tmp_path / "tok" / f) for f in os.listdir("tok"))
    before = written(tmp_path / "out")
    status, again, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", second, "--out", "out")
    assert status == 0, err
    assert again == record and written(tmp_path / "out") == before
    shutil.copytree(tmp_path / "tok", tmp_path / "other")
    status, _, err = run_data(capsys, "--train", src, "--val-every", 5, "--tokenizer", "other", "--out", "out")
    assert status == 2 and f"tokenizer {str(tmp_path / 'tok')!r} there, {str(tmp_path / 'other')!r} here" in err
