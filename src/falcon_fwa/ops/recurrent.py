"""Recurrent form: the token-by-token scan. This is the definition of truth.

One loop serves all six rules (Algorithms 2 and 5 and their analogues). With the
window's pairs stacked as rows, ``X_t`` ``[W, K]`` and ``Y_t`` ``[W, V]`` (row ``j``
the pair ``(x_j, y_j)``, ``j in I_t``; zero rows for empty slots; one row for the
non-sliding rules; the paper's ``X_t`` is this ``X_t^T``) and the slot gains
``Eta_t = diag(eta_{t,j})``, ``eta_{t,j} = eta_t / B_t`` (zero for empty slots)::

    S'  = exp(g_t) * S_{t-1}                         # optional gate (Gated DeltaNet / Mamba-2)
    R_t = Y_t - X_t S'      (regression rules)       # residuals at the gated pre-update state
    R_t = Y_t               (inner-product rules)
    S_t = gamma_t * S' + X_t^T Eta_t R_t             # gamma_t, eta_t per column for 2/2A
    o_t = S_t^T q_t   (read after write)   or   S_{t-1}^T q_t   (read before write)

``X_t^T Eta_t R_t = sum_{j in I_t} eta_t / B_t x_j r_j^T`` is the window's average of the
rank-one writes: ``eta_t x_t r_t^T`` of Eq. 3.3 for rule 1 (Algorithm 5, line 7), Eq. 4.14
for rule 3 (Algorithm 2, line 15), ``eta_t x_t y_t^T`` of Eq. 4.6 for 1A, Eq. 4.19 for 3A;
per column (``eta_t`` and ``gamma_t`` vectors over ``V``) Eqs. 4.4 and 4.7 for 2 and 2A.
``gamma_t`` is the clamped carry of Eq. 4.20 (``step_sizes.py``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["recurrent_form", "recurrent_step"]


def recurrent_step(
    q_t: torch.Tensor,
    X: torch.Tensor,
    Y: torch.Tensor,
    eta_t: torch.Tensor,
    gamma_t: torch.Tensor,
    gate_t: Optional[torch.Tensor],
    S: torch.Tensor,
    *,
    regression: bool,
    read_after: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One step of the scan (the module docstring's equations), arguments in the order of
    ``recurrent_form``'s, for one step.

    ``q_t`` ``[B, H, K]``, ``X`` ``[B, H, W, K]``, ``Y`` ``[B, H, W, V]``, ``eta_t``
    ``[B, H, W, Vd]`` (the slot gains), ``gamma_t`` ``[B, H, Vd]`` (the carry, not its log),
    ``gate_t`` ``[B, H]`` (``exp(g_t)``, not ``g_t``) or ``None``, ``S`` ``[B, H, K, V]``
    (``S_{t-1}``); ``Vd`` is ``V`` for the per-column rules, else 1. Returns ``o_t``
    ``[B, H, V]`` and ``S_t`` ``[B, H, K, V]``.
    """
    S_prev = S
    if gate_t is not None:
        S = gate_t[..., None, None] * S  # S'
    R = Y - X @ S if regression else Y  # R_t
    X_T, update = X.transpose(-1, -2), eta_t * R  # Eta_t R_t
    # X^T Eta R sums over the window slots; with one slot it is an outer product (a broadcast product).
    S = gamma_t[:, :, None, :] * S + (X_T * update if X.shape[-2] == 1 else X_T @ update)
    read = S if read_after else S_prev
    return (read.transpose(-1, -2) @ q_t[..., None])[..., 0], S


def recurrent_form(
    q: torch.Tensor,
    xs: torch.Tensor,
    ys: torch.Tensor,
    eta_slots: torch.Tensor,
    log_gamma: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    S0: torch.Tensor,
    *,
    regression: bool,
    read_after: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scan ``T`` steps.

    ``q`` ``[B, H, T, K]``, ``xs`` ``[B, H, T, W, K]``, ``ys`` ``[B, H, T, W, V]``,
    ``eta_slots`` ``[B, H, T, W, Vd]``, ``log_gamma`` ``[B, H, T, Vd]``,
    ``log_gate`` ``[B, H, T]`` or ``None``, ``S0`` ``[B, H, K, V]``.
    Returns ``o`` ``[B, H, T, V]`` and ``S_T`` ``[B, H, K, V]``.
    """
    # Per-step views through unbind (its backward is one stack, linear in T).
    steps = zip(q.unbind(2), xs.unbind(2), ys.unbind(2), eta_slots.unbind(2), torch.exp(log_gamma).unbind(2),
                [None] * q.shape[2] if log_gate is None else torch.exp(log_gate).unbind(2))
    S = S0
    outs = []
    for q_t, X, Y, eta_t, gamma_t, gate_t in steps:  # X [B, H, W, K], Y [B, H, W, V]
        o_t, S = recurrent_step(q_t, X, Y, eta_t, gamma_t, gate_t, S, regression=regression, read_after=read_after)
        outs.append(o_t)
    return torch.stack(outs, dim=2), S
