"""Gradients of the WY chunk op of the regression rule (``delta.delta_chunk``, whose
backward ends in ``delta_kernels.wy_bwd``) against autograd through a float64 recurrence
written straight from its definition::

    d_t = eta_t v_t - kappa_t S_prev^T x_t,   S_t = exp(log_a_t) S_{t-1} + x_t d_t^T

``S_prev`` is the state before the step of row ``t`` (``slots`` rows per step, ``log_a``
non-zero only on a step's first row; with one row per step it is ``S_{t-1}``), and
``o_t = S_t^T q_t``. Every gradient (``q``, ``x``, ``v``, ``eta``, ``kappa``, ``log_a``,
the initial state) of a fixed random projection of ``o`` and the final states is compared
in ``rel_norm``. Fresh buffers of forward and backward start as NaN, so a value a kernel
reads before anything wrote it, or a row it leaves unwritten, shows.
"""
from __future__ import annotations

from typing import Optional, Sequence

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, PoisonedEmpty, in_this_process, needs_cuda, rel_norm

from falcon_fwa.ops.triton.delta import delta_chunk

pytestmark = in_this_process

NAMES = ("q", "x", "v", "eta", "kappa", "log_a", "S0")


def delta_recurrent(q, x, v, eta, kappa, log_a, S0, *, slots: int, bounds: Sequence[int]):
    """Float64 recurrence over the rows ``bounds[n] .. bounds[n + 1]`` of every batch row
    (each its own sequence, state ``S0[n]``): outputs ``[B, T, H, V]`` and final states
    ``[N, H, K, V]``."""
    B, T, H, K = x.shape
    V = v.shape[-1]
    outputs, finals = [], []
    n = 0
    for b in range(B):
        rows = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            S = S0[n] if S0 is not None else x.new_zeros(H, K, V)
            S_prev = S
            for t in range(start, end):
                if (t - start) % slots == 0:
                    S_prev = S
                xt, qt = x[b, t], q[b, t]  # [H, K]
                d = eta[b, t, :, None] * v[b, t] - kappa[b, t, :, None] * torch.einsum("hkv,hk->hv", S_prev, xt)
                S = torch.exp(log_a[b, t])[:, None, None] * S + xt[:, :, None] * d[:, None, :]
                rows.append(torch.einsum("hkv,hk->hv", S, qt))
            finals.append(S)
            n += 1
        outputs.append(torch.stack(rows))
    return torch.stack(outputs), torch.stack(finals)


def check_gradients(monkeypatch, dims, dtype=torch.float32, *, slots: int = 1, chunk_size: int = 16,
                    cu_seqlens: Optional[Sequence[int]] = None, with_state: bool = True, device: str = DEVICE,
                    tol: float = 1e-5, seed: int = 0, kappa_is_eta: bool = False) -> None:
    B, T, H, K, V = dims
    g = torch.Generator().manual_seed(seed)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = dict(
        q=torch.randn(B, T, H, K, generator=g) / K ** 0.5,
        x=torch.randn(B, T, H, K, generator=g) / K ** 0.5,
        v=torch.randn(B, T, H, V, generator=g),
        eta=0.05 + 0.6 * torch.rand(B, T, H, generator=g),
        kappa=None,
        log_a=-0.2 * torch.rand(B, T, H, generator=g),
        S0=0.3 * torch.randn(N, H, K, V, generator=g) if with_state else None,
    )
    leaves["kappa"] = None if kappa_is_eta else leaves["eta"] * torch.exp(-0.1 * torch.rand(B, T, H, generator=g))
    for n in ("q", "x", "v"):  # the reference sees the values the kernels get
        leaves[n] = leaves[n].to(dtype).float()
    leaves["log_a"][:, torch.arange(T) % slots != 0] = 0.0
    w_o = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    w_s = torch.randn(N, H, K, V, generator=g, dtype=torch.float64)
    bounds = [0, T] if cu_seqlens is None else list(cu_seqlens)

    # the reference runs where the kernels do: on a GPU its thousand small steps take seconds, on a host
    # shared with other test workers minutes
    ref = {n: None if t is None else t.to(device, torch.float64).requires_grad_() for n, t in leaves.items()}
    o, S = delta_recurrent(*(ref["eta"] if n == "kappa" and kappa_is_eta else ref[n] for n in NAMES), slots=slots,
                           bounds=bounds)
    ((o * w_o.to(device)).sum() + (S * w_s.to(device)).sum()).backward()
    o, S = o.detach().cpu(), S.detach().cpu()

    got = {n: None if t is None else t.to(device, dtype if n in ("q", "x", "v") else torch.float32)
           .requires_grad_() for n, t in leaves.items()}
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device, dtype=torch.int32)
    with PoisonedEmpty(monkeypatch):
        o_k, S_k = delta_chunk(*(got[n] for n in NAMES), read_after=True, chunk_size=chunk_size, cu_seqlens=cu,
                               output_final_state=True, slots=slots)
        ((o_k.double() * w_o.to(device)).sum() + (S_k.double() * w_s.to(device)).sum()).backward()
    errors = {"o": rel_norm(o_k.cpu(), o), "S_T": rel_norm(S_k.cpu(), S)}
    for n in NAMES:
        if ref[n] is None:
            continue
        grad = got[n].grad.cpu()
        assert torch.isfinite(grad).all(), f"d{n} has entries no kernel wrote"
        errors["d" + n] = rel_norm(grad, ref[n].grad.cpu())
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"


