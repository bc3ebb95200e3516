"""``falcon_attention(segments=n)`` on the Triton kernels: the same function as one call
(interpreter on CPU, GPU when present), and on the GPU the point of it, a lower peak memory."""
from __future__ import annotations

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, in_this_process, needs_cuda, rel_norm

from falcon_fwa import falcon_attention

pytestmark = in_this_process


def _inputs(rule, B, T, H, K, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g) * K ** -0.5 for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    beta = torch.rand(B, T, H, *((V,) if rule in ("2", "2A") else ()), generator=g)
    lam, gate = 0.2 * torch.rand(B, T, H, generator=g), -0.2 * torch.rand(B, T, H, generator=g)
    return [t.to(DEVICE, dtype).requires_grad_() for t in (q, k, v, beta, lam, gate)]


def _fwd_bwd(leaves, rule, window, segments, chunk_size=16):
    q, k, v, beta, lam, gate = leaves
    o, st = falcon_attention(q, k, v, beta, lam, log_gate=gate, rule=rule, window=window, chunk_size=chunk_size,
                             backend="triton", output_final_state=True, segments=segments)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(o.shape, generator=g).to(o.device, o.dtype)
    grads = torch.autograd.grad((o * w).float().sum() + st.S.sum(), leaves)
    return o, st, grads


@pytest.mark.parametrize("rule,window", [("1", 1), ("3", 2), ("2", 1), ("1A", 1)])
def test_segments_on_the_kernels_match_one_call(rule, window):
    leaves = _inputs(rule, 1, 52, 2, 16, 16, torch.float32, seed=3)
    o1, st1, g1 = _fwd_bwd(leaves, rule, window, 1)
    o, st, g = _fwd_bwd(leaves, rule, window, 3)
    assert rel_norm(o, o1) < 1e-5 and rel_norm(st.S, st1.S) < 1e-5
    for a, b in zip(g, g1):
        assert rel_norm(a, b) < 1e-5


def test_packed_segments_on_the_kernels_match_one_call():
    leaves = _inputs("3", 1, 60, 2, 16, 16, torch.float32, seed=4)
    cu = torch.tensor([0, 9, 30, 31, 60], device=DEVICE)
    q, k, v, beta, lam, gate = leaves

    def run(segments):
        o, st = falcon_attention(q, k, v, beta, lam, log_gate=gate, rule="3", window=2, chunk_size=16,
                                 backend="triton", cu_seqlens=cu, output_final_state=True, segments=segments)
        return o, st, torch.autograd.grad(o.square().sum() + st.S.sum(), leaves)

    o1, st1, g1 = run(1)
    o, st, g = run(2)
    assert rel_norm(o, o1) < 1e-5 and rel_norm(st.S, st1.S) < 1e-5
    for a, b in zip(g, g1):
        assert rel_norm(a, b) < 1e-5


@needs_cuda
@pytest.mark.parametrize("rule,window,most", [("3", 4, 0.6), ("2", 1, 0.9)])
def test_segments_lower_the_peak_memory(rule, window, most):
    # bf16 at a shape where the kernels' intermediates dominate: a quarter of the sequence at a time. Rule 2's
    # node frees its intermediates during its own backward; inside a piece's graph it still does
    leaves = _inputs(rule, 2, 2048, 4, 64, 64, torch.bfloat16, seed=5)

    def peak(segments):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = _fwd_bwd(leaves, rule, window, segments, chunk_size=64)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base, out

    _fwd_bwd(leaves, rule, window, 4, chunk_size=64)  # compile outside the measurement
    m1, (o1, _, g1) = peak(1)
    m4, (o4, _, g4) = peak(4)
    assert m4 < most * m1, (m4, m1)
    assert rel_norm(o4, o1) < 1e-2
    for a, b in zip(g4, g1):
        assert rel_norm(a, b) < 1e-2
