"""Host copies of cu_seqlens (``ops.seqlens``) and the packed chunk layout built from them: a
model reads the boundaries once per batch, and a direct caller always gets the tensor's values."""
import pytest
import torch

from falcon_fwa.models import FalconForCausalLM, get_preset
from falcon_fwa.ops.seqlens import known_sequence_bounds, memo, sequence_bounds
from falcon_fwa.ops.triton.chunk_index import chunk_layout


@pytest.fixture
def reads(monkeypatch):
    """Counts the device reads (``Tensor.tolist``) of every test."""
    count = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: count.append(1) or real(t))
    return count


def test_layout_of_packed_sequences_by_hand():
    cu = torch.tensor([0, 5, 12, 13], dtype=torch.int32)  # lengths 5, 7, 1 -> 2, 2, 1 chunks of 4
    lay = chunk_layout(1, 13, 4, cu)
    assert (lay.N, lay.T, lay.BT, lay.num_chunks, lay.max_chunks) == (3, 13, 4, 5, 2)
    assert lay.chunk_offsets.tolist() == [0, 2, 4, 5]
    assert lay.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0]]
    assert lay.cu_seqlens.dtype == torch.int32 and lay.cu_seqlens.tolist() == [0, 5, 12, 13]
    fixed = chunk_layout(2, 13, 4, None)
    assert (fixed.N, fixed.num_chunks, fixed.max_chunks, fixed.chunk_indices) == (2, 8, 4, None)


def test_outside_a_block_every_call_reads_the_tensor(reads):
    cu = torch.tensor([0, 3, 8])
    assert sequence_bounds(cu) == (0, 3, 8)
    cu.data[1] = 5  # a write the version counter does not see: still no stale answer
    assert sequence_bounds(cu) == (0, 5, 8)
    assert chunk_layout(1, 8, 4, cu).chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0]]
    assert len(reads) >= 3


def test_inside_a_block_the_declared_bounds_answer_without_reads(reads):
    cu = torch.tensor([0, 3, 8])
    built = []
    with known_sequence_bounds(cu, [0, 3, 8]):
        for _ in range(4):  # every layer of a model
            assert sequence_bounds(cu, 8) == (0, 3, 8)
            assert memo(cu, "k", lambda: built.append(1) or len(built)) == 1
        first = chunk_layout(1, 8, 4, cu)
        assert chunk_layout(1, 8, 4, cu) is first  # shared by the layers
        halves = chunk_layout(1, 8, 2, cu)  # another chunk size: lengths 3 and 5 in 2 + 3 chunks
        assert (halves.num_chunks, halves.max_chunks) == (5, 3)
        assert sequence_bounds(torch.tensor([0, 3, 8])) == (0, 3, 8)  # another object: read
        n_inside = len(reads)
        with known_sequence_bounds(cu, [0, 2, 8]):  # a nested block for the same tensor, then restored
            assert sequence_bounds(cu) == (0, 2, 8)
        assert sequence_bounds(cu) == (0, 3, 8)
    assert n_inside == 1 and len(built) == 1
    assert sequence_bounds(cu) == (0, 3, 8) and len(reads) == 2  # after the block: read again


def test_bounds_are_checked_and_name_cu_seqlens():
    for bad in ([0, 3, 3, 8], [1, 3, 8], [0, 3, 7], [0]):
        with pytest.raises(ValueError, match="cu_seqlens must rise strictly from 0 to T = 8"):
            sequence_bounds(torch.tensor(bad), 8)


@pytest.mark.parametrize("bad,error", [([0, 3, 8], TypeError), (torch.tensor([0.0, 2.7, 8.0]), TypeError),
                                       (torch.tensor([[0, 3, 8]]), ValueError)])
def test_a_model_names_cu_seqlens_that_is_not_a_1d_integer_tensor(bad, error):
    model = FalconForCausalLM(get_preset("tiny-falcon")).eval()
    with pytest.raises(error, match=r"^cu_seqlens must"):
        model(torch.randint(0, 64, (1, 8)), cu_seqlens=bad)


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_a_packed_forward_reads_cu_seqlens_once_whatever_the_depth(mixer, reads):
    counts = []
    for layers in (1, 3):
        torch.manual_seed(0)
        model = FalconForCausalLM(get_preset(f"tiny-{mixer}", num_hidden_layers=layers)).eval()
        ids = torch.randint(0, 64, (1, 13))
        cu = torch.tensor([0, 5, 12, 13])
        before = len(reads)
        with torch.no_grad():
            model(ids, cu_seqlens=cu, use_cache=False)
        counts.append(len(reads) - before)
    assert counts[0] == counts[1] == 1, counts
