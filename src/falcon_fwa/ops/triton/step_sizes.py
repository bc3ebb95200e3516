"""Autograd functions over the fused step-size kernels: the non-sliding rules' step sizes
(scalar for rules 1 and 1A, per value column for rules 2 and 2A), and the top eigenvalue
of rule 3's window Grams."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import step_size_kernels as kern
from .launch import cdiv, next_power_of_2

__all__ = ["feature_step_sizes", "shifted_step_sizes", "top_eigenvalue_triton"]

# The scalar rules' kernels (``step_fwd``, ``step_bwd``): rows per program, the key block (capped by the
# head dim; a block that covers the head reads each feature tile once) and warps. On an H200 inside
# falcon-1 (B=8, T=2048, H=16, K=128, bf16; benchmarks/results/h200_step_launch_sweep.txt): 32 rows and one
# 128-wide block, 0.039 ms forward and 0.067 backward, against 0.045 and 0.074 at 64 rows and two 64-wide
# blocks (the features read twice) and 0.048 and 0.161 at 64 rows and one block (182 registers, 2 blocks per SM).
LAUNCH = {"step_fwd": dict(BR=32, BK=128, num_warps=4), "step_bwd": dict(BR=32, BK=128, num_warps=4)}
# The per-column rules' kernels: rows per program, key and value blocks, warps (grid: row blocks
# times value blocks forward, row blocks backward).
COLUMN_LAUNCH = dict(BR=32, BK=64, BV=32, num_warps=4)


def _launch(name, x, K):
    c = dict(LAUNCH[name])
    c["BK"] = min(c["BK"], max(16, next_power_of_2(K)))
    return dict(H=x.shape[2], K=K, **c)


def _column_launch(x, K, V):
    c = dict(COLUMN_LAUNCH)
    c["BK"] = min(c["BK"], max(16, next_power_of_2(K)))
    c["BV"] = min(c["BV"], max(16, next_power_of_2(V)))
    return dict(H=x.shape[2], K=K, V=V, **c)


class _StepSizes(torch.autograd.Function):
    """``(x, eta, log_a)`` from the write features or, with ``shift``, from the keys
    (``step_size_kernels``); the backward takes the gradient ``x`` received downstream.
    ``beta`` ``[B, T, H]`` (the scalar rules) or ``[B, T, H, V]`` (the per-column rules:
    ``eta``, ``log_a`` per value column)."""

    @staticmethod
    def forward(ctx, src, first, valid, beta, lam, log_gate, eps, decay_floor, normalize, scale_ridge, shift):
        B, T, H, K = src.shape
        n = lam.numel()
        per_column = beta.dim() == 4
        eta = torch.empty(beta.shape, dtype=torch.float32, device=src.device)
        log_a = torch.empty_like(eta)
        x = torch.empty_like(src) if shift else src
        flags = dict(NORMALIZE=normalize, SCALE_RIDGE=scale_ridge, SHIFT=shift, HAS_FIRST=shift and first is not None,
                     HAS_VALID=valid is not None)
        args = (src, first, valid, beta, lam, log_gate, x, eta, log_a, n, T, eps, decay_floor)
        if per_column:
            c = _column_launch(src, K, beta.shape[-1])
            kern.column_step_fwd[(cdiv(n, c["BR"]), cdiv(c["V"], c["BV"]))](
                *args, HAS_GATE=log_gate is not None, **flags, **c)
        else:
            c = _launch("step_fwd", src, K)
            kern.step_fwd[(cdiv(n, c["BR"]),)](*args, HAS_GATE=log_gate is not None, **flags, **c)
        ctx.save_for_backward(src, first, valid, beta, lam)
        ctx.options = (eps, decay_floor, flags, None if log_gate is None else log_gate.dtype)
        if not shift:
            ctx.mark_non_differentiable(x)  # src itself: callers use src (feature_step_sizes drops this)
        return x, eta, log_a

    @staticmethod
    def backward(ctx, dx_in, d_eta, d_log_a):
        src, first, valid, beta, lam = ctx.saved_tensors
        eps, decay_floor, flags, gate_dtype = ctx.options
        B, T, H, K = src.shape
        n = lam.numel()
        d_eta = torch.zeros(beta.shape, device=src.device) if d_eta is None else d_eta.float().contiguous()
        d_log_a = torch.zeros(beta.shape, device=src.device) if d_log_a is None else d_log_a.float().contiguous()
        if not flags["SHIFT"]:
            dx_in = None  # non-differentiable output (see forward)
        dx = torch.empty_like(src)
        d_first = torch.empty_like(first) if flags["HAS_FIRST"] else None
        d_beta, d_lam = torch.empty_like(beta), torch.empty_like(lam)
        dx_in = None if dx_in is None else dx_in.contiguous()
        flags = dict(flags, HAS_DX_IN=dx_in is not None)
        if beta.dim() == 4:  # per column: the gate's gradient is the row sum of d_log_a
            d_gate = None if gate_dtype is None else torch.empty(lam.shape, dtype=gate_dtype, device=src.device)
            c = _column_launch(src, K, beta.shape[-1])
            kern.column_step_bwd[(cdiv(n, c["BR"]),)](
                src, first, valid, beta, lam, d_eta, d_log_a, dx_in, dx, d_first, d_beta, d_lam, d_gate, n, T, eps,
                decay_floor, HAS_GATE=d_gate is not None, **flags, **c)
        else:  # the gate's gradient is d_log_a itself
            d_gate = None if gate_dtype is None else d_log_a.to(gate_dtype)
            c = _launch("step_bwd", src, K)
            kern.step_bwd[(cdiv(n, c["BR"]),)](
                src, first, valid, beta, lam, d_eta, d_log_a, dx_in, dx, d_first, d_beta, d_lam, n, T, eps,
                decay_floor, **flags, **c)
        return dx, d_first, None, d_beta, d_lam, d_gate, None, None, None, None, None


def _step_sizes(src, first, valid, beta, lam, log_gate, *, eps, decay_floor, normalize, scale_ridge, shift):
    src, beta, lam = src.contiguous(), beta.contiguous(), lam.contiguous()
    log_gate = None if log_gate is None else log_gate.contiguous()
    first = None if first is None else first.to(src.dtype).contiguous()
    valid = None if valid is None else valid.to(torch.uint8).contiguous()
    return _StepSizes.apply(src, first, valid, beta, lam, log_gate, float(eps), float(decay_floor),
                            bool(normalize), bool(scale_ridge), bool(shift))


def feature_step_sizes(
    x: torch.Tensor,
    valid: Optional[torch.Tensor],
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    *,
    eps: float,
    decay_floor: float,
    normalize: bool,
    scale_ridge: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``eta`` and ``log_a = log gamma + log_gate`` fp32, of ``beta``'s shape, from the write
    features ``x`` ``[B, T, H, K]``, pair validity ``valid`` ``[B, T]`` (bool; ``None``: every
    pair valid), ``beta`` (``[B, T, H]`` for rules 1 and 1A, ``[B, T, H, V]`` for the
    per-column rules 2 and 2A), ``lam`` and ``log_gate`` ``[B, T, H]`` (the equations of
    ``ops.step_sizes``): ``eta = beta / (||x_t||^2 + lambda_t + eps)``,
    ``log gamma = log1p(-min(eta lambda_t, 1 - decay_floor))``."""
    _, eta, log_a = _step_sizes(x, None, valid, beta, lam, log_gate, eps=eps, decay_floor=decay_floor,
                                normalize=normalize, scale_ridge=scale_ridge, shift=False)
    return eta, log_a


