"""Normalized step sizes and the positive-decay clamp, shared by every form.

For step ``t`` with window slots ``j in I_t`` (``B_t = |I_t|`` real pairs):

* the normalization statistic ``E_t`` (Section 4.1):
  ``||x_t||^2`` for the rules 1, 2, 1A, 2A;
  ``mu_t = lambda_max(X_t^T X_t) / B_t`` for rule 3 (the exact top eigenvalue of the
  ``B_t x B_t`` window Gram, never a ``K x K`` matrix);
  ``Ebar_t = sum_j ||x_j||^2 / B_t`` for rule 3A;
* the ridge ``lambda_t = lam`` or, with ``scale_ridge``, ``lambda_t = lam * E_t``
  (``E_t`` detached for the sliding rules, Appendix C.6);
* ``eta_t = beta_t / (E_t + lambda_t + eps)`` (``eta_t = beta_t`` without
  ``normalize``), with ``eta_t = 0`` at the boundary sentinel and wherever the
  denominator vanishes; per value column for the rules 2 and 2A;
* ``alpha_t = min(eta_t * lambda_t, 1 - decay_floor)``, ``gamma_t = 1 - alpha_t``,
  returned as ``log gamma_t = log1p(-alpha_t)``. The write gain stays ``eta_t``.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from .rules import RuleSpec

__all__ = ["normalization_statistic", "step_sizes", "gains_from_statistic", "log_carry", "top_eigenvalue",
           "top_eigenvalue_by_squaring"]

# cuSOLVER's batched symmetric eigensolver (reached by torch.linalg.eigvalsh on CUDA) fails
# with CUSOLVER_STATUS_INTERNAL_ERROR on batches of a few hundred thousand matrices (seen at
# B=8, T=2048, H=16: 262,144 window Grams); it is called on slices of at most this many.
EIGH_BATCH = 16384


def top_eigenvalue(gram: torch.Tensor, batch: int = EIGH_BATCH) -> torch.Tensor:
    """Largest eigenvalue of each symmetric matrix in ``gram`` ``[..., W, W]`` -> ``[...]``,
    computed by ``torch.linalg.eigvalsh`` on slices of at most ``batch`` matrices."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    flat = gram.reshape(-1, *gram.shape[-2:])
    return torch.cat([torch.linalg.eigvalsh(part)[..., -1] for part in flat.split(batch)]).reshape(gram.shape[:-2])


def top_eigenvalue_by_squaring(gram: torch.Tensor, squarings: int = 20) -> torch.Tensor:
    """Largest eigenvalue of each symmetric positive semi-definite matrix in ``gram``
    ``[..., W, W]`` -> ``[...]``, from elementwise products only: no host synchronization
    and no eigensolver. This is the readable statement of the method rule 3's Triton kernels use
    for the window statistic (``ops/triton/step_size_kernels.py``), and what its bound is tested on.

    ``M = G / max_i G_ii`` (which cannot overflow: ``lambda_max / W <= max_i G_ii <=
    lambda_max``) is squared ``squarings`` times, renormalized to unit trace each time,
    which leaves ``M ~ v v^T`` for the top eigenvector ``v``; the column of ``M`` with the
    largest diagonal entry, times ``G`` once more, is the estimate of ``v``, and the
    result is the Rayleigh quotient ``v^T G v / v^T v``. The eigenvector's error decays as
    ``(lambda_i / lambda_1)^(m+1)`` with ``m = 2^squarings`` and enters the quotient
    squared, so the relative error is at most about ``W max_r (1 - r) r^(2m+2) < W / (2m + 3)``
    (close to ``W / (e (2m + 3))`` for large ``m``); 20 squarings give about ``7e-7`` at
    ``W = 4``, below float32 rounding. ``v`` is detached, so the gradient is ``v v^T``,
    that of the exact eigenvalue. A zero matrix gives 0."""
    if squarings < 0:
        raise ValueError(f"squarings must be >= 0, got {squarings}")
    tiny = torch.finfo(gram.dtype).tiny

    def unit_trace(m):
        return m / m.diagonal(dim1=-2, dim2=-1).sum(-1).clamp(min=tiny)[..., None, None]

    g = gram.detach()
    g0 = g / g.diagonal(dim1=-2, dim2=-1).amax(-1).clamp(min=tiny)[..., None, None]  # G up to a scale, entries <= 1
    m = g0
    for _ in range(squarings):  # M <- M M, as a broadcast product (batched tiny matmuls are slow on GPUs)
        m = unit_trace((m[..., :, :, None] * m[..., None, :, :]).sum(-2))
    col = m.diagonal(dim1=-2, dim2=-1).argmax(-1)
    v = torch.take_along_dim(m, col[..., None, None], dim=-1)[..., 0]  # [..., W]
    v = (g0 * v[..., None, :]).sum(-1)
    v = v / v.norm(dim=-1, keepdim=True).clamp(min=tiny)
    return ((gram * v[..., None, :]).sum(-1) * v).sum(-1)


