"""RMSNorm (optionally SiLU-gated) and the query/key feature normalizations."""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.api import cast_to
from ..ops.validate import check_positive_int

__all__ = ["QK_NORMS", "RMSNorm", "rms_normalize", "normalize_features"]

QK_NORMS = ("rmsnorm", "l2", "none")
"""The query/key normalizations ``normalize_features`` applies (the config's ``qk_norm``)."""


def rms_normalize(u: torch.Tensor, eps: float, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``RMSNorm(u) = u / sqrt(||u||^2 / d_u + eps)`` (Section 4.1) over the last dimension of ``u``
    ``[..., d_u]`` (result the same shape), times ``weight`` ``[d_u]`` if given
    (``torch.nn.functional.rms_norm``: one fused kernel on CUDA)."""
    return F.rms_norm(u, (u.shape[-1],), weight, eps)


def normalize_features(u: torch.Tensor, kind: str, eps: float) -> torch.Tensor:
    """Query/key normalization of Section 4.1 over the head dimension: ``u`` ``[B, T, H, K]``
    (any ``[..., K]``) -> the same shape.

    ``"rmsnorm"``: ``u / sqrt(||u||^2/d + eps)`` (``||.||^2 ~ d``, the paper's default);
    ``"l2"``: ``u / sqrt(||u||^2 + eps)`` (unit norm, as in DeltaNet); ``"none"``.
    """
    if kind == "rmsnorm":
        return rms_normalize(u, eps)
    if kind == "l2":
        return u * torch.rsqrt(u.pow(2).sum(-1, keepdim=True) + eps)
    if kind == "none":
        return u
    raise ValueError(f"kind (the qk_norm) must be one of {QK_NORMS}, got {kind!r}")


class RMSNorm(nn.Module):
    """``y = RMSNorm(x) * w`` over the last dimension, times ``SiLU(gate)`` when a
    gate is given (the output gate of Gated DeltaNet / RetNet); with
    ``norm_before_gate=False`` the gate comes first, ``y = RMSNorm(x * SiLU(gate)) * w``
    (Mamba-2's gated norm). Computed in at least float32. ``x`` and ``gate`` ``[..., dim]`` ->
    ``[..., dim]`` in ``x``'s dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        check_positive_int("dim", dim)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
            raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: Optional[torch.Tensor] = None,
                norm_before_gate: bool = True) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        u = cast_to(x, dt)
        if gate is not None and not norm_before_gate:
            u = u * F.silu(cast_to(gate, dt))
        y = rms_normalize(u, self.eps, cast_to(self.weight, dt))
        if gate is not None and norm_before_gate:
            y = y * F.silu(cast_to(gate, dt))
        return cast_to(y, x.dtype)
