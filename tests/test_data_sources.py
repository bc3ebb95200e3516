"""The inputs of ``falcon-fwa data``: every source kind counted independently, refused inputs named in
one line, tokenizers against the ``tokenizers`` library, and a preparation killed mid-write."""
import json
import os
import logging
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import needs_datasets

from falcon_fwa.cli import main
from falcon_fwa.data import TokenShards, byte_tokenizer, encode_documents, iter_documents, load_tokenizer


def words(n, seed):
    rng = random.Random(seed)
    vocab = "the state memory key value write read gate decay token fast weight é ✓".split()
    return [" ".join(rng.choice(vocab) for _ in range(rng.randint(2, 12))) for _ in range(n)]


def run_data(capsys, *argv):
    """(exit status, stdout record or None, stderr) of ``falcon-fwa data ARGV``."""
    # the datasets library logs through a handler made once, on the stderr of whichever test imported it
    # first: capsys has closed that one since, and a record written to it would print a logging error here
    for handler in logging.getLogger("datasets").handlers:
        if type(handler) is logging.StreamHandler:
            handler.stream = sys.stderr  # not setStream: it flushes the closed stream first
    status = main(["data", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, (json.loads(out) if status == 0 else None), err


def stored(folder):
    """The documents of a shard folder as (eos, bytes) pairs."""
    return [(int(d[0]), bytes(d[1:].astype(np.uint8))) for d in TokenShards(str(folder)).documents()]


def sources(tmp_path):
    """One corpus written as text files, JSONL, a JSON array, Parquet and a local dataset folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs, val = words(23, 0), words(4, 1)
    (tmp_path / "txt").mkdir()
    for n, d in enumerate(docs):
        (tmp_path / "txt" / f"{n:02d}.txt").write_text(d)
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": d, "n": i}) + "\n" for i, d in enumerate(docs)))
    (tmp_path / "c.json").write_text(json.dumps([{"body": d} for d in docs], indent=1))
    pq.write_table(pa.table({"body": docs}), tmp_path / "c.parquet")
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    (tmp_path / "hub" / "validation.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in val))
    return docs, val


@pytest.mark.parametrize("kind", ["folder", "glob", "jsonl", "json", "parquet",
                                  pytest.param("hf", marks=needs_datasets)])
def test_every_source_kind_stores_the_documents_it_holds(tmp_path, capsys, kind):
    docs, val = sources(tmp_path)
    held = [d for i, d in enumerate(docs) if i % 5 == 4]
    kept = [d for i, d in enumerate(docs) if i % 5 != 4]
    cases = {"folder": (tmp_path / "txt", None), "glob": (str(tmp_path / "txt" / "*.txt"), None),
             "jsonl": (tmp_path / "c.jsonl", None), "json": (tmp_path / "c.json", None),
             "parquet": (tmp_path / "c.parquet", None), "hf": (f"hf:{tmp_path / 'hub'}", f"hf:{tmp_path / 'hub'}")}
    train, val_source = cases[kind]
    out = tmp_path / f"out-{kind}"
    extra = ["--val", val_source] if val_source else ["--val-every", 5]
    status, record, err = run_data(capsys, "--train", train, *extra, "--text-field", "body", "--out", out)
    assert status == 0, (kind, err)
    want = {"train": docs, "val": val} if val_source else {"train": kept, "val": held}
    for split, texts in want.items():
        assert stored(out / split) == [(256, t.encode()) for t in texts], (kind, split)
        n_tokens = sum(len(t.encode()) + 1 for t in texts)
        assert record["counts"][split] == {"n_docs": len(texts), "n_tokens": n_tokens}
    assert (record["vocab_size"], record["eos_token_id"]) == (257, 256)


def test_max_documents_caps_each_source_before_the_held_out_split(tmp_path, capsys):
    docs, _ = sources(tmp_path)
    status, record, _ = run_data(capsys, "--train", tmp_path / "c.jsonl", "--text-field", "body", "--val-every", 5,
                                 "--max-documents", 12, "--out", tmp_path / "out-max")
    assert status == 0 and stored(tmp_path / "out-max" / "val") == [(256, d.encode()) for d in docs[4:12:5]]
    assert record["counts"]["train"]["n_docs"] == 10


def bad_inputs(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "ok.txt").write_text("fine\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "notjson.jsonl").write_text('{"text": "a"}\nnot json\n')
    (tmp_path / "cut.json").write_text('[{"text": "a"}, {"text"')
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    pq.write_table(pa.table({"text": [b"a", b"b"]}), tmp_path / "bytes.parquet")
    pq.write_table(pa.table({"text": [["a"], ["b"]]}), tmp_path / "lists.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 no footer")
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text('{"text": 7}\n')
    (tmp_path / "hub2").mkdir()
    (tmp_path / "hub2" / "train.jsonl").write_text('{"body": "x"}\n')


@pytest.mark.parametrize("train,more,message", [
    ("empty.txt", ["--val", "ok.txt"], r"the train split is empty: --train '.*empty\.txt' holds no document$"),
    ("ok.txt", ["--val", "empty.txt"], r"the val split is empty: --val '.*empty\.txt' holds no document$"),
    ("ok.txt", [], r"--train '.*ok\.txt' holds fewer than --val-every=20 documents; set --val, or a --text-split"),
    ("nothing-*.txt", [], r"data source '.*nothing-\*\.txt' names no \.txt/"),
    ("nofield.jsonl", [], r"nofield\.jsonl:1: record has no --text-field 'text' \(keys: \['body'\]\)$"),
    ("notjson.jsonl", [], r"notjson\.jsonl:2: not a JSON record"),
    ("cut.json", [], r"cut\.json: not a JSON array of records"),
    ("ints.parquet", [], r"ints\.parquet: column --text-field 'text' must hold strings, got int64$"),
    ("bytes.parquet", [], r"bytes\.parquet: column --text-field 'text' must hold strings, got binary$"),
    ("lists.parquet", [], r"lists\.parquet: column --text-field 'text' must hold strings, got list"),
    ("junk.parquet", [], r"junk\.parquet: not a Parquet file"),
    pytest.param("hf:hub", [], r"hf:.*hub \(train\) record 0: --text-field 'text' must hold a string, got int$",
                 marks=needs_datasets),
    pytest.param("hf:hub2", [], r"hf:.*hub2 \(train\) record 0: record has no --text-field 'text' \(keys: "
                 r"\['body'\]\)$", marks=needs_datasets),
])
def test_a_bad_input_ends_in_one_line_naming_it(tmp_path, capsys, train, more, message):
    """Exit status 2 and ``falcon-fwa data: error: ...`` naming the file or option: no traceback, no empty shard."""
    bad_inputs(tmp_path)
    train = f"hf:{tmp_path / train[3:]}" if train.startswith("hf:") else tmp_path / train
    more = [more[0], tmp_path / more[1]] if more else []
    status, _, err = run_data(capsys, "--train", train, *more, "--out", tmp_path / "out")
    lines = re.findall(r"falcon-fwa data: error: (.*)", err)  # after the progress bar, on its line
    assert status == 2 and "Traceback" not in err and len(lines) == 1
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out" / "prepared.json").exists()


def test_bytes_that_are_no_utf8_become_replacement_characters_in_text_and_json(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"ok \xff\xfe end")
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "ok \xff end"}\n')
    assert list(iter_documents(str(tmp_path / "a.txt"))) == ["ok \ufffd\ufffd end"]
    assert list(iter_documents(str(tmp_path / "b.jsonl"))) == ["ok \ufffd end"]


def test_a_byte_order_mark_opening_a_file_is_no_text(tmp_path):
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.txt").write_bytes(bom + b"first\n\nsecond \xef\xbb\xbf kept inside")
    (tmp_path / "b.jsonl").write_bytes(bom + b'{"text": "x"}\n{"text": "y"}\n')
    (tmp_path / "c.json").write_bytes(bom + b'[{"text": "z"}]')
    assert list(iter_documents(str(tmp_path / "a.txt"), text_split="paragraph")) == ["first", "second \ufeff kept inside"]
    assert list(iter_documents(str(tmp_path / "b.jsonl"))) == ["x", "y"]
    assert list(iter_documents(str(tmp_path / "c.json"))) == ["z"]


def test_blank_texts_are_no_documents_in_any_format_and_suffixes_count_in_any_case(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "A.TXT").write_text("upper case text\n\n   \n\nmore")
    (folder / "b.JsonL").write_text('{"text": " \\n\\t "}\n{"text": "json"}\n{"text": ""}\n{"text": null}\n')
    pq.write_table(pa.table({"text": ["  ", "parquet", None, "\n"]}), folder / "c.Parquet")
    (folder / "d.csv").write_text("not a source")
    docs = list(iter_documents(str(folder), text_split="paragraph"))
    assert docs == ["upper case text", "more", "json", "parquet"]


def test_the_byte_tokenizer_is_utf8_for_any_text_and_decodes_any_bytes():
    tok = byte_tokenizer()
    rng = random.Random(0)
    code_points = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]  # every scalar value but surrogates
    texts = ["".join(chr(rng.choice(code_points) if rng.random() < 0.5 else rng.randrange(128))
                     for _ in range(rng.randint(0, 40))) for _ in range(100)]
    for text, fast in zip(texts, encode_documents(tok, texts)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == fast.tolist() == list(text.encode("utf-8")) and tok.decode(ids) == text
    raw = bytes(rng.randrange(256) for _ in range(2000))  # mostly no UTF-8: decoded as Python does
    assert tok.decode(list(raw)) == raw.decode("utf-8", "replace")


def test_a_tokenizer_folder_encodes_as_the_tokenizers_library_does(tmp_path, capsys):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    docs = words(60, 2)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    argv = ["--train", tmp_path / "c.jsonl", "--val-every", 6, "--tokenizer", folder, "--out", tmp_path / "out"]
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and "defines no eos_token (a folder holding only tokenizer.json needs a tokenizer_config" in err
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    eos = tok.token_to_id("</s>")
    assert (record["vocab_size"], record["eos_token_id"]) == (tok.get_vocab_size(), eos) and eos == 1
    shards = TokenShards(str(tmp_path / "out" / "train"))
    assert (shards.vocab_size, shards.eos_token_id) == (tok.get_vocab_size(), eos)  # what the model is built with
    want = [[eos] + tok.encode(d, add_special_tokens=False).ids for i, d in enumerate(docs) if i % 6 != 5]
    assert [d.tolist() for d in shards.documents()] == want


def test_a_tokenizer_whose_ids_exceed_its_size_is_refused(tmp_path):
    """An id past len(tokenizer) would be cut to the shard's uint16 or fall outside the model's embedding."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1, "far": 70000}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"has ids up to 70000 but 4 tokens: its ids must be 0\.\.N-1$"):
        load_tokenizer(str(tmp_path))


KILLED_RUN = """
import os, signal, sys
from falcon_fwa.data import DataSpec, prepare_dataset, shards
close = shards._ShardWriter._close
def close_then_die(self):
    close(self)
    if len(self.shards) == 2:  # two shards of train written, the third begun
        os.kill(os.getpid(), signal.SIGKILL)
shards._ShardWriter._close = close_then_die
shards.write_token_shards.__kwdefaults__.update(shard_tokens=40, batch_documents=4)  # many small shards
prepare_dataset(DataSpec(train_source=sys.argv[1], val_every=4), sys.argv[2])
"""


def test_a_preparation_killed_mid_write_then_relaunched_writes_the_same_bytes(tmp_path, monkeypatch):
    from falcon_fwa.data import DataSpec, prepare_dataset, shards

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in words(40, 3)))
    monkeypatch.setattr(shards.write_token_shards, "__kwdefaults__",
                        dict(shards.write_token_shards.__kwdefaults__, shard_tokens=40, batch_documents=4))
    spec = DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=4)
    prepare_dataset(spec, str(tmp_path / "straight"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", KILLED_RUN, spec.train_source, str(tmp_path / "killed")], env=env,
                          capture_output=True)
    assert done.returncode == -9, done.stderr.decode()[-2000:]
    assert sorted(os.listdir(tmp_path / "killed" / "train.tmp"))[:2] == ["docs-00000.npy", "docs-00001.npy"]
    assert not (tmp_path / "killed" / "prepared.json").exists() and not (tmp_path / "killed" / "train").exists()
    prepare_dataset(spec, str(tmp_path / "killed"))

    def tree(root):
        return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                for d, _, names in os.walk(root) for f in names if f != ".prepare.lock"}

    straight, killed = tree(tmp_path / "straight"), tree(tmp_path / "killed")
    assert len([k for k in straight if k.startswith("train/tokens-")]) > 3 and straight == killed