def normalization_statistic(rule: RuleSpec, xs: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``E_t`` of shape ``[B, H, T]`` from the window slots ``xs`` ``[B, H, T, W, K]``
    (invalid slots are zero) and the realized window sizes ``count`` ``[B, T]``."""
    if not rule.sliding:
        return (xs[..., 0, :] ** 2).sum(-1)
    bt = count.clamp(min=1).to(xs.dtype)[:, None, :]
    if rule.regression:
        gram = xs @ xs.transpose(-1, -2)  # [B, H, T, W, W]
        # A non-finite window (e.g. garbage past the end of a sequence) gets a NaN
        # statistic of its own instead of failing the batched eigensolver for all.
        bad = ~torch.isfinite(gram).all(-1).all(-1)
        top = top_eigenvalue(gram.masked_fill(bad[..., None, None], 0.0))
        return top.masked_fill(bad, float("nan")) / bt
    return (xs ** 2).sum((-1, -2)) / bt


def step_sizes(
    rule: RuleSpec,
    xs: torch.Tensor,
    slot_valid: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    eps: float,
    decay_floor: float,
    normalize: bool,
    scale_ridge: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-slot write gains and per-token log carries.

    ``xs`` ``[B, H, T, W, K]``, ``slot_valid`` ``[B, T, W]``, ``beta`` ``[B, H, T]`` or
    ``[B, H, T, V]`` (per-column rules), ``lam`` ``[B, H, T]``.

    Returns ``eta_slots`` ``[B, H, T, W, Vd]`` (``eta_t * [j in I_t] / B_t``) and
    ``log_gamma`` ``[B, H, T, Vd]``, where ``Vd = V`` for the per-column rules and 1
    otherwise.
    """
    count = slot_valid.sum(-1)  # B_t, [B, T]
    stat = normalization_statistic(rule, xs, count)
    return gains_from_statistic(rule, stat, slot_valid, beta, lam, eps=eps, decay_floor=decay_floor,
                                normalize=normalize, scale_ridge=scale_ridge)


def log_carry(alpha_raw: torch.Tensor, decay_floor: float) -> torch.Tensor:
    """The positive-decay clamp of Eq. 4.20 in log space: from the raw decay fraction
    ``alpha_raw = eta_t lambda_t``, ``alpha_t = min(alpha_raw, 1 - decay_floor)`` and
    ``log gamma_t = log1p(-alpha_t)`` (``gamma_t = 1 - alpha_t``), same shape.
    ``1 - decay_floor`` rounds to 1 in float32 for ``decay_floor < 2**-25`` (float64: ``< 2**-54``),
    which would leave ``gamma = 0`` and ``log gamma = -inf``: the clamp holds in log space too, so
    ``gamma_t >= decay_floor``. Where the clamped fraction is 1 (``alpha_raw >= 1`` there) the result is
    ``log decay_floor`` with a zero gradient: ``log1p`` is not evaluated at -1, whose gradient ``0 / 0`` would
    be NaN at ``alpha_raw = 1`` exactly (``normalize=False`` with ``beta = lam = 1``, say)."""
    alpha = alpha_raw.clamp(max=1.0 - decay_floor)
    at_one = alpha >= 1.0  # false for a NaN, which passes through
    log_gamma = torch.log1p(-torch.where(at_one, 0.0, alpha))
    return torch.where(at_one, -math.inf, log_gamma).clamp(min=math.log(decay_floor))


def gains_from_statistic(
    rule: RuleSpec,
    stat: torch.Tensor,
    slot_valid: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    eps: float,
    decay_floor: float,
    normalize: bool,
    scale_ridge: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``step_sizes`` from the normalization statistic ``E_t`` ``[B, H, T]``
    (``normalization_statistic``); same arguments and results."""
    count = slot_valid.sum(-1)  # B_t, [B, T]
    has_pair = (count > 0)[:, None, :]  # [B, 1, T]
    if scale_ridge:  # lambda_t = lambda-bar_t E_t (Section 4.1; E_t detached for the sliding rules, Appendix C.6)
        lam = lam * (stat.detach() if rule.sliding else stat)
    stat_c, lam_c, mask = stat[..., None], lam[..., None], has_pair[..., None]
    gain = beta if rule.per_column else beta[..., None]  # [B, H, T, Vd]
    if normalize:  # eta_t = beta_t / (E_t + lambda_t + eps), 0 at the sentinel and a zero denominator (Eqs. 3.4, 4.18)
        denom = stat_c + lam_c + eps
        ok = mask & (denom > 0)
        eta = torch.where(ok, gain / torch.where(ok, denom, 1.0), 0.0)
    else:
        eta = torch.where(mask, gain, 0.0)
    log_gamma = log_carry(eta * lam_c, decay_floor)  # log(1 - min(eta_t lambda_t, 1 - decay_floor)), Eq. 4.20
    if slot_valid.shape[-1] == 1:  # one slot (rules 1, 2, 1A, 2A): its weight [j in I_t] / B_t is 1 wherever eta_t != 0
        return eta[:, :, :, None, :], log_gamma
    weight = slot_valid.to(stat.dtype) / count.clamp(min=1).to(stat.dtype)[..., None]  # [B, T, W]
    eta_slots = eta[:, :, :, None, :] * weight[:, None, :, :, None]
    return eta_slots, log_gamma
