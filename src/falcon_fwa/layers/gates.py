"""The context gates of the recurrent mixers: write gain, ridge and state decay.

All gates are read from the token's hidden state ``h_t`` (``[B, T, D]``) by small
projections without bias plus a learned per-head (per-column) offset:

write gain (``gate``), handed to the op as ``beta``:

* ``"ctx-beta"``: ``beta_t = 2 sigmoid(w^T h_t + b)`` in ``(0, 2)``, the dimensionless
  NLMS gain; the op forms ``eta_t = beta_t / (E_t + lambda_t + eps)``. (In floating point
  the sigmoid rounds to 1 at saturation, from about 17 in float32 and 6 in bf16, so
  ``beta_t = 2`` exactly; ``eps > 0`` still keeps the write direction's eigenvalue
  ``1 - eta_t (E_t + lambda_t) > -1``.)
* ``"ctx-eta"``: the context emits the *normalized step size*
  ``eta-bar_t = c * sigmoid(w^T h_t + b)``, read as ``eta_t = eta-bar_t / E_t``: a
  step measured in units of the inverse write energy, which the ridge does not
  shrink (the ridge then acts only through the decay ``gamma_t = 1 - eta_t lambda_t
  = 1 - eta-bar_t lambda-bar_t``). It is passed as ``beta_t = eta-bar_t (1 +
  lambda-bar_t)``, so that with the scale-coupled ridge ``lambda_t = lambda-bar_t E_t``
  the op's ``beta_t / (E_t + lambda_t + eps)`` equals ``eta-bar_t / E_t`` up to
  ``eps``. Admissibility: the write direction's eigenvalue is ``1 - beta_t``;
  ``c = min(1, 2 / (1 + lambda_scale))`` keeps ``beta_t <= 2`` (and the op's clamp
  keeps ``gamma_t >= decay_floor``).
* ``"sigmoid"``: ``beta_t = sigmoid(.)`` in ``(0, 1)`` (DeltaNet, Gated DeltaNet).
* ``"dt"``: ``beta_t = dt_t = softplus(. + dt_bias)`` (Mamba-2's step).
* ``"one"``: ``beta_t = 1`` (RetNet / linear attention).

For the per-column rules 2 / 2A the gain has one value per head and value column.

ridge: ``lambda-bar_t = lambda_scale * sigmoid(w^T h_t + b)`` per head (0 without a
ridge). The offsets start log-uniform in ``[1e-3, 1e-1] * lambda_scale`` so that the
heads begin with memory horizons ``1 / alpha_t`` spread over two decades: the gain offsets
start at 0, so ``alpha_t = eta_t lambda_t`` starts at ``lambda-bar / (1 + lambda-bar)`` under
ctx-beta (``beta = 1``: about 11 to 1000 tokens at ``lambda_scale = 1``) and at
``c lambda-bar / 2`` under ctx-eta (``eta-bar = c / 2``: about 20 to 2000 tokens). The paper
states no initialization; these are this library's choices.

state decay (``log_gate``), ``g_t <= 0``:

* ``"data"``: ``g_t = -exp(A_log) * softplus(w^T h_t + dt_bias)`` (Gated DeltaNet);
* ``"dt"``: ``g_t = -exp(A_log) * dt_t`` (Mamba-2, sharing ``dt`` with the write gain);
* ``"fixed"``: ``g = log(1 - 2^{-5-h})`` for head ``h`` (RetNet's multi-scale decay);
* ``"none"``.

Precision: every gate is computed in its inputs' dtype. Under bf16 autocast the projections run in bf16 and
their float32 offsets (``gain_bias``, ``lam_bias``, ``decay_bias``) lift what follows them to float32: the gates
reach the op in float32.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.validate import check_positive_int

__all__ = ["ContextGates", "GATES", "LOG_GATES"]

GATES = ("ctx-beta", "ctx-eta", "sigmoid", "dt", "one")
"""The write gains ``gate`` may name (module docstring)."""
LOG_GATES = ("none", "data", "dt", "fixed")
"""The state decays ``log_gate`` may name."""


def _inv_softplus(y: torch.Tensor) -> torch.Tensor:
    return y + torch.log(-torch.expm1(-y))


def _log_uniform(n: int, lo: float, hi: float) -> torch.Tensor:
    if n == 1:
        return torch.tensor([math.sqrt(lo * hi)])
    return torch.exp(torch.linspace(math.log(lo), math.log(hi), n))


class ContextGates(nn.Module):
    """Computes ``(beta, lam, log_gate)`` for ``falcon_attention`` from ``h``.

    Shapes: ``beta`` ``[B, T, H]`` (``[B, T, H, V]`` when ``per_column``), ``lam``
    ``[B, T, H]`` (``lambda-bar``; the layer passes ``scale_ridge=normalize`` to the op, which then
    couples it to the write energy, ``lambda_t = lambda-bar_t E_t``), ``log_gate`` ``[B, T, H]``
    or ``None``. ``gate`` is one of :data:`GATES`, ``log_gate`` one of :data:`LOG_GATES`,
    ``lambda_scale`` a finite number ``>= 0`` (0: no ridge).
    """

    def __init__(self, hidden_size: int, num_heads: int, head_v_dim: int, *, gate: str, log_gate: str,
                 lambda_scale: float, per_column: bool):
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_heads", num_heads), ("head_v_dim", head_v_dim)):
            check_positive_int(name, value)
        if gate not in GATES:
            raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
        if log_gate not in LOG_GATES:
            raise ValueError(f"log_gate must be one of {LOG_GATES}, got {log_gate!r}")
        if isinstance(lambda_scale, bool) or not isinstance(lambda_scale, (int, float)) or not (
                0 <= lambda_scale < math.inf):
            raise ValueError(f"lambda_scale must be a finite number >= 0 (0: no ridge), got {lambda_scale!r}")
        self.gate, self.log_gate_kind, self.lambda_scale = gate, log_gate, lambda_scale
        self.num_heads, self.per_column = num_heads, per_column
        self.columns = head_v_dim if per_column else 1
        width = num_heads * self.columns
        if gate != "one":
            self.gain_proj = nn.Linear(hidden_size, width, bias=False)
            self.gain_bias = nn.Parameter(torch.empty(width))
        if lambda_scale > 0:
            self.lam_proj = nn.Linear(hidden_size, num_heads, bias=False)
            self.lam_bias = nn.Parameter(torch.empty(num_heads))
        if log_gate == "data":
            self.decay_proj = nn.Linear(hidden_size, num_heads, bias=False)
            self.decay_bias = nn.Parameter(torch.empty(num_heads))
        if log_gate in ("data", "dt"):
            self.A_log = nn.Parameter(torch.empty(num_heads))
        with torch.no_grad():
            for name, value in self.initial_values().items():
                getattr(self, name).copy_(value)

    def initial_values(self) -> Dict[str, torch.Tensor]:
        """The starting value of every offset and decay this module holds, by parameter name
        (deterministic, float32): ``gain_bias`` ``[H * C]`` (zeros; ``"dt"``: the inverse softplus
        of steps log-uniform in ``[1e-3, 1e-1]``), ``lam_bias`` ``[H]`` (``lambda-bar`` log-uniform in
        ``[1e-3, 1e-1] * lambda_scale``), ``decay_bias`` ``[H]``, ``A_log`` ``[H]`` (``log(1..16)``)."""
        H, C = self.num_heads, self.columns
        values = {}
        if self.gate != "one":
            if self.gate == "dt":
                dt0 = _log_uniform(H, 1e-3, 1e-1)[:, None].expand(H, C)
                values["gain_bias"] = _inv_softplus(dt0).reshape(H * C).clone()
            else:
                values["gain_bias"] = torch.zeros(H * C)
        if self.lambda_scale > 0:
            frac = _log_uniform(H, 1e-3, 1e-1)  # lambda-bar / lambda_scale at init
            values["lam_bias"] = torch.log(frac) - torch.log1p(-frac)
        if self.log_gate_kind == "data":
            values["decay_bias"] = _inv_softplus(_log_uniform(H, 1e-3, 1e-1))
        if self.log_gate_kind in ("data", "dt"):
            values["A_log"] = torch.log(torch.linspace(1.0, 16.0, H))
        return values

    def forward(self, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``h`` ``[B, T, D]`` -> ``(beta, lam, log_gate)``, shaped as in the class docstring, in that
        order: ``falcon_attention``'s ``beta``, ``lam`` and ``log_gate`` arguments."""
        B, T, _ = h.shape
        H, C = self.num_heads, self.columns
        if self.lambda_scale > 0:
            lam = self.lambda_scale * torch.sigmoid(self.lam_proj(h) + self.lam_bias)
        else:
            lam = h.new_zeros(B, T, H)
        if self.gate == "one":
            beta = h.new_ones(B, T, H, C)
        else:
            pre = (self.gain_proj(h) + self.gain_bias).view(B, T, H, C)
            if self.gate == "ctx-beta":
                beta = 2.0 * torch.sigmoid(pre)
            elif self.gate == "ctx-eta":
                c = min(1.0, 2.0 / (1.0 + self.lambda_scale))
                beta = c * torch.sigmoid(pre) * (1.0 + lam)[..., None]
            elif self.gate == "sigmoid":
                beta = torch.sigmoid(pre)
            else:  # "dt"
                beta = F.softplus(pre)
        log_gate = None
        if self.log_gate_kind == "data":
            log_gate = -torch.exp(self.A_log) * F.softplus(self.decay_proj(h) + self.decay_bias)
        elif self.log_gate_kind == "dt":
            log_gate = -torch.exp(self.A_log) * beta.mean(-1)
        elif self.log_gate_kind == "fixed":
            fixed = torch.log1p(-torch.pow(2.0, -5.0 - torch.arange(H, device=h.device, dtype=torch.float64)))
            log_gate = fixed.to(h.dtype).expand(B, T, H)
        beta = beta if self.per_column else beta[..., 0]  # [B, T, H, V] even for one value column
        return beta, lam, log_gate
