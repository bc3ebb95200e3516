"""The token shards against hand-written documents: every text split and source kind decodes back to
exactly the documents written (end-of-text first), packing covers each shard's stream once, and the
preparation refuses what would corrupt or leak data (ids past the vocabulary, a file in both splits,
an unreadable dataset file), naming it."""
import json
import os
import shutil

import numpy as np
import pytest
import torch
from test_data_sources import run_data, stored

from falcon_fwa.data import (BatchStream, DataSpec, PackedRows, TokenShards, byte_tokenizer, collate, iter_documents,
                             load_tokenizer, prepare_dataset, write_token_shards)

LONG = "x" * 20_000 + " é"  # one line far longer than any read or batch buffer


def edge_files(folder):
    """Text files of edge cases, with the documents each split must give written out by hand."""
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"\xef\xbb\xbfone\r\ntwo\rthree\n\n \t\n\nfour \xff end\n")
    (folder / "b.txt").write_bytes(b"   \n\t\n")  # blank only: no document in any split
    (folder / "c.txt").write_bytes(b"")
    (folder / "d.txt").write_text("\x00nul \u2028 emoji \U0001F600\n" + LONG + "\n\n\nlast", encoding="utf-8")
    return {
        "file": ["one\ntwo\nthree\n\n \t\n\nfour \ufffd end\n", "\x00nul \u2028 emoji \U0001F600\n" + LONG + "\n\n\nlast"],
        "line": ["one", "two", "three", "four \ufffd end", "\x00nul \u2028 emoji \U0001F600", LONG, "last"],
        "paragraph": ["one\ntwo\nthree", "four \ufffd end\n", "\x00nul \u2028 emoji \U0001F600\n" + LONG, "last"],
    }


@pytest.mark.parametrize("text_split", ["file", "line", "paragraph"])
def test_text_files_become_exactly_the_documents_written(tmp_path, capsys, text_split):
    """A text file's bytes as documents: U+FFFD for bytes that are no UTF-8, no byte-order mark, line ends
    as \\n, blank parts none; the byte shards hold each document's UTF-8 after the end-of-text 256."""
    want = edge_files(tmp_path / "src")[text_split]
    (tmp_path / "val.txt").write_text("held out")
    status, record, err = run_data(capsys, "--train", tmp_path / "src", "--val", tmp_path / "val.txt",
                                   "--text-split", text_split, "--out", tmp_path / "out")
    assert status == 0, err
    assert stored(tmp_path / "out" / "train") == [(256, d.encode("utf-8")) for d in want]
    assert record["counts"]["train"] == {"n_docs": len(want), "n_tokens": sum(len(d.encode()) + 1 for d in want)}
    assert stored(tmp_path / "out" / "val") == [(256, b"held out")]


def test_a_trained_bpe_decodes_its_shards_to_the_documents(tmp_path, capsys):
    from transformers import AutoTokenizer

    want = edge_files(tmp_path / "src")["line"]
    (tmp_path / "val.txt").write_text("held out é\nsecond")
    status, record, err = run_data(capsys, "--train", tmp_path / "src", "--val", tmp_path / "val.txt", "--text-split",
                                   "line", "--tokenizer", "bpe:300", "--out", tmp_path / "out")
    assert status == 0, err
    tok = AutoTokenizer.from_pretrained(tmp_path / "out" / "tokenizer")
    assert (len(tok), tok.eos_token_id) == (record["vocab_size"], record["eos_token_id"]) and tok.eos_token_id == 0
    for split, texts in (("train", want), ("val", ["held out é", "second"])):
        docs = list(TokenShards(str(tmp_path / "out" / split)).documents())
        assert [int(d[0]) for d in docs] == [0] * len(texts) and all((d[1:] != 0).all() for d in docs)
        assert [tok.decode(d[1:].tolist()) for d in docs] == texts
    assert sum(len(d) - 1 for d in TokenShards(str(tmp_path / "out" / "train")).documents()) < len(LONG) // 2


