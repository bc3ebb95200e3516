"""The data pipeline against documents written by hand: every text suffix and JSON layout, paragraphs cut at
whitespace-only lines, an excluded output folder that is no name prefix, the settings that reach the validation
source and the BPE, a changed validation file, the limits of each setting, and packed rows, their document cuts
and their sample order worked out token by token."""
import json
import os
import re

import numpy as np
import pytest
import torch

from falcon_fwa.data import (BatchStream, DataSpec, PackedRows, RowOrder, TokenShards, byte_tokenizer, collate,
                             iter_documents, list_files, prepare_dataset, write_token_shards)

EOS = 256


def jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))


def stored(folder):
    return [bytes(d[1:].astype(np.uint8)).decode() for d in TokenShards(str(folder)).documents()]


# --- sources -------------------------------------------------------------------------------------------------------

def test_md_rst_and_text_files_are_text_documents(tmp_path):
    """Every text suffix reads as text, split like a .txt file (a .md file was no Parquet)."""
    (tmp_path / "a.md").write_text("# title\n\nbody")
    (tmp_path / "b.RST").write_text("rst one\n\nrst two")
    (tmp_path / "c.text").write_text("plain")
    (tmp_path / "d.txt").write_text("txt")
    assert list(iter_documents(str(tmp_path), text_split="paragraph")) == ["# title", "body", "rst one", "rst two",
                                                                           "plain", "txt"]


def test_a_line_of_only_spaces_ends_a_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("one\n  \ntwo\n\t\nthree\n\n\n\nfour")
    assert list(iter_documents(str(tmp_path / "a.txt"), text_split="paragraph")) == ["one", "two", "three", "four"]


@pytest.mark.parametrize("name,content", [
    ("upper.JSON", '[{"text": "a"}, {"text": "b"}]'),  # an array, suffix in capitals
    ("spaced.json", '\n\n   [\n {"text": "a"},\n {"text": "b"}\n]\n'),  # the array after blank space
    ("lines.json", '{"text": "a"}\n{"text": "b"}\n'),  # JSON Lines under a .json name
    ("gaps.jsonl", '\n{"text": "a"}\n   \n\n{"text": "b"}\n\n'),  # blank lines between records
])
def test_each_json_layout_gives_its_records(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    assert list(iter_documents(str(tmp_path / name))) == ["a", "b"]


def test_a_json_lines_error_counts_blank_lines(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "a"}\n\n\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"c\.jsonl:4: record has no text_field 'text'"):
        list(iter_documents(str(tmp_path / "c.jsonl")))


def test_a_parquet_column_of_string_views_is_text(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(["p1", None, " ", "p2"], type=pa.string_view())}),
                   tmp_path / "c.parquet")
    assert list(iter_documents(str(tmp_path / "c.parquet"))) == ["p1", "p2"]


def test_an_excluded_folder_is_not_a_prefix_of_names(tmp_path):
    """Excluding ``src/out`` leaves ``src/out-notes.txt`` and ``src/outer/`` in the corpus."""
    src = tmp_path / "src"
    (src / "out").mkdir(parents=True)
    (src / "outer").mkdir()
    (src / "out" / "x.txt").write_text("excluded")
    (src / "out-notes.txt").write_text("kept")
    (src / "outer" / "y.txt").write_text("kept too")
    want = [str(src / "out-notes.txt"), str(src / "outer" / "y.txt")]
    assert list_files(str(src), exclude=str(src / "out")) == want



