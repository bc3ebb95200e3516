"""Which tokenizers take the byte fast path, and what the data and ppl paths store for the others: tokenizer
folders that are byte-level but not the byte tokenizer (high bytes renumbered, a merge past end-of-text, end-of-text
at id 0), each against ids worked out by hand from the UTF-8 bytes; and the refusals at the edges of the sizes."""
import json

import numpy as np
import pytest
from test_data_exact import word_tokenizer

from falcon_fwa.data import DataSpec, byte_tokenizer, encode_documents, load_tokenizer, prepare_dataset
from falcon_fwa.data.shards import write_token_shards
from falcon_fwa.data.tokenizer import is_byte_tokenizer, train_bpe_tokenizer
from falcon_fwa.eval.perplexity import token_stream

TEXTS = ["a\u00e9 \u20ac~\x7f\x00", "plain ascii", "x<|endoftext|>\u00ff y"]  # the name of end-of-text is text


def renumbered(b):
    """Byte ``b``'s id in :func:`byte_folder` ``"high"``: ASCII as in the byte tokenizer, 128..255 reversed."""
    return b if b < 128 else 383 - b


def byte_folder(tmp_path, change):
    """A tokenizer folder built from the byte tokenizer's ``tokenizer.json`` with its ids changed, and a
    ``tokenizer_config.json`` naming only its end-of-text token (so no ``split_special_tokens`` of ours), loaded
    as ``falcon-fwa data --tokenizer FOLDER`` loads it. ``change``: ``"high"`` (bytes 128..255 renumbered,
    :func:`renumbered`), ``"merge"`` (a merge ``"ab"`` -> 257 after end-of-text 256) or ``"eos0"``
    (end-of-text 0, byte 0 at 256)."""
    spec = json.loads(byte_tokenizer().backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    if change == "high":
        spec["model"]["vocab"] = {c: renumbered(i) for c, i in vocab.items()}
    elif change == "merge":
        vocab.update({"<|endoftext|>": 256, "ab": 257})  # (an added token missing from the vocab is renumbered)
        spec["model"]["merges"] = [["a", "b"]]
    else:
        spec["model"]["vocab"] = {c: 256 if i == 0 else i for c, i in vocab.items()} | {"<|endoftext|>": 0}
        spec["added_tokens"][0]["id"] = 0
    folder = tmp_path / change
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return load_tokenizer(str(folder))


def test_only_the_byte_tokenizer_takes_the_byte_path(tmp_path):
    """A tokenizer of 257 ids with end-of-text 256 that numbers the bytes 128..255 otherwise, or one that adds a
    merge past 256, is no byte tokenizer: its documents are its own ids (the fast path would store UTF-8 bytes),
    and a special token's name in a document is text there too."""
    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path / "byte")
    assert is_byte_tokenizer(tok) and is_byte_tokenizer(load_tokenizer(str(tmp_path / "byte")))

    high = byte_folder(tmp_path, "high")
    assert (len(high), high.eos_token_id) == (257, 256) and not is_byte_tokenizer(high)
    want = [[renumbered(b) for b in t.encode("utf-8")] for t in TEXTS]
    assert want[1] == list(b"plain ascii") and want[0] != list(TEXTS[0].encode("utf-8"))
    assert [ids.tolist() for ids in encode_documents(high, TEXTS)] == want
    assert [ids.tolist() for ids in encode_documents(high, TEXTS, byte_level=False)] == want

    merge = byte_folder(tmp_path, "merge")
    assert (len(merge), merge.eos_token_id) == (258, 256) and not is_byte_tokenizer(merge)
    assert [ids.tolist() for ids in encode_documents(merge, ["abc ab", "b a"])] == [[257, 99, 32, 257], [98, 32, 97]]


def test_held_out_text_and_shards_hold_the_tokenizers_own_ids(tmp_path):
    """``ppl``'s stream of a text file and a shard folder written with a tokenizer that is not the byte tokenizer:
    end-of-text, then that tokenizer's ids of each document (not its UTF-8 bytes)."""
    high = byte_folder(tmp_path, "high")
    held = tmp_path / "held.txt"
    held.write_text("\n".join(TEXTS[:2]), encoding="utf-8")
    want = [256] + [renumbered(b) for b in "\n".join(TEXTS[:2]).encode("utf-8")]
    assert token_stream([str(held)], high).tolist() == want
    by_line = [256] + [renumbered(b) for b in TEXTS[0].encode("utf-8")] + [256] + list(b"plain ascii")
    assert token_stream([str(held)], high, text_split="line").tolist() == by_line
    meta = write_token_shards(TEXTS[:2], high, str(tmp_path / "shards"))
    assert (meta["vocab_size"], meta["eos_token_id"], meta["n_tokens"]) == (257, 256, len(by_line))
    assert token_stream([str(tmp_path / "shards")], high).tolist() == by_line


