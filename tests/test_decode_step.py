"""The one-token decoding paths against their definitions: the short convolution's single
window product, and the op's step with unshifted pairs and the read before the write."""
import pytest
import torch
import torch.nn.functional as F
from conftest import random_inputs, reference_falcon, rel_err

from falcon_fwa import falcon_attention, falcon_step
from falcon_fwa.layers import Packing, ShortConv


def test_short_conv_one_token_at_a_time_equals_the_textbook_convolution():
    """y_t = SiLU(sum_i w_i x_{t-i}) with zeros before the start, fed one token per call."""
    torch.manual_seed(0)
    conv = ShortConv(6, kernel_size=4).double()
    w = conv.weight[:, 0].detach()  # [C, W]; w[:, -1] multiplies x_t
    x = torch.randn(3, 9, 6, dtype=torch.float64)
    padded = torch.cat([torch.zeros(3, 3, 6, dtype=x.dtype), x], 1)
    want = F.silu(torch.stack([(padded[:, t:t + 4] * w.t()).sum(1) for t in range(9)], 1))
    buf, outs = None, []
    with torch.no_grad():
        for t in range(9):
            y, buf = conv(x[:, t:t + 1], Packing.dense(3, 1, None, x.device), buf)
            outs.append(y)
    assert torch.allclose(torch.cat(outs, 1), want, atol=1e-14, rtol=0)
    assert torch.equal(buf, x[:, -3:])  # the last W-1 inputs


@pytest.mark.parametrize("rule", ["1", "2A", "3A"])
def test_unshifted_step_reading_before_the_write_equals_the_float64_loop(rule):
    """shift=False pairs (k_t, v_t) from the first token on (no sentinel); with read="before",
    normalize=False and a gate, steps from a fresh state reproduce the literal loop token by token."""
    inp = random_inputs(rule, B=2, T=9, seed=51, with_gate=True)
    options = dict(rule=rule, window=3, shift=False, normalize=False, read="before")
    full, full_S, _ = reference_falcon(**inp, **options)
    state = None
    for t in range(9):
        o_t, state = falcon_step(**{name: x[:, t] for name, x in inp.items()}, state=state, **options)
        assert rel_err(o_t, full[:, t]) <= 1e-13, t
    assert state.last_key is None
    assert rel_err(state.S, full_S) <= 1e-13


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("switches", [dict(scale_ridge=True), dict(normalize=False), dict(shift=False, read="before")])
@pytest.mark.parametrize("rule", ["1", "2", "3", "1A", "2A", "3A"])
def test_step_is_the_recurrent_form_bit_for_bit(rule, switches, dtype):
    """In float32 and bfloat16, continuing from a 3-token prefix (a partly filled window tail), each
    step gives exactly the recurrent form's output and final state: the step is that form's
    computation for one token, not an approximation of it."""
    inp = {n: x.to(dtype) for n, x in random_inputs(rule, B=2, T=7, seed=52, with_gate=True).items()}
    options = dict(rule=rule, window=4, **switches)
    full, full_state = falcon_attention(**inp, form="recurrent", output_final_state=True, **options)
    _, state = falcon_attention(**{n: x[:, :3] for n, x in inp.items()}, form="recurrent", output_final_state=True,
                                **options)
    for t in range(3, 7):
        o_t, state = falcon_step(**{n: x[:, t] for n, x in inp.items()}, state=state, backend="torch", **options)
        assert o_t.dtype == dtype and torch.equal(o_t, full[:, t]), t
    for name in ("S", "last_key", "tail_x", "tail_y", "tail_valid"):
        a, b = getattr(state, name), getattr(full_state, name)
        assert (a is None and b is None) or torch.equal(a, b), name
