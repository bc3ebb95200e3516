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

Everything per token is a kernel (``sliding_kernels``): the pair energies, the step
sizes and the gains ``e``, ``rho`` (two launches forward, three backward, on
``[B, T, H]``-sized scalars), the scan (``scalar_decay``) and the band (programs of 16
steps walking its ``W - 1`` diagonals, row-wise products summed over the head
dimension; one launch forward, two backward). The pairs live on an extended time axis ``[prefix | k]`` and
``[tail_y | v]``: the band reads ``k`` and ``v`` in place, and the delayed pairs the
scan reads are one copy, rebuilt in the backward rather than saved. No
``[B, H, T, W, K]`` window and no fp32 copy of a feature tensor is formed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import sliding_kernels as kern
from .chunk_index import chunk_layout
from .launch import cdiv, next_power_of_2
from .scalar_decay import scan_backward, scan_forward
from .shift import advance_rows, delay_rows

__all__ = ["sliding_chunk", "window_gains", "window_prefix", "MAX_WINDOW"]

_BT = 64  # rows per program of the step-size and gain kernels
MAX_WINDOW = 65  # the widest window tested on the GPU (the gain kernels hold [_BT, W] tiles in registers)
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
    return dict(H=q.shape[2], K=K, V=V, W=W, BT=_BAND_ROWS, BK=_block(K), BV=_block(V),
                BKF=max(16, next_power_of_2(K)), BVF=max(16, next_power_of_2(V)))


