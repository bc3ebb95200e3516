r"""Triton kernels of rule 3A (``ops.triton.sliding``): the pair energies, the step
sizes and gains of the decomposition, and the band of open pairs.

Pairs live on an *extended* time axis: position ``p`` holds pair ``p - W + 1`` of the
segment, so the ``W - 1`` pairs before the segment (the state's tail) come first.
An extended row is read from two buffers, a short ``prefix`` ``[B, n_pre, H, D]``
(positions ``p < n_pre``) and the ``body`` ``[B, T, H, D]`` (position ``p`` is body
row ``p - n_pre``): the keys ``k`` with the tail and the first write feature in front
(``n_pre = W`` with the shift, ``W - 1`` without) and the values ``v`` with the tail
values in front (``n_pre = W - 1``). No shifted copy of ``k`` or ``v`` is made.

With ``tau = t - LAG`` (``LAG = 0`` read after write, 1 read before) the band adds to
every output::

    o_t += sum_{d=1}^{W-1} rho_{tau,d} (q_t . x_{tau+d}) y_{tau+d}

A program owns ``BT`` rows of one ``(b, h)``, holds their ``q`` (and ``do``) rows in
registers (all ``K`` and ``V`` columns: ``BK >= K``, ``BV >= V``) and walks the band one
diagonal ``d`` at a time: row by row, ``q_t . x_{tau+d}`` is a product summed over the key
dimension, and ``y_{tau+d}`` is added with that weight. Each diagonal loads one ``x`` and
one ``y`` row per step, and no masked-out score is computed; two masked ``BT x BT`` score
tiles per block (its own pairs and the next block's) would compute ``2 BT / (W - 1)``
times the needed scores.

* ``energy_fwd``: ``n = ||x_p||^2`` per extended position (fp32); its gradient ``2 x_p dn_p``
  is part of ``band_bwd_pairs``.
* ``step_fwd``, ``gains_fwd`` / ``gains_bwd``, ``step_bwd``: the
  step sizes (``ops.step_sizes``) and the gains ``e``, ``rho`` (see below), forward and
  backward, on ``[B, T, H]`` scalars.
* ``band_fwd``: the band added in place to the scan's outputs.
* ``band_bwd_rows``: per step, ``d rho`` and the band's part of ``dq`` (in place).
* ``band_bwd_pairs``: per extended position, the band's part of ``dx`` and ``dy`` plus
  the scan's gradient of the delayed pairs and the energies' gradient, stored to the prefix
  or the body gradient.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .step_size_kernels import _log1p, ridge_terms


@triton.jit
def _ext_rows(prefix, body, i_b, pos, i_h, m_row, n_pre, T, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """Pointers ``[BT, BD]`` to the rows of the extended positions ``pos`` ``[BT]`` (columns
    ``0 .. BD-1``, ``BD >= D``) and where they exist. The select is between whole pointer tiles:
    selecting row pointers before adding the columns would lose the vectorized access."""
    o_d = tl.arange(0, BD)[None, :]
    p = pos[:, None]
    ptr = tl.where(p < n_pre, prefix + ((i_b * n_pre + p) * H + i_h) * D + o_d,
                   body + ((i_b * T + p - n_pre) * H + i_h) * D + o_d)
    return ptr, (m_row & (pos >= 0) & (pos < n_pre + T))[:, None] & (o_d < D)


@triton.jit
def _ext_tile(prefix, body, i_b, pos, i_h, m_row, n_pre, T, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr):
    """``[BT, BD]`` fp32: the rows of the extended positions ``pos`` (0 where missing)."""
    ptr, m = _ext_rows(prefix, body, i_b, pos, i_h, m_row, n_pre, T, H, D, BD)
    return tl.load(ptr, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _rows_tile(ptr, m_rows, D: tl.constexpr, BD: tl.constexpr):
    """``[BT, BD]`` fp32: the rows at the pointers ``ptr`` (``BD >= D``; 0 where missing)."""
    o_d = tl.arange(0, BD)
    return tl.load(ptr[:, None] + o_d[None, :], mask=m_rows[:, None] & (o_d[None, :] < D), other=0.0).to(tl.float32)


@triton.jit
def _band_weight(rho, i_b, i_h, o_tau, m_tau, d, T, H: tl.constexpr, W: tl.constexpr):
    """``rho_{tau, d}`` ``[BT]`` on one diagonal ``1 <= d < W``."""
    return tl.load(rho + ((i_b * T + o_tau) * H + i_h) * (W - 1) + d - 1, mask=m_tau, other=0.0)


@triton.jit
def energy_fwd(x_body, x_pre, n_ext, T, TE, n_pre, H: tl.constexpr, D: tl.constexpr, BR: tl.constexpr,
               BD: tl.constexpr):
    """Grid ``(cdiv(TE * H, BR), B)``: ``n_ext[b, p, h] = ||x_p||^2`` (fp32) for the extended
    positions ``p < TE`` of ``[x_pre | x_body]``, ``BR`` rows ``(p, h)`` per program."""
    i_b = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    m_r = r < TE * H
    r2 = r[:, None]  # row (p, h) of the extended axis: prefix row r, or body row r - n_pre * H
    acc = tl.zeros([BR], dtype=tl.float32)
    for i_d in range(tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)[None, :]
        ptr = tl.where(r2 < n_pre * H, x_pre + (i_b * n_pre * H + r2) * D + o_d,
                       x_body + (i_b * T * H + r2 - n_pre * H) * D + o_d)
        b = tl.load(ptr, mask=m_r[:, None] & (o_d < D), other=0.0).to(tl.float32)
        acc += tl.sum(b * b, axis=1)
    tl.store(n_ext + i_b * TE * H + r, acc, mask=m_r)


@triton.jit
def _band_program_rows(T, H: tl.constexpr, BT: tl.constexpr, LAG: tl.constexpr):
    """The steps ``tau`` of a band program of grid ``(cdiv(T, BT), B * H)``: batch row, head, ``tau``
    ``[BT]``, whether its output step ``t = tau + LAG`` exists, and the flat row index of ``t``."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    o_tau = i_t * BT + tl.arange(0, BT)
    o_t = o_tau + LAG
    m_t = o_t < T
    return i_b, i_h, o_tau, m_t, (i_b * T + o_t) * H + i_h


