"""Language-model data: tokenizers, document sources, token shards, packing, sample order."""
import json
import random
import re

import numpy as np
import pytest
import torch

from falcon_fwa.data import (BatchStream, DataSpec, PackedRows, RowOrder, TokenShards, byte_tokenizer, collate,
                             encode_documents, iter_documents, load_tokenizer, prepare_dataset, train_bpe_tokenizer,
                             write_token_shards)

TEXTS = ["Fast weights write keys.", "Zürich – naïve café ✓", "line one\nline two", "x" * 300, "a"]


def corpus(n=60, seed=0):
    rng = random.Random(seed)
    words = "the state memory key value write read gate decay token fast weight".split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 40))) + "." for _ in range(n)]


def test_byte_tokenizer_is_utf8_and_round_trips(tmp_path):
    tok = byte_tokenizer()
    assert len(tok) == 257 and tok.eos_token_id == 256
    for text in TEXTS:
        slow = tok(text, add_special_tokens=False)["input_ids"]
        assert slow == list(text.encode("utf-8"))
        assert tok.decode(slow) == text
    fast = encode_documents(tok, TEXTS)
    assert [f.tolist() for f in fast] == [list(t.encode("utf-8")) for t in TEXTS]
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again("héllo", add_special_tokens=False)["input_ids"] == list("héllo".encode())
    assert again.eos_token_id == 256
    # saved to pad on the left: a padded batch of prompts ends each row with its own last token
    batch = again(["ab", "abcd"], padding=True, add_special_tokens=False)
    assert batch["input_ids"] == [[256, 256, 97, 98], [97, 98, 99, 100]]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_bpe_trained_on_corpus_round_trips_and_compresses():
    docs = corpus(200)
    tok = train_bpe_tokenizer(docs, vocab_size=300)
    assert len(tok) <= 300 and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    ids = encode_documents(tok, docs[:20])
    for doc, d in zip(docs[:20], ids):
        assert tok.decode(d.tolist()) == doc
    assert sum(map(len, ids)) < 0.8 * sum(len(d.encode()) for d in docs[:20])  # merges were learned


