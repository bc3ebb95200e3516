"""The short convolution, the packed layout and the model cache against hand-computed references:
a kernel of width 1 (no buffer to carry), a carried buffer of another dtype than the input, layouts
that do not describe the input, dense rows meeting ``check_rows``, and ``FalconCache.detach``."""
import pytest
import torch
import torch.nn.functional as F

from falcon_fwa import FalconState
from falcon_fwa.layers import Packing, ShortConv, cu_seqlens_from_lengths
from falcon_fwa.models import FalconCache


def _reference(x, w):
    """y_t = SiLU(sum_i w_{W-1-i} x_{t-i}) with zeros before the start; x [B, T, C], w [C, W]."""
    W = w.shape[1]
    padded = torch.cat([x.new_zeros(x.shape[0], W - 1, x.shape[2]), x], 1)
    return F.silu(torch.stack([(padded[:, t:t + W] * w.t()).sum(1) for t in range(x.shape[1])], 1))


def test_kernel_of_width_one_carries_an_empty_buffer_and_continues():
    """W = 1: y_t = SiLU(w_0 x_t); the buffer holds the last W - 1 = 0 inputs, dense and packed,
    and a call continuing from it (one token or several) gives the full sequence's outputs."""
    torch.manual_seed(0)
    conv = ShortConv(3, kernel_size=1).double()
    w = conv.weight[:, 0].detach()
    x = torch.randn(2, 6, 3, dtype=torch.float64)
    want = F.silu(x * w[:, 0])
    with torch.no_grad():
        a, buf = conv(x[:, :4])
        assert tuple(buf.shape) == (2, 0, 3)
        b, buf = conv(x[:, 4:5], buffer=buf)
        assert tuple(buf.shape) == (2, 0, 3)
        c, buf = conv(x[:, 5:], buffer=buf)
        assert tuple(buf.shape) == (2, 0, 3)
        assert torch.allclose(torch.cat([a, b, c], 1), want, atol=1e-15, rtol=0)
        packing = Packing.from_cu_seqlens(cu_seqlens_from_lengths(torch.tensor([4, 2])), torch.tensor([0, 1]), None)
        y, pbuf = conv(torch.cat([x[0, :4], x[1, :2]])[None], packing)
        assert tuple(pbuf.shape) == (2, 0, 3)
        assert torch.allclose(y[0], torch.cat([want[0, :4], want[1, :2]]), atol=1e-15, rtol=0)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_float32_buffer_continues_bfloat16_inputs_in_their_dtype(steps):
    """Outputs are like x: a carried buffer of another dtype (float32, bfloat16 inputs) is taken in
    x's dtype, so y and the new buffer are bfloat16 and equal to the call given the rounded buffer."""
    torch.manual_seed(0)
    conv = ShortConv(4, kernel_size=3)
    x = torch.randn(2, steps, 4).to(torch.bfloat16)
    buffer = torch.randn(2, 2, 4)
    with torch.no_grad():
        y, buf = conv(x, buffer=buffer)
        y_ref, buf_ref = conv(x, buffer=buffer.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16 and buf.dtype == torch.bfloat16
    assert torch.equal(y, y_ref) and torch.equal(buf, buf_ref)


def test_packed_layout_refuses_an_input_of_several_rows():
    """A packed layout describes one row of its tokens: x [2, N_tok, C] is refused, naming the
    shape it must have, rather than convolving its first row only."""
    conv = ShortConv(3, kernel_size=2)
    packing = Packing.from_cu_seqlens(torch.tensor([0, 2, 5]), torch.tensor([0, 1]), None)
    with pytest.raises(ValueError, match=r"so x must have shape \[1, 5, \.\.\.\]"):
        conv(torch.randn(2, 5, 3), packing)


def test_dense_layout_of_another_shape_is_refused():
    """A dense layout whose positions are not [B, T] of x is refused, naming packing and both shapes."""
    conv = ShortConv(3, kernel_size=2)
    with pytest.raises(ValueError, match=r"packing describes dense rows of shape \(2, 5\)"):
        conv(torch.randn(2, 4, 3), Packing.dense(2, 5, None, "cpu"))
    with pytest.raises(ValueError, match=r"but x has \[B, T\] = \(3, 4\)"):
        conv(torch.randn(3, 4, 3), Packing.dense(2, 4, None, "cpu"))


def test_check_rows_has_nothing_to_check_for_dense_rows():
    """Dense rows continue the cache row by row: check_rows accepts them whatever the rows held."""
    packing = Packing.dense(3, 2, None, "cpu")
    for held in (0, 1, 3):
        packing.check_rows(held)
        packing.check_rows(held, filled=True)


def test_detach_cuts_every_tensor_of_the_cache_from_the_graph():
    """FalconCache.detach (truncated backpropagation): the recurrent state, the convolution buffers and
    the keys and values keep their values and no longer require gradients; the cache itself is returned."""
    leaf = torch.randn(2, 3, requires_grad=True)
    grown = lambda *shape: (leaf.sum() * torch.ones(*shape))  # noqa: E731 (a tensor in the graph)
    cache = FalconCache(2)
    cache.layers[0].state = FalconState(rule="1", window=1, shift=True, S=grown(2, 1, 3, 3),
                                        last_key=grown(2, 1, 3))
    cache.layers[0].conv = {"q": grown(2, 3, 4), "k": grown(2, 3, 4)}
    cache.layers[1].keys, cache.layers[1].values = grown(2, 1, 5, 3), grown(2, 1, 5, 3)
    cache.layers[1].lengths = [5, 5]
    before = {"S": cache.layers[0].state.S, "last_key": cache.layers[0].state.last_key,
              "q": cache.layers[0].conv["q"], "k": cache.layers[0].conv["k"],
              "keys": cache.layers[1].keys, "values": cache.layers[1].values}
    assert cache.detach() is cache
    after = {"S": cache.layers[0].state.S, "last_key": cache.layers[0].state.last_key,
             "q": cache.layers[0].conv["q"], "k": cache.layers[0].conv["k"],
             "keys": cache.layers[1].keys, "values": cache.layers[1].values}
    for name, t in after.items():
        assert not t.requires_grad and t.grad_fn is None, name
        assert torch.equal(t, before[name].detach()), name
