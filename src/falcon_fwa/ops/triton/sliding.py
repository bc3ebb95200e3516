r"""The sliding-window inner-product rule (Falcon-3A) on the scalar-decay chunk kernels.

Rule 3A writes, at step ``t``, every pair ``j`` of its window ``I_t`` (Algorithm 4)::

    S_t = a_t S_{t-1} + sum_{m=0}^{W-1} c_{t,m} x_{t-m} y_{t-m}^T,   c_{t,m} = eta_t [t-m in I_t] / B_t

with the carry ``a_t = gamma_t exp(g_t)``. Pair ``j`` is written at the ``W`` steps
``s = j .. j+W-1``; by step ``p = j+W-1`` (its *completion step*) all its writes are in.
Split the state into the completed pairs and the pairs still inside some window::

    S_t = L_t + R_t
    L_t = a_t L_{t-1} + e_t x_{t-W+1} y_{t-W+1}^T                 (a Falcon-1A scan)
    e_p = sum_{n=0}^{W-1} c_{p-n, W-1-n} exp(Lam_{p-n, n})          (the completed gain of pair p-W+1)
    R_t = sum_{d=1}^{W-1} rho_{t,d} x_{t+d-W+1} y_{t+d-W+1}^T       (at most W-1 open pairs)
    rho_{t,d} = sum_{i=0}^{W-1-d} c_{t-i, W-1-d-i} exp(Lam_{t-i, i})

where ``Lam_{s,n} = sum_{r=s+1}^{s+n} log a_r <= 0`` is the decay over ``n`` steps (only
non-positive exponents are evaluated). So the chunk kernels of rule 1A run unchanged on
the delayed pairs ``(x_{t-W+1}, y_{t-W+1})`` with the gains ``e_t`` (that scan is the
banded decay mask ``M_{t,j} = sum_s (eta_s/B_s) exp(u_t - u_s) [j in I_s]`` summed
for the pairs whose band lies wholly at or before ``t``), and the outputs and the final
state add the band of open pairs::

    o_t  = L_tau^T q_t + sum_d rho_{tau,d} (q_t . x_{tau+d-W+1}) y_{tau+d-W+1}
    S_T  = L_T + R_T

with ``tau = t`` (read after write) or ``t - 1`` (read before). Pairs before the
segment (``j <= 0``) are the state's tail, so a continued sequence resumes the
windows and the writes that were still open. With ``W = 1`` this is rule 1A exactly
(``e = c``, no open pairs). The band costs ``O(T W (K + V))`` per head, next to the
``O(T C (K + V) + T K V)`` of the scan.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..pairs import next_tail, window_slots, write_pairs
from ..rules import get_rule
from ..step_sizes import step_sizes
from .scalar_decay import scalar_decay_chunk

__all__ = ["sliding_chunk", "completed_gains", "open_weights"]


def _shift(t: torch.Tensor, n: int) -> torch.Tensor:
    """``out[..., s] = t[..., s + n]`` along the last dim (``n`` may be negative), 0 outside."""
    if n == 0:
        return t
    T = t.shape[-1]
    if abs(n) >= T:
        return torch.zeros_like(t)
    return F.pad(t[..., n:], (0, n)) if n > 0 else F.pad(t[..., :n], (-n, 0))


def _lag_decays(log_a: torch.Tensor, W: int) -> list:
    """``Lam[n][..., s] = sum_{r=s+1}^{s+n} log_a[..., r]`` for ``n = 0 .. W-1`` (``[..., T]`` each)."""
    lam = [torch.zeros_like(log_a)]
    for n in range(1, W):
        lam.append(lam[-1] + _shift(log_a, n))
    return lam


def completed_gains(c: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """``e`` ``[..., T]``: the gain of the pair completed at each step, from the slot gains
    ``c`` ``[..., T, W]`` (``c[..., t, m] = eta_t [t-m in I_t] / B_t``) and ``log_a`` ``[..., T]``."""
    W = c.shape[-1]
    lam = _lag_decays(log_a, W)
    e = torch.zeros_like(log_a)
    for n in range(W):
        e = e + _shift(c[..., W - 1 - n] * torch.exp(lam[n]), -n)
    return e


def open_weights(c: torch.Tensor, log_a: torch.Tensor) -> torch.Tensor:
    """``rho`` ``[..., T, W-1]``: ``rho[..., t, d-1]`` weighs pair ``t+d-W+1`` (still open
    after step ``t``) in ``S_t``, for ``d = 1 .. W-1``."""
    W = c.shape[-1]
    lam = _lag_decays(log_a, W)
    cols = []
    for d in range(1, W):
        r = torch.zeros_like(log_a)
        for i in range(W - d):
            r = r + _shift(c[..., W - 1 - d - i] * torch.exp(lam[i]), -i)
        cols.append(r)
    return torch.stack(cols, -1)


def _band(q: torch.Tensor, x_ext: torch.Tensor, y_ext: torch.Tensor, rho: torch.Tensor, read_after: bool) -> torch.Tensor:
    """Open-pair outputs ``[B, H, T, V]``: ``sum_d rho_{tau,d} (q_t . x_ext[tau+d]) y_ext[tau+d]``.

    Head-first: ``q`` ``[B, H, T, K]``, ``x_ext`` ``[B, H, T+W-1, K]`` and ``y_ext``
    (the ``W-1`` pairs before the segment first), ``rho`` ``[B, H, T, W-1]``. One
    diagonal of the band at a time, on slices (no gathered copies)."""
    T, W = q.shape[2], rho.shape[-1] + 1
    lag = 0 if read_after else 1
    if lag:  # tau = t - 1; nothing is open before the first step
        rho = F.pad(rho[:, :, :-1], (0, 0, 1, 0))
    out = None
    for d in range(1, W):
        xd, yd = x_ext[:, :, d - lag:d - lag + T], y_ext[:, :, d - lag:d - lag + T]
        score = torch.einsum("bhtk,bhtk->bht", q, xd) * rho[..., d - 1]
        term = score[..., None] * yd
        out = term if out is None else out + term
    return out


def sliding_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    S0: Optional[torch.Tensor],
    last_key: Optional[torch.Tensor],
    tail: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    window: int,
    eps: float,
    decay_floor: float,
    shift: bool,
    normalize: bool,
    scale_ridge: bool,
    read_after: bool,
    chunk_size: int,
    lengths: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
):
    """Rule 3A over rows of equal length (rows may end in padding: ``lengths`` ``[B]``).

    Time-major inputs: ``q``, ``k`` ``[B, T, H, K]`` (one dtype), ``v`` ``[B, T, H, V]``,
    ``beta``, ``lam``, ``log_gate`` ``[B, T, H]`` (zero ``beta``, ``lam``, ``log_gate`` on
    padding steps makes them no-ops); ``S0`` ``[B, H, K, V]``, ``last_key`` ``[B, H, K]``,
    ``tail = (tail_x, tail_y, tail_valid)`` as in ``FalconState`` (or ``None``).
    The step sizes (mean window energy, ``B_t``, the clamp) are ``ops.step_sizes`` in
    fp32; the scan is ``scalar_decay_chunk``. Returns ``o`` ``[B, T, H, V]`` in ``q``'s
    dtype and, with ``output_final_state``, ``(S_T, tail_x, tail_y, tail_valid)``.
    """
    W = window
    T = q.shape[1]
    f32 = torch.float32
    qh, kh, vh = (t.transpose(1, 2).to(f32) for t in (q, k, v))
    beta_h, lam_h = beta.transpose(1, 2).to(f32), lam.transpose(1, 2).to(f32)
    step_mask = None if lengths is None else torch.arange(T, device=q.device)[None, :] < lengths[:, None]
    x, valid = write_pairs(kh, shift, last_key, step_mask)
    if tail is not None:
        tail = (tail[0].to(f32), tail[1].to(f32), tail[2])
    xs, ys, slot_valid = window_slots(x, vh, valid, W, tail)
    eta_slots, log_gamma = step_sizes(get_rule("3A"), xs, slot_valid, beta_h, lam_h, eps=eps,
                                      decay_floor=decay_floor, normalize=normalize, scale_ridge=scale_ridge)
    del xs, ys
    c = eta_slots[..., 0]  # [B, H, T, W]
    log_a = log_gamma[..., 0]
    if log_gate is not None:
        log_a = log_a + log_gate.transpose(1, 2).to(f32)

    if tail is None:
        x_ext = F.pad(x, (0, 0, W - 1, 0))
        y_ext = F.pad(vh, (0, 0, W - 1, 0))
    else:
        x_ext = torch.cat([tail[0], x], 2)
        y_ext = torch.cat([tail[1], vh], 2)

    # the completed pairs: a rule-1A scan on the pairs delayed by W-1 steps
    e = completed_gains(c, log_a)
    dt = q.dtype
    o, L_T = scalar_decay_chunk(q, x_ext[:, :, :T].transpose(1, 2).to(dt), y_ext[:, :, :T].transpose(1, 2).to(dt),
                                e.transpose(1, 2), log_a.transpose(1, 2), S0, read_after=read_after,
                                chunk_size=chunk_size, output_final_state=output_final_state)
    rho = None
    if W > 1:  # the open pairs: a band of W-1 diagonals
        rho = open_weights(c, log_a)
        o = o.float() + _band(qh, x_ext, y_ext, rho, read_after).transpose(1, 2)
    final = None
    if output_final_state:
        S_T = L_T
        if W > 1:  # the pairs still open after the last step
            r = rho[:, :, -1]  # [B, H, W-1]
            xo, yo = x_ext[:, :, T:], y_ext[:, :, T:]
            S_T = S_T + torch.einsum("bhd,bhdk,bhdv->bhkv", r, xo, yo)
            tx, ty, tv = next_tail(x, vh, valid, W, tail, lengths)
            final = (S_T, tx, ty, tv)
        else:
            final = (S_T, None, None, None)
    return o.to(dt), final
