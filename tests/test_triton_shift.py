"""The row-delay helpers of the kernels' prologue (``ops.triton.shift``) against the
concatenation they replace, values and gradients (plain PyTorch: no kernel runs)."""
from __future__ import annotations

import pytest
import torch

from falcon_fwa.ops.triton.shift import advance_rows, delay_rows, shift_rows


def _cat_reference(prefix, body):
    """Rows ``0 .. T-1`` of ``[prefix | body]`` by concatenation."""
    return torch.cat([prefix, body], 1)[:, :body.shape[1]]


@pytest.mark.parametrize("B,T,n_pre", [(3, 7, 1), (3, 7, 3), (2, 4, 6), (1, 5, 5), (4, 1, 2), (2, 6, 0), (0, 4, 2)])
def test_delay_rows_is_the_concatenation(B, T, n_pre):
    g = torch.Generator().manual_seed(B * 100 + T * 10 + n_pre)
    body = torch.randn(B, T, 2, 3, generator=g, dtype=torch.float64)
    prefix = torch.randn(B, n_pre, 2, 3, generator=g, dtype=torch.float64)
    out = delay_rows(prefix, body)
    assert out.is_contiguous()
    assert torch.equal(out, _cat_reference(prefix, body))


@pytest.mark.parametrize("B,T,m", [(3, 7, 1), (3, 7, 3), (2, 4, 6), (1, 5, 5), (2, 5, 0), (0, 4, 2)])
def test_advance_rows_is_the_adjoint_of_delay(B, T, m):
    """<delay(0, body), d> = <body, advance(d)> for every body and d: the adjoint by definition."""
    g = torch.Generator().manual_seed(7 + m)
    body = torch.randn(B, T, 2, 3, generator=g, dtype=torch.float64)
    d = torch.randn(B, T, 2, 3, generator=g, dtype=torch.float64)
    lhs = (delay_rows(torch.zeros(B, m, 2, 3, dtype=torch.float64), body) * d).sum()
    rhs = (body * advance_rows(d, m)).sum()
    assert torch.allclose(lhs, rhs, rtol=1e-14, atol=1e-14)
    # and by hand: row t of the result is row t + m of d, the last m rows zero
    expect = torch.zeros_like(d)
    if T > m:
        expect[:, :T - m] = d[:, m:]
    assert torch.equal(advance_rows(d, m), expect)


def test_shift_rows_values_and_gradients():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(3, 6, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    first = torch.randn(3, 1, 2, 4, generator=g, dtype=torch.float64, requires_grad=True)
    x = shift_rows(k, first)
    assert torch.equal(x, torch.cat([first, k[:, :-1]], 1))
    assert torch.autograd.gradcheck(shift_rows, (k, first))
    # a first row without gradient (the sentinel's zero) gets none and costs nothing
    zero = torch.zeros(3, 1, 2, 4, dtype=torch.float64)
    shift_rows(k, zero).sum().backward()
    assert torch.equal(k.grad[:, :-1], torch.ones(3, 5, 2, 4, dtype=torch.float64))
    assert torch.equal(k.grad[:, -1], torch.zeros(3, 2, 4, dtype=torch.float64))


def test_shift_rows_names_a_bad_first_row():
    k = torch.zeros(2, 5, 3, 4)
    with pytest.raises(ValueError, match="first must have shape"):
        shift_rows(k, torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="dtype"):
        shift_rows(k, torch.zeros(2, 1, 3, 4, dtype=torch.float64))
