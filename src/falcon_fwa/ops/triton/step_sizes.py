"""Autograd functions over the fused step-size kernels: the scalar, non-sliding rules' step
sizes, and the top eigenvalue of rule 3's window Grams."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import step_size_kernels as kern
from .launch import cdiv, next_power_of_2

__all__ = ["scalar_step_sizes", "shifted_step_sizes", "top_eigenvalue_triton"]

_BR = 64  # rows per program


def _launch(x, K):
    return dict(H=x.shape[2], K=K, BK=min(64, max(16, next_power_of_2(K))), BR=_BR)


class _ScalarStepSizes(torch.autograd.Function):
    """``(x, eta, log_a)`` from the write features or, with ``shift``, from the keys
    (``step_size_kernels``); the backward takes the gradient ``x`` received downstream."""

    @staticmethod
    def forward(ctx, src, first, valid, beta, lam, log_gate, eps, decay_floor, normalize, scale_ridge, shift):
        B, T, H, K = src.shape
        n = beta.numel()
        eta = torch.empty(beta.shape, dtype=torch.float32, device=src.device)
        log_a = torch.empty_like(eta)
        x = torch.empty_like(src) if shift else src
        flags = dict(NORMALIZE=normalize, SCALE_RIDGE=scale_ridge, SHIFT=shift, HAS_FIRST=shift and first is not None,
                     HAS_VALID=valid is not None)
        kern.step_fwd[(cdiv(n, _BR),)](
            src, first, valid, beta, lam, log_gate, x, eta, log_a, n, T, eps, decay_floor,
            HAS_GATE=log_gate is not None, **flags, **_launch(src, K))
        ctx.save_for_backward(src, first, valid, beta, lam)
        ctx.options = (eps, decay_floor, flags, None if log_gate is None else log_gate.dtype)
        if not shift:
            ctx.mark_non_differentiable(x)  # src itself: callers use src (scalar_step_sizes drops this)
        return x, eta, log_a

    @staticmethod
    def backward(ctx, dx_in, d_eta, d_log_a):
        src, first, valid, beta, lam = ctx.saved_tensors
        eps, decay_floor, flags, gate_dtype = ctx.options
        B, T, H, K = src.shape
        n = beta.numel()
        d_eta = torch.zeros(beta.shape, device=src.device) if d_eta is None else d_eta.float().contiguous()
        d_log_a = torch.zeros(beta.shape, device=src.device) if d_log_a is None else d_log_a.float().contiguous()
        if not flags["SHIFT"]:
            dx_in = None  # non-differentiable output (see forward)
        dx = torch.empty_like(src)
        d_first = torch.empty_like(first) if flags["HAS_FIRST"] else None
        d_beta, d_lam = torch.empty_like(beta), torch.empty_like(lam)
        kern.step_bwd[(cdiv(n, _BR),)](
            src, first, valid, beta, lam, d_eta, d_log_a, None if dx_in is None else dx_in.contiguous(), dx, d_first,
            d_beta, d_lam, n, T, eps, decay_floor, HAS_DX_IN=dx_in is not None, **flags, **_launch(src, K))
        d_gate = None if gate_dtype is None else d_log_a.to(gate_dtype)
        return dx, d_first, None, d_beta, d_lam, d_gate, None, None, None, None, None


def _step_sizes(src, first, valid, beta, lam, log_gate, *, eps, decay_floor, normalize, scale_ridge, shift):
    src, beta, lam = src.contiguous(), beta.contiguous(), lam.contiguous()
    log_gate = None if log_gate is None else log_gate.contiguous()
    first = None if first is None else first.to(src.dtype).contiguous()
    valid = None if valid is None else valid.to(torch.uint8).contiguous()
    return _ScalarStepSizes.apply(src, first, valid, beta, lam, log_gate, float(eps), float(decay_floor),
                                  bool(normalize), bool(scale_ridge), bool(shift))


def scalar_step_sizes(
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
    """``eta`` and ``log_a = log gamma + log_gate`` ``[B, T, H]`` fp32 from the write
    features ``x`` ``[B, T, H, K]``, pair validity ``valid`` ``[B, T]`` (bool; ``None``: every
    pair valid), ``beta``, ``lam`` and ``log_gate`` ``[B, T, H]`` (the equations of
    ``ops.step_sizes`` for the rules 1 and 1A)."""
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
    (``first=None``), with their ``eta`` and ``log_a`` (as ``scalar_step_sizes``), in one
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