def test_sources_text_jsonl_parquet(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\n\npara two\n")
    with open(tmp_path / "b.jsonl", "w") as f:
        for t in ["j1", "j2"]:
            f.write(json.dumps({"body": t}) + "\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["p1", "p2", "p3"]}), tmp_path / "c.parquet")
    assert list(iter_documents(str(tmp_path / "a.txt"))) == ["para one\nstill one\n\n\npara two\n"]
    assert list(iter_documents(str(tmp_path / "a.txt"), text_split="paragraph")) == ["para one\nstill one", "para two\n"]
    assert list(iter_documents(str(tmp_path / "a.txt"), text_split="line")) == ["para one", "still one", "para two"]
    got = list(iter_documents(str(tmp_path), text_split="paragraph", text_field="body"))
    assert got == ["para one\nstill one", "para two\n", "j1", "j2", "p1", "p2", "p3"]
    with pytest.raises(ValueError, match="text_field 'text'"):
        list(iter_documents(str(tmp_path / "b.jsonl")))
    with pytest.raises(ValueError, match="text_split"):
        list(iter_documents(str(tmp_path), text_split="sentence"))


def test_json_sources_skip_empty_text_and_read_arrays(tmp_path):
    records = [{"text": "a"}, {"text": None}, {"text": ""}, {"text": "b"}]
    (tmp_path / "lines.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "array.json").write_text(json.dumps(records, indent=1))  # one array over several lines
    assert list(iter_documents(str(tmp_path / "lines.jsonl"))) == ["a", "b"]
    assert list(iter_documents(str(tmp_path / "array.json"))) == ["a", "b"]
    (tmp_path / "bad.json").write_text(json.dumps([{"text": "a"}, {"body": "b"}]))
    with pytest.raises(ValueError, match=r"bad.json\[1\]: record has no text_field 'text'"):
        list(iter_documents(str(tmp_path / "bad.json")))


@pytest.mark.parametrize("line,message", [
    ('{"text": "a"', r"c.jsonl:2: not a JSON record"),
    ('"just a string"', r"c.jsonl:2: a record must be a JSON object, got str"),
    ('{"text": 123}', r"c.jsonl:2: text_field 'text' must hold a string, got int"),
])
def test_a_bad_json_record_is_a_value_error_naming_its_line(tmp_path, line, message):
    """A ValueError (the commands print it as one error line) with the file and line, not a traceback."""
    (tmp_path / "c.jsonl").write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        list(iter_documents(str(tmp_path / "c.jsonl")))


def test_a_lone_surrogate_in_json_text_is_replaced_not_fatal(tmp_path):
    (tmp_path / "c.jsonl").write_text('{"text": "a\\ud800b"}\n')  # valid JSON, no valid UTF-8
    docs = list(iter_documents(str(tmp_path / "c.jsonl")))
    assert docs == ["a?b"] and encode_documents(byte_tokenizer(), docs)[0].tolist() == list(b"a?b")


def test_shards_keep_documents_and_boundaries(tmp_path):
    docs = corpus(50)
    tok = byte_tokenizer()
    meta = write_token_shards(docs, tok, str(tmp_path / "s"), shard_tokens=500, batch_documents=7)
    shards = TokenShards(str(tmp_path / "s"))
    assert meta["dtype"] == "uint16" and len(shards.shards) > 1  # split over several files
    assert all(s.tokens.dtype == np.uint16 for s in shards.shards)
    back = list(shards.documents())
    assert len(back) == len(docs) == meta["n_docs"]
    for doc, ids in zip(docs, back):
        assert ids[0] == 256 and bytes(ids[1:].astype(np.uint8)).decode() == doc
    assert shards.n_tokens == sum(len(d.encode()) + 1 for d in docs)
    assert not (tmp_path / "s.tmp").exists()


def test_a_shard_folder_is_one_whose_meta_names_the_format(tmp_path):
    """A folder written by write_token_shards is a shard folder; one whose meta.json is a training checkpoint's,
    not JSON, or absent is not, and TokenShards refuses it by name (a checkpoint's meta.json was read as a
    shard folder's and failed on a missing key)."""
    from falcon_fwa.data.shards import is_shard_folder
    write_token_shards(corpus(5), byte_tokenizer(), str(tmp_path / "s"))
    assert is_shard_folder(str(tmp_path / "s"))
    for name, text in (("ckpt", json.dumps({"step": 4, "complete": True})), ("bad", "{not json"), ("list", "[]"),
                       ("none", None)):
        (tmp_path / name).mkdir()
        if text is not None:
            (tmp_path / name / "meta.json").write_text(text)
        assert not is_shard_folder(str(tmp_path / name)), name
        with pytest.raises(FileNotFoundError, match=f"{name}' is no token shard folder"):
            TokenShards(str(tmp_path / name))


def test_prepare_reuses_and_rejects_changed_settings(tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus(40)))
    spec = DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=10)
    rec = prepare_dataset(spec, str(tmp_path / "d"))
    assert rec["counts"]["val"]["n_docs"] == 4 and rec["counts"]["train"]["n_docs"] == 36
    assert prepare_dataset(spec, str(tmp_path / "d")) == rec
    with pytest.raises(ValueError, match=r"other settings \(val_every 10 there, 5 here\): choose another folder"):
        prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=5), str(tmp_path / "d"))


