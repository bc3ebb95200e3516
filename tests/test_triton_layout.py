"""Chunk layouts of packed sequences, and their per-tensor host cache (one device read per batch)."""
import torch

from falcon_fwa.ops.triton import chunk_index
from falcon_fwa.ops.triton.chunk_index import chunk_layout, sequence_bounds


def test_layout_of_packed_sequences_by_hand():
    cu = torch.tensor([0, 5, 12, 13], dtype=torch.int32)  # lengths 5, 7, 1 -> 2, 2, 1 chunks of 4
    lay = chunk_layout(1, 13, 4, cu)
    assert (lay.N, lay.T, lay.BT, lay.num_chunks, lay.max_chunks) == (3, 13, 4, 5, 2)
    assert lay.chunk_offsets.tolist() == [0, 2, 4, 5]
    assert lay.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0]]
    assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_seqlens.tolist() == [0, 5, 12, 13]
    fixed = chunk_layout(2, 13, 4, None)
    assert (fixed.N, fixed.num_chunks, fixed.max_chunks, fixed.chunk_indices) == (2, 8, 4, None)


def test_one_read_per_tensor_object_and_none_after_a_write(monkeypatch):
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(1) or real_tolist(t))
    cu = torch.tensor([0, 3, 8])
    assert sequence_bounds(cu) == (0, 3, 8)
    first = chunk_layout(1, 8, 4, cu)
    for _ in range(5):  # every layer of a model passes the same tensor: no further reads
        assert sequence_bounds(cu) == (0, 3, 8)
        assert chunk_layout(1, 8, 4, cu) is first
    assert len(reads) == 1
    halves = chunk_layout(1, 8, 2, cu)  # another chunk size: lengths 3 and 5 in 2 + 3 chunks
    assert (halves.num_chunks, halves.max_chunks) == (5, 3) and len(reads) == 1
    cu[1] = 5  # an in-place write bumps the version counter: the cache is not used
    assert sequence_bounds(cu) == (0, 5, 8)
    assert chunk_layout(1, 8, 4, cu).chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0]]
    other = torch.tensor([0, 3, 8])  # equal values, another object: its own entry, same answer
    assert sequence_bounds(other) == (0, 3, 8)


def test_a_dead_tensor_never_answers_for_a_new_one():
    for n in range(20):  # recycled ids and addresses: the weak reference tells them apart
        cu = torch.tensor([0, n + 1, 2 * n + 3])
        assert sequence_bounds(cu) == (0, n + 1, 2 * n + 3)
        del cu
    assert len(chunk_index._CACHE) <= chunk_index._CACHE_SIZE


def test_inference_tensors_are_read_without_the_cache():
    with torch.inference_mode():
        cu = torch.tensor([0, 2, 6])
        assert sequence_bounds(cu) == (0, 2, 6)
        assert chunk_layout(1, 6, 4, cu).chunk_indices.tolist() == [[0, 0], [1, 0]]
