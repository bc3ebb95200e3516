"""Token shards and row order by hand: a shard takes documents up to exactly ``shard_tokens`` tokens and a
document longer than that gets a shard of its own; without shuffling, every epoch visits the rows in order."""
from falcon_fwa.data import BatchStream, PackedRows, RowOrder, TokenShards, byte_tokenizer, write_token_shards

EOS = 256


def _shards(tmp_path, docs, shard_tokens):
    folder = str(tmp_path / f"s{shard_tokens}")
    meta = write_token_shards(docs, byte_tokenizer(), folder, shard_tokens=shard_tokens, batch_documents=2)
    return meta, TokenShards(folder)


def test_a_shard_fills_to_exactly_shard_tokens(tmp_path):
    """Documents of 4, 3 and 2 tokens (end-of-text + text): with shard_tokens 7 the first two fill one shard
    exactly and the third opens the next; with 6 each document after the first that overflows opens one."""
    docs = ["abc", "de", "f"]
    want = [[EOS, 97, 98, 99], [EOS, 100, 101], [EOS, 102]]
    for shard_tokens, sizes, starts in ((7, [7, 2], [[0, 4], [0]]), (6, [4, 5], [[0], [0, 3]]),
                                        (9, [9], [[0, 4, 7]]), (100, [9], [[0, 4, 7]])):
        meta, shards = _shards(tmp_path, docs, shard_tokens)
        assert [s["n_tokens"] for s in meta["shards"]] == sizes, shard_tokens
        assert [s.doc_starts.tolist() for s in shards.shards] == starts, shard_tokens
        assert [d.tolist() for d in shards.documents()] == want


def test_a_document_longer_than_a_shard_gets_one_of_its_own(tmp_path):
    meta, shards = _shards(tmp_path, ["ab", "x" * 9, "c"], 5)
    assert [s["n_tokens"] for s in meta["shards"]] == [3, 10, 2]
    assert [s.doc_starts.tolist() for s in shards.shards] == [[0], [0], [0]]
    assert [d.tolist() for d in shards.documents()] == [[EOS, 97, 98], [EOS] + [120] * 9, [EOS, 99]]
    meta, shards = _shards(tmp_path / "first", ["x" * 9, "ab"], 5)  # the first document: no empty shard before it
    assert [s["n_tokens"] for s in meta["shards"]] == [10, 3]
    assert [d.tolist() for d in shards.documents()] == [[EOS] + [120] * 9, [EOS, 97, 98]]


def test_without_shuffling_every_epoch_visits_the_rows_in_order(tmp_path):
    order = RowOrder(5, seed=3, shuffle=False)
    assert [order[n] for n in range(15)] == list(range(5)) * 3
    write_token_shards(["abcdefghijklmnopq"], byte_tokenizer(), str(tmp_path / "s"))
    rows = PackedRows(TokenShards(str(tmp_path / "s")), 4)  # 18 tokens: rows 0..3
    stream = BatchStream(rows, micro_batch=3, packing="eos", seed=0, shuffle=False)
    firsts = [next(stream)["input_ids"][:, 0].tolist() for _ in range(4)]
    tokens = [EOS] + list(b"abcdefghijklmnopq")
    assert firsts == [[tokens[4 * r] for r in rows_] for rows_ in ([0, 1, 2], [3, 0, 1], [2, 3, 0], [1, 2, 3])]