def test_prepare_refuses_a_corpus_changed_since_and_reuses_one_removed(tmp_path):
    """A source file that grew, or a new file in a source folder, is named; the folder is rebuilt only
    on request. A corpus removed after tokenizing (its tokens are in the folder) is reused."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta")
    (src / "b.txt").write_text("gamma")
    (tmp_path / "v.txt").write_text("held out")
    spec = DataSpec(train_source=str(src), val_source=str(tmp_path / "v.txt"))
    out = str(tmp_path / "d")
    rec = prepare_dataset(spec, out)
    assert rec["files"] == {"train": {str(src / "a.txt"): 10, str(src / "b.txt"): 5}, "val": {str(tmp_path / "v.txt"): 8}}
    (src / "b.txt").write_text("gamma delta")
    with pytest.raises(ValueError, match=r"other source files \(.*b\.txt held 5 bytes, now 11\): rebuild it"):
        prepare_dataset(spec, out)
    (src / "b.txt").write_text("gamma")
    again = prepare_dataset(spec, out)  # as it was: reused, the record keeping b.txt's new time
    assert {**again, "stamps": None} == {**rec, "stamps": None}
    assert again["stamps"]["train"][str(src / "b.txt")] == [(src / "b.txt").stat().st_mtime_ns,
                                                           rec["stamps"]["train"][str(src / "b.txt")][1]]
    (src / "c.txt").write_text("new")
    with pytest.raises(ValueError, match=r"c\.txt is new"):
        prepare_dataset(spec, out)
    assert prepare_dataset(spec, out, overwrite=True)["counts"]["train"] == {"n_docs": 3, "n_tokens": 10 + 5 + 3 + 3}
    for f in (src / "a.txt", src / "b.txt", src / "c.txt", tmp_path / "v.txt"):
        f.unlink()
    assert prepare_dataset(spec, out)["counts"]["train"]["n_docs"] == 3  # the tokens stay usable


def test_preparations_started_together_on_one_folder_tokenize_it_once(tmp_path, monkeypatch):
    import threading
    import time

    from falcon_fwa.data import prepare as prepare_module

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus(40)))
    spec = DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=10)
    real = prepare_module.iter_documents
    tokenized = []

    def slow(*args, **kwargs):  # reading the corpus takes a while: the two preparations overlap
        tokenized.append(kwargs.get("split"))
        for doc in real(*args, **kwargs):
            time.sleep(0.005)
            yield doc

    monkeypatch.setattr(prepare_module, "iter_documents", slow)
    results, errors = [], []

    def prepare():
        try:
            results.append(prepare_dataset(spec, str(tmp_path / "d")))
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=prepare) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 2 and results[0] == results[1]
    assert tokenized == ["train"]  # one preparation (one read: val held out of train as it goes); the other reuses
    docs = list(TokenShards(str(tmp_path / "d" / "train")).documents())
    assert len(docs) == 36 and [len(d) for d in docs] == [len(t.encode()) + 1 for i, t in enumerate(corpus(40))
                                                          if i % 10 != 9]


def test_an_interrupted_rebuild_leaves_no_folder_that_looks_prepared(tmp_path, monkeypatch):
    from falcon_fwa.data import prepare as prepare_module

    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus(40)))
    old, new = (DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=v) for v in (10, 5))
    prepare_dataset(old, str(tmp_path / "d"))
    real = prepare_module.write_token_shards

    def dies_on_val(docs, tok, folder, **kw):
        if folder.endswith("val"):
            raise KeyboardInterrupt("killed while tokenizing the validation split")
        return real(docs, tok, folder, **kw)

    monkeypatch.setattr(prepare_module, "write_token_shards", dies_on_val)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(new, str(tmp_path / "d"), overwrite=True)  # train/ is the new split, val/ the old one
    monkeypatch.undo()
    rec = prepare_dataset(old, str(tmp_path / "d"))  # not taken for the old dataset: rebuilt
    assert rec["counts"]["train"]["n_docs"] == 36
    assert TokenShards(str(tmp_path / "d" / "train")).meta["n_docs"] == 36


def _stream(tmp_path, docs):
    write_token_shards(docs, byte_tokenizer(), str(tmp_path / "s"))
    return TokenShards(str(tmp_path / "s"))


def test_rows_are_windows_of_the_stream_and_cu_seqlens_cut_at_documents(tmp_path):
    docs = corpus(30)
    shards = _stream(tmp_path, docs)
    stream = np.concatenate([np.r_[256, np.frombuffer(d.encode(), np.uint8).astype(np.int64)] for d in docs])
    L = 16
    rows = PackedRows(shards, L)
    assert len(rows) == (len(stream) - 1) // L
    for i in [0, 1, 7, len(rows) - 1]:
        tokens, starts = rows.row(i)
        np.testing.assert_array_equal(tokens, stream[i * L:i * L + L + 1])
        # document starts are exactly the end-of-text positions inside the row (position 0 excluded)
        assert starts.tolist() == [p for p in range(1, L) if tokens[p] == 256]
    picked = [rows.row(i) for i in (3, 4, 5)]
    b = collate(picked, "cu_seqlens")
    assert b["input_ids"].shape == (1, 3 * L) and b["targets"].shape == (1, 3 * L)
    cu = b["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 3 * L and cu == sorted(set(cu))
    flat = b["input_ids"][0]
    for start in cu[:-1]:  # every segment starts a row or a document
        assert start % L == 0 or flat[start] == 256
    for start in range(0, 3 * L):  # every document start inside a row is a boundary
        if flat[start] == 256:
            assert start in cu
    for r, (tokens, _) in enumerate(picked):  # targets are each row's next tokens
        assert b["targets"][0, r * L:(r + 1) * L].tolist() == tokens[1:].tolist()
    e = collate(picked, "eos")
    assert e["input_ids"].shape == (3, L) and "cu_seqlens" not in e
    torch.testing.assert_close(e["targets"][:, :-1], e["input_ids"][:, 1:])


def test_row_order_is_an_epoch_permutation_and_ranks_are_disjoint(tmp_path):
    order = RowOrder(10, seed=3)
    first, second = [order[n] for n in range(10)], [order[n] for n in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert [RowOrder(10, seed=3)[n] for n in range(10)] == first  # deterministic
    shards = _stream(tmp_path, corpus(40))
    rows = PackedRows(shards, 8)
    seen = []
    for rank in range(2):
        s = BatchStream(rows, micro_batch=2, packing="eos", seed=0, rank=rank, world_size=2)
        seen.append([next(s)["input_ids"] for _ in range(3)])
    single = BatchStream(rows, micro_batch=4, packing="eos", seed=0)
    for m in range(3):  # two ranks of 2 rows = one process of 4 rows, in the same order
        torch.testing.assert_close(torch.cat([seen[0][m], seen[1][m]]), next(single)["input_ids"])
    resumed = BatchStream(rows, micro_batch=2, packing="eos", seed=0, rank=1, world_size=2, position=2)
    torch.testing.assert_close(next(resumed)["input_ids"], seen[1][2])


def test_a_refused_val_every_leaves_no_folder(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    with pytest.raises(ValueError, match="data.val_every must be >= 2, got 1"):
        prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=1), str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("fields, field, message", [
    (dict(val_every=1), "val_every", "must be >= 2, got 1"),
    (dict(max_documents=0), "max_documents", "must be >= 1, got 0"),
    (dict(bpe_documents=0), "bpe_documents", "must be >= 1, got 0"),
    (dict(tokenizer="bpe:abc"), "tokenizer", "bpe:N needs an integer N (the vocabulary size), got 'bpe:abc'"),
    (dict(tokenizer="bpe:257"), "tokenizer", "bpe:N needs N > 257"),
])
def test_a_bad_data_setting_is_named_before_the_folder_is_made(tmp_path, fields, field, message):
    """Checked before the lock (which creates the folder) and before any document is read; named
    as the recipe's data.FIELD, or as the caller names it (the data command: its options)."""
    (tmp_path / "c.jsonl").write_text(json.dumps({"text": "a b c"}) + "\n")
    spec = DataSpec(train_source=str(tmp_path / "c.jsonl"), **fields)
    with pytest.raises(ValueError, match="^" + re.escape(f"data.{field} {message}")):
        prepare_dataset(spec, str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()
    with pytest.raises(ValueError, match="^" + re.escape(f"--{field.replace('_', '-')} {message}")):
        spec.check(name=lambda f: "--" + f.replace("_", "-"))


def test_load_tokenizer_names_a_bpe_size_that_is_not_an_integer():
    with pytest.raises(ValueError, match=r"^tokenizer bpe:N needs an integer N .*got 'bpe:1e3'$"):
        load_tokenizer("bpe:1e3", texts=["a b c"])


@pytest.mark.parametrize("spec,meant", [("bytes", "byte"), ("Byte", "byte"), ("bpe=1024", "bpe:<vocab_size>"),
                                        ("BPE:512", "bpe:<vocab_size>")])
def test_load_tokenizer_names_a_misspelt_built_in_before_asking_the_hub(spec, meant, monkeypatch):
    import transformers

    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_hub)
    with pytest.raises(ValueError, match=rf"^tokenizer '{spec}' is no tokenizer \(did you mean '{meant}'\?\)$"):
        load_tokenizer(spec, texts=["a b c"])


