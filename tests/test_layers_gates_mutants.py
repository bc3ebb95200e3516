"""The short convolution, the context gates, the mixer's cached calls and the layer cache held to what their
docstrings state, each against a reference written here: ``ShortConv``'s default width of 4 and its
``nn.Conv1d`` kernel draw (bound ``1 / sqrt(W)``); ``lambda_scale`` a finite number ``>= 0`` and never a bool;
a cache of other rows refused, and one cached token per row taken by ``falcon_step`` and equal to the full
call; the cache's row scatter, row selection (state, buffers, keys, values, lengths together) and growth
(contents kept, at least doubling, nothing reallocated when the room is there)."""
import math

import pytest
import torch

import falcon_fwa.layers.falcon_attention as falcon_attention_module
from falcon_fwa.layers import ContextGates, FalconAttention, LayerCache, Packing, ShortConv
from falcon_fwa.layers.layer_cache import scatter_rows
from falcon_fwa.models import get_preset
from falcon_fwa.ops import FalconState

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


def test_short_conv_is_four_taps_wide_by_default():
    """``kernel_size`` defaults to 4: a kernel ``[C, 1, 4]`` and a carried buffer of the last 3 inputs."""
    conv = ShortConv(3).double()
    assert conv.kernel_size == 4 and tuple(conv.weight.shape) == (3, 1, 4)
    x = torch.randn(2, 6, 3, dtype=F64)
    _, buf = conv(x, Packing.dense(2, 6, None, x.device))
    torch.testing.assert_close(buf, x[:, 3:], rtol=0, atol=0)


