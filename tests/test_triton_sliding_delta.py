"""Falcon-3 (sliding-window regression rule) on the Triton chunk kernels against the
float64 recurrent form (the definition).

Outputs, final states (``S``, the last key and the window tail) and the gradients of
``q, k, v, beta, lam, log_gate`` and of every initial-state tensor are compared with
``falcon_attention(rule="3", form="recurrent")`` in float64 on the same inputs. On a
machine without CUDA the kernels run through Triton's interpreter on tiny shapes;
with CUDA the same checks run at larger and ragged shapes.
"""
from __future__ import annotations

import functools

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import (DEVICE, check_kernel, check_public_op_routing, check_segments_continue, in_this_process,
                           needs_cuda)

from falcon_fwa.ops.triton import falcon_chunk_triton
from falcon_fwa.ops.triton import delta
from falcon_fwa.ops.triton.delta import delta_chunk

pytestmark = in_this_process
_check = functools.partial(check_kernel, "3", output_final_state=True)


# ---- the window Grams' top eigenvalue (the step-size statistic) ----

def _window_steps(gram, valid_ext, **kw):
    """``window_steps_forward`` on Grams ``[B, T, H, W, W]`` with unit ``beta`` and zero ``lam``."""
    from falcon_fwa.ops.triton.step_sizes import window_steps_forward

    B, T, H = gram.shape[:3]
    ones = torch.ones(B, T, H, device=gram.device)
    steps = dict(eps=1e-6, decay_floor=1e-3, normalize=True, scale_ridge=False)
    return window_steps_forward(gram, valid_ext, ones, torch.zeros_like(ones), None, **{**steps, **kw})


@pytest.mark.parametrize("W", [1, 2, 4, 8, 16])
def test_top_eigenpair_kernel_against_eigvalsh(W):
    """The step kernel's top eigenvalue of PSD Grams against float64 ``eigvalsh`` (within float32
    rounding and the squaring bound), including rank-deficient and zero matrices, and its
    eigenvector through the gradient ``v v^T`` of the eigenvalue, against that of ``eigvalsh``."""
    g = torch.Generator().manual_seed(W)
    x = torch.randn(5, 41, W, 3, generator=g, dtype=torch.float64)  # rank <= 3: ties at 0 for W > 3
    x[0, :4] = 0.0  # zero windows (the start of a fresh sequence)
    gram = (x @ x.transpose(-1, -2)).float()[:, :, None].to(DEVICE)  # [5, 41, 1, W, W]
    valid_ext = torch.ones(5, 41 + W - 1, dtype=torch.bool, device=DEVICE)
    exact = torch.linalg.eigvalsh(gram.double().cpu())[..., -1]
    *_, top, vec = _window_steps(gram, valid_ext)
    got = top.double().cpu()
    assert torch.equal(got[0, :4], torch.zeros(4, 1, dtype=torch.float64))
    assert torch.allclose(got, exact, rtol=2e-6, atol=1e-6)
    ref = gram.double().cpu()[1:].requires_grad_()
    torch.linalg.eigvalsh(ref)[..., -1].sum().backward()
    v = vec.double().cpu()[1:]
    assert torch.allclose(v[..., :, None] * v[..., None, :], ref.grad, rtol=1e-4, atol=1e-4)
    # a Gram whose trace overflows float32 while no entry does
    big = (torch.eye(W, device=DEVICE) * 1e38).expand(1, 1, 1, W, W).contiguous()
    *_, top, _ = _window_steps(big, valid_ext[:1, :W])
    assert torch.allclose(top.double().cpu(), torch.tensor([1e38], dtype=torch.float64), rtol=1e-6)


@pytest.mark.parametrize("n_pre,cut,gated,scale_ridge,normalize", [
    (0, 0, False, False, True), (3, 0, True, True, True), (4, 1, True, False, False)])
