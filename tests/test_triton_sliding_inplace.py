"""Rule 3A reads its delayed pairs in place: the scan kernels' delayed read and the cases
of the in-place path that the other rule-3A tests do not reach.

The scan's delayed read (``scalar_decay.scan_forward`` / ``scan_backward`` with
``delayed``) must compute exactly what the same kernels compute on the concatenation
``[x_pre | x]`` cut to ``T`` rows, built here with ``torch.cat``, including prefixes longer
than a chunk and segments shorter than the prefix. The whole op is then checked against
the float64 recurrent form where the delay and the in-place gradients have edge cases:
a prefix longer than a scan chunk, packed sequences shorter than the window, window 1
(the gradient of ``v`` and, without the shift, of ``k`` written in place) on poisoned
buffers.
"""
from __future__ import annotations

import functools

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, check_kernel, in_this_process, needs_cuda, rel_norm

from falcon_fwa.ops.triton.chunk_index import chunk_layout
from falcon_fwa.ops.triton.scalar_decay import scan_backward, scan_forward

pytestmark = in_this_process
_check = functools.partial(check_kernel, "3A", output_final_state=True)


def _scan_inputs(B, T, H, K, V, n_x, n_v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = dict(q=torch.randn(B, T, H, K, generator=g), x=torch.randn(B, T, H, K, generator=g),
             v=torch.randn(B, T, H, V, generator=g), x_pre=torch.randn(B, n_x, H, K, generator=g),
             v_pre=torch.randn(B, n_v, H, V, generator=g), do=torch.randn(B, T, H, V, generator=g))
    t = {n: x.to(DEVICE, dtype) for n, x in t.items()}
    t["eta"] = (torch.rand(B, T, H, generator=g) + 0.1).to(DEVICE)
    t["log_a"] = (-0.2 * torch.rand(B, T, H, generator=g)).to(DEVICE)
    t["S0"] = (0.1 * torch.randn(B, H, K, V, generator=g)).to(DEVICE)
    t["dS_T"] = torch.randn(B, H, K, V, generator=g).to(DEVICE)
    return t


@pytest.mark.parametrize("T,n_x,n_v,chunk,read_after", [
    (40, 5, 4, 16, True),    # prefixes inside the first chunk
    (45, 20, 19, 16, False),  # prefixes longer than a chunk
    (7, 12, 0, 16, True),    # a segment shorter than the prefix; no value prefix
])
def test_delayed_read_is_the_concatenation(T, n_x, n_v, chunk, read_after):
    """Outputs, chunk states, final state and every gradient of the delayed read equal the
    kernels' results on ``cat([x_pre, x])[:, :T]`` and ``cat([v_pre, v])[:, :T]``, bit for bit."""
    B, H, K, V = 2, 2, 20, 24  # head dims off the blocks
    t = _scan_inputs(B, T, H, K, V, n_x, n_v, torch.float32, seed=T + n_x)
    layout = chunk_layout(B, T, chunk, None)
    x_cat = torch.cat([t["x_pre"], t["x"]], 1)[:, :T].contiguous()
    v_cat = torch.cat([t["v_pre"], t["v"]], 1)[:, :T].contiguous()
    common = (t["eta"], t["log_a"], t["S0"], layout, read_after, True)
    want = scan_forward(t["q"], x_cat, v_cat, *common)
    got = scan_forward(t["q"], t["x"], t["v"], *common, delayed=(t["x_pre"], t["v_pre"]))
    for name, a, b in zip(("o", "h", "S_T"), got, want):
        assert torch.equal(a, b), name
    h = want[1]
    back = (t["eta"], t["log_a"], h, t["S0"], t["do"], t["dS_T"], layout, read_after)
    want_g = scan_backward(t["q"], x_cat, v_cat, *back)
    got_g = scan_backward(t["q"], t["x"], t["v"], *back, delayed=(t["x_pre"], t["v_pre"]))
    for name, a, b in zip(("dq", "dx", "dv", "deta", "dlog_a", "dS0"), got_g, want_g):
        assert torch.equal(a, b), name


def test_prefix_longer_than_a_scan_chunk():
    # window 20 without the shift: 19 tail pairs precede the segment, more than a chunk of 16
    # steps, so the scan's first two chunks read delayed pairs from the prefix
    _check((1, 45, 2, 16, 16), window=20, state=True, shift=False, chunk_size=16, seed=101)


def test_packed_sequences_shorter_than_the_window():
    # sequences of 2 and 1 steps with window 5 (their windows reach into their own tails),
    # then a long one; read before write
    _check((1, 33, 2, 16, 16), window=5, state=True, cu_seqlens=[0, 2, 3, 33], read="before", seed=102)


@pytest.mark.parametrize("shift", [True, False])
def test_window_one_gradients_in_place_on_poisoned_buffers(shift, monkeypatch):
    # window 1: the value gradient is the scan's own (and, without the shift, the key gradient
    # too, plus the energies' part); fresh buffers start as NaN
    _check((2, 21, 2, 16, 16), window=1, state=True, shift=shift, poison=monkeypatch, seed=103)


def test_poisoned_buffers_prefix_longer_than_a_chunk(monkeypatch):
    _check((1, 30, 1, 16, 16), window=19, state=True, read="before", poison=monkeypatch, chunk_size=16, seed=104)


# ---- GPU: the delayed read at benchmark-sized head dims ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,V", [(64, 64), (100, 100), (128, 128), (256, 256)])
def test_cuda_delayed_read_is_the_concatenation(K, V, dtype):
    # two compiled programs (the compiler may order roundings differently): equal to far below
    # the dtype's kernel tolerance rather than bit for bit
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    B, T, H, n_x, n_v = 2, 300, 2, 5, 4
    t = _scan_inputs(B, T, H, K, V, n_x, n_v, dtype, seed=K)
    layout = chunk_layout(B, T, 64, None)
    x_cat = torch.cat([t["x_pre"], t["x"]], 1)[:, :T].contiguous()
    v_cat = torch.cat([t["v_pre"], t["v"]], 1)[:, :T].contiguous()
    for read_after in (True, False):
        common = (t["eta"], t["log_a"], t["S0"], layout, read_after, True)
        want = scan_forward(t["q"], x_cat, v_cat, *common)
        got = scan_forward(t["q"], t["x"], t["v"], *common, delayed=(t["x_pre"], t["v_pre"]))
        for name, a, b in zip(("o", "h", "S_T"), got, want):
            assert rel_norm(a, b) <= tol, name
        back = (t["eta"], t["log_a"], want[1], t["S0"], t["do"], t["dS_T"], layout, read_after)
        want_g = scan_backward(t["q"], x_cat, v_cat, *back)
        got_g = scan_backward(t["q"], t["x"], t["v"], *back, delayed=(t["x_pre"], t["v_pre"]))
        for name, a, b in zip(("dq", "dx", "dv", "deta", "dlog_a", "dS0"), got_g, want_g):
            assert rel_norm(a, b) <= tol, name


@needs_cuda
@pytest.mark.parametrize("window,shift,read", [(1, True, "after"), (1, False, "before"), (20, False, "after")])
def test_cuda_window_edges(window, shift, read):
    _check((2, 1000, 2, 128, 128), torch.bfloat16, window=window, shift=shift, read=read, chunk_size=64,
           state=True, device="cuda")