@needs_datasets
def test_an_hf_source_that_cannot_be_opened_is_named(tmp_path, monkeypatch):
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text('{"text": "a"}\n')
    source = f"hf:{tmp_path / 'hub'}"
    assert list(iter_documents(source)) == ["a"]
    with pytest.raises(ValueError, match=rf"^data source '{re.escape(source)}' \(validation split\): .*validation"):
        list(iter_documents(source, split="validation"))  # the folder has no validation split
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'corpus' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"^data source 'hf:corpus:en' \(train split\): Couldn't reach 'corpus'"):
        list(iter_documents("hf:corpus:en"))


def test_a_tokenizer_file_is_refused_naming_its_folder(tmp_path):
    byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"tokenizer\.json' is a file: give the folder that holds it"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).eos_token_id == 256


@needs_datasets
def test_a_file_read_by_an_hf_folder_split_and_by_the_other_source_is_refused(tmp_path, capsys):
    """An ``hf:`` dataset folder reads, for ``--train``, its train split's files and, for ``--val``, its validation
    split's: a plain source that reads one of those files too is refused before ``--out`` is made, naming both
    options; one that reads the other split's file, or the same folder as both sources, is no overlap."""
    hub, plain = tmp_path / "hub", tmp_path / "plain"
    hub.mkdir()
    plain.mkdir()
    (hub / "train.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in words(30, 5)))
    (hub / "validation.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in words(5, 6)))
    (plain / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in words(12, 7)))
    out = tmp_path / "out"

    status, _, err = run_data(capsys, "--train", hub, "--val", f"hf:{hub}", "--out", out)
    assert status == 2 and not out.exists()
    assert f"--val 'hf:{hub}' (its validation split) reads file '{hub / 'validation.jsonl'}', also read by " \
           f"--train '{hub}': its documents would be in both splits" in err
    status, _, err = run_data(capsys, "--train", f"hf:{hub}", "--val", hub / "train.jsonl", "--out", out)
    assert status == 2 and not out.exists()
    assert f"--val file '{hub / 'train.jsonl'}', also read by --train 'hf:{hub}' (its train split)" in err
    # a folder of no split names is all train split: its file is the train split's
    status, _, err = run_data(capsys, "--train", f"hf:{plain}", "--val", plain / "data.jsonl", "--out", out)
    assert status == 2 and not out.exists() and "(its train split)" in err

    for n, (train, val) in enumerate([(hub / "train.jsonl", f"hf:{hub}"), (f"hf:{hub}", hub / "validation.jsonl"),
                                      (f"hf:{hub}", f"hf:{tmp_path}/./hub/")]):
        status, record, err = run_data(capsys, "--train", train, "--val", val, "--out", tmp_path / f"ok{n}")
        assert status == 0, err
        assert (record["counts"]["train"]["n_docs"], record["counts"]["val"]["n_docs"]) == (30, 5)
