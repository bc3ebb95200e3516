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
the delayed pairs ``(x_{t-W+1}, y_{t-W+1})`` with the gains ``e_t``, and the outputs
and the final state add the band of open pairs::

    o_t  = L_tau^T q_t + sum_d rho_{tau,d} (q_t . x_{tau+d-W+1}) y_{tau+d-W+1}
    S_T  = L_T + R_T

with ``tau = t`` (read after write) or ``t - 1`` (read before). Pairs before the
segment (``j <= 0``) are the state's tail, so a continued sequence resumes the
windows and the writes that were still open. With ``W = 1`` this is rule 1A exactly
(``e = c``, no open pairs).

Everything per token is a kernel (``sliding_kernels``), behind one autograd function: the
pair energies (one launch forward; their gradient is part of the band's pair kernel), the
step sizes and the gains ``e``, ``rho`` (two launches forward, two backward, on
``[B, T, H]``-sized scalars), the scan (``scalar_decay``) and the band (programs of 16
steps walking its ``W - 1`` diagonals, row-wise products summed over the head
dimension; one launch forward, two backward). The pairs live on an extended time axis
``[prefix | k]`` and ``[tail_y | v]``: the band reads ``k`` and ``v`` in place, and so does the scan (its
delayed read: row ``t`` of ``[prefix | k]`` is row ``t - n_pre`` of ``k``, the first rows
come from the prefix); the band's pair kernel stores the scan's gradient of the delayed
rows back onto ``k``, ``v`` and the prefixes. No shifted copy, no ``[B, H, T, W, K]``
window and no fp32 copy of a feature tensor is formed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from ..kernel_limits import MAX_WINDOW
from . import sliding_kernels as kern
from .chunk_index import chunk_layout
from .launch import cdiv, next_power_of_2
from .scalar_decay import scan_backward, scan_forward

__all__ = ["sliding_chunk", "window_gains", "window_prefix", "MAX_WINDOW"]

_BT = 64  # rows per program of the step-size and gain kernels
_BR = 64  # rows per energy program


# ---- the pairs on the extended axis ----

def window_prefix(q, k, v, last_key, tail, lengths, *, window: int, shift: bool):
    """The pairs that precede the body rows on the extended axis ``[tail | pairs]`` of the
    sliding rules, and every pair's validity.

    Time-major ``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]``; ``last_key``, ``tail`` and
    ``lengths`` as in ``sliding_chunk``. Returns ``x_pre`` ``[B, n_pre, H, K]`` (the ``W - 1``
    tail features, then with ``shift`` the first write feature: the last key, or the
    sentinel's zero), ``y_pre`` ``[B, W - 1, H, V]`` and ``valid_ext`` ``[B, T + W - 1]`` (tail
    slots as flagged, then the steps: padding steps and the sentinel carry no pair). Empty
    tail slots are zeroed, whatever they hold. The pair at extended position ``p >= n_pre``
    has feature ``k[:, p - n_pre]`` and, for ``p >= W - 1``, value ``v[:, p - W + 1]``."""
    B, T, H, K = q.shape
    n, dt, dev = window - 1, q.dtype, q.device
    sentinel = shift and last_key is None  # the first pair of the segment is the sentinel's
    if lengths is None:
        valid_ext = torch.ones(B, n + T, dtype=torch.bool, device=dev)
    else:  # padding steps carry no pair (the tail slots are set below)
        valid_ext = torch.arange(-n, T, device=dev)[None, :] < lengths[:, None]
    if tail is None:  # no pair before the segment: empty slots, zero features (a few tensor ops in all)
        valid_ext[:, :n + int(sentinel)] = False
        x_pre = q.new_zeros(B, n + int(shift), H, K)
        if shift and last_key is not None:
            x_pre[:, n] = last_key.to(dt)
        return x_pre, q.new_zeros(B, n, H, v.shape[-1]), valid_ext
    tail_valid = tail[2]
    valid_ext[:, :n] = tail_valid
    if sentinel:
        valid_ext[:, n] = False
    keep = tail_valid[:, :, None, None]
    x_pre = torch.where(keep, tail[0].transpose(1, 2).to(dt), 0.0)
    y_pre = torch.where(keep, tail[1].transpose(1, 2).to(dt), 0.0)
    if shift:
        first = q.new_zeros(B, 1, H, K) if last_key is None else last_key.to(dt)[:, None]
        x_pre = torch.cat([x_pre, first], 1)
    return x_pre.contiguous(), y_pre.contiguous(), valid_ext


def _ext_rows(prefix: torch.Tensor, body: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rows ``pos`` ``[B, n]`` of the extended axis ``[prefix | body]``: ``[B, n, H, D]``."""
    n_pre, T = prefix.shape[1], body.shape[1]
    b = torch.arange(body.shape[0], device=body.device)[:, None]
    rows = body[b, (pos - n_pre).clamp(0, T - 1)]
    if n_pre == 0:
        return rows
    return torch.where((pos < n_pre)[..., None, None], prefix[b, pos.clamp(max=n_pre - 1)], rows)


# ---- kernels behind autograd ----

def _block(D: int) -> int:
    return min(64, max(16, next_power_of_2(D)))


_BAND_ROWS = 16  # rows per band program (all K and V columns of a row in registers); 16 timed best on an H200


def _band_args(q: torch.Tensor, K: int, V: int, W: int) -> dict:
    return dict(H=q.shape[2], K=K, V=V, W=W, BT=_BAND_ROWS, BK=max(16, next_power_of_2(K)),
                BV=max(16, next_power_of_2(V)))


def _or(t: Optional[torch.Tensor], fallback: torch.Tensor) -> torch.Tensor:
    """A launchable pointer: an empty (or absent) buffer is never read, pass another one."""
    return t if t is not None and t.numel() else fallback


def _delayed(x_pre: torch.Tensor, y_pre: torch.Tensor):
    """The scan's delayed read of the pairs (``scalar_decay.scan_forward``): rows ``0 .. T-1`` of
    ``[x_pre | k]`` and ``[y_pre | v]``; ``None`` when neither has a prefix (``W = 1``, no shift)."""
    return (x_pre, y_pre) if x_pre.shape[1] or y_pre.shape[1] else None


def _lags(H: int, W: int) -> dict:
    return dict(H=H, W=W, WP=max(2, next_power_of_2(W)), BT=_BT)


def _energies(x_pre: torch.Tensor, k: torch.Tensor, window: int) -> torch.Tensor:
    """``n_ext`` ``[B, T+W-1, H]`` fp32: ``||x_p||^2`` of the pairs on the extended axis ``[x_pre | k]``."""
    B, T, H, K = k.shape
    TE = T + window - 1
    n_ext = torch.empty(B, TE, H, dtype=torch.float32, device=k.device)
    kern.energy_fwd[(cdiv(TE * H, _BR), B)](k, _or(x_pre, k), n_ext, T, TE, x_pre.shape[1], H=H, D=K, BR=_BR,
                                            BD=_block(K))
    return n_ext


def _gain_flags(normalize: bool, scale_ridge: bool, log_gate: Optional[torch.Tensor]) -> dict:
    """The step-size kernels' switches."""
    return dict(NORMALIZE=bool(normalize), SCALE_RIDGE=bool(scale_ridge), HAS_GATE=log_gate is not None)


def _gains_forward(n_ext, valid_ext, beta, lam, log_gate, window, eps, decay_floor, flags):
    """``step_fwd`` (``g = eta / B``, ``log a``) then ``gains_fwd``: fp32 ``g``, ``log_a``, ``e`` ``[B, T, H]``
    and ``rho`` ``[B, T, H, W-1]``."""
    B, T, H = beta.shape
    grid, lags = (cdiv(T, _BT), B * H), _lags(H, window)
    g, log_a, e = (torch.empty(B, T, H, dtype=torch.float32, device=beta.device) for _ in range(3))
    rho = torch.empty(B, T, H, window - 1, dtype=torch.float32, device=beta.device)
    kern.step_fwd[grid](n_ext, valid_ext, beta, lam, log_gate, g, log_a, T, eps, decay_floor, **lags, **flags)
    kern.gains_fwd[grid](g, log_a, valid_ext, e, _or(rho, e), T, **lags)
    return g, log_a, e, rho


def _gains_backward(n_ext, valid_ext, beta, lam, log_gate, g, log_a, de, drho, dlog_a, window, eps, decay_floor,
                    flags):
    """``gains_bwd`` then ``step_bwd`` from the fp32 ``de``, ``drho``, ``dlog_a``: ``d_beta``, ``d_lam``,
    ``d_gate`` (in their inputs' dtypes; ``None`` without a gate) and fp32 ``d_stat`` ``[B, T, H]``, the
    gradient of each step's mean energy over its pair count (``_WindowGains.backward``, or
    ``band_bwd_pairs`` within the rule, turns it into the energies' gradient)."""
    B, T, H = beta.shape
    grid, lags = (cdiv(T, _BT), B * H), _lags(H, window)
    lag_a, lag_d = (torch.empty(B, T, H, lags["WP"], dtype=torch.float32, device=g.device) for _ in range(2))
    kern.gains_bwd[grid](g, log_a, valid_ext, de, _or(drho, de), lag_a, lag_d, T, **lags)
    d_beta, d_lam, d_stat = torch.empty_like(beta), torch.empty_like(lam), torch.empty_like(g)
    d_gate = None if log_gate is None else torch.empty_like(log_gate)
    kern.step_bwd[grid](n_ext, valid_ext, beta, lam, log_gate, lag_a, lag_d, dlog_a, d_beta, d_lam, d_gate,
                        d_stat, T, eps, decay_floor, **lags, **flags)
    return d_beta, d_lam, d_gate, d_stat


class _WindowGains(torch.autograd.Function):
    """``window_gains``: ``_gains_forward``; backward ``_gains_backward``, then each step's energy gradient
    spread over the pairs of its window."""

    @staticmethod
    def forward(ctx, n_ext, valid_ext, beta, lam, log_gate, window, eps, decay_floor, flags):
        g, log_a, e, rho = _gains_forward(n_ext, valid_ext, beta, lam, log_gate, window, eps, decay_floor, flags)
        ctx.save_for_backward(n_ext, valid_ext, beta, lam, log_gate, g, log_a)
        ctx.options = (window, eps, decay_floor, flags)
        return e, rho, log_a

    @staticmethod
    def backward(ctx, de, drho, dlog_a):
        n_ext, valid_ext, beta, lam, log_gate, g, log_a = ctx.saved_tensors
        window, eps, decay_floor, flags = ctx.options
        B, T, H = beta.shape
        de = torch.zeros_like(g) if de is None else de.float().contiguous()
        dlog_a = torch.zeros_like(g) if dlog_a is None else dlog_a.float().contiguous()
        drho = g.new_zeros(B, T, H, window - 1) if drho is None else drho.float().contiguous()
        d_beta, d_lam, d_gate, d_stat = _gains_backward(n_ext, valid_ext, beta, lam, log_gate, g, log_a, de, drho,
                                                        dlog_a, window, eps, decay_floor, flags)
        # dn_p = [p valid] sum_{m < W} d_stat_{p-m}: the steps whose window holds extended position p
        spread = F.pad(d_stat, (0, 0, window - 1, window - 1)).unfold(1, window, 1).sum(-1)  # [B, T+W-1, H]
        dn_ext = spread * valid_ext[..., None]
        return dn_ext, None, d_beta, d_lam, d_gate, None, None, None, None


def window_gains(
    n_ext: torch.Tensor,
    valid_ext: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    *,
    window: int,
    eps: float,
    decay_floor: float,
    normalize: bool,
    scale_ridge: bool,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step sizes of rule 3A (the equations of ``ops.step_sizes``) turned into scan gains.

    ``n_ext`` ``[B, T+W-1, H]``: ``||x_j||^2`` of the pairs on the extended axis (the
    ``W-1`` tail pairs first); ``valid_ext`` ``[B, T+W-1]`` bool; ``beta``, ``lam``,
    ``log_gate`` ``[B, T, H]``. Step ``t``'s window holds the extended positions
    ``t .. t+W-1``; with ``B_t`` its real pairs and ``Ebar_t`` their mean energy::

        eta_t = beta_t / (Ebar_t + lambda_t + eps),   log a_t = log1p(-min(eta_t lambda_t, 1 - decay_floor)) + g_t
        c_{t,m} = eta_t [t-m in I_t] / B_t

    Returns fp32 ``e`` ``[B, T, H]`` (gain of the pair completed at ``t``), ``rho``
    ``[B, T, H, W-1]`` (``rho[t, d-1]`` weighs the open pair at extended position
    ``t+d`` in ``S_t``) and ``log_a`` ``[B, T, H]``; differentiable in ``n_ext``,
    ``beta``, ``lam`` and ``log_gate``.
    """
    flags = _gain_flags(normalize, scale_ridge, log_gate)
    return _WindowGains.apply(n_ext.float().contiguous(), valid_ext.to(torch.uint8).contiguous(),
                              beta.contiguous(), lam.contiguous(),
                              None if log_gate is None else log_gate.contiguous(), int(window), float(eps),
                              float(decay_floor), flags)


class _SlidingRule(torch.autograd.Function):
    """Rule 3A end to end (see the module docstring): the pair energies, the step sizes and
    gains, the rule-1A scan reading the delayed pairs in place, and the open band.

    ``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]`` (one dtype), ``x_pre``
    ``[B, n_pre, H, K]``, ``y_pre`` ``[B, W-1, H, V]`` (the extended-axis prefixes),
    ``valid_ext`` ``[B, T+W-1]`` uint8, ``beta``, ``lam``, ``log_gate`` ``[B, T, H]``, ``S0``
    ``[B, H, K, V]`` fp32 or ``None``. Returns ``o``, ``L_T`` (``None`` unless ``want_final``)
    and ``rho`` at the last step ``[B, H, W-1]`` fp32 (the weights of the pairs still open).

    One function, so the backward chains its kernels without PyTorch glue: the scan's and the
    band's gradients reach ``e``, ``rho`` and ``log a``, the step-size kernels turn them into
    the gradients of ``beta``, ``lam``, ``log_gate`` and of every step's mean energy, and the
    band's pair kernel adds the energies' part (``2 x_p dn_p``) to the pairs' gradient."""

    @staticmethod
    def forward(ctx, q, k, v, x_pre, y_pre, valid_ext, beta, lam, log_gate, S0, window, eps, decay_floor, flags,
                read_after, chunk_size, want_final):
        B, T, H, K = q.shape
        V, W = v.shape[-1], window
        n_ext = _energies(x_pre, k, W)
        g, log_a, e, rho = _gains_forward(n_ext, valid_ext, beta, lam, log_gate, W, eps, decay_floor, flags)
        layout = chunk_layout(B, T, chunk_size, None)
        o, h, L_T = scan_forward(q, k, v, e, log_a, S0, layout, read_after, want_final, _delayed(x_pre, y_pre))
        if W > 1:
            kern.band_fwd[(cdiv(T, _BAND_ROWS), B * H)](
                q, k, _or(x_pre, k), v, _or(y_pre, v), rho, o, T, x_pre.shape[1], W - 1, **_band_args(q, K, V, W),
                LAG=1 - int(read_after))
        ctx.save_for_backward(q, k, v, x_pre, y_pre, valid_ext, n_ext, beta, lam, log_gate, g, log_a, e, rho, h, S0)
        ctx.layout, ctx.options = layout, (W, eps, decay_floor, flags, read_after)
        return o, L_T, rho[:, T - 1].clone() if want_final and W > 1 else None

    @staticmethod
    def backward(ctx, do, dL_T, drho_last):
        q, k, v, x_pre, y_pre, valid_ext, n_ext, beta, lam, log_gate, g, log_a, e, rho, h, S0 = ctx.saved_tensors
        W, eps, decay_floor, flags, read_after = ctx.options
        B, T, H, K = q.shape
        V = v.shape[-1]
        n_x, n_y = x_pre.shape[1], W - 1
        args = dict(**_band_args(q, K, V, W), LAG=0 if read_after else 1)
        do = do.contiguous()
        dq, dx_del, dy_del, de, dlog_a, dS0 = scan_backward(
            q, k, v, e, log_a, h, S0, do, None if dL_T is None else dL_T.contiguous(), ctx.layout, read_after,
            _delayed(x_pre, y_pre))
        drho = torch.empty_like(rho)
        if W > 1:
            kern.band_bwd_rows[(cdiv(T, _BAND_ROWS), B * H)](
                q, k, _or(x_pre, k), v, _or(y_pre, v), do, rho, dq, drho, T, n_x, n_y, **args)
            if drho_last is not None:  # the open pairs of the final state
                drho[:, T - 1] += drho_last
        d_beta, d_lam, d_gate, d_stat = _gains_backward(n_ext, valid_ext, beta, lam, log_gate, g, log_a, de, drho,
                                                        dlog_a, W, eps, decay_floor, flags)
        # a pair's gradient stays in place where nothing delays it (W = 1: y, and x without the shift)
        dk = dx_del if n_x == 0 else torch.empty_like(k)
        dv = dy_del if n_y == 0 else torch.empty_like(v)
        dx_pre, dy_pre = torch.empty_like(x_pre), torch.empty_like(y_pre)
        kern.band_bwd_pairs[(cdiv(T + n_x, _BAND_ROWS), B * H)](
            q, do, k, _or(x_pre, k), v, _or(y_pre, v), _or(rho, dq), dx_del, dy_del, d_stat, valid_ext, dk,
            _or(dx_pre, dk), dv, _or(dy_pre, dv), T, n_x, n_y, **args, num_warps=8)
        return (dq, dk, dv, dx_pre, dy_pre, None, d_beta, d_lam, d_gate, dS0) + (None,) * 7


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
    The energies, step sizes and gains (fp32), the scan and the band are kernels, behind one
    autograd function.
    Returns ``o`` ``[B, T, H, V]`` in ``q``'s dtype and, with ``output_final_state``,
    ``(S_T, tail_x, tail_y, tail_valid)`` (fp32 states).
    """
    W = window
    if W > MAX_WINDOW:
        raise NotImplementedError(f"window={W} is above {MAX_WINDOW}, the widest band the Triton kernels hold")
    B, T, H, K = q.shape
    dev = q.device
    q, k, v = (t.contiguous() for t in (q, k, v))

    x_pre, y_pre, valid_ext = window_prefix(q, k, v, last_key, tail, lengths, window=W, shift=shift)
    flags = _gain_flags(normalize, scale_ridge, log_gate)
    beta, lam = beta.contiguous(), lam.contiguous()
    log_gate = None if log_gate is None else log_gate.contiguous()
    S0 = None if S0 is None else S0.float().contiguous()
    o, L_T, rho_last = _SlidingRule.apply(q, k, v, x_pre, y_pre, valid_ext.view(torch.uint8), beta, lam, log_gate,
                                          S0, W, eps, decay_floor, flags, read_after, chunk_size, output_final_state)
    final = None
    if output_final_state:
        if W == 1:
            return o, (L_T, None, None, None)
        steps = torch.arange(W - 1, device=dev)[None, :]
        # the pairs still open after the last step (padding steps are no-ops, so step T-1 holds)
        pos = T + steps.expand(B, W - 1)
        xo, yo = _ext_rows(x_pre, k, pos).float(), _ext_rows(y_pre, v, pos).float()
        S_T = L_T + torch.einsum("bhd,bdhk,bdhv->bhkv", rho_last, xo, yo)
        # the last W-1 pairs of every row, oldest first (without padding: the open pairs)
        end, tx, ty = pos, xo, yo
        if lengths is not None:
            end = lengths.to(dev)[:, None] + steps
            tx, ty = _ext_rows(x_pre, k, end).float(), _ext_rows(y_pre, v, end).float()
        final = (S_T, tx.transpose(1, 2), ty.transpose(1, 2), valid_ext.gather(1, end))
    return o, final
