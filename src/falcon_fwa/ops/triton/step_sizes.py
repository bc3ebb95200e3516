"""Autograd functions over the fused step-size kernels: the scalar, non-sliding rules' step
sizes, and the top eigenvalue of rule 3's window Grams."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import step_size_kernels as kern
from .launch import cdiv, next_power_of_2

__all__ = ["scalar_step_sizes", "top_eigenvalue_triton"]

_BR = 64  # rows per program


def _launch(x, K):
    return dict(H=x.shape[2], K=K, BK=min(64, max(16, next_power_of_2(K))), BR=_BR)


class _ScalarStepSizes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, valid, beta, lam, log_gate, eps, decay_floor, normalize, scale_ridge):
        n, K = beta.numel(), x.shape[-1]
        eta = torch.empty(beta.shape, dtype=torch.float32, device=x.device)
        log_a = torch.empty_like(eta)
        kern.step_fwd[(cdiv(n, _BR),)](
            x, valid, beta, lam, log_gate, eta, log_a, n, eps, decay_floor, NORMALIZE=normalize,
            SCALE_RIDGE=scale_ridge, HAS_GATE=log_gate is not None, **_launch(x, K))
        ctx.save_for_backward(x, valid, beta, lam)
        gate_dtype = None if log_gate is None else log_gate.dtype
        ctx.options = (eps, decay_floor, normalize, scale_ridge, gate_dtype)
        return eta, log_a

    @staticmethod
    def backward(ctx, d_eta, d_log_a):
        x, valid, beta, lam = ctx.saved_tensors
        eps, decay_floor, normalize, scale_ridge, gate_dtype = ctx.options
        n, K = beta.numel(), x.shape[-1]
        d_eta = torch.zeros(beta.shape, device=x.device) if d_eta is None else d_eta.float().contiguous()
        d_log_a = torch.zeros(beta.shape, device=x.device) if d_log_a is None else d_log_a.float().contiguous()
        dx = torch.empty_like(x)
        d_beta = torch.empty(beta.shape, dtype=torch.float32, device=x.device)
        d_lam = torch.empty_like(d_beta)
        kern.step_bwd[(cdiv(n, _BR),)](
            x, valid, beta, lam, d_eta, d_log_a, dx, d_beta, d_lam, n, eps, decay_floor,
            NORMALIZE=normalize, SCALE_RIDGE=scale_ridge, **_launch(x, K))
        d_gate = None if gate_dtype is None else d_log_a.to(gate_dtype)
        return dx, None, d_beta.to(beta.dtype), d_lam.to(lam.dtype), d_gate, None, None, None, None


def scalar_step_sizes(
    x: torch.Tensor,
    valid: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    *,
    eps: float,
    decay_floor: float,
    normalize: bool,
    scale_ridge: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``eta`` and ``log_a = log gamma + log_gate`` ``[B, T, H]`` fp32 from the write
    features ``x`` ``[B, T, H, K]``, pair validity ``valid`` ``[B, T]`` (bool),
    ``beta``, ``lam`` and ``log_gate`` ``[B, T, H]`` (the equations of ``ops.step_sizes``
    for the rules 1 and 1A)."""
    x, beta, lam = x.contiguous(), beta.contiguous(), lam.contiguous()
    log_gate = None if log_gate is None else log_gate.contiguous()
    return _ScalarStepSizes.apply(x, valid.to(torch.uint8).contiguous(), beta, lam, log_gate, float(eps),
                                  float(decay_floor), bool(normalize), bool(scale_ridge))


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
