"""The fused step-size kernels: autograd functions for the non-sliding rules' step sizes
(scalar for rules 1 and 1A, per value column for rules 2 and 2A), and the launches of rule 3's
(from the top eigenvalues of its window Grams; ``sliding_delta`` puts them in its autograd node)."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import step_size_kernels as kern
from .launch import cdiv, next_power_of_2

__all__ = ["feature_step_sizes", "shifted_step_sizes", "step_sizes_forward", "step_sizes_backward", "step_flags",
           "check_first", "prepare_inputs", "window_steps_forward", "window_steps_backward"]

# The scalar rules' kernels (``step_fwd``, ``step_bwd``): rows per program, the key block (capped by the
# head dim; a block that covers the head reads each feature tile once) and warps. On an H200 inside
# falcon-1 (B=8, T=2048, H=16, K=128, bf16; benchmarks/results/h200_step_launch_sweep.txt): 32 rows and one
# 128-wide block, 0.039 ms forward and 0.067 backward, against 0.045 and 0.074 at 64 rows and two 64-wide
# blocks (the features read twice) and 0.048 and 0.161 at 64 rows and one block (182 registers, 2 blocks per SM).
# Both at 16 rows since: step_bwd 0.055 ms against 0.067 at 32 (h200_step_bwd_sweep_a9b87fc.txt), step_fwd
# 0.034 against 0.039 (h200_step_fwd_sweep_d7198b8.txt).
LAUNCH = {"step_fwd": dict(BR=16, BK=128, num_warps=4), "step_bwd": dict(BR=16, BK=128, num_warps=4)}
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


def step_flags(*, normalize: bool, scale_ridge: bool, shift: bool, first, valid) -> dict:
    """The step kernels' switches for these inputs."""
    return dict(NORMALIZE=normalize, SCALE_RIDGE=scale_ridge, SHIFT=shift, HAS_FIRST=shift and first is not None,
                HAS_VALID=valid is not None)


def step_sizes_forward(src, first, valid, beta, lam, log_gate, *, eps: float, decay_floor: float, flags: dict):
    """The step kernels' forward, outside autograd, on prepared inputs (``prepare_inputs``):
    ``(x, eta, log_a, eta_scale)`` as ``_StepSizes`` returns them (``x`` is ``src`` without shift,
    ``eta_scale`` ``None`` for a scalar ``beta``)."""
    B, T, H, K = src.shape
    n = lam.numel()
    per_column = beta.dim() == 4
    eta = torch.empty(beta.shape, dtype=torch.float32, device=src.device)
    log_a = torch.empty_like(eta)
    x = torch.empty_like(src) if flags["SHIFT"] else src
    scale = torch.empty(lam.shape, dtype=torch.float32, device=src.device) if per_column else None
    args = (src, first, valid, beta, lam, log_gate, x, eta, log_a)
    tail = (n, T, eps, decay_floor)
    if per_column:
        c = _column_launch(src, K, beta.shape[-1])
        kern.column_step_fwd[(cdiv(n, c["BR"]), cdiv(c["V"], c["BV"]))](
            *args, scale, *tail, HAS_GATE=log_gate is not None, **flags, **c)
    else:
        c = _launch("step_fwd", src, K)
        kern.step_fwd[(cdiv(n, c["BR"]),)](*args, *tail, HAS_GATE=log_gate is not None, **flags, **c)
    return x, eta, log_a, scale


def step_sizes_backward(src, first, valid, beta, lam, gate_dtype, d_eta, d_log_a, dx_in, *, eps: float,
                        decay_floor: float, flags: dict):
    """The step kernels' backward, outside autograd: from the gradients of ``eta`` and ``log_a``
    (fp32, ``beta``'s shape) and the gradient ``dx_in`` the features received downstream (or
    ``None``), the gradients of ``src`` (the keys with shift), ``first``, ``beta``, ``lam`` and
    the gate (``None`` when ``gate_dtype`` is)."""
    B, T, H, K = src.shape
    n = lam.numel()
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
    return dx, d_first, d_beta, d_lam, d_gate


