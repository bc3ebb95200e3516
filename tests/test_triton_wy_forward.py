"""The WY forward kernel of the regression rules (``delta_kernels.wy_fwd``, launched by
``delta.wy_forward``) against float64 PyTorch built straight from its definition.

Per chunk of ``BT`` rows of one sequence and head, with ``u`` the inclusive prefix of
``log_a`` in the chunk and ``w_p`` its prefix before the step of write ``p`` (``slots``
writes per step)::

    N[p, r] = kappa_p exp(w_p - u_r) (x_p . x_r)   for r of an earlier step than p, else 0
    A = (I + N)^{-1},   U = A (eta Y),   W = A (kappa exp(w) X)

``A`` comes from ``torch.linalg.inv`` in float64. Every output buffer starts as NaN, so a
value the kernel reads before writing it, or a row it leaves unwritten, shows. Every test runs
both forms of the forward: one launch (``wy_fwd``) and two (``wy_inverse``, then ``wy_apply``).
"""
from __future__ import annotations

from typing import Optional, Sequence

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, PoisonedEmpty, in_this_process, needs_cuda, rel_norm

from falcon_fwa.ops.triton import delta
from falcon_fwa.ops.triton.chunk_index import chunk_layout
from falcon_fwa.ops.triton.delta import wy_forward

pytestmark = in_this_process


@pytest.fixture(autouse=True, params=["one launch", "two launches"])
def wy_launches(request, monkeypatch):
    """Every entry of ``delta.WY_FWD_LAUNCH`` in the form of ``request.param``, at its own block
    sizes, warps and stages."""
    for key, entry in delta.WY_FWD_LAUNCH.items():
        c = dict(entry["wy_fwd"]) if "wy_fwd" in entry else {**entry["wy_inverse"], **entry["wy_apply"]}
        if request.param == "one launch":
            form = {"wy_fwd": c}
        else:
            form = {"wy_inverse": {n: c[n] for n in ("BK", "num_warps", "num_stages")}, "wy_apply": c}
        monkeypatch.setitem(delta.WY_FWD_LAUNCH, key, form)


def wy_inputs(B: int, T: int, H: int, K: int, V: int, *, slots: int = 1, seed: int = 0, eta_scale: float = 0.6,
              coupled: bool = False):
    """Float32 ``x`` ``[B, T, H, K]`` (unit rows around one shared direction with ``coupled``),
    ``v`` ``[B, T, H, V]``, ``eta`` and ``kappa`` ``[B, T, H]``, ``log_a`` ``[B, T, H]``
    (non-zero only on the first row of each step, as the rule-3 layout has it)."""
    g = torch.Generator().manual_seed(seed)
    if coupled:
        x = torch.randn(1, 1, H, K, generator=g) + 0.3 * torch.randn(B, T, H, K, generator=g)
        x = x / x.norm(dim=-1, keepdim=True)
    else:
        x = torch.randn(B, T, H, K, generator=g) / K ** 0.5
    v = torch.randn(B, T, H, V, generator=g)
    eta = eta_scale * torch.rand(B, T, H, generator=g) + (1.8 if coupled else 0.05)
    kappa = eta * (1.0 if coupled else torch.exp(-0.1 * torch.rand(B, T, H, generator=g)))
    log_a = -0.2 * torch.rand(B, T, H, generator=g)
    log_a[:, torch.arange(T) % slots != 0] = 0.0
    return x, v, eta, kappa, log_a


def wy_reference(x, v, eta, kappa, log_a, *, BT: int, slots: int, bounds: Optional[Sequence[int]] = None):
    """``A`` ``[B, T, H, BT]``, ``U``, ``W`` in float64, chunk by chunk of every sequence (the rows
    ``bounds[n] .. bounds[n + 1]`` of batch row 0, or each batch row whole)."""
    B, T, H, K = x.shape
    x, v, eta, kappa, log_a = (t.double().cpu() for t in (x, v, eta, kappa, log_a))
    A = torch.zeros(B, T, H, BT, dtype=torch.float64)
    U, W = torch.zeros_like(v), torch.zeros_like(x)
    segments = [(b, 0, T) for b in range(B)] if bounds is None else \
        [(0, s, e) for s, e in zip(bounds[:-1], bounds[1:])]
    for b, start, end in segments:
        for c0 in range(start, end, BT):
            rows = torch.arange(c0, min(c0 + BT, end))
            n = len(rows)
            step = torch.arange(n) // slots
            earlier = step[None, :] < step[:, None]  # [p, r]: r of an earlier step than p
            for h in range(H):
                la = log_a[b, rows, h]
                u = torch.cumsum(la, 0)
                before = torch.cat([la.new_zeros(1), u])  # before[i] = sum_{r < i} la_r
                w = before[step * slots]
                X, Y = x[b, rows, h], v[b, rows, h]
                ka = kappa[b, rows, h]
                N = torch.where(earlier, ka[:, None] * torch.exp(w[:, None] - u[None, :]) * (X @ X.T), 0.0)
                inv = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + N)
                A[b, rows, h, :n] = inv
                U[b, rows, h] = inv @ (eta[b, rows, h, None] * Y)
                W[b, rows, h] = inv @ ((ka * torch.exp(w))[:, None] * X)
    return A, U, W