@pytest.mark.parametrize("change", ["merge", "eos0"])
def test_shards_are_refused_by_a_tokenizer_of_another_size_or_end_of_text(tmp_path, change):
    """Byte shards (257 ids, end-of-text 256) read with a tokenizer of 258 ids and the same end-of-text, or of
    257 ids and end-of-text 0: either difference alone is refused."""
    other = byte_folder(tmp_path, change)
    assert (len(other), other.eos_token_id) == {"merge": (258, 256), "eos0": (257, 0)}[change]
    write_token_shards(TEXTS, byte_tokenizer(), str(tmp_path / "shards"))
    with pytest.raises(ValueError, match=r"come from another tokenizer \(vocab_size 257, eos_token_id 256\)"):
        token_stream([str(tmp_path / "shards")], other)
    assert token_stream([str(tmp_path / "shards")], byte_tokenizer())[:3].tolist() == [256, 97, 0xC3]


def test_a_tokenizer_whose_top_id_equals_its_size_is_refused(tmp_path):
    """Ids 0, 1, 3 and end-of-text 4: four tokens, the top id 4 is one past N - 1 (the smallest gap)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1, "b": 3, "</s>": 4}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    assert tok.token_to_id("</s>") == 4
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=r"has ids up to 4 but 4 tokens: its ids must be 0\.\.N-1$"):
        load_tokenizer(str(tmp_path))


def test_a_bpe_needs_more_than_the_bytes_and_end_of_text():
    """257 tokens are the 256 bytes and end-of-text with no merge: refused, naming vocab_size; 258 gives one merge."""
    texts = ["ab ab ab abc"] * 4
    with pytest.raises(ValueError, match=r"^tokenizer vocab_size must exceed 257 for BPE, got 257$"):
        train_bpe_tokenizer(texts, 257)
    tok = train_bpe_tokenizer(texts, 258)
    assert len(tok) == 258 and tok.convert_ids_to_tokens(tok.eos_token_id) == "<|endoftext|>"
    ids = encode_documents(tok, ["ab"])[0]
    assert len(ids) == 1 and tok.decode(ids.tolist()) == "ab" and np.all(ids < 258)


def test_an_id_or_end_of_text_equal_to_the_size_is_refused_by_the_shard_writer(tmp_path):
    """len(tokenizer) = N sizes the shards and the model: an id N (the smallest one past them), as a word's or as
    end-of-text's, is refused before a folder is written."""
    tok = word_tokenizer({"w0": 0, "a": 1, "b": 4})  # end-of-text takes id 3: ids 0, 1, 3, 4 of 4 tokens
    assert (len(tok), tok.eos_token_id) == (4, 3) and tok("a b", add_special_tokens=False)["input_ids"] == [1, 4]
    with pytest.raises(ValueError, match=r"^tokenizer gave token id 4, outside 0\.\.3 "):
        write_token_shards(["a a", "a b"], tok, str(tmp_path / "word"))
    assert write_token_shards(["a a"], tok, str(tmp_path / "a"))["n_tokens"] == 3
    tok.add_special_tokens({"eos_token": "b"})
    assert (len(tok), tok.eos_token_id) == (4, 4)
    with pytest.raises(ValueError, match=r"^tokenizer eos_token_id 4 is no token id of 0\.\.3"):
        write_token_shards(["a a"], tok, str(tmp_path / "eos"))
    assert not (tmp_path / "word").exists() and not (tmp_path / "eos").exists()


def test_a_bpe_learns_from_the_first_bpe_documents_training_documents(tmp_path, monkeypatch):
    """bpe_documents=3 with every 4th document held out: documents 0, 1 and 2, whatever follows."""
    from falcon_fwa.data import tokenizer as tokenizer_module

    docs = [f"document {n} " * 3 for n in range(12)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    seen = []
    real = tokenizer_module.train_bpe_tokenizer
    monkeypatch.setattr(tokenizer_module, "train_bpe_tokenizer",
                        lambda texts, size: real(seen.extend(texts) or seen, size))
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c.jsonl"), val_every=4, tokenizer="bpe:280",
                             bpe_documents=3), str(tmp_path / "d"))
    assert seen == docs[:3]
