"""Falcon-3A (sliding-window inner-product rule) on the Triton chunk kernels against
the float64 recurrent form (the definition).

Outputs, final states (``S``, the last key and the window tail) and the gradients of
``q, k, v, beta, lam, log_gate`` and of every initial-state tensor are compared with
``falcon_attention(rule="3A", form="recurrent")`` in float64 on the same inputs. On a
machine without CUDA the kernels run through Triton's interpreter on tiny shapes;
with CUDA the same checks run at larger and ragged shapes.
"""
from __future__ import annotations

import functools

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import (DEVICE, check_kernel, check_public_op_routing, check_segments_continue, in_this_process,
                           needs_cuda, rel_norm)

from falcon_fwa.ops.triton import falcon_chunk_triton
from falcon_fwa.ops.triton.sliding import MAX_WINDOW, window_gains

pytestmark = in_this_process
_check = functools.partial(check_kernel, "3A", output_final_state=True)


# ---- the step sizes and the gains of the decomposition, against a literal loop ----

def _gains_by_hand(n_ext, valid_ext, beta, lam, log_gate, W, eps, decay_floor, normalize, scale_ridge):
    """Float64, one step at a time: every write ``c_{s,p}`` of pair ``p`` (extended
    position) decayed to step ``t``; ``e_t`` is pair ``t``'s weight once complete,
    ``rho[t, d-1]`` pair ``t+d``'s weight so far."""
    T = beta.shape[0]
    c, log_a = {}, []
    for s in range(T):
        window = [p for p in range(s, s + W) if valid_ext[p]]
        stat = sum(n_ext[p] for p in window) / max(len(window), 1)
        lam_s = lam[s] * stat.detach() if scale_ridge else lam[s]
        eta = beta[s] * 0.0
        if window:
            eta = beta[s] / (stat + lam_s + eps) if normalize else beta[s]
        log_a.append(torch.log1p(-torch.clamp(eta * lam_s, max=1 - decay_floor)) + log_gate[s])
        for p in window:
            c[s, p] = eta / len(window)

    zero = torch.zeros((), dtype=torch.float64)

    def weight(p, t):  # pair p in S_t: its writes up to step t, decayed
        return sum((c[s, p] * torch.exp(sum(log_a[s + 1:t + 1], zero))
                    for s in range(max(0, p - W + 1), t + 1) if (s, p) in c), zero)

    e = torch.stack([weight(t, t) for t in range(T)])
    rho = torch.stack([torch.stack([weight(t + d, t) for d in range(1, W)]) for t in range(T)])
    return e, rho, torch.stack(log_a)


@pytest.mark.parametrize("normalize,scale_ridge", [(True, False), (False, True), (True, True)])
def test_window_gains_kernels_against_a_literal_loop(normalize, scale_ridge):
    # W = 3 over 9 steps with two empty slots (the sentinel and a tail slot) and a large
    # ridge, so that the clamp is active on some steps; values and all gradients
    W, T = 3, 9
    g = torch.Generator().manual_seed(7)
    n_ext = torch.rand(T + W - 1, generator=g, dtype=torch.float64) * 2
    valid_ext = torch.ones(T + W - 1, dtype=torch.bool)
    valid_ext[0] = valid_ext[W - 1] = False
    beta = torch.rand(T, generator=g, dtype=torch.float64) + 0.5
    lam = torch.rand(T, generator=g, dtype=torch.float64) * 4
    log_gate = -torch.rand(T, generator=g, dtype=torch.float64) * 0.3
    opts = dict(eps=1e-6, decay_floor=0.05, normalize=normalize, scale_ridge=scale_ridge)
    leaves = [t.clone().requires_grad_() for t in (n_ext, beta, lam, log_gate)]
    want = _gains_by_hand(*leaves[:1], valid_ext, *leaves[1:], W, **opts)
    probes = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in want]
    want_grads = torch.autograd.grad(sum((p * t).sum() for p, t in zip(probes, want)), leaves, allow_unused=True)
    want_grads = [torch.zeros_like(x) if d is None else d for d, x in zip(want_grads, leaves)]
    clamped = (-torch.expm1(want[2] - leaves[3]) >= 0.95 - 1e-9).sum().item()
    assert 0 < clamped < T  # the clamp is active on some steps only

    kleaves = [t.detach().float().to(DEVICE).requires_grad_() for t in leaves]
    n_k, b_k, l_k, g_k = (t[None, :, None] for t in kleaves)  # B = H = 1
    got = window_gains(n_k, valid_ext[None].to(DEVICE), b_k, l_k, g_k, window=W, **opts)
    got = (got[0][0, :, 0], got[1][0, :, 0], got[2][0, :, 0])
    got_grads = torch.autograd.grad(sum((p.to(DEVICE).float() * t).sum() for p, t in zip(probes, got)), kleaves)
    for name, a, b in zip(("e", "rho", "log_a"), got, want):
        assert rel_norm(a.cpu(), b) < 1e-5, name
    for name, a, b in zip(("n", "beta", "lam", "log_gate"), got_grads, want_grads):
        assert (a.cpu() - b).abs().max() <= 1e-5 * max(b.abs().max().item(), 1.0), f"d{name}"


# ---- every switch, tiny shapes (interpreter on CPU, GPU when present) ----