def test_an_excluded_folder_named_relatively_is_excluded(tmp_path, monkeypatch):
    """``--train src --out src/out`` from the folder above: relative names exclude the output as absolute ones do."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src" / "out").mkdir(parents=True)
    (tmp_path / "src" / "a.txt").write_text("kept")
    (tmp_path / "src" / "out" / "x.txt").write_text("excluded")
    assert list_files("src", exclude="src/out") == [f"src{os.sep}a.txt"]
    assert list_files("src", exclude=str(tmp_path / "src" / "out")) == [f"src{os.sep}a.txt"]


def test_a_parquet_null_beside_bytes_that_are_no_utf8_is_no_document(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = b"ok" + b"x\xff"
    ends = np.array([0, 2, 2, 4], dtype=np.int32)  # "ok", null, "x" + a byte that is no UTF-8
    validity = pa.py_buffer(np.packbits([1, 0, 1], bitorder="little").tobytes())
    column = pa.Array.from_buffers(pa.string(), 3, [validity, pa.py_buffer(ends.tobytes()), pa.py_buffer(data)])
    pq.write_table(pa.table({"text": column}), tmp_path / "c.parquet")
    assert list(iter_documents(str(tmp_path / "c.parquet"))) == ["ok", "x\ufffd"]

# --- preparation ---------------------------------------------------------------------------------------------------

def test_max_documents_caps_the_validation_source_too(tmp_path):
    jsonl(tmp_path / "t.jsonl", [f"train {n}" for n in range(5)])
    jsonl(tmp_path / "v.jsonl", [f"val {n}" for n in range(5)])
    spec = DataSpec(train_source=str(tmp_path / "t.jsonl"), val_source=str(tmp_path / "v.jsonl"), max_documents=2)
    record = prepare_dataset(spec, str(tmp_path / "d"))
    assert stored(tmp_path / "d" / "train") == ["train 0", "train 1"]
    assert stored(tmp_path / "d" / "val") == ["val 0", "val 1"]
    assert record["counts"]["val"] == {"n_docs": 2, "n_tokens": 2 * (1 + len("val 0"))}


def test_an_output_inside_the_validation_folder_is_not_read_as_corpus(tmp_path):
    (tmp_path / "t.txt").write_text("train text")
    val = tmp_path / "val"
    val.mkdir()
    (val / "a.txt").write_text("first")
    (val / "b.txt").write_text("second")
    spec = DataSpec(train_source=str(tmp_path / "t.txt"), val_source=str(val))
    record = prepare_dataset(spec, str(val / "tokens"))
    assert stored(val / "tokens" / "val") == ["first", "second"]
    assert record["files"]["val"] == {str(val / "a.txt"): 5, str(val / "b.txt"): 6}
    assert prepare_dataset(spec, str(val / "tokens")) == record  # its own files are no change of the corpus



def test_the_record_lists_no_file_of_the_output_inside_the_source(tmp_path):
    """A tokenizer folder left in the output (inside the source folder) by a preparation stopped before its
    record is neither corpus nor a source file of the record."""
    src = tmp_path / "src"
    src.mkdir()
    for n in range(4):
        (src / f"{n}.txt").write_text(f"doc {n}")
    byte_tokenizer().save_pretrained(str(src / "out" / "tokenizer"))  # what the stopped preparation left
    record = prepare_dataset(DataSpec(train_source=str(src), val_every=2), str(src / "out"))
    assert record["files"] == {"train": {str(src / f"{n}.txt"): 5 for n in range(4)}, "val": None}
    assert (stored(src / "out" / "train"), stored(src / "out" / "val")) == (["doc 0", "doc 2"], ["doc 1", "doc 3"])

def test_a_bpe_learns_from_the_first_bpe_documents_only(tmp_path, monkeypatch):
    from falcon_fwa.data import tokenizer as tokenizer_module

    docs = [f"doc {n} " * 3 for n in range(9)]
    jsonl(tmp_path / "c.jsonl", docs)
    seen = []
    real = tokenizer_module.train_bpe_tokenizer

    def recording(texts, vocab_size):
        seen.extend(texts)
        return real(list(seen), vocab_size)

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", recording)
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=3, tokenizer="bpe:270",
                             bpe_documents=4), str(tmp_path / "d"))
    assert seen == [docs[0], docs[1], docs[3], docs[4]]  # documents 2, 5, 8 are held out; the first 4 others


def test_a_validation_file_changed_since_is_refused(tmp_path):
    (tmp_path / "t.txt").write_text("train text")
    (tmp_path / "v.txt").write_text("val")
    spec = DataSpec(train_source=str(tmp_path / "t.txt"), val_source=str(tmp_path / "v.txt"))
    prepare_dataset(spec, str(tmp_path / "d"))
    (tmp_path / "v.txt").write_text("val grown")
    with pytest.raises(ValueError, match=r"other source files \(.*v\.txt held 3 bytes, now 9\)"):
        prepare_dataset(spec, str(tmp_path / "d"))


def test_more_than_three_changed_files_are_counted_not_listed(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a")
    spec = DataSpec(train_source=str(src), val_source=str(tmp_path / "v.txt"))
    (tmp_path / "v.txt").write_text("v")
    prepare_dataset(spec, str(tmp_path / "d"))
    for name in "bcde":
        (src / f"{name}.txt").write_text(name)
    with pytest.raises(ValueError) as err:
        prepare_dataset(spec, str(tmp_path / "d"))
    listed = re.search(r"other source files \((.*)\): rebuild", str(err.value)).group(1)
    assert listed == f"{src / 'b.txt'} is new; {src / 'c.txt'} is new; {src / 'd.txt'} is new; 1 more"
    (src / "e.txt").unlink()
    with pytest.raises(ValueError, match=re.escape(f"{src / 'd.txt'} is new): rebuild")):
        prepare_dataset(spec, str(tmp_path / "d"))


@pytest.mark.parametrize("field,value", [("max_documents", 1), ("bpe_documents", 1), ("val_every", 2)])
def test_the_smallest_value_of_each_setting_is_taken(field, value):
    DataSpec(train_source="unused", **{field: value}).check()  # raises nothing


def test_one_document_of_each_source_with_max_documents_one(tmp_path):
    jsonl(tmp_path / "t.jsonl", ["t1", "t2"])
    jsonl(tmp_path / "v.jsonl", ["v1", "v2"])
    spec = DataSpec(train_source=str(tmp_path / "t.jsonl"), val_source=str(tmp_path / "v.jsonl"), max_documents=1)
    record = prepare_dataset(spec, str(tmp_path / "d"))
    assert (stored(tmp_path / "d" / "train"), stored(tmp_path / "d" / "val")) == (["t1"], ["v1"])
    assert record["counts"]["train"] == {"n_docs": 1, "n_tokens": 3}


# --- packing -------------------------------------------------------------------------------------------------------

def shards_of(tmp_path, docs, **kw):
    write_token_shards(docs, byte_tokenizer(), str(tmp_path / "s"), **kw)
    return TokenShards(str(tmp_path / "s"))


def test_rows_and_cuts_by_hand(tmp_path):
    """Documents "ab", "c", "d": stream [E a b E c E d] (7 tokens). With L=2, rows 0..2 are stream[0:3], [2:5],
    [4:7]; documents start at stream positions 3 and 5, which are position 1 of rows 1 and 2."""
    a, b, c, d = 97, 98, 99, 100
    rows = PackedRows(shards_of(tmp_path, ["ab", "c", "d"]), 2)
    assert len(rows) == 3
    got = [rows.row(i) for i in range(3)]
    assert [t.tolist() for t, _ in got] == [[EOS, a, b], [b, EOS, c], [c, EOS, d]]
    assert [s.tolist() for _, s in got] == [[], [1], [1]]
    assert all(t.dtype == np.int64 for t, _ in got)
    batch = collate(got, "cu_seqlens")
    assert batch["input_ids"].tolist() == [[EOS, a, b, EOS, c, EOS]]
    assert batch["targets"].tolist() == [[a, b, EOS, c, EOS, d]]
    assert batch["cu_seqlens"].tolist() == [0, 2, 3, 4, 5, 6] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["input_ids"].dtype == batch["targets"].dtype == torch.int64
    eos = collate(got, "eos")
    assert eos["input_ids"].tolist() == [[EOS, a], [b, EOS], [c, EOS]]
    assert eos["targets"].tolist() == [[a, b], [EOS, c], [EOS, d]]


def test_a_document_starting_on_a_rows_last_target_is_no_cut_in_that_row(tmp_path):
    """Documents "abc", "d": stream [E a b c E d]; with L=2 row 0 = [E a b] and row 1 = [b c E]. The document
    opening at stream position 4 is row 1's last target only: no input of row 1 belongs to it."""
    rows = PackedRows(shards_of(tmp_path, ["abc", "d"]), 2)
    assert [rows.row(i)[0].tolist() for i in range(len(rows))] == [[EOS, 97, 98], [98, 99, EOS]]
    assert [rows.row(i)[1].tolist() for i in range(len(rows))] == [[], []]
    assert collate([rows.row(1), rows.row(0)], "cu_seqlens")["cu_seqlens"].tolist() == [0, 2, 4]


