"""``DIR/tokenizer`` is the tokenizer the shards were written with (training copies it into the exported model):
a rebuild with another tokenizer leaves none of the files the earlier one saved there that loading would read
with the new one (a chat template, a vocabulary), while files of other kinds beside them stay."""
import filecmp
import os
import random

from transformers import AutoTokenizer

from falcon_fwa.data import DataSpec, byte_tokenizer, prepare_dataset
from falcon_fwa.data.tokenizer import train_bpe_tokenizer


def corpus(folder, n=30):
    rng = random.Random(0)
    folder.mkdir()
    texts = [" ".join(rng.choice("the state memory key value write read gate".split()) for _ in range(10))
             for _ in range(n)]
    for i, text in enumerate(texts):
        (folder / f"{i:02d}.txt").write_text(text)
    return texts


def test_a_rebuild_with_another_tokenizer_saves_that_tokenizer_alone(tmp_path):
    texts = corpus(tmp_path / "c")
    tok = train_bpe_tokenizer(texts * 4, 300)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "tok" / "vocab.txt").write_text("the\nstate\n")  # a vocabulary file loading reads if present
    out = tmp_path / "out"
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c"), tokenizer=str(tmp_path / "tok"), val_every=5), str(out))
    assert AutoTokenizer.from_pretrained(str(out / "tokenizer")).chat_template is not None
    (out / "tokenizer" / "vocab.txt").write_text("the\nstate\n")
    (out / "tokenizer" / "README.md").write_text("notes")  # no tokenizer file: not the preparation's to remove

    record = prepare_dataset(DataSpec(train_source=str(tmp_path / "c"), tokenizer="byte", val_every=5), str(out),
                             overwrite=True)
    assert (record["vocab_size"], record["eos_token_id"]) == (257, 256)
    byte_tokenizer().save_pretrained(tmp_path / "fresh")  # the reference: the byte tokenizer saved on its own
    fresh = sorted(os.listdir(tmp_path / "fresh"))
    assert sorted(os.listdir(out / "tokenizer")) == sorted(fresh + ["README.md"])
    assert filecmp.cmpfiles(out / "tokenizer", tmp_path / "fresh", fresh, shallow=False)[0] == fresh
    loaded = AutoTokenizer.from_pretrained(str(out / "tokenizer"))
    assert loaded.chat_template is None and len(loaded) == 257 and loaded.eos_token_id == 256
    assert (out / "tokenizer" / "README.md").read_text() == "notes"


def test_a_folder_that_lost_its_tokenizer_copy_is_refused_on_reuse(tmp_path):
    """The tokenizer copy is part of what a prepared folder records (training exports it with the model): one
    removed by hand since is named, as a lost split is, rather than reused until an export finds it gone."""
    import shutil

    import pytest

    corpus(tmp_path / "c")
    spec = DataSpec(train_source=str(tmp_path / "c"), tokenizer="byte", val_every=5)
    out = tmp_path / "out"
    record = prepare_dataset(spec, str(out))
    assert prepare_dataset(spec, str(out)) == record
    shutil.rmtree(out / "tokenizer")
    lost = r"has lost its tokenizer \('.*/out/tokenizer' holds no tokenizer files\).*--overwrite"
    with pytest.raises(ValueError, match=lost):
        prepare_dataset(spec, str(out))
    assert prepare_dataset(spec, str(out), overwrite=True)["counts"] == record["counts"]
    assert len(AutoTokenizer.from_pretrained(str(out / "tokenizer"))) == 257
