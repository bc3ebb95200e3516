"""``window_sum`` (the gradient of overlapping windows summed onto their axis) against float64
references: torch's ``unfold`` backward through autograd and an explicit loop."""
from __future__ import annotations

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, in_this_process, needs_cuda

from falcon_fwa.ops.triton.window_sum import axis_concat, window_sum

pytestmark = in_this_process


def _unfold_grad(g: torch.Tensor) -> torch.Tensor:
    """float64 gradient of ``ext.unfold(1, S, 1)`` laid out ``[B, R, S, H, D]``, through autograd."""
    B, R, S, H, D = g.shape
    ext = torch.zeros(B, R + S - 1, H, D, dtype=torch.float64, requires_grad=True)
    rows = ext.unfold(1, S, 1).permute(0, 1, 4, 2, 3)  # [B, R, S, H, D]
    (rows * g.double().cpu()).sum().backward()
    return ext.grad


def _loop_sum(g: torch.Tensor) -> torch.Tensor:
    B, R, S, H, D = g.shape
    out = torch.zeros(B, R + S - 1, H, D, dtype=torch.float64)
    for r in range(R):
        for j in range(S):
            out[:, r + j] += g[:, r, j].double().cpu()
    return out


@pytest.mark.parametrize("S", [1, 2, 4, 8, 16])
def test_window_sum_against_float64(S):
    g = torch.Generator().manual_seed(S)
    B, R, H, D = 2, 37, 3, 20  # R and D off every block size
    x = torch.randn(B, R, S, H, D, generator=g)
    want = _unfold_grad(x)
    assert torch.allclose(want, _loop_sum(x))
    got = window_sum(x.to(DEVICE))
    assert got.dtype == torch.float32 and got.shape == (B, R + S - 1, H, D)
    assert torch.allclose(got.double().cpu(), want, rtol=1e-6, atol=1e-6)
    # 16-bit input: fp32 accumulation, one rounding at the end (or fp32 output on request)
    xb = x.to(DEVICE, torch.bfloat16)
    want_b = _unfold_grad(xb.float())
    got_b = window_sum(xb)
    assert got_b.dtype == torch.bfloat16
    assert torch.allclose(got_b.double().cpu(), want_b, rtol=2 ** -7, atol=1e-6)  # one bf16 step
    assert torch.allclose(window_sum(xb, dtype=torch.float32).double().cpu(), want_b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("S,n_head,n_body", [(4, 3, 40), (4, 4, 39), (2, 0, 38), (8, 7, 37), (16, 16, 37)])
def test_window_sum_added_and_split(S, n_head, n_body):
    """``acc`` added on the axis; the axis stored as ``[:n_head]`` and the rest on ``n_body`` rows
    (zero past the axis, cut before its end), into NaN-filled fresh buffers."""
    g = torch.Generator().manual_seed(100 + S)
    B, R, H, D = 2, 37, 2, 24
    P = R + S - 1
    x = torch.randn(B, R, S, H, D, generator=g)
    acc = torch.randn(B, P, H, D, generator=g)
    want = _unfold_grad(x) + acc.double()
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    torch.empty = nan_empty
    try:
        head, body = window_sum(x.to(DEVICE), acc.to(DEVICE), split=n_head, n_body=n_body)
    finally:
        torch.empty = real_empty
    assert head.shape == (B, n_head, H, D) and body.shape == (B, n_body, H, D)
    assert torch.allclose(head.double().cpu(), want[:, :n_head], rtol=1e-6, atol=1e-6)
    m = min(n_body, P - n_head)
    assert torch.allclose(body[:, :m].double().cpu(), want[:, n_head:n_head + m], rtol=1e-6, atol=1e-6)
    assert torch.equal(body[:, m:].cpu(), torch.zeros_like(body[:, m:].cpu()))
    with pytest.raises(ValueError, match="acc must have shape"):
        window_sum(x.to(DEVICE), acc[:, 1:].to(DEVICE))


@needs_cuda
@pytest.mark.parametrize("S", [1, 4, 16])
def test_cuda_window_sum_benchmark_shape(S):
    g = torch.Generator().manual_seed(S)
    B, R, H, D = 2, 2048 // S + 3, 4, 128
    x = torch.randn(B, R, S, H, D, generator=g).to("cuda", torch.bfloat16)
    want = _unfold_grad(x.float())
    assert torch.allclose(window_sum(x, dtype=torch.float32).double().cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n,L", [(0, 9), (3, 12), (4, 4), (2, 11)])
def test_axis_concat_is_the_cut_concatenation(n, L):
    # L = n + m - 1 cuts the body's last row; L = n keeps none of it; n = 0 is the body alone
    g = torch.Generator().manual_seed(n + L)
    B, m, H, D = 2, 10, 3, 20
    head = torch.randn(B, n, H, D, generator=g).to(torch.bfloat16)
    body = torch.randn(B, m, H, D, generator=g).to(torch.bfloat16)
    got = axis_concat(head.to(DEVICE), body.to(DEVICE), L).cpu()
    assert torch.equal(got, torch.cat([head, body[:, :L - n]], 1))
    # and window_sum over one slot with the same split takes it apart again, past-the-axis body rows zero
    d_head, d_body = window_sum(got.to(DEVICE)[:, :, None], split=n, n_body=m)
    assert torch.equal(d_head.cpu(), head)
    assert torch.equal(d_body.cpu()[:, :L - n], body[:, :L - n]) and not d_body.cpu()[:, L - n:].any()


def test_axis_concat_names_the_bad_argument():
    head, body = torch.zeros(1, 2, 3), torch.zeros(1, 5, 3)
    with pytest.raises(ValueError, match="L must lie in"):
        axis_concat(head, body, 8)
    with pytest.raises(ValueError, match="trailing dims"):
        axis_concat(head, torch.zeros(1, 5, 4), 4)
