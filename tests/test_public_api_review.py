"""The public API used as a first-time user would: argument forms that the rest of PyTorch accepts, and errors
that name the argument at fault."""
from __future__ import annotations

import pytest
import torch

from falcon_fwa import falcon_attention, falcon_step


def _state(rule="3A", window=3, B=3, H=2, K=4, V=3, seed=0):
    """A continued state of a short float64 sequence (every field set for a sliding rule)."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, 5, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, 5, H, V, generator=g, dtype=torch.float64)
    beta, lam = (torch.rand(B, 5, H, generator=g, dtype=torch.float64) for _ in range(2))
    _, st = falcon_attention(q, k, v, beta, lam, rule=rule, window=window, output_final_state=True)
    return st


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_to_takes_a_dtype_first_as_tensor_to_does(dtype):
    st = _state()
    out = st.to(dtype)  # torch.Tensor.to(dtype) and nn.Module.to(dtype) take the dtype positionally
    for field in ("S", "last_key", "tail_x", "tail_y"):
        t = getattr(out, field)
        assert t.dtype == dtype and t.device == getattr(st, field).device
        assert torch.equal(t, getattr(st, field).to(dtype))  # each value rounded once, as Tensor.to rounds it
    assert out.tail_valid.dtype == torch.bool and torch.equal(out.tail_valid, st.tail_valid)
    # the same state as the keyword form gives
    kw = st.to(dtype=dtype)
    assert all(torch.equal(getattr(out, f), getattr(kw, f)) for f in ("S", "last_key", "tail_x", "tail_y"))


def test_state_to_refuses_two_dtypes_by_name():
    with pytest.raises(TypeError, match="^device must be a device"):
        _state().to(torch.float32, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool])
def test_model_refuses_non_integer_input_ids_by_name(dtype):
    from falcon_fwa import FalconForCausalLM, get_preset
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon")).eval()
    ids = torch.randint(0, 2, (2, 6))
    with pytest.raises(ValueError, match=f"^input_ids must hold integer token ids, got {dtype}"):
        model(ids.to(dtype))
    # labels of the same dtype are refused by name too, and integer ids of any width are taken
    with pytest.raises(ValueError, match="^labels must hold integer token ids"):
        model(ids, labels=ids.to(dtype))
    assert torch.equal(model(ids.int()).logits, model(ids).logits)


@pytest.mark.parametrize("rows", [[-1], [0, 3], torch.tensor([3]), torch.tensor([0, -2])])
def test_state_index_select_names_a_row_outside_the_state(rows):
    st = _state(B=3)
    with pytest.raises(IndexError, match=r"^index holds row -?\d, outside the state's rows \[0, 3\)"):
        st.index_select(rows)


def test_state_index_select_refuses_a_matrix_of_rows_by_name():
    with pytest.raises(ValueError, match=r"^index must be one-dimensional \[N\], got shape \(1, 2\)"):
        _state(B=3).index_select(torch.tensor([[0, 1]]))


def test_state_index_select_rows_in_range_continue_those_sequences():
    # the rows kept (reordered, repeated) continue exactly as the same rows of the whole batch
    g = torch.Generator().manual_seed(1)
    B, T, H, K, V = 3, 9, 2, 4, 3
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta, lam = (torch.rand(B, T, H, generator=g, dtype=torch.float64) for _ in range(2))
    full, _ = falcon_attention(q, k, v, beta, lam, rule="3", window=3)
    _, st = falcon_attention(q[:, :5], k[:, :5], v[:, :5], beta[:, :5], lam[:, :5], rule="3", window=3,
                             output_final_state=True)
    rows = [2, 0, 2]
    state = st.index_select(rows)
    for t in range(5, T):
        o, state = falcon_step(q[rows, t], k[rows, t], v[rows, t], beta[rows, t], lam[rows, t], state=state,
                               rule="3", window=3)
        assert torch.allclose(o, full[rows, t], rtol=1e-10, atol=1e-12)