# ---- interpreter on CPU (GPU when present): tiny shapes, every layout, fp32 (errors near 2e-7; a 1e-3
# error in one of the kernel's log-prefix gradients shows as 6e-5 or more in dlog_a) ----

def test_one_write_per_step_ragged(monkeypatch):
    # T = 40 at chunk 16: two full chunks and a partial one of 8 rows
    check_gradients(monkeypatch, (2, 40, 2, 16, 16))


def test_grouped_writes(monkeypatch):
    # four writes per step, each seeing the state before its step (the rule-3 layout)
    check_gradients(monkeypatch, (1, 48, 1, 16, 16), slots=4, chunk_size=32, seed=1)


def test_packed_sequences(monkeypatch):
    # varlen: lengths 5, 27, 1, 15; chunks restart at every sequence, partial chunks in the middle of the buffer
    check_gradients(monkeypatch, (1, 48, 2, 16, 16), cu_seqlens=[0, 5, 32, 33, 48], seed=2)


def test_packed_grouped_writes(monkeypatch):
    check_gradients(monkeypatch, (1, 40, 1, 16, 16), slots=4, cu_seqlens=[0, 12, 40], seed=3)


@pytest.mark.parametrize("slots", [1, 4])
def test_kappa_is_eta(monkeypatch, slots):
    # kappa=None: the kernels read eta for kappa, and eta's gradient holds both parts
    check_gradients(monkeypatch, (1, 40, 2, 16, 16), slots=slots, chunk_size=16, seed=11 + slots, kappa_is_eta=True)


def test_head_dims_spanning_value_blocks(monkeypatch):
    # K = V = 100: the key dimension masked inside one block, several value blocks, the last one masked
    check_gradients(monkeypatch, (1, 20, 1, 100, 100), with_state=False, seed=4)


@pytest.mark.parametrize("slots", [1, 4])
def test_half_precision_buffers(monkeypatch, slots):
    # fp16 inputs: the inverse A and the write values' gradient dD are kept in fp16 (the dtype their
    # products take), which the interpreter runs as well (bf16 it does not); fp16 rounding sets the bound
    check_gradients(monkeypatch, (1, 40, 2, 16, 16), torch.float16, slots=slots, chunk_size=16, seed=7 + slots,
                    tol=5e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_second_backward_sees_the_same_graph(monkeypatch, dtype):
    # the backward writes over the saved A, W and D (the Gram's gradient, dx and dv); a second backward
    # through the same graph (retain_graph=True) recomputes them and gives the first one's gradients exactly
    g = torch.Generator().manual_seed(11)
    B, T, H, K, V = 1, 40, 2, 16, 16
    q, x = ((torch.randn(B, T, H, K, generator=g) / 4).to(DEVICE, dtype).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g).to(DEVICE, dtype).requires_grad_()
    eta = (0.05 + 0.6 * torch.rand(B, T, H, generator=g)).to(DEVICE).requires_grad_()
    log_a = (-0.2 * torch.rand(B, T, H, generator=g)).to(DEVICE).requires_grad_()
    leaves = (q, x, v, eta, log_a)
    with PoisonedEmpty(monkeypatch):
        o, _ = delta_chunk(q, x, v, eta, eta * 0.9, log_a, None, read_after=True, chunk_size=16)
        probe = torch.randn(o.shape, generator=g).to(DEVICE, dtype)
        first = torch.autograd.grad((o * probe).float().sum(), leaves, retain_graph=True)
        second = torch.autograd.grad((o * probe).float().sum(), leaves)
    for name, a, b in zip(("q", "x", "v", "eta", "log_a"), first, second):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), f"d{name} differs in the second backward"


# ---- GPU: benchmark head dims ----

@needs_cuda
@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_head_dims_128(monkeypatch, dtype, slots):
    # fp32 under the default matmul precision: exact fp32 products ("ieee"); chunk 64, wy_bwd at 8 warps in fp32
    # and 4 in bf16 (the pattern of the Hopper miscompile of fla issue #984, checked here against float64)
    torch.backends.cuda.matmul.allow_tf32 = False
    check_gradients(monkeypatch, (2, 512, 4, 128, 128), dtype, slots=slots, chunk_size=64, device="cuda", seed=5,
                    tol=1e-4 if dtype == torch.float32 else 1e-2)


@needs_cuda
def test_cuda_ragged_packed_bf16(monkeypatch):
    check_gradients(monkeypatch, (1, 1000, 2, 100, 64), torch.bfloat16, chunk_size=64, device="cuda",
                    cu_seqlens=[0, 1, 300, 301, 999, 1000], seed=6, tol=1e-2)