def _or(t: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """A launchable pointer: an empty buffer is never read, pass another one."""
    return t if t.numel() else fallback


class _Energy(torch.autograd.Function):
    """``n = ||k||^2`` per row ``[B, T, H]`` fp32 (no fp32 copy of ``k``)."""

    @staticmethod
    def forward(ctx, k):
        rows, K = k.numel() // k.shape[-1], k.shape[-1]
        n = torch.empty(k.shape[:-1], dtype=torch.float32, device=k.device)
        kern.energy_fwd[(cdiv(rows, _BR),)](k, n, rows, K=K, BR=_BR, BK=_block(K))
        ctx.save_for_backward(k)
        return n

    @staticmethod
    def backward(ctx, dn):
        (k,) = ctx.saved_tensors
        rows, K = k.numel() // k.shape[-1], k.shape[-1]
        dk = torch.empty_like(k)
        kern.energy_bwd[(cdiv(rows, _BR),)](k, dn.float().contiguous(), dk, rows, K=K, BR=_BR, BK=_block(K))
        return dk


class _WindowGains(torch.autograd.Function):
    """``window_gains``: ``step_fwd`` (``g = eta / B``, ``log a``) then ``gains_fwd``;
    backward ``gains_bwd``, ``step_bwd``, ``energy_spread``."""

    @staticmethod
    def forward(ctx, n_ext, valid_ext, beta, lam, log_gate, window, eps, decay_floor, normalize, scale_ridge):
        B, T, H = beta.shape
        W, grid = window, (cdiv(T, _BT), B * H)
        f32 = dict(dtype=torch.float32, device=beta.device)
        lags = dict(H=H, W=W, WP=max(2, next_power_of_2(W)), BT=_BT)
        flags = dict(NORMALIZE=normalize, SCALE_RIDGE=scale_ridge, HAS_GATE=log_gate is not None)
        g, log_a, e = (torch.empty(B, T, H, **f32) for _ in range(3))
        rho = torch.empty(B, T, H, W - 1, **f32)
        kern.step_fwd[grid](n_ext, valid_ext, beta, lam, log_gate, g, log_a, T, eps, decay_floor, **lags, **flags)
        kern.gains_fwd[grid](g, log_a, valid_ext, e, _or(rho, e), T, **lags)
        ctx.save_for_backward(n_ext, valid_ext, beta, lam, log_gate, g, log_a)
        ctx.options = (eps, decay_floor, lags, flags)
        return e, rho, log_a

    @staticmethod
    def backward(ctx, de, drho, dlog_a):
        n_ext, valid_ext, beta, lam, log_gate, g, log_a = ctx.saved_tensors
        eps, decay_floor, lags, flags = ctx.options
        B, T, H = beta.shape
        W, WP, grid = lags["W"], lags["WP"], (cdiv(T, _BT), B * H)
        de = torch.zeros_like(g) if de is None else de.float().contiguous()
        dlog_a = torch.zeros_like(g) if dlog_a is None else dlog_a.float().contiguous()
        drho = g.new_zeros(B, T, H, W - 1) if drho is None else drho.float().contiguous()
        lag_a, lag_d = g.new_empty(B, T, H, WP), g.new_empty(B, T, H, WP)
        kern.gains_bwd[grid](g, log_a, valid_ext, de, _or(drho, de), lag_a, lag_d, T, **lags)
        d_beta, d_lam, d_gate, d_stat = (torch.empty_like(g) for _ in range(4))
        kern.step_bwd[grid](n_ext, valid_ext, beta, lam, log_gate, lag_a, lag_d, dlog_a, d_beta, d_lam, d_gate,
                            d_stat, T, eps, decay_floor, **lags, **flags)
        dn_ext = torch.empty_like(n_ext)
        kern.energy_spread[(cdiv(T + W - 1, _BT), B * H)](d_stat, valid_ext, dn_ext, T, **lags)
        d_gate = None if log_gate is None else d_gate.to(log_gate.dtype)
        return dn_ext, None, d_beta.to(beta.dtype), d_lam.to(lam.dtype), d_gate, None, None, None, None, None


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
    return _WindowGains.apply(n_ext.float().contiguous(), valid_ext.to(torch.uint8).contiguous(),
                              beta.contiguous(), lam.contiguous(),
                              None if log_gate is None else log_gate.contiguous(), int(window), float(eps),
                              float(decay_floor), bool(normalize), bool(scale_ridge))


class _SlidingScan(torch.autograd.Function):
    """The rule-1A scan on the delayed pairs plus the open band (see the module docstring).

    ``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]`` (one dtype), ``x_pre``
    ``[B, n_pre, H, K]``, ``y_pre`` ``[B, W-1, H, V]`` (the extended-axis prefixes),
    ``e``, ``log_a`` ``[B, T, H]`` and ``rho`` ``[B, T, H, W-1]`` fp32 (``None`` when
    ``W = 1``), ``S0`` ``[B, H, K, V]`` fp32 or ``None``. Returns ``o`` and ``L_T``."""

    @staticmethod
    def forward(ctx, q, k, v, x_pre, y_pre, e, rho, log_a, S0, window, read_after, chunk_size, want_final):
        B, T, H, K = q.shape
        V = v.shape[-1]
        layout = chunk_layout(B, T, chunk_size, None)
        o, h, L_T = scan_forward(q, delay_rows(x_pre, k), delay_rows(y_pre, v), e, log_a, S0, layout, read_after,
                                 want_final)
        if window > 1:
            kern.band_fwd[(cdiv(T, _BAND_ROWS), B * H)](
                q, k, _or(x_pre, k), v, y_pre, rho, o, T, x_pre.shape[1], window - 1, **_band_args(q, K, V, window),
                LAG=1 - int(read_after))
        ctx.save_for_backward(q, k, v, x_pre, y_pre, e, rho, log_a, h, S0)
        ctx.layout, ctx.window, ctx.read_after = layout, window, read_after
        return o, L_T

    @staticmethod
    def backward(ctx, do, dL_T):
        q, k, v, x_pre, y_pre, e, rho, log_a, h, S0 = ctx.saved_tensors
        W, lag = ctx.window, 0 if ctx.read_after else 1
        B, T, H, K = q.shape
        V = v.shape[-1]
        n_x, n_y = x_pre.shape[1], W - 1
        do = do.contiguous()
        dq, dx_del, dy_del, de, dlog_a, dS0 = scan_backward(
            q, delay_rows(x_pre, k), delay_rows(y_pre, v), e, log_a, h, S0, do,
            None if dL_T is None else dL_T.contiguous(), ctx.layout, ctx.read_after)
        if W == 1:  # no band: only the shift, back onto k and the first write feature
            m = min(n_x, T)
            dk = advance_rows(dx_del, n_x)
            dx_pre = torch.cat([dx_del[:, :n_x], dx_del.new_zeros(B, n_x - m, H, K)], 1)
            return dq, dk, dy_del, dx_pre, torch.zeros_like(y_pre), de, None, dlog_a, dS0, None, None, None, None
        args = dict(**_band_args(q, K, V, W), LAG=lag)
        drho = torch.zeros_like(rho)  # the rows whose step is past the end stay 0
        kern.band_bwd_rows[(cdiv(T, _BAND_ROWS), B * H)](
            q, k, _or(x_pre, k), v, y_pre, do, rho, dq, drho, T, n_x, n_y, **args)
        dk, dx_pre, dv, dy_pre = (torch.empty_like(t) for t in (k, x_pre, v, y_pre))
        kern.band_bwd_pairs[(cdiv(T + n_x, _BAND_ROWS), B * H)](
            q, do, k, _or(x_pre, k), v, y_pre, rho, dx_del, dy_del, dk, _or(dx_pre, dk), dv, dy_pre, T, n_x, n_y,
            **args, num_warps=8)
        return dq, dk, dv, dx_pre, dy_pre, de, drho, dlog_a, dS0, None, None, None, None


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
    The step sizes and gains are ``window_gains`` (fp32); the scan and the band are kernels.
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

    # step sizes and gains from the pair energies (the body rows of x are rows of k)
    n_ext = torch.cat([(x_pre.float() ** 2).sum(-1), _Energy.apply(k)], 1)[:, :T + W - 1]
    e, rho, log_a = window_gains(n_ext, valid_ext, beta, lam, log_gate, window=W, eps=eps, decay_floor=decay_floor,
                                 normalize=normalize, scale_ridge=scale_ridge)
    rho = rho if W > 1 else None

    S0 = None if S0 is None else S0.float().contiguous()
    o, L_T = _SlidingScan.apply(q, k, v, x_pre, y_pre, e, rho, log_a, S0, W, read_after, chunk_size,
                                output_final_state)
    final = None
    if output_final_state:
        if W == 1:
            return o, (L_T, None, None, None)
        steps = torch.arange(W - 1, device=dev)[None, :]
        # the pairs still open after the last step (padding steps are no-ops, so step T-1 holds)
        pos = T + steps.expand(B, W - 1)
        xo, yo = _ext_rows(x_pre, k, pos).float(), _ext_rows(y_pre, v, pos).float()
        S_T = L_T + torch.einsum("bhd,bdhk,bdhv->bhkv", rho[:, T - 1], xo, yo)
        # the last W-1 pairs of every row, oldest first
        end = pos if lengths is None else lengths.to(dev)[:, None] + steps
        tx = _ext_rows(x_pre, k, end).transpose(1, 2).float()
        ty = _ext_rows(y_pre, v, end).transpose(1, 2).float()
        final = (S_T, tx, ty, valid_ext.gather(1, end))
    return o, final