def test_window_writes_against_float64(n_pre, cut, gated, scale_ridge, normalize):
    """``_WindowWrites``: the extended axis ``[prefix | body]`` (the body's last ``cut`` rows left off,
    as with the shift) and the step sizes per write, ``eta``, ``kappa`` and the carry, against
    float64 ones from the materialized windows (``eigvalsh`` of their Grams, invalid pairs as zero,
    then ``ops.step_sizes.gains_from_statistic``); and the gradients of the prefix, the body
    (rows left off: zero), ``beta``, ``lam`` and ``log_gate`` from those of all four outputs.
    K = 80 spans two key blocks."""
    from falcon_fwa.ops.rules import get_rule
    from falcon_fwa.ops.step_sizes import gains_from_statistic
    from falcon_fwa.ops.triton.sliding_delta import _WindowWrites

    g = torch.Generator().manual_seed(5 + n_pre)
    steps = dict(eps=1e-6, decay_floor=0.05, normalize=normalize, scale_ridge=scale_ridge)
    for W in (1, 2, 4, 16):
        B, T, H, K = 2, 7, 2, 80
        L = T + W - 1
        if n_pre > L:
            continue
        prefix = torch.randn(B, n_pre, H, K, generator=g) / 4
        body = torch.randn(B, L - n_pre + cut, H, K, generator=g) / 4
        valid = torch.rand(B, L, generator=g) > 0.3
        beta = torch.rand(B, T, H, generator=g)
        lam = torch.rand(B, T, H, generator=g) * (4.0 if scale_ridge else 20.0)  # some steps reach the clamp
        gate = -torch.rand(B, T, H, generator=g) if gated else None
        prefix[~valid[:, :n_pre]] = 1e4  # an invalid pair is zero in the Grams, whatever it holds
        body[:, :L - n_pre][~valid[:, n_pre:]] = 1e4
        x = torch.cat([prefix, body[:, :L - n_pre]], 1)
        cot = [torch.randn(B, L, H, K, generator=g, dtype=torch.float64)] + [
            torch.randn(B, T * W, H, generator=g, dtype=torch.float64) for _ in range(3)]
        inputs = [prefix, body, beta, lam] + ([gate] if gated else [])
        leaves = [t.clone().to(DEVICE).requires_grad_() for t in inputs]
        got = _WindowWrites.apply(leaves[0], leaves[1], valid.to(DEVICE), leaves[2], leaves[3],
                                  leaves[4] if gated else None, L, W, steps)
        assert torch.equal(got[0].cpu(), x)
        if not gated:
            assert got[2] is None  # kappa is eta
        sum(((o.double() * c.to(DEVICE)).sum() for o, c in zip(got, cot) if o is not None)).backward()
        # the float64 reference
        ref = [t.double().requires_grad_() for t in (x, beta, lam) + ((gate,) if gated else ())]
        xz = torch.where(valid[..., None, None], ref[0], 0.0)
        win = xz.unfold(1, W, 1).permute(0, 2, 1, 4, 3)  # [B, H, T, W, K]
        top = torch.linalg.eigvalsh(win @ win.transpose(-1, -2))[..., -1]  # [B, H, T]
        slot_valid = valid.unfold(1, W, 1)
        stat = top / slot_valid.sum(-1).clamp(min=1)[:, None, :]
        eta_s, log_gamma = gains_from_statistic(get_rule("3"), stat, slot_valid, ref[1].transpose(1, 2),
                                                ref[2].transpose(1, 2), **steps)
        eta = eta_s[..., 0].permute(0, 2, 3, 1).reshape(B, T * W, H)
        log_a = log_gamma[..., 0].transpose(1, 2)
        kappa = eta
        if gated:
            log_a = log_a + ref[3]
            kappa = (eta.view(B, T, W, H) * torch.exp(ref[3])[:, :, None]).reshape(B, T * W, H)
        carry = torch.zeros(B, T, W, H, dtype=torch.float64)
        carry = carry + torch.nn.functional.one_hot(torch.zeros((), dtype=torch.long), W).double()[None, None, :, None] \
            * log_a[:, :, None, :]
        carry = carry.reshape(B, T * W, H)
        want = [ref[0], eta, kappa if gated else None, carry]
        for o, w in zip(got[1:], want[1:]):
            if w is not None:
                assert torch.allclose(o.double().cpu(), w.detach(), rtol=1e-4, atol=1e-6), W
        sum(((w * c).sum() for w, c in zip(want, cot) if w is not None)).backward()
        d_axis = ref[0].grad
        assert torch.allclose(leaves[0].grad.double().cpu(), d_axis[:, :n_pre], rtol=1e-4, atol=1e-4), W
        got_body = leaves[1].grad.double().cpu()
        assert torch.allclose(got_body[:, :L - n_pre], d_axis[:, n_pre:], rtol=1e-4, atol=1e-4), W
        assert torch.equal(got_body[:, L - n_pre:], torch.zeros_like(got_body[:, L - n_pre:])), W
        for name, leaf, r in zip(("beta", "lam", "log_gate"), leaves[2:], ref[1:]):
            assert r.grad is not None and leaf.grad is not None, (W, name)
            assert torch.allclose(leaf.grad.double().cpu(), r.grad, rtol=1e-4, atol=1e-5), (W, name)