@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 6])
def test_windows_read_after(window):
    _check((2, 21, 2, 16, 16), window=window, seed=window)


@pytest.mark.parametrize("window,read,shift", [(2, "before", True), (4, "before", False), (5, "after", False),
                                               (1, "after", False)])
def test_read_and_shift(window, read, shift):
    _check((1, 37, 2, 16, 24), window=window, read=read, shift=shift, seed=10 + window)


@pytest.mark.parametrize("window", [1, 3])
def test_unnormalized_scale_ridge_chunk_32(window):
    _check((1, 45, 1, 16, 16), window=window, normalize=False, scale_ridge=True, chunk_size=32, seed=20 + window)


def test_band_across_blocks_of_steps():
    # T = 75 spans several band programs (16 steps each) and scan chunks: the open pairs of a
    # block's last steps sit in the next block, and the pairs at the start of a block are read
    # from the previous one
    _check((1, 75, 1, 16, 16), window=5, state=True, read="before", chunk_size=32, seed=25)


def test_band_wider_than_a_program():
    # W - 1 = 17 open pairs per step reach two band programs (16 steps each) ahead; head dims
    # off the blocks (K = 20, V = 24)
    _check((1, 20, 2, 20, 24), window=18, state=True, read="before", seed=26)


@pytest.mark.parametrize("window,shift", [(1, True), (4, True), (3, False)])
def test_continuation_from_state_with_tail(window, shift):
    # K = 80 spans two key blocks; the window reaches into the previous segment's tail.
    _check((2, 19, 1, 80, 20), window=window, state=True, shift=shift, seed=30 + window)


@pytest.mark.parametrize("window", [1, 4])
def test_packed_sequences_with_states(window):
    _check((1, 46, 2, 16, 16), window=window, state=True, cu_seqlens=[0, 5, 30, 31, 46], read="before",
           seed=40 + window)


def test_packed_sequences_fresh_start():
    _check((1, 40, 1, 16, 16), window=3, cu_seqlens=[0, 2, 40], seed=50)


def test_fp16_inputs():
    _check((1, 33, 2, 32, 32), torch.float16, window=4, seed=60)


def test_poisoned_buffers_and_garbage_in_empty_tail_slots(monkeypatch):
    # every fresh buffer starts as NaN and the empty tail slot holds NaN: neither may reach
    # the outputs, the final state or any gradient (read before write: the band's last row
    # and the first step's missing open pairs are the edge cases)
    _check((1, 23, 2, 16, 16), window=4, state=True, read="before", poison=monkeypatch, empty_slot=float("nan"),
           seed=90)


@pytest.mark.parametrize("shift,read", [(True, "after"), (False, "before")])
def test_segment_shorter_than_the_window(shift, read):
    # T = 3 < W - 1: the delayed pairs, the open pairs and the next tail all reach into the old tail
    _check((2, 3, 1, 16, 16), window=6, state=True, shift=shift, read=read, seed=91)


def test_two_segments_continue_exactly():
    # a segment cut inside the windows: the tail carries the open writes across the cut
    check_segments_continue("3A", seed=70, cut=18, window=4)


def test_window_wider_than_the_kernels_raises():
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    beta, lam = torch.rand(1, 4, 1, device=DEVICE), torch.rand(1, 4, 1, device=DEVICE)
    with pytest.raises(NotImplementedError, match=f"window={MAX_WINDOW + 1}"):
        falcon_chunk_triton(q, q, q, beta, lam, rule="3A", window=MAX_WINDOW + 1)


def test_window_state_is_checked():
    q = torch.randn(1, 8, 1, 16, device=DEVICE)
    beta, lam = torch.rand(1, 8, 1, device=DEVICE), torch.rand(1, 8, 1, device=DEVICE)
    _, st = falcon_chunk_triton(q, q, q, beta, lam, rule="3A", window=3, output_final_state=True)
    assert st.window == 3 and st.tail_x.shape == (1, 1, 2, 16)
    with pytest.raises(ValueError, match="window"):
        falcon_chunk_triton(q, q, q, beta, lam, rule="3A", window=4, initial_state=st)


# ---- GPU: larger, ragged and packed shapes ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [2, 4, 8])
def test_cuda_benchmark_head_dims(window, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check((1, 2048, 2, 128, 128), dtype, window=window, chunk_size=64, state=True, device="cuda")


@needs_cuda
@pytest.mark.parametrize("K,V,read,window", [(64, 64, "after", 4), (100, 100, "before", 3), (128, 64, "before", 8),
                                             (256, 256, "after", 4)])
def test_cuda_ragged(K, V, read, window):
    _check((2, 1000, 2, K, V), torch.bfloat16, window=window, chunk_size=64, read=read, device="cuda")


@needs_cuda
def test_cuda_widest_band():
    # the open pairs of a step reach four band programs (16 steps each) ahead
    _check((1, 300, 2, 64, 64), torch.bfloat16, window=MAX_WINDOW, chunk_size=64, state=True, read="before",
           device="cuda")


@needs_cuda
def test_cuda_packed_fp16():
    _check((1, 1500, 2, 128, 128), torch.float16, window=4, chunk_size=64, state=True,
           cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")


def test_public_op_routes_3a_to_the_kernels_only_when_asked():
    check_public_op_routing("3A", seed=80, window=4)
