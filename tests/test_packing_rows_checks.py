"""``Packing.rows`` names the cache row each packed sequence continues. ``Packing.from_cu_seqlens`` refuses a
repeated row (two sequences would write one row's state) and a negative one, and the mixers refuse a row the
cache they meet does not hold, each with a ``ValueError`` naming ``rows``, the row and the rule (before, a
repeated row filled the cache wrongly without a word, and a row past the cache failed inside ``index_copy_``
or an indexing op with a bare ``IndexError``). Valid rows, in any order, still continue each sequence exactly
as a dense call of that sequence alone does."""
from dataclasses import fields

import pytest
import torch

from falcon_fwa.layers import CausalSelfAttention, FalconAttention, LayerCache, Packing, cu_seqlens_from_lengths
from falcon_fwa.models import get_preset
from falcon_fwa.ops import FalconState

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


def _packed(lengths, rows, offsets=None):
    return Packing.from_cu_seqlens(cu_seqlens_from_lengths(torch.tensor(lengths)), torch.tensor(rows),
                                   None if offsets is None else torch.tensor(offsets))


def _layer(mixer):
    torch.manual_seed(0)
    if mixer == "falcon":
        return FalconAttention(get_preset("tiny-falcon", rule="3", window=3)).double()
    return CausalSelfAttention(get_preset("tiny-transformer")).double()


# ----------------------------------------------------------------------------- refused at construction
@pytest.mark.parametrize("rows, repeated, first, second", [
    ([0, 0], 0, 0, 1),
    ([2, 0, 1, 0], 0, 1, 3),
    ([1, 3, 3], 3, 1, 2),
])
def test_a_repeated_row_is_refused(rows, repeated, first, second):
    lengths = [2] * len(rows)
    with pytest.raises(ValueError) as err:
        _packed(lengths, rows)
    msg = str(err.value)
    assert msg.startswith("rows must name a different cache row for each sequence")
    assert "each sequence continues a cache row of its own" in msg
    assert f"got row {repeated} repeated, for sequences {first} and {second}" in msg


@pytest.mark.parametrize("rows, bad, n", [([-1, 0], -1, 0), ([0, 1, -3], -3, 2)])
def test_a_negative_row_is_refused(rows, bad, n):
    with pytest.raises(ValueError, match=rf"rows must hold cache rows >= 0 \(a negative row is refused, not "
                                         rf"counted from the end\), got {bad} for sequence {n}$"):
        _packed([3] * len(rows), rows)


def test_a_row_past_the_offsets_is_refused():
    """``offsets`` holds the tokens cached per row: a row it lacks is named (an ``IndexError`` before)."""
    with pytest.raises(ValueError, match=r"rows must name cache rows below 2 \(offsets holds the tokens cached "
                                         r"in 2 rows\), got 2 for sequence 0$"):
        _packed([3, 1], [2, 0], offsets=[5, 4])


def test_the_host_copy_of_rows_is_kept():
    p = _packed([1, 2, 3], [2, 0, 1], offsets=[10, 20, 30])
    assert p.host_rows == (2, 0, 1) and p.rows.tolist() == [2, 0, 1]
    assert p.positions.tolist() == [[30, 10, 11, 20, 21, 22]]  # rows 2, 0, 1 continue after 30, 10, 20 tokens


# ----------------------------------------------------------------------------- refused where the cache is met
def _filled_cache(layer, batch=2, length=3):
    cache = LayerCache()
    with torch.no_grad():
        layer(torch.randn(batch, length, 32, dtype=torch.float64), None, cache)
    return cache


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
@pytest.mark.parametrize("rows, bad, n", [([0, 2], 2, 1), ([5, 1], 5, 0)])
def test_a_row_the_cache_does_not_hold_is_refused(mixer, rows, bad, n):
    layer = _layer(mixer)
    cache = _filled_cache(layer)
    h = torch.randn(1, 5, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=rf"rows must name cache rows 0 \.\. 1 \(the cache holds 2 rows; a negative "
                                         rf"row is refused\), got {bad} for sequence {n}$"):
        with torch.no_grad():
            layer(h, _packed([2, 3], rows), cache)


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_a_first_call_fills_rows_0_to_n_minus_1(mixer):
    """An empty cache gets one row per sequence: a row past them is named (for the recurrent mixer
    ``index_copy_`` raised an ``IndexError`` before; the attention cache made a row of no keys for the gap)."""
    layer = _layer(mixer)
    h = torch.randn(1, 5, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"rows must name cache rows 0 \.\. 1 \(an empty cache is filled with one "
                                         r"row per sequence, 2 rows; a negative row is refused\), got 2 for "
                                         r"sequence 1$"):
        with torch.no_grad():
            layer(h, _packed([2, 3], [0, 2]), LayerCache())


def test_a_layout_built_by_hand_is_checked_from_its_rows():
    p = _packed([2, 3], [0, 2])
    p.host_rows = None
    with pytest.raises(ValueError, match=r"got 2 for sequence 1$"):
        p.check_rows(2)
    p.check_rows(3)  # rows 0 and 2 of a cache of 3 rows


