r"""Fused recurrent kernel of all six rules: decoding steps and short prompts (inference).

One program holds ``BV`` columns of one head's state ``S`` (the whole key dimension) in
registers and walks the tokens of its sequence, step sizes included. At step ``t``, with
the window slots ``j = 0 .. W-1`` holding the pairs ``(x_{t-j}, y_{t-j})`` (one slot for the
rules 1, 2, 1A, 2A), ``B_t`` the valid ones and ``E_t`` the rule's statistic (``||x_t||^2``;
``sum_j ||x_j||^2 / B_t`` for 3A; ``lambda_max(X_t X_t^T) / B_t`` for 3)::

    eta_t   = beta_t / (E_t + lambda_t + eps)          (per value column for 2 and 2A)
    gamma_t = max(1 - min(eta_t lambda_t, 1 - decay_floor), decay_floor)
    S'      = exp(g_t) S_{t-1}
    r_j     = y_j - S'^T x_j   (regression)   or   y_j   (inner product)
    S_t     = gamma_t S' + eta_t / B_t sum_j x_j r_j^T
    o_t     = S_t^T q_t   (read after write)   or   S_{t-1}^T q_t   (read before write)

which is ``ops.recurrent.recurrent_step`` with the step sizes of ``ops.step_sizes``. The pair
at position ``p`` of the segment is ``(phi(k_{p-1}), v_p)`` with ``shift`` (``x_0`` the carried
last key, or the invalid sentinel ``0``) or ``(k_p, v_p)``; positions before the segment come
from the carried tail of the sliding rules. State, last key and tail leave the kernel ready to
continue. Tensors are time-major ``[B, T, H, D]`` (``B = 1`` with ``cu_seqlens``); states
``[N, H, K, V]`` fp32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .step_size_kernels import _log1p, top_eigenpair


@triton.jit
def _lanes(cond, n):
    """``n`` where the scalar ``cond`` holds, else 0: masks are ``offsets < _lanes(cond, n)``, never a
    scalar and a vector combined (which Triton's interpreter cannot load under)."""
    return tl.where(cond, n, 0)


@triton.jit
def _pair(k, v, first, tail_x, tail_y, tail_valid, bos, i_n, i_h, p, o_k, o_v,
          H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr, SHIFT: tl.constexpr,
          HAS_FIRST: tl.constexpr, HAS_TAIL: tl.constexpr):
    """The pair at segment position ``p`` (``p >= -(W - 1)``): its write feature ``x`` ``[BK]``
    and value ``y`` ``[BV]`` in fp32, zero unless the pair is valid, and its validity."""
    if SHIFT:
        if HAS_FIRST:
            ok = p >= 0
        else:
            ok = p >= 1
        src = bos + p - 1
    else:
        ok = p >= 0
        src = bos + p
    b_x = tl.load(k + (src * H + i_h).to(tl.int64) * K + o_k, mask=o_k < _lanes(src >= bos, K),
                  other=0.0).to(tl.float32)
    if SHIFT and HAS_FIRST:
        b_f = tl.load(first + (i_n * H + i_h).to(tl.int64) * K + o_k, mask=o_k < _lanes(p == 0, K), other=0.0)
        b_x = tl.where(p == 0, b_f.to(tl.float32), b_x)
    b_y = tl.load(v + ((bos + p) * H + i_h).to(tl.int64) * V + o_v, mask=o_v < _lanes(p >= 0, V),
                  other=0.0).to(tl.float32)
    if HAS_TAIL:  # slot s = W - 1 + p of the tail holds the pair at p < 0 (oldest first)
        s = W - 1 + p
        before = p < 0
        tail_ok = tl.load(tail_valid + i_n * (W - 1) + tl.minimum(s, W - 2)) != 0
        t_row = (i_n * H + i_h).to(tl.int64) * (W - 1) + tl.minimum(s, W - 2)
        b_tx = tl.load(tail_x + t_row * K + o_k, mask=o_k < _lanes(before, K), other=0.0).to(tl.float32)
        b_ty = tl.load(tail_y + t_row * V + o_v, mask=o_v < _lanes(before, V), other=0.0).to(tl.float32)
        b_x = tl.where(before, b_tx, b_x)
        b_y = tl.where(before, b_ty, b_y)
        ok = ok | (before & tail_ok)
    b_x = tl.where(ok, b_x, 0.0)
    b_y = tl.where(ok, b_y, 0.0)
    return b_x, b_y, ok


@triton.jit
def fused_recurrent(
    q, k, v, beta, lam, log_gate, s0, first, tail_x, tail_y, tail_valid,
    o, s_out, tail_x_out, tail_y_out, tail_valid_out, cu_seqlens, T, eps, decay_floor,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, WP: tl.constexpr, REGRESSION: tl.constexpr, PER_COLUMN: tl.constexpr,
    TOP_EIGEN: tl.constexpr, NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr,
    SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_S0: tl.constexpr,
    READ_AFTER: tl.constexpr, STORE_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, SQUARINGS: tl.constexpr,
):
    """Grid ``(N * H, cdiv(V, BV))`` (rows times heads on the axis without the 65535 limit) with ``BK >= K``; ``W`` window slots (``WP``: the next power
    of two, for rule 3's window Gram). Writes ``o`` and, with ``STORE_STATE``, ``s_out`` and the
    tail (the last ``W - 1`` pairs, oldest first; the values' columns by every program, the
    features and validity by the first value block)."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int32)
        T_n = tl.load(cu_seqlens + i_n + 1).to(tl.int32) - bos
    else:
        bos = i_n * T
        T_n = T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = i_nh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    b_S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        b_S += tl.load(s0 + state_off, mask=m_kv, other=0.0)
    log_floor = tl.log(decay_floor)
    for t in range(T_n):
        row = (bos + t) * H + i_h
        # the statistic E_t and the count B_t of valid window pairs
        cnt = 0.0
        E = 0.0
        if TOP_EIGEN:
            o_w = tl.arange(0, WP)
            b_X = tl.zeros([WP, BK], dtype=tl.float32)
        for j in tl.static_range(W):
            b_x, _, ok = _pair(k, v, first, tail_x, tail_y, tail_valid, bos, i_n, i_h, t - j, o_k, o_v, H, K,
                               V, W, SHIFT, HAS_FIRST, HAS_TAIL)
            cnt += ok.to(tl.float32)
            if TOP_EIGEN:
                b_X = tl.where((o_w == j)[:, None], b_x[None, :], b_X)
            else:
                E += tl.sum(b_x * b_x)
        if TOP_EIGEN:  # the window Gram [WP, WP], row by row (zero past the W slots)
            b_G = tl.zeros([WP, WP], dtype=tl.float32)
            for j in tl.static_range(W):
                x_j = tl.sum(tl.where((o_w == j)[:, None], b_X, 0.0), axis=0)
                b_G = tl.where((o_w == j)[:, None], tl.sum(b_X * x_j[None, :], axis=1)[None, :], b_G)
            top, _ = top_eigenpair(b_G[None, :, :], WP, SQUARINGS, 1)
            E = tl.sum(top, axis=0)
        if W > 1:
            E = E / tl.maximum(cnt, 1.0)
        # step sizes (ops.step_sizes.gains_from_statistic)
        b_lam = tl.load(lam + row).to(tl.float32)
        if SCALE_RIDGE:
            lam_eff = b_lam * E
        else:
            lam_eff = b_lam
        denom = E + lam_eff + eps
        ok_t = cnt > 0.0
        if NORMALIZE:
            ok_t = ok_t & (denom > 0.0)
        if PER_COLUMN:
            b_beta = tl.load(beta + row.to(tl.int64) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        else:
            b_beta = tl.load(beta + row).to(tl.float32)
        if NORMALIZE:
            b_eta = tl.where(ok_t, b_beta / tl.where(ok_t, denom, 1.0), 0.0)
        else:
            b_eta = tl.where(ok_t, b_beta, 0.0)
        b_gamma = tl.exp(tl.maximum(_log1p(-tl.minimum(b_eta * lam_eff, 1.0 - decay_floor)), log_floor))
        gain = b_eta / tl.maximum(cnt, 1.0)  # per slot: eta_t / B_t
        # the write, every residual read at the gated state before the step
        b_prev = b_S
        if HAS_GATE:
            b_S = b_S * tl.exp(tl.load(log_gate + row).to(tl.float32))
        b_upd = tl.zeros([BK, BV], dtype=tl.float32)
        for j in tl.static_range(W):
            b_x, b_y, ok = _pair(k, v, first, tail_x, tail_y, tail_valid, bos, i_n, i_h, t - j, o_k, o_v, H, K,
                                 V, W, SHIFT, HAS_FIRST, HAS_TAIL)
            if REGRESSION:
                b_y = b_y - tl.sum(b_S * b_x[:, None], axis=0)
            b_upd += b_x[:, None] * (gain * b_y)[None, :]
        if PER_COLUMN:
            b_S = b_gamma[None, :] * b_S + b_upd
        else:
            b_S = b_gamma * b_S + b_upd
        b_q = tl.load(q + row.to(tl.int64) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        if READ_AFTER:
            b_o = tl.sum(b_S * b_q[:, None], axis=0)
        else:
            b_o = tl.sum(b_prev * b_q[:, None], axis=0)
        tl.store(o + row.to(tl.int64) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    if STORE_STATE:
        tl.store(s_out + state_off, b_S, mask=m_kv)
        for s in tl.static_range(W - 1):  # the last W - 1 pairs, oldest first: positions T_n - W + 1 + s
            b_x, b_y, ok = _pair(k, v, first, tail_x, tail_y, tail_valid, bos, i_n, i_h, T_n - W + 1 + s, o_k,
                                 o_v, H, K, V, W, SHIFT, HAS_FIRST, HAS_TAIL)
            t_row = (i_n * H + i_h).to(tl.int64) * (W - 1) + s
            tl.store(tail_y_out + t_row * V + o_v, b_y, mask=m_v)
            if i_v == 0:
                tl.store(tail_x_out + t_row * K + o_k, b_x, mask=m_k)
                if i_h == 0:
                    tl.store(tail_valid_out + i_n * (W - 1) + s, ok.to(tl.uint8))