def test_a_data_source_that_does_not_exist_is_named_as_such(tmp_path):
    from falcon_fwa.data.sources import list_files

    with pytest.raises(FileNotFoundError, match=r"data source '.*nothing\.txt' does not exist$"):
        list_files(str(tmp_path / "nothing.txt"))
    (tmp_path / "notes.csv").write_text("a,b\n")  # exists, but holds no text, JSON or Parquet file
    with pytest.raises(FileNotFoundError, match=r"names no \.txt/"):
        list_files(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"names no \.txt/"):  # a glob that matches nothing
        list_files(str(tmp_path / "*.txt"))


def test_preparation_refuses_to_replace_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus(40)))
    out = tmp_path / "d"
    (out / "train").mkdir(parents=True)
    (out / "train" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"train' exists and is no token shard folder: it is not replaced"):
        prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=10), str(out))
    assert (out / "train" / "notes.txt").read_text() == "mine"
    # a folder of shards it wrote is replaced on a rebuild
    (out / "train" / "notes.txt").unlink()
    (out / "train").rmdir()
    first = prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=10), str(out))
    again = prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=5), str(out), overwrite=True)
    assert first["counts"]["val"]["n_docs"] == 4 and again["counts"]["val"]["n_docs"] == 8


def test_an_output_inside_the_source_folder_is_not_read_as_corpus(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    for n, doc in enumerate(corpus(40)):
        (src / f"{n:02d}.txt").write_text(doc)
    rec = prepare_dataset(DataSpec(train_source=str(src), val_every=10), str(src / "tokens"))
    again = prepare_dataset(DataSpec(train_source=str(src), val_every=10), str(src / "tokens2"))
    assert rec["counts"] == again["counts"] and rec["counts"]["train"]["n_docs"] == 36  # 40 files, 4 held out


def test_a_bpe_tokenizer_learns_from_the_training_documents_only(tmp_path, monkeypatch):
    from falcon_fwa.data import tokenizer as tokenizer_module

    docs = [f"document number {n} " * 3 for n in range(20)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    seen = []
    real = tokenizer_module.train_bpe_tokenizer

    def recording(texts, vocab_size):
        texts = list(texts)
        seen.extend(texts)
        return real(texts, vocab_size)

    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer", recording)
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=5, tokenizer="bpe:300"),
                    str(tmp_path / "d"))
    held_out = {docs[i] for i in range(4, 20, 5)}  # every 5th document is validation
    assert seen == [d for d in docs if d not in held_out]


def test_text_split_is_checked_before_any_document_is_read(tmp_path):
    with pytest.raises(ValueError, match=r"^data\.text_split must be one of .*got 'lines'"):
        prepare_dataset(DataSpec(train_source=str(tmp_path / "none.txt"), text_split="lines"), str(tmp_path / "d"))
    assert not (tmp_path / "d").exists()


def test_a_special_tokens_name_in_a_document_is_text_on_every_path(tmp_path):
    """Shards (the byte fast path), the tokenizer's own call (generate, lm-eval) and the slow path agree:
    "<|endoftext|>" written in a text is its 13 bytes, never the end-of-text token 256."""
    from transformers import AutoTokenizer

    text = "a<|endoftext|>b"
    want = list(text.encode())
    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert encode_documents(tok, [text])[0].tolist() == want
    assert encode_documents(tok, [text], byte_level=False)[0].tolist() == want
    assert again(text, add_special_tokens=False)["input_ids"] == want
    assert again.decode([256]) == "<|endoftext|>" and again.eos_token_id == 256