def test_rows_of_a_second_shard_start_at_its_own_first_token(tmp_path):
    """Shards [E a b c] and [E d e f g] (shard_tokens 5): with L=3 one row each; with L=2 rows 0 of the first,
    then rows 0 and 1 of the second; no row spans two shards."""
    shards = shards_of(tmp_path, ["abc", "defg"], shard_tokens=5)
    assert [len(s.tokens) for s in shards.shards] == [4, 5]
    r3 = PackedRows(shards, 3)
    assert [r3.row(i)[0].tolist() for i in range(len(r3))] == [[EOS, 97, 98, 99], [EOS, 100, 101, 102]]
    r2 = PackedRows(shards, 2)
    assert [r2.row(i)[0].tolist() for i in range(len(r2))] == [[EOS, 97, 98], [EOS, 100, 101], [101, 102, 103]]


def test_a_seq_len_or_stream_too_short_for_one_row_is_named(tmp_path):
    shards = shards_of(tmp_path, ["ab"])  # 3 tokens: one row of L=2, none of L=3
    assert len(PackedRows(shards, 2)) == 1
    with pytest.raises(ValueError, match=r"holds 3 tokens: fewer than one row of seq_len=3$"):
        PackedRows(shards, 3)
    with pytest.raises(ValueError, match=r"^seq_len must be >= 1, got 0$"):
        PackedRows(shards, 0)