class _StepSizes(torch.autograd.Function):
    """``(x, eta, log_a, eta_scale)`` from the write features or, with ``shift``, from the keys
    (``step_size_kernels``); the backward takes the gradient ``x`` received downstream.
    ``beta`` ``[B, T, H]`` (the scalar rules; ``eta_scale`` is ``None``) or ``[B, T, H, V]``
    (the per-column rules: ``eta``, ``log_a`` per value column, ``eta = beta * eta_scale`` with
    the row factor ``eta_scale`` ``[B, T, H]`` fp32, not differentiable)."""

    @staticmethod
    def forward(ctx, src, first, valid, beta, lam, log_gate, eps, decay_floor, normalize, scale_ridge, shift):
        flags = step_flags(normalize=normalize, scale_ridge=scale_ridge, shift=shift, first=first, valid=valid)
        x, eta, log_a, scale = step_sizes_forward(src, first, valid, beta, lam, log_gate, eps=eps,
                                                  decay_floor=decay_floor, flags=flags)
        ctx.save_for_backward(src, first, valid, beta, lam)
        ctx.options = (eps, decay_floor, flags, None if log_gate is None else log_gate.dtype)
        # x is src itself without shift: callers use src (feature_step_sizes drops this); the scale is a
        # by-product (its gradient reaches beta and the features through eta's)
        ctx.mark_non_differentiable(*(t for t in ((None if shift else x), scale) if t is not None))
        return x, eta, log_a, scale

    @staticmethod
    def backward(ctx, dx_in, d_eta, d_log_a, _d_scale):
        src, first, valid, beta, lam = ctx.saved_tensors
        eps, decay_floor, flags, gate_dtype = ctx.options
        d_eta = torch.zeros(beta.shape, device=src.device) if d_eta is None else d_eta.float().contiguous()
        d_log_a = torch.zeros(beta.shape, device=src.device) if d_log_a is None else d_log_a.float().contiguous()
        if not flags["SHIFT"]:
            dx_in = None  # non-differentiable output (see forward)
        dx, d_first, d_beta, d_lam, d_gate = step_sizes_backward(
            src, first, valid, beta, lam, gate_dtype, d_eta, d_log_a, dx_in, eps=eps, decay_floor=decay_floor,
            flags=flags)
        return dx, d_first, None, d_beta, d_lam, d_gate, None, None, None, None, None


def check_first(first: Optional[torch.Tensor], k: torch.Tensor) -> None:
    """``ValueError`` unless the carried last key ``first`` is ``None`` or ``[B, H, K]`` for the keys
    ``k`` ``[B, T, H, K]`` (the kernels would read past it)."""
    want = (k.shape[0], *k.shape[2:])
    if first is not None and tuple(first.shape) != want:
        raise ValueError(f"first (the carried last key) must have shape {want} = [B, H, K], got {tuple(first.shape)}")


def prepare_inputs(src, first, valid, beta, lam, log_gate):
    """The step kernels' inputs as they read them: contiguous, ``first`` in ``src``'s dtype,
    ``valid`` as bytes."""
    src, beta, lam = src.contiguous(), beta.contiguous(), lam.contiguous()
    log_gate = None if log_gate is None else log_gate.contiguous()
    first = None if first is None else first.to(src.dtype).contiguous()
    valid = None if valid is None else valid.to(torch.uint8).contiguous()
    return src, first, valid, beta, lam, log_gate


def _step_sizes(src, first, valid, beta, lam, log_gate, *, eps, decay_floor, normalize, scale_ridge, shift):
    src, first, valid, beta, lam, log_gate = prepare_inputs(src, first, valid, beta, lam, log_gate)
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
) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``eta`` and ``log_a = log gamma + log_gate`` fp32, of ``beta``'s shape, from the write
    features ``x`` ``[B, T, H, K]``, pair validity ``valid`` ``[B, T]`` (bool; ``None``: every
    pair valid), ``beta`` (``[B, T, H]`` for rules 1 and 1A, ``[B, T, H, V]`` for the
    per-column rules 2 and 2A), ``lam`` and ``log_gate`` ``[B, T, H]`` (the equations of
    ``ops.step_sizes``): ``eta = beta / (||x_t||^2 + lambda_t + eps)``,
    ``log gamma = log1p(-min(eta lambda_t, 1 - decay_floor))``; and, for a per-column ``beta``,
    the row factor ``eta_scale`` ``[B, T, H]`` fp32 with ``eta = beta * eta_scale`` to the bit
    (``None`` for the scalar rules; not differentiable)."""
    _, eta, log_a, eta_scale = _step_sizes(x, None, valid, beta, lam, log_gate, eps=eps, decay_floor=decay_floor,
                                           normalize=normalize, scale_ridge=scale_ridge, shift=False)
    return eta, log_a, eta_scale


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
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The write features ``x`` ``[B, T, H, K]`` of fixed-length rows, ``x_t = k_{t-1}`` and
    ``x_0 = first`` ``[B, H, K]`` (the carried last key) or the invalid sentinel ``0``
    (``first=None``), with their ``eta``, ``log_a`` and ``eta_scale`` (as ``feature_step_sizes``),
    in one kernel each way; differentiable in ``k``, ``first``, ``beta``, ``lam`` and ``log_gate``."""
    check_first(first, k)
    return _step_sizes(k, first, None, beta, lam, log_gate, eps=eps, decay_floor=decay_floor, normalize=normalize,
                       scale_ridge=scale_ridge, shift=True)


