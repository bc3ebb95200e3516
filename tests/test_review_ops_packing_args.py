"""The layers' packed layout and cache arguments are checked where they are given: ``Packing.from_cu_seqlens``
refuses offsets that do not rise strictly from 0 and rows that are not one integer row per sequence, and the
mixers refuse a cache that is not a ``LayerCache``, each naming the argument and what it takes."""
import pytest
import torch

from falcon_fwa import FalconConfig
from falcon_fwa.layers import CausalSelfAttention, FalconAttention, LayerCache, Packing


@pytest.mark.parametrize("cu, bounds", [
    ([0, 5, 3], None),          # falling: a negative length
    ([0, 5, 5, 9], None),       # an empty sequence
    ([1, 5, 9], None),          # not starting at 0
    ([0, 5, 3], [0, 5, 3]),     # the caller's host copy is checked too
])
def test_offsets_must_rise_strictly_from_zero(cu, bounds):
    rows = torch.arange(len(cu) - 1)
    with pytest.raises(ValueError, match=r"cu_seqlens must rise strictly from 0"):
        Packing.from_cu_seqlens(torch.tensor(cu), rows, None, bounds)


def test_offsets_must_be_an_integer_tensor():
    with pytest.raises(TypeError, match=r"cu_seqlens must hold integers"):
        Packing.from_cu_seqlens(torch.tensor([0.0, 5.0, 9.0]), torch.arange(2), None)
    with pytest.raises(ValueError, match=r"bounds must hold the 3 values of cu_seqlens, got 2"):
        Packing.from_cu_seqlens(torch.tensor([0, 5, 9]), torch.arange(2), None, bounds=[0, 9])


@pytest.mark.parametrize("rows, error, message", [
    (torch.tensor([0]), ValueError, r"rows must have shape \[N\] = \(2,\), one cache row for each of the 2"),
    (torch.tensor([[0, 1]]), ValueError, r"rows must have shape \[N\] = \(2,\)"),
    (torch.tensor([0.0, 1.0]), TypeError, r"rows must hold integers"),
    (torch.tensor([True, False]), TypeError, r"rows must hold integers"),
    ([0, 1], TypeError, r"rows must be a 1-D integer torch.Tensor"),
])
def test_rows_must_name_one_cache_row_per_sequence(rows, error, message):
    with pytest.raises(error, match=message):
        Packing.from_cu_seqlens(torch.tensor([0, 5, 9]), rows, None)


def test_a_valid_layout_is_unchanged():
    """Positions count from each sequence's start plus its row's cached tokens (hand-computed)."""
    p = Packing.from_cu_seqlens(torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([1, 0]),
                                torch.tensor([10, 20]))
    assert p.bounds == (0, 2, 5) and p.cu_seqlens.dtype == torch.int64
    assert p.positions.tolist() == [[20, 21, 10, 11, 12]] and p.seq_ids.tolist() == [0, 0, 1, 1, 1]


def test_a_short_rows_tensor_no_longer_runs_a_layer():
    """Before the check, a layer without a cache ran on two sequences with one row named; with a cache it
    failed inside ``index_copy_`` without naming ``rows``."""
    torch.manual_seed(0)
    layer = FalconAttention(FalconConfig(hidden_size=16, num_hidden_layers=1, num_heads=2, rule="3", window=3))
    h = torch.randn(1, 9, 16)
    with pytest.raises(ValueError, match=r"rows must have shape"):
        layer(h, Packing.from_cu_seqlens(torch.tensor([0, 4, 9]), torch.tensor([0]), None))


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_cache_must_be_a_layer_cache(mixer):
    config = FalconConfig(hidden_size=16, num_hidden_layers=1, num_heads=2, mixer=mixer)
    layer = FalconAttention(config) if mixer == "falcon" else CausalSelfAttention(config)
    h = torch.randn(2, 3, 16)
    for bad in ({}, {"state": None}, "cache"):
        with pytest.raises(TypeError, match=r"cache must be a LayerCache \(or None"):
            layer(h, None, bad)
    cache = LayerCache()
    with torch.no_grad():
        full = layer(h)
        steps = torch.cat([layer(h[:, :2], None, cache), layer(h[:, 2:], None, cache)], 1)
    assert torch.allclose(steps, full, atol=1e-5)