def test_an_unknown_packing_is_refused_by_name(tmp_path):
    rows = PackedRows(shards_of(tmp_path, ["abcdef"]), 2)
    with pytest.raises(ValueError, match=r"^packing must be one of \('eos', 'cu_seqlens'\), got 'flat'$"):
        collate([rows.row(0)], "flat")
    with pytest.raises(ValueError, match=r"^packing must be one of .*got 'flat'$"):
        BatchStream(rows, micro_batch=1, packing="flat", seed=0)


def test_the_seed_chooses_the_order_and_each_epoch_draws_anew():
    """Over 50 rows, two seeds (or two epochs) agreeing by chance has probability 1/50!."""
    n = 50
    orders = {seed: [RowOrder(n, seed)[k] for k in range(4 * n)] for seed in (0, 1)}
    for order in orders.values():
        epochs = [tuple(order[e * n:(e + 1) * n]) for e in range(4)]
        assert all(sorted(e) == list(range(n)) for e in epochs)
        assert len(set(epochs)) == 4 and epochs[0] != tuple(range(n))
    assert orders[0][:n] != orders[1][:n]


def test_row_order_does_not_depend_on_the_order_of_asking():
    straight = [RowOrder(7, 11)[k] for k in range(35)]
    order = RowOrder(7, 11)
    asked = list(range(35))
    np.random.default_rng(0).shuffle(asked)
    assert {k: order[k] for k in asked} == dict(enumerate(straight))


def test_every_rank_follows_one_order(tmp_path):
    """Two ranks of one sample each take the samples one process of two would, step for step: the order is
    the seed's, not the rank's."""
    rows = PackedRows(shards_of(tmp_path, ["abcdefghijklmnopqrstuvw"]), 2)  # 24 tokens: 11 rows
    order = RowOrder(len(rows), 4)
    ranks = [BatchStream(rows, micro_batch=1, packing="eos", seed=4, rank=r, world_size=2) for r in range(2)]
    for step in range(8):
        for r, stream in enumerate(ranks):
            want = rows.row(order[2 * step + r])[0]
            assert next(stream)["input_ids"][0].tolist() == want[:-1].tolist()