# ---- the grouped WY solve itself, against a literal loop ----

def test_grouped_writes_see_the_state_before_their_step():
    """``delta_chunk(slots=2)`` against the recurrence written out by hand in float64: the two
    writes of a step both read ``S_{t-1}``, the carry applies once per step, and the last row
    of a step reads the state after it."""
    g = torch.Generator().manual_seed(3)
    T, S, K, V = 12, 2, 16, 16  # 6 steps of 2 writes
    x = torch.randn(1, T, 1, K, generator=g) / 4
    v = torch.randn(1, T, 1, V, generator=g)
    q = torch.randn(1, T, 1, K, generator=g) / 4
    eta = torch.rand(1, T, 1, generator=g) * 0.5
    kappa = eta * 0.9
    carry = -torch.rand(1, T // S, 1, generator=g) * 0.2
    log_a = torch.zeros(1, T, 1)
    log_a[:, ::S] = carry
    o, S_T = delta_chunk(q.to(DEVICE), x.to(DEVICE), v.to(DEVICE), eta.to(DEVICE), kappa.to(DEVICE),
                         log_a.to(DEVICE), None, read_after=True, chunk_size=16, output_final_state=True, slots=S)
    st = torch.zeros(K, V, dtype=torch.float64)
    want = torch.zeros(T, V, dtype=torch.float64)
    xd, vd, qd = x[0, :, 0].double(), v[0, :, 0].double(), q[0, :, 0].double()
    for t in range(T // S):
        rows = range(t * S, t * S + S)
        prev = st
        st = torch.exp(carry[0, t, 0].double()) * prev
        for r in rows:
            st = st + torch.outer(xd[r], eta[0, r, 0].double() * vd[r] - kappa[0, r, 0].double() * (prev.T @ xd[r]))
        want[t * S + S - 1] = st.T @ qd[t * S + S - 1]  # a step's last row reads the state after the step
    last = torch.arange(S - 1, T, S)
    assert torch.allclose(o[0, last, 0].double().cpu(), want[last], atol=1e-5, rtol=1e-4)
    assert torch.allclose(S_T[0, 0].double().cpu(), st, atol=1e-5, rtol=1e-4)


# ---- every switch, tiny shapes (interpreter on CPU, GPU when present) ----

@pytest.mark.parametrize("window", [1, 2, 4, 8, 16])
def test_windows_read_after(window):
    _check((2, 21, 2, 16, 16), window=window, seed=window)


@pytest.mark.parametrize("window,read,shift", [(2, "before", True), (4, "before", False), (4, "after", False)])
def test_read_and_shift(window, read, shift):
    _check((1, 37, 2, 16, 24), window=window, read=read, shift=shift, seed=10 + window)


def test_unnormalized_scale_ridge_no_gate_chunk_32():
    _check((1, 45, 1, 16, 16), window=2, normalize=False, scale_ridge=True, gate=False, chunk_size=32, seed=21)


def test_clamped_decay():
    _check((1, 30, 2, 16, 16), window=4, normalize=False, lam_scale=3.0, decay_floor=0.05, seed=22)


@pytest.mark.parametrize("window,shift", [(1, True), (4, True), (2, False)])
def test_continuation_from_state_with_tail(window, shift):
    # K = 80 spans two key blocks; the window reaches into the previous segment's tail.
    _check((2, 19, 1, 80, 20), window=window, state=True, shift=shift, seed=30 + window)


def test_packed_sequences_with_states():
    _check((1, 46, 2, 16, 16), window=4, state=True, cu_seqlens=[0, 5, 30, 31, 46], read="before", seed=44)


def test_key_dim_above_128():
    # K = 136 takes the 256-row key tile of the WY kernels that hold the whole key dimension, mostly masked
    _check((1, 12, 1, 136, 24), window=2, chunk_size=16, state=True, seed=61)


@pytest.mark.parametrize("small_grid", [delta.SMALL_GRID, 0])
def test_fp16_inputs(small_grid, monkeypatch):
    # one sequence x two heads takes state_fwd's small-grid setting (32 value columns), SMALL_GRID 0 the wide one
    monkeypatch.setattr(delta, "SMALL_GRID", small_grid)
    _check((1, 33, 2, 32, 48), torch.float16, window=4, seed=60)


def test_garbage_in_empty_tail_slots_and_short_segment():
    # T = 3 < W - 1 and the empty tail slot holds NaN: it must act as zero
    _check((2, 3, 1, 16, 16), window=8, state=True, read="before", empty_slot=float("nan"), seed=91)


def test_two_segments_continue_exactly():
    check_segments_continue("3", seed=70, cut=18, window=4)


@pytest.mark.parametrize("S", [2, 4])
def test_pairs_read_in_place_from_the_window_axis(S):
    """``delta_chunk(..., windowed=True)`` reading ``x`` ``[B, T // S + S - 1, H, K]`` and ``v``
    ``[B, T // S + S - 1, H, V]`` in place (write ``j*S + i`` takes row ``j + i`` of both) gives
    exactly the outputs, final state and gradients (summed onto that axis) of the same scan on
    the materialized overlapping windows."""
    g = torch.Generator().manual_seed(S)
    n_steps, B, H, K, V = 20 // S, 2, 1, 16, 24  # 20 rows: two chunks of 16
    T, L = n_steps * S, n_steps + S - 1
    q = (torch.randn(B, T, H, K, generator=g) / 4).to(DEVICE)
    x_axis = (torch.randn(B, L, H, K, generator=g) / 4).to(DEVICE)
    y = torch.randn(B, L, H, V, generator=g).to(DEVICE)
    eta = (torch.rand(B, T, H, generator=g) * 0.5).to(DEVICE)
    log_a = torch.zeros(B, T, H)
    log_a[:, ::S] = -torch.rand(B, n_steps, H, generator=g) * 0.2
    log_a = log_a.to(DEVICE)
    probe = torch.randn(B, T, H, V, generator=g).to(DEVICE)
    S0 = torch.randn(B, H, K, V, generator=g).to(DEVICE) * 0.1

    def windows(t):  # [B, L, H, D] -> the write rows [B, T, H, D]
        return t.unfold(1, S, 1).permute(0, 1, 4, 2, 3).reshape(B, T, H, t.shape[-1])

    results = []
    for windowed in (False, True):
        xl, yl = x_axis.clone().requires_grad_(), y.clone().requires_grad_()
        x, v = (xl, yl) if windowed else (windows(xl), windows(yl))
        o, S_T = delta_chunk(q, x, v, eta, eta * 0.9, log_a, S0, read_after=False, chunk_size=16,
                             output_final_state=True, slots=S, windowed=windowed)
        ((o * probe).sum() + S_T.sum()).backward()
        results.append((o, S_T, xl.grad, yl.grad))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    # the value axis built inside from a prefix and a body one row longer than the axis needs (cut):
    # the same outputs, and the axis' gradient split back onto the two (the extra row's: zero)
    y_pre = y[:, :S - 1].clone().requires_grad_()
    y_body = torch.cat([y[:, S - 1:], torch.randn(B, 1, H, V, generator=g).to(DEVICE)], 1).requires_grad_()
    xl = x_axis.clone().requires_grad_()
    o, S_T = delta_chunk(q, xl, y_body, eta, eta * 0.9, log_a, S0, read_after=False, chunk_size=16,
                         output_final_state=True, slots=S, windowed=True, value_prefix=y_pre)
    ((o * probe).sum() + S_T.sum()).backward()
    want = results[1]
    for a, b in ((o, want[0]), (S_T, want[1]), (xl.grad, want[2]), (y_pre.grad, want[3][:, :S - 1]),
                 (y_body.grad[:, :L - S + 1], want[3][:, S - 1:])):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(y_body.grad[:, -1], torch.zeros_like(y_body.grad[:, -1]))
    with pytest.raises(ValueError, match="value_prefix needs windowed"):
        delta_chunk(q, windows(x_axis), windows(y), eta, eta, log_a, None, read_after=True, slots=S,
                    value_prefix=y_pre.detach())
    with pytest.raises(ValueError, match="cu_seqlens=None"):
        delta_chunk(q[:1], x_axis[:1], y[:1], eta[:1], eta[:1], log_a[:1], None, read_after=True, slots=S,
                    windowed=True, cu_seqlens=torch.tensor([0, T], device=DEVICE))
    with pytest.raises(ValueError, match="v must have"):
        delta_chunk(q, x_axis, y[:, 1:], eta, eta, log_a, None, read_after=True, slots=S, windowed=True)
    with pytest.raises(ValueError, match="x must have"):
        delta_chunk(q, x_axis[:, 1:], y, eta, eta, log_a, None, read_after=True, slots=S, windowed=True)
    with pytest.raises(ValueError, match="x must have T = "):
        delta_chunk(q, x_axis, y, eta, eta, log_a, None, read_after=True, slots=S)


def test_grouped_rows_must_be_whole_steps():
    x = torch.randn(1, 6, 1, 16, device=DEVICE)
    eta = torch.rand(1, 6, 1, device=DEVICE)
    with pytest.raises(ValueError, match="T=6 must be a multiple"):
        delta_chunk(x, x, x, eta, eta, -eta, None, read_after=True, chunk_size=16, slots=4)
    with pytest.raises(ValueError, match="cu_seqlens boundary"):
        delta_chunk(x, x, x, eta, eta, -eta, None, read_after=True, chunk_size=16, slots=2,
                    cu_seqlens=torch.tensor([0, 3, 6], device=DEVICE))


def test_unsupported_window_names_itself():
    q = torch.randn(1, 6, 1, 16, device=DEVICE)
    beta, lam = torch.rand(1, 6, 1, device=DEVICE), torch.rand(1, 6, 1, device=DEVICE)
    with pytest.raises(NotImplementedError, match="window=3"):
        falcon_chunk_triton(q, q, q, beta, lam, rule="3", window=3)


def test_public_op_routes_3_to_the_kernels_only_when_asked():
    check_public_op_routing("3", seed=80, window=4)


# ---- GPU: larger, ragged and packed shapes ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_benchmark_head_dims(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check((1, 2048, 2, 128, 128), dtype, window=4, chunk_size=64, state=True, device="cuda")


@needs_cuda
def test_cuda_bf16_state_kernels_at_wide_grid_settings(monkeypatch):
    monkeypatch.setattr(delta, "SMALL_GRID", 0)  # the settings of B x H at or above SMALL_GRID, here on 1 x 2
    _check((1, 2048, 2, 128, 128), torch.bfloat16, window=4, chunk_size=64, state=True, device="cuda")


@needs_cuda
@pytest.mark.parametrize("K,V,read,window", [(64, 64, "after", 4), (100, 100, "before", 2), (128, 64, "before", 8),
                                              (256, 256, "after", 4), (200, 96, "before", 2)])
def test_cuda_ragged(K, V, read, window):
    _check((2, 1000, 2, K, V), torch.bfloat16, window=window, chunk_size=64, read=read, device="cuda")


@needs_cuda
def test_cuda_key_dim_256_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    _check((1, 300, 2, 256, 256), torch.float32, window=4, chunk_size=64, state=True, device="cuda")


@needs_cuda
def test_cuda_packed_fp16():
    _check((1, 1500, 2, 128, 128), torch.float16, window=4, chunk_size=64, state=True,
           cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")