_EIGEN_SQUARINGS = 20  # as ops.step_sizes.top_eigenvalue_by_squaring's default


def _window_rows(W: int) -> int:
    """Rows per program of the rule-3 step kernels: their ``[BR, W, W]`` Gram tiles stay in registers."""
    return min(256, max(1, 2048 // (W * W)))


def window_steps_forward(gram, valid_ext, beta, lam, log_gate, *, eps: float, decay_floor: float, normalize: bool,
                         scale_ridge: bool):
    """Rule 3's step sizes per write, from its window Grams: ``step_size_kernels.window_step_fwd``.

    ``gram`` ``[B, T, H, W, W]`` fp32 (``G_t[i, j] = x_{t+i} . x_{t+j}``), ``valid_ext``
    ``[B, T + W - 1]`` (the pairs' validity on the extended axis), time-major ``beta``, ``lam``,
    ``log_gate`` ``[B, T, H]`` (``log_gate`` may be ``None``). Returns ``eta``, ``kappa`` (``None``
    without a gate: kappa is eta) and the carry ``[B, T * W, H]`` fp32 (step ``t``'s writes on rows
    ``t*W ..``; the carry on the first), and the top eigenpairs ``top`` ``[B, T, H]``, ``vec``
    ``[B, T, H, W]`` for ``window_steps_backward``. Not differentiable by itself."""
    B, T, H, W = gram.shape[:4]
    n = B * T * H
    eta = torch.empty(B, T * W, H, dtype=torch.float32, device=gram.device)
    kappa = torch.empty_like(eta) if log_gate is not None else None
    carry = torch.empty_like(eta)
    top = torch.empty(B, T, H, dtype=torch.float32, device=gram.device)
    vec = torch.empty(B, T, H, W, dtype=torch.float32, device=gram.device)
    BR = _window_rows(W)
    if n:
        kern.window_step_fwd[(cdiv(n, BR),)](
            gram, valid_ext, beta, lam, log_gate, eta, kappa, carry, top, vec, n, T, float(eps), float(decay_floor),
            math.log(decay_floor), H=H, W=W, SQUARINGS=_EIGEN_SQUARINGS, BR=BR, NORMALIZE=normalize,
            SCALE_RIDGE=scale_ridge, HAS_GATE=log_gate is not None)
    return eta, kappa, carry, top, vec


def window_steps_backward(top, valid_ext, beta, lam, log_gate, d_eta, d_kappa, d_carry, *, eps: float,
                          decay_floor: float, normalize: bool, scale_ridge: bool):
    """The backward of ``window_steps_forward`` (``step_size_kernels.window_step_bwd``) from the
    gradients of ``eta``, the carry and, with a gate, ``kappa`` (each ``[B, T * W, H]``): ``d_top``
    ``[B, T, H]`` fp32 (that of the Grams' top eigenvalues), ``d_beta``, ``d_lam``, ``d_gate`` in
    their tensors' dtypes (``d_gate`` ``None`` without a gate)."""
    B, T, H = top.shape
    W = valid_ext.shape[1] - T + 1
    n = B * T * H
    d_top = torch.empty_like(top)
    d_beta, d_lam = torch.empty_like(beta), torch.empty_like(lam)
    d_gate = None if log_gate is None else torch.empty_like(log_gate)
    d_eta, d_carry = d_eta.float().contiguous(), d_carry.float().contiguous()
    d_kappa = None if log_gate is None else d_kappa.float().contiguous()
    BR = _window_rows(W)
    if n:
        kern.window_step_bwd[(cdiv(n, BR),)](
            top, valid_ext, beta, lam, log_gate, d_eta, d_kappa, d_carry, d_top, d_beta, d_lam, d_gate, n, T,
            float(eps), float(decay_floor), math.log(decay_floor), H=H, W=W, BR=BR, NORMALIZE=normalize,
            SCALE_RIDGE=scale_ridge, HAS_GATE=log_gate is not None)
    return d_top, d_beta, d_lam, d_gate