@pytest.mark.parametrize("width", [2, 4, 9])
def test_short_conv_kernel_is_drawn_uniform_within_one_over_root_width(width):
    """Kaiming-uniform with ``a = sqrt(5)`` over a fan-in of ``W`` is ``U(-1/sqrt(W), 1/sqrt(W))``, as
    ``nn.Conv1d`` draws it: with 4096 draws every value lies inside the bound and the extremes come within 2 %
    of it on both sides."""
    torch.manual_seed(0)
    w = ShortConv(4096 // width, kernel_size=width).weight.detach().double()
    bound = 1.0 / math.sqrt(width)
    assert float(w.abs().max()) <= bound
    assert float(w.max()) > 0.98 * bound and float(w.min()) < -0.98 * bound


# ----------------------------------------------------------------------------- the layer cache
def test_scatter_rows_replaces_only_the_named_rows_and_orders_a_first_call():
    """``scatter_rows(old, rows, new)``: row ``rows[n]`` becomes ``new[n]``, every other row of ``old`` stays; with
    no ``old``, ``new[n]`` lands at row ``rows[n]``; ``rows=None``: ``new`` as it is."""
    old = torch.arange(12.0, dtype=F64).view(4, 3)
    new = -torch.arange(1.0, 7.0, dtype=F64).view(2, 3)
    got = scatter_rows(old, torch.tensor([3, 1]), new)
    want = old.clone()
    want[3], want[1] = new[0], new[1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(old, torch.arange(12.0, dtype=F64).view(4, 3), rtol=0, atol=0)  # not written in place
    first = scatter_rows(None, torch.tensor([1, 0]), new)
    torch.testing.assert_close(first, new.flip(0), rtol=0, atol=0)
    assert scatter_rows(old, None, new) is new


def test_store_state_keeps_the_rows_it_was_not_given():
    """A state returned for rows ``[2, 0]`` of a 3-row cache replaces those two rows, field by field, and keeps
    row 1 and the configuration of the state already held."""
    S = torch.randn(3, 2, 4, 5, dtype=F64)
    key = torch.randn(3, 2, 4, dtype=F64)
    cache = LayerCache(state=FalconState(rule="1A", window=1, shift=True, S=S.clone(), last_key=key.clone()))
    S_new, key_new = torch.randn(2, 2, 4, 5, dtype=F64), torch.randn(2, 2, 4, dtype=F64)
    cache.store_state(FalconState(rule="1A", window=1, shift=True, S=S_new, last_key=key_new), torch.tensor([2, 0]))
    want_S, want_key = S.clone(), key.clone()
    want_S[2], want_S[0], want_key[2], want_key[0] = S_new[0], S_new[1], key_new[0], key_new[1]
    torch.testing.assert_close(cache.state.S, want_S, rtol=0, atol=0)
    torch.testing.assert_close(cache.state.last_key, want_key, rtol=0, atol=0)


def test_store_conv_scatters_each_buffer_by_name():
    cache = LayerCache()
    q0, k0 = torch.randn(3, 3, 4, dtype=F64), torch.randn(3, 3, 4, dtype=F64)
    cache.store_conv("q", q0, None)
    cache.store_conv("k", k0, None)
    q1 = torch.randn(1, 3, 4, dtype=F64)
    cache.store_conv("q", q1, torch.tensor([1]))
    want = q0.clone()
    want[1] = q1[0]
    torch.testing.assert_close(cache.conv["q"], want, rtol=0, atol=0)
    torch.testing.assert_close(cache.conv["k"], k0, rtol=0, atol=0)


def test_select_rows_reorders_every_part_of_the_cache_together():
    """Keep / reorder / repeat rows: state, short-convolution buffers, keys, values and the per-row lengths all
    follow the same index."""
    S = torch.randn(3, 1, 2, 2, dtype=F64)
    conv = torch.randn(3, 3, 4, dtype=F64)
    keys, values = torch.randn(3, 2, 5, 4, dtype=F64), torch.randn(3, 2, 5, 4, dtype=F64)
    cache = LayerCache(state=FalconState(rule="1A", window=1, shift=True, S=S.clone()), conv={"v": conv.clone()},
                       keys=keys.clone(), values=values.clone(), lengths=[5, 2, 4])
    index = torch.tensor([2, 2, 0])
    cache.select_rows(index)
    torch.testing.assert_close(cache.state.S, S[index], rtol=0, atol=0)
    torch.testing.assert_close(cache.conv["v"], conv[index], rtol=0, atol=0)
    torch.testing.assert_close(cache.keys, keys[index], rtol=0, atol=0)
    torch.testing.assert_close(cache.values, values[index], rtol=0, atol=0)
    assert cache.lengths == [4, 4, 5]


@pytest.mark.parametrize("capacity,slots,want", [(4, 5, 8), (4, 11, 11), (4, 4, 4), (4, 2, 4)])
def test_grow_at_least_doubles_only_when_the_room_is_short(capacity, slots, want):
    """``grow(slots)``: capacity ``max(slots, 2 * capacity)`` when fewer than ``slots`` slots exist, else the
    buffers untouched; the tokens held keep their slots, the new slots are zero."""
    keys, values = torch.randn(2, 3, capacity, 4, dtype=F64), torch.randn(2, 3, capacity, 4, dtype=F64)
    cache = LayerCache(keys=keys, values=values, lengths=[capacity, 1])
    cache.grow(slots)
    assert cache.keys.shape == (2, 3, want, 4) and cache.values.shape == (2, 3, want, 4)
    if want == capacity:
        assert cache.keys is keys and cache.values is values
    for got, old in ((cache.keys, keys), (cache.values, values)):
        torch.testing.assert_close(got[:, :, :capacity], old, rtol=0, atol=0)
        assert not got[:, :, capacity:].any()


# ----------------------------------------------------------------------------- the gates' arguments
@pytest.mark.parametrize("scale", [True, False, -0.5, math.inf, math.nan, "1.0", None])
def test_context_gates_refuse_a_ridge_scale_that_is_not_a_finite_number_at_least_zero(scale):
    """``lambda_scale``: a finite number ``>= 0`` (0: no ridge); a bool is a switch, not a number."""
    with pytest.raises(ValueError, match=r"lambda_scale must be a finite number >= 0 \(0: no ridge\), got "):
        ContextGates(8, 2, 4, gate="ctx-beta", log_gate="none", lambda_scale=scale, per_column=False)


@pytest.mark.parametrize("scale", [0, 0.0, 2, 1e-3])
def test_context_gates_take_any_finite_ridge_scale_at_least_zero(scale):
    gates = ContextGates(8, 2, 4, gate="ctx-beta", log_gate="none", lambda_scale=scale, per_column=False).double()
    _, lam, _ = gates(torch.randn(1, 3, 8, dtype=F64))
    assert hasattr(gates, "lam_proj") == (scale > 0)
    assert bool((lam >= 0).all() & (lam < scale if scale > 0 else lam == 0).all())



# ----------------------------------------------------------------------------- the mixer's cached calls
def _falcon_layer(**fields):
    torch.manual_seed(0)
    return FalconAttention(get_preset("tiny-falcon", **fields)).double().eval()


def test_a_cache_of_more_rows_than_h_is_refused():
    """Dense rows continue the cache row by row: a cache of 3 rows given 2 is a ValueError naming both counts
    (2 of 3 rows would otherwise be read against a state of another batch)."""
    layer = _falcon_layer()
    h = torch.randn(3, 4, layer.q_proj.in_features, dtype=F64)
    cache = LayerCache()
    with torch.no_grad():
        layer(h, Packing.dense(3, 4, None, h.device), cache)
        with pytest.raises(ValueError, match="^cache holds 3 rows, h has 2"):
            layer(h[:2, :1], Packing.dense(2, 1, torch.tensor([4, 4]), h.device), cache)


def test_one_cached_token_per_row_takes_the_step_and_equals_the_full_call(monkeypatch):
    """A cached forward over one token per row goes to ``falcon_step`` (module docstring) and gives what the
    uncached call over the whole sequence gives at that token."""
    calls = []
    real_step = falcon_attention_module.falcon_step

    def counting_step(*args, **kwargs):
        calls.append(1)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(falcon_attention_module, "falcon_step", counting_step)
    layer = _falcon_layer()
    h = torch.randn(2, 6, layer.q_proj.in_features, dtype=F64)
    with torch.no_grad():
        full = layer(h, Packing.dense(2, 6, None, h.device))
        cache = LayerCache()
        outs = [layer(h[:, :4], Packing.dense(2, 4, None, h.device), cache)]
        assert not calls
        for t in (4, 5):
            outs.append(layer(h[:, t:t + 1], Packing.dense(2, 1, torch.tensor([t, t]), h.device), cache))
    assert len(calls) == 2
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-12)
