"""More checks of the layers: the Transformer baseline on a packed layout built by hand (no ``bounds``), as the
recurrent mixers take it, and on a dense layout whose rows are not its cache's rows; RoPE against an odd head dim."""
import math

import pytest
import torch

from falcon_fwa.layers import CausalSelfAttention, FalconAttention, LayerCache, Packing
from falcon_fwa.models import get_preset

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread

H, DH = 2, 4  # heads, head dim


def _attention(theta=100.0):
    torch.manual_seed(0)
    return CausalSelfAttention(get_preset("tiny-transformer", hidden_size=H * DH, num_heads=H,
                                          rope_theta=theta)).double()


def _rope(x, pos, theta):
    """Rotate-half RoPE written out: pairs ``(x_i, x_{i + d/2})`` rotated by ``pos * theta^{-2i/d}``;
    ``x`` ``[T, H, d]``, ``pos`` ``[T]``."""
    d = x.shape[-1]
    out = x.clone()
    for t in range(x.shape[0]):
        for i in range(d // 2):
            a = float(pos[t]) * theta ** (-2.0 * i / d)
            c, s = math.cos(a), math.sin(a)
            out[t, :, i] = x[t, :, i] * c - x[t, :, i + d // 2] * s
            out[t, :, i + d // 2] = x[t, :, i + d // 2] * c + x[t, :, i] * s
    return out


def _reference(layer, u, theta):
    """One sequence ``u`` ``[T, D]`` alone: RoPE at positions 0..T-1, a masked softmax per head, ``W_o``."""
    T = u.shape[0]
    q, k, v = (getattr(layer, f"{p}_proj").weight for p in "qkv")
    q = _rope((u @ q.T).view(T, H, DH), torch.arange(T), theta)
    k = _rope((u @ k.T).view(T, H, DH), torch.arange(T), theta)
    v = (u @ v.T).view(T, H, DH)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(DH)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
    return o.reshape(T, H * DH) @ layer.o_proj.weight.T


@pytest.mark.parametrize("cached", [False, True])
def test_attention_takes_a_packed_layout_built_by_hand_without_bounds(cached):
    """``Packing.bounds`` is optional (``layout_of`` and the recurrent mixers read ``cu_seqlens`` without it): the
    attention layer on a layout built by hand equals each sequence attended alone."""
    theta = 100.0
    layer = _attention(theta)
    cu = torch.tensor([0, 3, 5])
    seq_ids = torch.tensor([0, 0, 0, 1, 1])
    hand = Packing(cu_seqlens=cu, rows=torch.arange(2), positions=torch.tensor([[0, 1, 2, 0, 1]]), seq_ids=seq_ids)
    u = torch.randn(1, 5, H * DH, dtype=torch.float64)
    with torch.no_grad():
        got = layer(u, hand, LayerCache() if cached else None)
    want = torch.cat([_reference(layer, u[0, :3], theta), _reference(layer, u[0, 3:], theta)])
    torch.testing.assert_close(got[0], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rows", [1, 3])
def test_attention_refuses_a_dense_layout_of_other_rows_than_its_cache(rows):
    """Dense rows continue the cache row by row: a ``Packing.dense`` of another number of rows is refused with the
    ``ValueError`` the recurrent mixers give (``FalconAttention``), not an ``IndexError`` (more rows) or a silent
    continuation of the first rows only (fewer)."""
    layer = _attention()
    cache = LayerCache()
    with torch.no_grad():
        layer(torch.randn(2, 3, H * DH, dtype=torch.float64), None, cache)
        with pytest.raises(ValueError, match="cache holds 2 rows"):
            layer(torch.randn(rows, 1, H * DH, dtype=torch.float64),
                  Packing.dense(rows, 1, torch.full((rows,), 3), "cpu"), cache)
    assert cache.lengths == [3, 3]
    # the recurrent mixers' refusal, for comparison
    torch.manual_seed(0)
    mixer = FalconAttention(get_preset("tiny-deltanet", num_heads=H, head_k_dim=DH, head_v_dim=DH,
                                       hidden_size=H * DH)).double()
    cache = LayerCache()
    with torch.no_grad():
        mixer(torch.randn(2, 3, H * DH, dtype=torch.float64), None, cache)
        with pytest.raises(ValueError, match="cache holds 2 rows"):
            mixer(torch.randn(rows, 1, H * DH, dtype=torch.float64), Packing.dense(rows, 1, None, "cpu"), cache)


def test_rope_refuses_an_odd_head_dim_naming_x():
    """RoPE rotates pairs of dims: an odd head dim is a ValueError naming ``x`` and its shape, not a shape mismatch
    inside the rotation."""
    from falcon_fwa.layers import apply_rope

    with pytest.raises(ValueError, match=r"x must have an even last dimension .*got \(1, 3, 2, 5\)"):
        apply_rope(torch.zeros(1, 3, 2, 5), torch.arange(3)[None], 100.0)
    x = torch.randn(1, 3, 2, 4, dtype=torch.float64)
    torch.testing.assert_close(apply_rope(x, torch.arange(3)[None], 100.0)[0], _rope(x[0], torch.arange(3), 100.0))
