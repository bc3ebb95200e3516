"""The layers as building blocks of one's own ``nn.Module``: called on dense rows without a ``Packing``
(``packing=None``), checked against float64 references written here, and a ``packing`` that does not
describe the input named as such."""
import math

import pytest
import torch
import torch.nn.functional as F

from falcon_fwa import FalconConfig
from falcon_fwa.layers import CausalSelfAttention, FalconAttention, LayerCache, Packing, ShortConv

BASE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2)


def _rope(x, positions, theta):
    """Rotate-half RoPE of ``x`` ``[T, H, d]`` at integer ``positions`` ``[T]``, in float64."""
    d = x.shape[-1]
    half = d // 2
    inv = torch.tensor([theta ** (-2.0 * i / d) for i in range(half)], dtype=torch.float64)
    ang = positions.to(torch.float64)[:, None, None] * inv
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def _attention_reference(layer, h):
    """Causal softmax attention with RoPE at positions 0..T-1, one row at a time, from the layer's weights."""
    B, T, D = h.shape
    H = layer.num_heads
    d = D // H
    out = torch.zeros(B, T, D, dtype=torch.float64)
    for b in range(B):
        x = h[b]
        q, k, v = ((x @ p.weight.T).view(T, H, d) for p in (layer.q_proj, layer.k_proj, layer.v_proj))
        pos = torch.arange(T)
        q, k = _rope(q, pos, layer.rope_theta), _rope(k, pos, layer.rope_theta)
        o = torch.zeros(T, H, d, dtype=torch.float64)
        for t in range(T):
            for head in range(H):
                w = torch.softmax(k[:t + 1, head] @ q[t, head] / math.sqrt(d), 0)
                o[t, head] = w @ v[:t + 1, head]
        out[b] = o.reshape(T, D) @ layer.o_proj.weight.T
    return out


def test_attention_layer_runs_dense_rows_without_a_packing_and_continues_its_cache():
    torch.manual_seed(0)
    layer = CausalSelfAttention(FalconConfig(**BASE, mixer="transformer")).double()
    h = torch.randn(2, 6, 32, dtype=torch.float64)
    ref = _attention_reference(layer, h)
    with torch.no_grad():
        torch.testing.assert_close(layer(h), ref, rtol=1e-10, atol=1e-12)
        cache = LayerCache()  # a prompt of 3, then one token at a time: positions continue the cached rows
        steps = [layer(h[:, :3], cache=cache)] + [layer(h[:, t:t + 1], None, cache) for t in range(3, 6)]
    torch.testing.assert_close(torch.cat(steps, 1), ref, rtol=1e-10, atol=1e-12)


def test_short_conv_runs_dense_rows_without_a_packing():
    torch.manual_seed(0)
    conv = ShortConv(5, kernel_size=3).double()
    x = torch.randn(2, 7, 5, dtype=torch.float64)
    w = conv.weight[:, 0].detach()  # [C, W]; the last tap weights the current token
    ref = torch.zeros_like(x)
    for t in range(7):
        for j in range(3):
            s = t - 2 + j
            if s >= 0:
                ref[:, t] += w[:, j] * x[:, s]
    y, buf = conv(x)
    torch.testing.assert_close(y, F.silu(ref), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(buf, x[:, -2:])


def test_falcon_layer_runs_dense_rows_without_a_packing():
    """Rows are sequences of their own, and one-token steps from the cache give the whole pass's outputs."""
    torch.manual_seed(0)
    layer = FalconAttention(FalconConfig(**BASE, rule="3", window=3)).double()
    h = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        full = layer(h)
        for b in range(2):
            torch.testing.assert_close(layer(h[b:b + 1])[0], full[b], rtol=1e-10, atol=1e-12)
        cache = LayerCache()
        steps = [layer(h[:, :4], cache=cache)] + [layer(h[:, t:t + 1], None, cache) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-12)


def _layers():
    return [FalconAttention(FalconConfig(**BASE)), CausalSelfAttention(FalconConfig(**BASE, mixer="transformer"))]


@pytest.mark.parametrize("index", [0, 1])
def test_a_packing_of_another_shape_is_named(index):
    layer = _layers()[index]
    h = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"^packing describes dense rows of shape \(2, 4\).*h has \[B, T\] = \(2, 5\)"):
        layer(h, Packing.dense(2, 4, None, "cpu"))
    with pytest.raises(TypeError, match=r"^packing must be a Packing \(or None for dense rows\), got str"):
        layer(h, "dense")
    packed = Packing.from_cu_seqlens(torch.tensor([0, 2, 5]), torch.arange(2), None)
    with pytest.raises(ValueError, match=r"^(h must have shape \[1, 5, hidden_size\]|packing holds 2 packed)"):
        layer(h, packed)


def test_short_conv_names_a_packing_of_another_shape():
    with pytest.raises(ValueError, match=r"^packing describes dense rows of shape \(1, 7\).*x has \[B, T\] = \(2, 7\)"):
        ShortConv(5)(torch.randn(2, 7, 5), Packing.dense(1, 7, None, "cpu"))


def test_attention_layer_names_a_hidden_state_of_the_wrong_width_and_a_cache_of_other_rows():
    layer = CausalSelfAttention(FalconConfig(**BASE, mixer="transformer"))
    with pytest.raises(ValueError, match=r"^h must have shape \[B, T, hidden_size=32\], got \(2, 5, 16\)"):
        layer(torch.randn(2, 5, 16))
    cache = LayerCache()
    layer(torch.randn(2, 3, 32), cache=cache)
    with pytest.raises(ValueError, match=r"^cache holds 2 rows, h has 1"):
        layer(torch.randn(1, 1, 32), cache=cache)