def check_wy(monkeypatch, dims, dtype=torch.float32, *, BT: int = 64, slots: int = 1, cu_seqlens=None,
             device: str = DEVICE, tol_a: float = 2e-6, tol_uw: float = 2e-6, seed: int = 0,
             coupled: bool = False) -> None:
    """``wy_forward`` on NaN-filled buffers against ``wy_reference``: every entry finite, ``A``,
    ``U``, ``W`` within ``tol_a`` / ``tol_uw`` in ``rel_norm``, ``A`` exactly zero above its
    diagonal and exactly one on it."""
    B, T, H, K, V = dims
    inputs = wy_inputs(B, T, H, K, V, slots=slots, seed=seed, coupled=coupled)
    x, v = (t.to(device, dtype) for t in inputs[:2])
    eta, kappa, log_a = (t.to(device) for t in inputs[2:])
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device, dtype=torch.int32)
    layout = chunk_layout(B, T, BT, cu)
    with PoisonedEmpty(monkeypatch):
        A, U, W = wy_forward(x, v, eta, kappa, log_a, layout, slots)
    # the inverse is formed in fp32 and returned in the inputs' dtype, in which every product takes it
    assert A.dtype == dtype and A.shape == (B, T, H, BT)
    assert U.dtype == dtype and W.dtype == dtype
    for name, t in (("A", A), ("U", U), ("W", W)):
        assert torch.isfinite(t).all(), f"{name} has entries the kernel never wrote"
    ref = wy_reference(x, v, eta, kappa, log_a, BT=BT, slots=slots, bounds=cu_seqlens)
    A, U, W = A.cpu(), U.cpu(), W.cpu()
    # the unit diagonal and the zeros above it are exact (chunk-local column = row mod BT within the chunk)
    starts = [0] if cu_seqlens is None else cu_seqlens[:-1]
    local = torch.zeros(T, dtype=torch.long)
    for s, e in zip(starts, list(starts[1:]) + [T]):
        local[s:e] = torch.arange(e - s) % BT
    col = torch.arange(BT)
    diag = A.gather(-1, local[None, :, None, None].expand(B, T, H, 1)).squeeze(-1)
    assert torch.equal(diag, torch.ones_like(diag))
    upper = (col[None, :] > local[:, None])[None, :, None, :].expand_as(A)
    assert torch.equal(A[upper], torch.zeros_like(A[upper]))
    errors = {n: rel_norm(got, want) for n, got, want in (("A", A, ref[0]), ("U", U, ref[1]), ("W", W, ref[2]))}
    tols = {"A": tol_a, "U": tol_uw, "W": tol_uw}
    bad = {n: e for n, e in errors.items() if not e <= tols[n]}
    assert not bad, f"relative errors above tolerance: {bad} (all: {errors})"


# ---- interpreter on CPU (GPU when present): tiny shapes, every layout ----

def test_one_write_per_step_ragged(monkeypatch):
    # T = 75: a full chunk of 64, then 11 rows (a partial 16-row block)
    check_wy(monkeypatch, (2, 75, 2, 16, 16))


@pytest.mark.parametrize("slots", [2, 4])
def test_grouped_writes(monkeypatch, slots):
    # the rule-3 layout: a step's writes do not see one another (N is block-strictly lower)
    check_wy(monkeypatch, (1, 72, 1, 16, 16), slots=slots, seed=slots)