def shifted_step_sizes(
    k: torch.Tensor,
    first: Optional[torch.Tensor],
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    *,
    eps: float,
    decay_floor: float,
    normalize: bool,
    scale_ridge: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The write features ``x`` ``[B, T, H, K]`` of fixed-length rows, ``x_t = k_{t-1}`` and
    ``x_0 = first`` ``[B, H, K]`` (the carried last key) or the invalid sentinel ``0``
    (``first=None``), with their ``eta`` and ``log_a`` (as ``feature_step_sizes``), in one
    kernel each way; differentiable in ``k``, ``first``, ``beta``, ``lam`` and ``log_gate``."""
    want = (k.shape[0], *k.shape[2:])
    if first is not None and tuple(first.shape) != want:
        raise ValueError(f"first (the carried last key) must have shape {want} = [B, H, K], got {tuple(first.shape)}")
    return _step_sizes(k, first, None, beta, lam, log_gate, eps=eps, decay_floor=decay_floor, normalize=normalize,
                       scale_ridge=scale_ridge, shift=True)


_EIGEN_SQUARINGS = 20  # as ops.step_sizes.top_eigenvalue_by_squaring's default


class _TopEigenvalue(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gram):
        W = gram.shape[-1]
        flat = gram.reshape(-1, W, W).float().contiguous()
        n = flat.shape[0]
        lam = torch.empty(n, dtype=torch.float32, device=gram.device)
        vec = torch.empty(n, W, dtype=torch.float32, device=gram.device)
        BR = max(1, 2048 // (W * W))  # matrices per program: the [BR, W, W] tiles stay in registers
        if n:
            kern.top_eigen_fwd[(cdiv(n, BR),)](flat, lam, vec, n, W=W, SQUARINGS=_EIGEN_SQUARINGS, BR=BR)
        ctx.save_for_backward(vec)
        ctx.shape, ctx.dtype = gram.shape, gram.dtype
        return lam.reshape(gram.shape[:-2]).to(gram.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, d_lam):
        (vec,) = ctx.saved_tensors
        d = d_lam.reshape(-1).float()[:, None, None] * vec[:, :, None] * vec[:, None, :]
        return d.reshape(ctx.shape).to(ctx.dtype)


def top_eigenvalue_triton(gram: torch.Tensor) -> torch.Tensor:
    """Largest eigenvalue of each symmetric PSD matrix in ``gram`` ``[..., W, W]`` (``W`` a power
    of two up to 16) -> ``[...]``: ``ops.step_sizes.top_eigenvalue_by_squaring`` in one kernel
    (``step_size_kernels.top_eigen_fwd``), with the gradient ``v v^T`` of its eigenvector."""
    W = gram.shape[-1]
    if gram.shape[-2] != W or W not in (1, 2, 4, 8, 16):
        raise ValueError(f"gram must end in [W, W] with W in (1, 2, 4, 8, 16), got {tuple(gram.shape)}")
    return _TopEigenvalue.apply(gram)