def test_datasets_folders_of_text_jsonl_and_parquet_give_their_records(tmp_path):
    """``hf:FOLDER`` through ``datasets``: a text file is one record a line (blank lines none), JSONL and
    Parquet records give their text field (null, empty and blank none)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for kind in ("t", "j", "p"):
        (tmp_path / kind).mkdir()
    (tmp_path / "t" / "train.txt").write_text("l1\n\nl2 é\n   \nl3\n")
    (tmp_path / "j" / "train.jsonl").write_text('{"text": "j1"}\n{"text": null}\n{"text": " "}\n{"text": "j2\\n"}\n')
    pq.write_table(pa.table({"text": ["p1", None, "", "p2"]}), tmp_path / "p" / "train.parquet")
    assert list(iter_documents(f"hf:{tmp_path / 't'}")) == ["l1", "l2 é", "l3"]
    assert list(iter_documents(f"hf:{tmp_path / 'j'}")) == ["j1", "j2\n"]
    assert list(iter_documents(f"hf:{tmp_path / 'p'}")) == ["p1", "p2"]


@pytest.mark.parametrize("content", ['{"text": "a"}\n{"text": "b"}\nnot json\n', '{"text": "a"}\n{"text": "x\\ud800y"}\n'])
def test_a_dataset_file_unreadable_midway_is_named(tmp_path, capsys, content):
    """A streamed dataset reads its files while documents are taken: what it cannot parse there is one
    error line naming the source, as for a dataset that cannot be opened."""
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "train.jsonl").write_text(content)
    source = f"hf:{tmp_path / 'hub'}"
    status, _, err = run_data(capsys, "--train", source, "--val-every", 2, "--out", tmp_path / "out")
    assert status == 2 and "Traceback" not in err
    assert f"falcon-fwa data: error: data source '{source}' (train split), after " in err
    assert not (tmp_path / "out" / "prepared.json").exists()


def word_tokenizer(ids):
    """A word-level tokenizer of ``{word: id}`` with end-of-text ``</s>`` (the next id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(ids, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def test_a_token_id_past_the_vocabulary_is_refused_not_cut_to_the_dtype(tmp_path):
    tok = word_tokenizer({"w0": 0, "a": 1, "far": 70000})  # 4 tokens, one of id 70000
    assert len(tok) == 4 and tok("a far", add_special_tokens=False)["input_ids"] == [1, 70000]
    with pytest.raises(ValueError, match=r"^tokenizer gave token id 70000, outside 0\.\.3 .*uint16"):
        write_token_shards(["a far a"], tok, str(tmp_path / "s"))  # uint16 would store 70000 as 4464
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("vocab_size,dtype", [(1 << 16, np.uint16), ((1 << 16) + 1, np.uint32)])
def test_the_largest_id_of_a_vocabulary_is_stored_exactly(tmp_path, vocab_size, dtype):
    """uint16 holds ids 0..65535: a vocabulary of 2**16 tokens fits, one more token needs uint32."""
    n = vocab_size - 1  # word ids 0..n-1, end-of-text n
    tok = word_tokenizer({f"w{i}": i for i in range(n)})
    assert (len(tok), tok.eos_token_id) == (vocab_size, n)
    meta = write_token_shards([f"w{n - 1} w0 w1", "w7"], tok, str(tmp_path / "s"))
    shards = TokenShards(str(tmp_path / "s"))
    assert meta["dtype"] == np.dtype(dtype).name and shards.shards[0].tokens.dtype == dtype
    assert [d.tolist() for d in shards.documents()] == [[n, n - 1, 0, 1], [n, 7]]


def test_a_validation_file_that_the_train_source_reads_is_refused(tmp_path, capsys):
    """The same file as both sources, or a training folder that holds the validation file: every document
    of it would be scored after being trained on."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "train.txt").write_text("train text")
    (tmp_path / "corpus" / "val.txt").write_text("val text")
    val = tmp_path / "corpus" / "val.txt"
    for train in (tmp_path / "corpus", val, tmp_path / "corpus" / "*.txt"):
        status, _, err = run_data(capsys, "--train", train, "--val", val, "--out", tmp_path / "out")
        assert status == 2, err
        assert f"error: --val file '{val}' is also read by --train '{train}': its documents would be in both" in err
        assert not (tmp_path / "out" / "train").exists()
    status, _, err = run_data(capsys, "--train", tmp_path / "corpus" / "train.txt", "--val", val, "--out",
                              tmp_path / "out")
    assert status == 0, err
    with pytest.raises(ValueError, match=r"^data\.val_source file .* is also read by data\.train_source"):
        prepare_dataset(DataSpec(train_source=str(tmp_path / "corpus"), val_source=str(val)), str(tmp_path / "o2"))


def test_a_rebuild_stopped_while_removing_the_old_split_can_run_again(tmp_path, monkeypatch):
    """The old split folder goes aside whole before it is removed: a stop in that removal leaves no folder
    without its meta.json under the split's name (which no later run would replace)."""
    from falcon_fwa.data import shards as shards_module

    docs = [f"document {n} " + "ab" * n for n in range(40)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    spec = DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=10)
    out = str(tmp_path / "d")
    prepare_dataset(spec, out)
    real = shutil.rmtree

    def stopped_midway(path, *args, **kwargs):  # removes meta.json first, then Ctrl-C
        if os.path.isdir(path) and not str(path).endswith(".tmp"):
            os.remove(os.path.join(path, "meta.json"))
            raise KeyboardInterrupt
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shards_module.shutil, "rmtree", stopped_midway)
    new = DataSpec(train_source=spec.train_source, val_every=5)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(new, out, overwrite=True)
    monkeypatch.undo()
    record = prepare_dataset(new, out)
    assert record["counts"]["train"]["n_docs"] == 32
    assert stored(tmp_path / "d" / "train") == [(256, d.encode()) for i, d in enumerate(docs) if i % 5 != 4]
    assert sorted(os.listdir(out)) == [".prepare.lock", "prepared.json", "tokenizer", "train", "val"]


@pytest.mark.parametrize("spec", ["/no/such/tok", "./tok", "a/b/c"])
def test_a_tokenizer_folder_that_does_not_exist_is_named(tmp_path, spec, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    with pytest.raises(ValueError, match=rf"^tokenizer folder '{spec}' does not exist"):
        load_tokenizer(spec)


def test_preparing_again_writes_the_same_bytes_whatever_the_batch(tmp_path, monkeypatch):
    from falcon_fwa.data import shards as shards_module

    docs = [f"doc {n} é " * (n % 7 + 1) for n in range(50)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    spec = DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=7, tokenizer="bpe:280")

    def tree(root):
        return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                for d, _, names in os.walk(root) for f in names}

    trees = []
    for batch in (1, 64):
        monkeypatch.setattr(shards_module.write_token_shards, "__kwdefaults__",
                            dict(shards_module.write_token_shards.__kwdefaults__, batch_documents=batch))
        prepare_dataset(spec, str(tmp_path / f"d{batch}"))
        trees.append(tree(tmp_path / f"d{batch}"))
    assert trees[0] == trees[1] and len([k for k in trees[0] if k.startswith("train/tokens-")]) == 1


def test_rows_cover_each_shard_once_and_cut_at_every_document(tmp_path):
    """Row i of a shard is tokens[iL : iL+L+1] of that shard; documents lengths alone give the reference
    stream, shard cuts and document starts."""
    rng = np.random.default_rng(0)
    docs = ["".join(rng.choice(list("ab é\n"), size=int(rng.integers(1, 60)))) for _ in range(200)]
    docs = [d for d in docs if d.strip()]
    write_token_shards(docs, byte_tokenizer(), str(tmp_path / "s"), shard_tokens=400, batch_documents=3)
    shards = TokenShards(str(tmp_path / "s"))
    # reference shard streams: documents in order, a new shard when the next one would pass 400 tokens
    streams, starts, cur, cur_starts = [], [], [], []
    for d in docs:
        ids = [256] + list(d.encode())
        if cur and len(cur) + len(ids) > 400:
            streams.append(cur), starts.append(cur_starts)
            cur, cur_starts = [], []
        cur_starts.append(len(cur))
        cur += ids
    streams.append(cur), starts.append(cur_starts)
    assert [s.tokens.tolist() for s in shards.shards] == streams and len(streams) > 5
    for L in (1, 5, 64):
        rows = PackedRows(shards, L)
        want = [(np.asarray(s[i * L:i * L + L + 1]), [p - i * L for p in st if i * L < p < i * L + L])
                for s, st in zip(streams, starts) for i in range((len(s) - 1) // L)]
        assert len(rows) == len(want)
        for i, (tokens, doc_starts) in enumerate(want):
            got, got_starts = rows.row(i)
            np.testing.assert_array_equal(got, tokens)
            assert got_starts.tolist() == doc_starts
        batch = collate([rows.row(i) for i in range(3)], "cu_seqlens")
        cuts = sorted({r * L + p for r in range(3) for p in [0] + want[r][1]} | {3 * L})
        assert batch["cu_seqlens"].tolist() == cuts


def test_every_process_count_takes_the_same_samples_across_epochs(tmp_path):
    write_token_shards([f"text {n} " * 3 for n in range(30)], byte_tokenizer(), str(tmp_path / "s"))
    rows = PackedRows(TokenShards(str(tmp_path / "s")), 8)
    n_steps = 2 * len(rows) // 4 + 3  # past two epochs of 4 samples a step

    def samples(world):
        streams = [BatchStream(rows, micro_batch=4 // world, packing="eos", seed=5, rank=r, world_size=world)
                   for r in range(world)]
        return torch.cat([torch.cat([next(s)["input_ids"] for s in streams]) for _ in range(n_steps)])

    one = samples(1)
    torch.testing.assert_close(samples(2), one, rtol=0, atol=0)
    torch.testing.assert_close(samples(4), one, rtol=0, atol=0)
    first_epoch = one[:len(rows)]  # every row once, in some order
    all_rows = torch.stack([torch.from_numpy(rows.row(i)[0][:-1]) for i in range(len(rows))])
    assert sorted(map(tuple, first_epoch.tolist())) == sorted(map(tuple, all_rows.tolist()))