def test_packed_sequences_chunk_32(monkeypatch):
    # chunks restart at every sequence; lengths 5, 65, 1, 29 (two 16-row blocks per chunk)
    check_wy(monkeypatch, (1, 100, 1, 16, 16), BT=32, cu_seqlens=[0, 5, 70, 71, 100], seed=3)


def test_chunk_16(monkeypatch):
    # one 16-row block per chunk: its inverse is the diagonal block's alone
    check_wy(monkeypatch, (1, 40, 2, 16, 16), BT=16, slots=2, cu_seqlens=[0, 18, 40], seed=5)


def test_packed_grouped_writes(monkeypatch):
    check_wy(monkeypatch, (1, 88, 1, 16, 16), slots=4, cu_seqlens=[0, 20, 88], seed=4)


def test_head_dims_spanning_key_blocks(monkeypatch):
    # K = V = 100: several key / value blocks, the last one masked
    check_wy(monkeypatch, (1, 40, 1, 100, 100), seed=5)


def test_strongly_coupled_writes(monkeypatch):
    # unit keys around one direction, eta near 2: blocks of I + N far from the identity (entries
    # near 1.8, entries of A up to ~10): block forward substitution keeps the inverse within the
    # conditioning of fp32 inputs (a product of powers of N would lose digits here)
    check_wy(monkeypatch, (1, 64, 1, 32, 16), coupled=True, seed=6, tol_a=5e-5, tol_uw=5e-5)


@pytest.mark.parametrize("slots", [1, 4])
def test_half_precision_inverse(monkeypatch, slots):
    # fp16 inputs: A is formed in fp32 and returned in fp16 (at most 2^-11 relative per entry), the
    # dtype every product takes it in; the interpreter runs fp16 (not bf16)
    check_wy(monkeypatch, (1, 72, 2, 16, 16), torch.float16, slots=slots, seed=9 + slots, tol_a=1e-3, tol_uw=3e-3)


def test_windowed_pairs_read_in_place(monkeypatch):
    # rule 3's layout read in place: write j*slots + i takes its pair from row j + i of the extended axis
    # [B, T // slots + slots - 1, H, D]; the result is that of the expanded write rows
    B, steps, slots, H, K, V = 2, 19, 4, 1, 16, 16
    T = steps * slots
    g = torch.Generator().manual_seed(11)
    x_axis = torch.randn(B, steps + slots - 1, H, K, generator=g) / K ** 0.5
    v_axis = torch.randn(B, steps + slots - 1, H, V, generator=g)
    _x, _v, eta, kappa, log_a = wy_inputs(B, T, H, K, V, slots=slots, seed=12)
    pos = (torch.arange(T) // slots + torch.arange(T) % slots)  # write -> row of the axis
    layout = chunk_layout(B, T, 64, None)
    with PoisonedEmpty(monkeypatch):
        A, U, W = wy_forward(*(t.to(DEVICE) for t in (x_axis, v_axis, eta, kappa, log_a)), layout, slots,
                             windowed=True)
    ref = wy_reference(x_axis[:, pos], v_axis[:, pos], eta, kappa, log_a, BT=64, slots=slots)
    for name, got, want in (("A", A, ref[0]), ("U", U, ref[1]), ("W", W, ref[2])):
        assert rel_norm(got.cpu(), want) <= 2e-6, name


# ---- GPU: benchmark head dims ----

@needs_cuda
@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_head_dims_128(monkeypatch, dtype, slots):
    # fp32 under the default matmul precision: exact fp32 products ("ieee"). bf16: the Gram in bf16
    # (exact products, fp32 sums), the inverse's off-diagonal blocks in tf32 (an emulation in PyTorch
    # gives 1e-5 to 3e-5 on A here), A returned rounded to bf16 (at most 2^-9 relative per entry),
    # U and W from that A, stored in bf16 (2.3e-3).
    torch.backends.cuda.matmul.allow_tf32 = False
    exact = dtype == torch.float32
    check_wy(monkeypatch, (2, 512, 4, 128, 128), dtype, slots=slots, device="cuda", seed=7,
             tol_a=1e-5 if exact else 3e-3, tol_uw=1e-5 if exact else 1e-2)


@needs_cuda
def test_cuda_ragged_packed_bf16(monkeypatch):
    check_wy(monkeypatch, (1, 1000, 2, 100, 64), torch.bfloat16, device="cuda", cu_seqlens=[0, 1, 300, 301, 999, 1000],
             seed=8, tol_a=3e-3, tol_uw=1e-2)