@triton.jit
def band_fwd(
    q, x_body, x_pre, y_body, y_pre, rho, o, T, n_pre_x, n_pre_y,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LAG: tl.constexpr,
):
    """Grid ``(cdiv(T, BT), B * H)``, rows ``tau`` of one block (``BK >= K``, ``BV >= V``), in
    place on the scan's outputs: ``o_t += sum_d rho_{tau,d} (q_t . x_{tau+d}) y_{tau+d}``."""
    i_b, i_h, o_tau, m_t, row = _band_program_rows(T, H, BT, LAG)
    o_v = tl.arange(0, BV)
    m_tv = m_t[:, None] & (o_v[None, :] < V)
    b_q = _rows_tile(q + row * K, m_t, K, BK)
    acc = tl.load(o + row[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    for d in range(1, W):
        pos = o_tau + d
        s = tl.sum(b_q * _ext_tile(x_pre, x_body, i_b, pos, i_h, m_t, n_pre_x, T, H, K, BK), axis=1)
        w = _band_weight(rho, i_b, i_h, o_tau, m_t, d, T, H, W)
        acc += (w * s)[:, None] * _ext_tile(y_pre, y_body, i_b, pos, i_h, m_t, n_pre_y, T, H, V, BV)
    tl.store(o + row[:, None] * V + o_v[None, :], acc.to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def band_bwd_rows(
    q, x_body, x_pre, y_body, y_pre, do, rho, dq, drho, T, n_pre_x, n_pre_y,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LAG: tl.constexpr,
):
    """Grid ``(cdiv(T, BT), B * H)``, rows ``tau``: ``drho_{tau,d} = sq sd`` (0 where the step
    ``t = tau + LAG`` is past the end) and, in place, ``dq_t += sum_d rho_{tau,d} sd x_{tau+d}``
    (``sq = q_t . x_{tau+d}``, ``sd = do_t . y_{tau+d}``)."""
    i_b, i_h, o_tau, m_t, row = _band_program_rows(T, H, BT, LAG)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k[None, :] < K)
    b_q = _rows_tile(q + row * K, m_t, K, BK)
    b_do = _rows_tile(do + row * V, m_t, V, BV)
    acc = tl.load(dq + row[:, None] * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
    for d in range(1, W):
        pos = o_tau + d
        b_x = _ext_tile(x_pre, x_body, i_b, pos, i_h, m_t, n_pre_x, T, H, K, BK)
        sq = tl.sum(b_q * b_x, axis=1)
        sd = tl.sum(b_do * _ext_tile(y_pre, y_body, i_b, pos, i_h, m_t, n_pre_y, T, H, V, BV), axis=1)
        tl.store(drho + ((i_b * T + o_tau) * H + i_h) * (W - 1) + d - 1, sq * sd, mask=o_tau < T)
        w = _band_weight(rho, i_b, i_h, o_tau, m_t, d, T, H, W)
        acc += (w * sd)[:, None] * b_x
    tl.store(dq + row[:, None] * K + o_k[None, :], acc.to(dq.dtype.element_ty), mask=m_tk)


@triton.jit
def band_bwd_pairs(
    q, do, x_body, x_pre, y_body, y_pre, rho, dx_del, dy_del, d_stat, valid_ext, dx_body, dx_pre, dy_body, dy_pre,
    T, n_pre_x, n_pre_y,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, BT: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, LAG: tl.constexpr,
):
    """Grid ``(cdiv(T + n_pre_x, BT), B * H)`` over extended positions ``p``:
    ``dx_p = dx_del_p + 2 dn_p x_p + sum_d rho_{p-d,d} (do_t . y_p) q_t`` and
    ``dy_p = dy_del_p + sum_d rho_{p-d,d} (q_t . x_p) do_t`` (``t = p - d + LAG``), stored to
    the prefix or the body; ``dn_p = v_p sum_{m<W} d_stat_{p-m}`` is the gradient of the energy
    ``||x_p||^2`` (the steps whose window holds ``p``). Without a prefix (``n_pre = 0``) the
    output may be the delayed gradient itself: each row is read, then written, by one program."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    pos = i_t * BT + tl.arange(0, BT)
    b_x = _ext_tile(x_pre, x_body, i_b, pos, i_h, pos >= 0, n_pre_x, T, H, K, BK)
    b_y = _ext_tile(y_pre, y_body, i_b, pos, i_h, pos >= 0, n_pre_y, T, H, V, BV)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    delayed = (pos < T)[:, None]
    del_row = (i_b * T + pos) * H + i_h
    acc_x = tl.load(dx_del + del_row[:, None] * K + o_k[None, :], mask=delayed & (o_k[None, :] < K),
                    other=0.0).to(tl.float32)
    acc_y = tl.load(dy_del + del_row[:, None] * V + o_v[None, :], mask=delayed & (o_v[None, :] < V),
                    other=0.0).to(tl.float32)
    TE = T + W - 1
    dn = tl.zeros([BT], dtype=tl.float32)
    for m in range(W):
        s = pos - m
        dn += tl.load(d_stat + (i_b * T + s) * H + i_h, mask=(s >= 0) & (s < T), other=0.0)
    ok = tl.load(valid_ext + i_b * TE + pos, mask=pos < TE, other=0) != 0
    acc_x += tl.where(ok, 2.0 * dn, 0.0)[:, None] * b_x
    for d in range(1, W):
        o_tau = pos - d
        o_t = o_tau + LAG
        m_c = (o_tau >= 0) & (o_t < T)
        row = (i_b * T + o_t) * H + i_h
        w = _band_weight(rho, i_b, i_h, o_tau, m_c, d, T, H, W)
        b_q = _rows_tile(q + row * K, m_c, K, BK)
        b_do = _rows_tile(do + row * V, m_c, V, BV)
        acc_x += (w * tl.sum(b_y * b_do, axis=1))[:, None] * b_q
        acc_y += (w * tl.sum(b_x * b_q, axis=1))[:, None] * b_do
    dx_ptr, m_dx = _ext_rows(dx_pre, dx_body, i_b, pos, i_h, pos >= 0, n_pre_x, T, H, K, BK)
    tl.store(dx_ptr, acc_x.to(dx_body.dtype.element_ty), mask=m_dx)
    dy_ptr, m_dy = _ext_rows(dy_pre, dy_body, i_b, pos, i_h, pos >= 0, n_pre_y, T, H, V, BV)
    tl.store(dy_ptr, acc_y.to(dy_body.dtype.element_ty), mask=m_dy)


# ---- per-token scalars: step sizes, completed gains and open weights ----
#
# With g_s = eta_s / B_s (the window of step s holds the extended positions s .. s+W-1),
# the lag tiles G[t, i] = g_{t-i}, L[t, i] = log a_{t-i} (i < W) and
# U[t, i] = L[t, 0] + ... + L[t, i-1] (the decay over the i steps after t-i), the gains are
#
#     P[t, j] = sum_{i<=j} G[t, i] exp(U[t, i]),   e_t = v_t P[t, W-1],   rho_{t,d} = v_{t+d} P[t, W-1-d]
#
# (v_p: validity of the pair at extended position p). Backward, with dP[t, j] the gradient
# reaching P[t, j], Q = its suffix sums over j and A = exp(U) Q:
#
#     dg_r = sum_i A[r+i, i],    dlog a_r = sum_a D[r+a, a],   D[t, a] = sum_{i>a} G[t, i] A[t, i]


@triton.jit
def _step_terms(n_ext, valid_ext, beta, lam, log_gate, i_b, i_h, s, m_s, T, eps, decay_floor,
                H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, NORMALIZE: tl.constexpr,
                SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr):
    """The equations of ``ops.step_sizes`` for rule 3A at the steps ``s`` (no-ops where
    ``m_s`` is False): ``1 / B_s``, ``Ebar_s``, ``lambda_s``, the denominator, whether
    ``eta_s`` is live, ``eta_s``, ``eta_s lambda_s`` and ``log a_s``."""
    TE = T + W - 1
    m = tl.arange(0, WP)
    p = s[:, None] + m[None, :]  # the window's extended positions
    m_p = m_s[:, None] & (m[None, :] < W)
    ok_p = tl.load(valid_ext + i_b * TE + p, mask=m_p, other=0) != 0
    n_p = tl.load(n_ext + (i_b * TE + p) * H + i_h, mask=ok_p, other=0.0)
    count = tl.sum(tl.where(ok_p, 1.0, 0.0), axis=1)
    inv_count = 1.0 / tl.maximum(count, 1.0)
    stat = tl.sum(tl.where(ok_p, n_p, 0.0), axis=1) * inv_count
    row = (i_b * T + s) * H + i_h
    b_beta = tl.load(beta + row, mask=m_s, other=0.0).to(tl.float32)
    b_lam = tl.load(lam + row, mask=m_s, other=0.0).to(tl.float32)
    lam_eff, denom, ok = ridge_terms(stat, b_lam, count > 0, eps, NORMALIZE, SCALE_RIDGE)
    if NORMALIZE:
        eta = tl.where(ok, b_beta / tl.where(ok, denom, 1.0), 0.0)
    else:
        eta = tl.where(ok, b_beta, 0.0)
    alpha_raw = eta * lam_eff
    la = _log1p(-tl.minimum(alpha_raw, 1.0 - decay_floor))
    if HAS_GATE:
        la += tl.load(log_gate + row, mask=m_s, other=0.0).to(tl.float32)
    return inv_count, stat, lam_eff, denom, ok, eta, alpha_raw, la


@triton.jit
def step_fwd(
    n_ext, valid_ext, beta, lam, log_gate, g, log_a, T, eps, decay_floor,
    H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr, NORMALIZE: tl.constexpr,
    SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """Grid ``(cdiv(T, BT), B * H)``: ``g = eta / B`` and ``log a`` per step."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    inv_count, _stat, _lam, _den, _ok, eta, _ar, la = _step_terms(
        n_ext, valid_ext, beta, lam, log_gate, i_b, i_h, o_t, m_t, T, eps, decay_floor,
        H, W, WP, NORMALIZE, SCALE_RIDGE, HAS_GATE)
    row = (i_b * T + o_t) * H + i_h
    tl.store(g + row, eta * inv_count, mask=m_t)
    tl.store(log_a + row, la, mask=m_t)


@triton.jit
def _lag_tiles(g, log_a, i_b, i_h, o_t, m_t, T, H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """``G[t, i] = g_{t-i}``, ``L[t, i] = log a_{t-i}`` and ``exp(U[t, i])`` (0 / 1 outside)."""
    i = tl.arange(0, WP)
    s = o_t[:, None] - i[None, :]
    m = m_t[:, None] & (i[None, :] < W) & (s >= 0)
    G = tl.load(g + (i_b * T + s) * H + i_h, mask=m, other=0.0)
    L = tl.load(log_a + (i_b * T + s) * H + i_h, mask=m, other=0.0)
    return G, L, tl.exp(tl.cumsum(L, axis=1) - L)


@triton.jit
def gains_fwd(
    g, log_a, valid_ext, e, rho, T,
    H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
):
    """Grid ``(cdiv(T, BT), B * H)``: ``e`` ``[B, T, H]`` and ``rho`` ``[B, T, H, W-1]``."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    TE = T + W - 1
    G, L, eU = _lag_tiles(g, log_a, i_b, i_h, o_t, m_t, T, H, W, WP)
    P = tl.cumsum(G * eU, axis=1)
    j = tl.arange(0, WP)[None, :]
    v = tl.load(valid_ext + i_b * TE + o_t[:, None] + (W - 1 - j), mask=m_t[:, None] & (j < W), other=0) != 0
    P = tl.where(v, P, 0.0)
    row = (i_b * T + o_t) * H + i_h
    tl.store(e + row, tl.sum(tl.where(j == W - 1, P, 0.0), axis=1), mask=m_t)
    tl.store(rho + row[:, None] * (W - 1) + (W - 2 - j), P, mask=m_t[:, None] & (j < W - 1))


@triton.jit
def gains_bwd(
    g, log_a, valid_ext, de, drho, lag_a, lag_d, T,
    H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
):
    """Grid ``(cdiv(T, BT), B * H)``: the tiles ``A`` and ``D`` ``[B, T, H, WP]``."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    TE = T + W - 1
    G, L, eU = _lag_tiles(g, log_a, i_b, i_h, o_t, m_t, T, H, W, WP)
    j = tl.arange(0, WP)[None, :]
    row = (i_b * T + o_t) * H + i_h
    v = tl.load(valid_ext + i_b * TE + o_t[:, None] + (W - 1 - j), mask=m_t[:, None] & (j < W), other=0) != 0
    d_e = tl.load(de + row, mask=m_t, other=0.0)
    d_rho = tl.load(drho + row[:, None] * (W - 1) + (W - 2 - j), mask=m_t[:, None] & (j < W - 1), other=0.0)
    dP = tl.where(v, tl.where(j == W - 1, d_e[:, None], d_rho), 0.0)
    Q = tl.sum(dP, axis=1)[:, None] - tl.cumsum(dP, axis=1) + dP  # suffix sums
    A = eU * Q
    GA = G * A
    D = tl.sum(GA, axis=1)[:, None] - tl.cumsum(GA, axis=1)  # strict suffix sums
    off = row[:, None] * WP + j
    tl.store(lag_a + off, A, mask=m_t[:, None])
    tl.store(lag_d + off, D, mask=m_t[:, None])


@triton.jit
def step_bwd(
    n_ext, valid_ext, beta, lam, log_gate, lag_a, lag_d, dlog_a, d_beta, d_lam, d_gate, d_stat, T,
    eps, decay_floor, H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr, BT: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """Grid ``(cdiv(T, BT), B * H)``, rows ``r``: ``dg_r = sum_i A[r+i, i]``,
    ``dlog a_r`` (plus ``D[r+a, a]``), then the gradients of ``beta``, ``lam``,
    ``log_gate`` and ``d_stat = dEbar_r / B_r`` (spread onto the energies by ``band_bwd_pairs``)."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    o_r = i_t * BT + tl.arange(0, BT)
    m_r = o_r < T
    row = (i_b * T + o_r) * H + i_h
    a = tl.arange(0, WP)[None, :]
    t = o_r[:, None] + a
    m = m_r[:, None] & (a < W) & (t < T)
    off = ((i_b * T + t) * H + i_h) * WP + a
    d_g = tl.sum(tl.load(lag_a + off, mask=m, other=0.0), axis=1)
    d_la = tl.sum(tl.load(lag_d + off, mask=m, other=0.0), axis=1) + tl.load(dlog_a + row, mask=m_r, other=0.0)
    inv_count, stat, lam_eff, denom, ok, eta, alpha_raw, la = _step_terms(
        n_ext, valid_ext, beta, lam, log_gate, i_b, i_h, o_r, m_r, T, eps, decay_floor,
        H, W, WP, NORMALIZE, SCALE_RIDGE, HAS_GATE)
    alpha = tl.minimum(alpha_raw, 1.0 - decay_floor)
    d_alpha = tl.where(alpha_raw <= 1.0 - decay_floor, -d_la / (1.0 - alpha), 0.0)
    d_eta = d_g * inv_count + d_alpha * lam_eff
    d_lam_eff = d_alpha * eta
    if NORMALIZE:
        safe = tl.where(ok, denom, 1.0)
        g_beta = tl.where(ok, d_eta / safe, 0.0)
        g_stat = tl.where(ok, -d_eta * eta / safe, 0.0)
        d_lam_eff += g_stat
    else:
        g_beta = tl.where(ok, d_eta, 0.0)
        g_stat = tl.zeros([BT], dtype=tl.float32)
    if SCALE_RIDGE:  # lambda = lam * Ebar with Ebar detached
        g_lam = d_lam_eff * stat
    else:
        g_lam = d_lam_eff
    tl.store(d_beta + row, g_beta, mask=m_r)
    tl.store(d_lam + row, g_lam, mask=m_r)
    if HAS_GATE:
        tl.store(d_gate + row, d_la, mask=m_r)
    tl.store(d_stat + row, g_stat * inv_count, mask=m_r)