# ----------------------------------------------------------------------------- valid rows, any order
def _rows_of(cache: LayerCache, r: int):
    """Everything cache row ``r`` holds (its state fields, conv buffers, real keys and values)."""
    out = {}
    if cache.state is not None:
        for f in fields(FalconState):
            t = getattr(cache.state, f.name)
            if isinstance(t, torch.Tensor):
                out[f.name] = t[r]
    out.update({f"conv.{k}": v[r] for k, v in cache.conv.items()})
    if cache.keys is not None:
        n = cache.lengths[r]
        out.update(keys=cache.keys[r, :, :n], values=cache.values[r, :, :n], length=torch.tensor(n))
    return out


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_packed_rows_in_any_order_equal_each_sequence_alone(mixer):
    """Three sequences: a packed first call holding them in the order of rows 2, 0, 1, then a packed
    continuation of rows 1, 2, 0 and one of rows 2, 0 only. Every output and every cache row equals that of
    the sequence run alone in dense calls with a cache of its own."""
    layer = _layer(mixer)
    torch.manual_seed(1)
    parts = [[torch.randn(1, n, 32, dtype=torch.float64) for n in ns] for ns in ((4, 3, 2), (2, 1, 3), (5, 2, 1))]
    calls = [[2, 0, 1], [1, 2, 0], [2, 0]]  # the rows each packed call continues, in its order
    with torch.no_grad():
        alone, caches = [], []
        for seq in parts:
            cache = LayerCache()
            alone.append([layer(x, None, cache) for x in seq])
            caches.append(cache)
        packed_cache, seen = LayerCache(), [0, 0, 0]
        for call, rows in enumerate(calls):
            xs = [parts[r][call] for r in rows]
            offsets = None if call == 0 else seen
            out = layer(torch.cat(xs, 1), _packed([x.shape[1] for x in xs], rows, offsets), packed_cache)
            for r, got in zip(rows, out.split([x.shape[1] for x in xs], 1)):
                assert torch.allclose(got, alone[r][call], atol=1e-12, rtol=0), (call, r)
            for r in rows:
                seen[r] += parts[r][call].shape[1]
    # row 1 stopped after its second call: compare it with the run alone after the same two calls
    with torch.no_grad():
        cache_1 = LayerCache()
        for x in parts[1][:2]:
            layer(x, None, cache_1)
    for r, want_cache in ((0, caches[0]), (1, cache_1), (2, caches[2])):
        got, want = _rows_of(packed_cache, r), _rows_of(want_cache, 0)
        assert got.keys() == want.keys() and got
        for name in want:
            assert torch.allclose(got[name].to(want[name].dtype), want[name], atol=1e-12, rtol=0), (r, name)


def test_host_rows_given_by_the_caller_are_kept_and_their_length_checked():
    """The model, which builds ``rows`` as ``arange(N)``, passes their values as ``host_rows`` so that no
    device read is made for them; a copy of another length is refused by name."""
    cu = cu_seqlens_from_lengths(torch.tensor([2, 3, 1]))
    p = Packing.from_cu_seqlens(cu, torch.tensor([2, 0, 1]), None, host_rows=[2, 0, 1])
    assert p.host_rows == (2, 0, 1)
    with pytest.raises(ValueError, match=r"host_rows must hold the 3 values of rows, got 2"):
        Packing.from_cu_seqlens(cu, torch.tensor([2, 0, 1]), None, host_rows=[2, 0])
    with pytest.raises(ValueError, match=r"rows must name a different cache row"):
        Packing.from_cu_seqlens(cu, torch.tensor([2, 0, 1]), None, host_rows=[2, 2, 1])


# ----------------------------------------------------------------------------- the short convolution alone
@pytest.mark.parametrize("rows, bad, n", [([0, 3], 3, 1), ([2, 0], 2, 0)])
def test_short_conv_called_alone_refuses_a_row_its_buffer_does_not_hold(rows, bad, n):
    """``ShortConv(x, packing, buffer)`` called directly (not through a mixer, which checks first) names
    ``rows``, the row and the buffer's row count; a bare ``IndexError`` from indexing the buffer before."""
    from falcon_fwa.layers.short_conv import ShortConv
    conv = ShortConv(4, kernel_size=3).double()
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    buffer = torch.randn(2, 2, 4, dtype=torch.float64)
    with pytest.raises(ValueError) as err:
        conv(x, _packed([2, 3], rows), buffer)
    assert "rows" in str(err.value) and f"got {bad} for sequence {n}" in str(err.value)
    assert "holds 2 rows" in str(err.value)


def test_short_conv_packed_rows_continue_their_buffer_rows():
    """Valid rows in any order: each packed sequence's outputs and new buffer are those of a dense call of
    that sequence alone on its own buffer row (the window ``[buffer row | tokens]``)."""
    from falcon_fwa.layers.short_conv import ShortConv
    torch.manual_seed(0)
    conv = ShortConv(4, kernel_size=3).double()
    x = torch.randn(1, 5, 4, dtype=torch.float64)
    buffer = torch.randn(3, 2, 4, dtype=torch.float64)
    y, new = conv(x, _packed([2, 3], [2, 0]), buffer)
    for n, (lo, hi, row) in enumerate(((0, 2, 2), (2, 5, 0))):
        ref_y, ref_buf = conv(x[:, lo:hi], None, buffer[row:row + 1])
        torch.testing.assert_close(y[:, lo:hi], ref_y, rtol=0, atol=1e-12)
        torch.testing.assert_close(new[n:n + 1], ref_buf, rtol=0, atol=0)
