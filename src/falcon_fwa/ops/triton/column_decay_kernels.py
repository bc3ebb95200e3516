r"""Triton kernels of the chunk form with one decay per value column (Falcon-2A).

Per head, with the write values ``U_s = eta_s * v_s`` (``[V]``, elementwise) and the
column carries ``a_{t,j}`` (``log_a`` = ``log gamma_{t,j} + g_t``), the state column
``j`` follows ``S_t[:, j] = a_{t,j} S_{t-1}[:, j] + x_t U_t[j]``. A chunk of ``BT``
steps entered with state ``h``, with chunk-local log-prefixes ``u_{t,j} = sum_{r <= t}
log a_{r,j}`` (``u``, written by ``chunk_cumsum``), computes::

    o[t, j] = exp(uq[t, j]) (q_t^T h)[j] + sum_{s in M(t)} P[t, s] exp(uq[t, j] - u[s, j]) U[s, j]
    h_next  = exp(u_C) * h + X^T (exp(u_C - u) * U)

with the scores ``P = Q X^T`` (``[BT, BT]``, shared by all columns), ``uq_t = u_t``,
``M(t) = {s <= t}`` (read after write) or ``uq_t = u_{t-1}``, ``M(t) = {s < t}`` (read
before write). The decay of the intra-chunk term depends on the column, so it is no
``BT x BT`` mask. The pairs ``s < t`` of a chunk are split by levels: at level ``b``
(``b = 1, 2, 4, ..., BT / 2``) the chunk is cut into blocks of ``2b`` rows and the level
holds the pairs with the source ``s`` in the first half of a block and the target ``t``
in its second half (every pair ``s < t`` lies in exactly one level: the smallest aligned
block holding both). With ``r`` the log-prefix at the last row ``m`` of the first half
(``u`` is non-increasing in time, and ``s <= m``, ``uq_t <= u_m``)::

    exp(uq_t - u_s) = exp(uq_t - r) * exp(r - u_s)          (both factors <= 1)

so a level is one dot, ``E_t * (P_b @ (E_s * U))``, with ``P_b`` the scores of the pairs
in one block and one ``[BT, BV]`` tile of decays ``E`` (``exp(r - u)`` on first-half
rows, ``exp(uq - r)`` on second-half rows: a row is a source or a target at each level,
never both). The pair ``s = t`` (read after write) has decay 1: ``P[t, t] U[t]``. Only
non-positive exponents are ever evaluated, however strong the decay. Per chunk and value
block: ``log2(BT) + 1`` tiles of exponentials and ``log2(BT)`` dots ``[BT, BT] @ [BT, BV]``
besides the scores and the entry state's term. Tensors are time-major ``[B, T, H, D]``
(``B = 1`` with packed sequences); states are ``[num_chunks, H, K, V]``.

Backward, with ``dH`` the gradient of a chunk's exit state and
``D[t, s] = sum_j do[t, j] exp(uq[t, j] - u[s, j]) U[s, j]`` (same levels)::

    dh     = exp(u_C) * dH + Q^T (exp(uq) * dO)                         (state_bwd)
    dq_t   = h (exp(uq_t) * do_t) + sum_{s in M(t)} D[t, s] x_s          (dqk_bwd)
    dx_s   = sum_{t: s in M(t)} D[t, s] q_t + dH (exp(u_C - u_s) * U_s)  (dqk_bwd)
    dU[s, j] = sum_{t: s in M(t)} P[t, s] exp(uq[t, j] - u[s, j]) do[t, j]
               + exp(u_C,j - u[s, j]) (x_s^T dH)[j]                      (dv_bwd)

level by level: ``dU += E_s * (P_b^T @ (E_t * dO))`` and ``D += mask_b * ((E_t * dO) @
(E_s * U)^T)``. ``dv = eta * dU``, ``deta = v * dU``. Every term of ``o[t, j]`` carries
``exp(uq[t, j])``, so ``d uq = dO * O`` (``O`` the read's values: the forward's output,
in ``v``'s dtype); the intra-chunk term gives ``d u_s = -U_s * dU^intra_s``; ``h_next``
gives ``d u_C = exp(u_C) colsum(h * dH) + sum_s c_s`` with ``c_s = U_s * dU^state_s``,
and ``d u_s = -c_s``. Since ``u_t = sum_{r <= t} log a_r``, ``dv_bwd`` assembles, within
the chunk::

    d log a_r = sum_{t >= r} du_t + sum_{t > r} dw_t + sum_{s < r} c_s

(``du_t = [read after] do_t * o_t - U_t * dU^intra_t``, plus ``exp(u_C) colsum(h * dH)``
at the last step; ``dw_t = do_t * o_t`` when reading before the write, whose ``uq_t`` is
``u_{t-1}``; the pair ``+c_s`` at ``u_C``, ``-c_s`` at ``u_s`` reaches exactly the steps
after ``s``).

Kernels (the per-column step sizes are ``step_size_kernels.column_step_fwd`` / ``_bwd``):
``chunk_cumsum``, ``state_fwd`` (entry state of every chunk, sequential over chunks),
``output_fwd`` (one program per chunk and value block), ``state_bwd`` (reverse over
chunks), ``dv_bwd`` (per chunk and value block, ``d log a`` included) and ``dqk_bwd`` (per
chunk and key block, the value blocks in a loop). Rule 2 runs ``dv_bwd`` for its outputs'
``dD`` only (its sequential ``state_bwd`` sums ``d log a``); its ``dq``, ``dx`` of both reads
come from one kernel of its own (``column_delta_kernels.dqk_bwd_two_reads``, on the level
helpers here).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .scalar_decay_kernels import _chunk_of_program, _sequence


@triton.jit
def _rows(ptr, rows, m_rows, i_h, H: tl.constexpr, D: tl.constexpr, o_d, m_d):
    """``ptr[rows, i_h, o_d]`` as ``[R, BD]`` (0 outside the masks)."""
    return tl.load(ptr + (rows[:, None] * H + i_h) * D + o_d[None, :], mask=m_rows[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _rows_t(ptr, rows, m_rows, i_h, H: tl.constexpr, D: tl.constexpr, o_d, m_d):
    """The transpose ``[BD, R]`` of ``_rows``, loaded directly."""
    return tl.load(ptr + (rows[None, :] * H + i_h) * D + o_d[:, None], mask=m_rows[None, :] & m_d[:, None], other=0.0)


@triton.jit
def _row(ptr, row, ok, i_h, H: tl.constexpr, D: tl.constexpr, o_d, m_d):
    """One row ``ptr[row, i_h, o_d]`` ``[BD]`` in fp32 (0 unless ``ok``)."""
    return tl.load(ptr + (row * H + i_h) * D + o_d, mask=tl.where(ok, m_d, False), other=0.0).to(tl.float32)


@triton.jit
def _read_prefix(u, rows, m_rows, first, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v, READ_AFTER: tl.constexpr):
    """``uq`` ``[R, BV]``: ``u`` at the row (read after) or the row before (read before;
    0 at the chunk's first row ``first``)."""
    if READ_AFTER:
        return _rows(u, rows, m_rows, i_h, H, V, o_v, m_v)
    else:
        return _rows(u, rows - 1, m_rows & (rows > first), i_h, H, V, o_v, m_v)


@triton.jit
def _query_prefix(u, b_u, rows, m_rows, first, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v,
                  READ_AFTER: tl.constexpr):
    """``uq`` ``[R, BV]`` given ``b_u = u[rows]`` (itself when reading after the write)."""
    if READ_AFTER:
        return b_u
    else:
        return _read_prefix(u, rows, m_rows, first, i_h, H, V, o_v, m_v, False)


@triton.jit
def _decay(delta, keep):
    """``exp(delta)`` where ``keep`` (``delta <= 0`` there), 0 elsewhere; never ``exp`` of a positive."""
    return tl.exp(tl.where(keep, delta, float("-inf")))


@triton.jit
def _writes(v, eta, rows, m_rows, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v, HAS_ETA: tl.constexpr):
    """``U = eta * v`` ``[R, BV]`` fp32 (``U = v`` without ``eta``: rule 2's values ``D``)."""
    b_v = _rows(v, rows, m_rows, i_h, H, V, o_v, m_v).to(tl.float32)
    if HAS_ETA:
        b_v *= _rows(eta, rows, m_rows, i_h, H, V, o_v, m_v)
    return b_v


@triton.jit
def _chunk_program(i_p, cu_seqlens, chunk_indices, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """For a per-chunk program (chunk ``i_p`` of the layout): the chunk's index in its
    sequence, the sequence's first chunk, the chunk's first and last row (absolute), its
    ``BT`` rows and their mask."""
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_p, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    first = bos + i_t * BT
    last = first + tl.minimum(BT, T_n - i_t * BT) - 1
    rows = first + tl.arange(0, BT)
    return i_t, boh, first, last, rows, rows <= last


@triton.jit
def _level_blocks(u, first, last, m_r, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v, BT: tl.constexpr, lvl):
    """Level ``lvl`` of the chunk's pairs (blocks of ``2 b`` rows, ``b = 2^lvl``): whether
    each row lies in the first half of its block (a source) or not (a target), the
    ``[BT, BT]`` mask of the row pairs in one block and, per row, ``r`` ``[BT, BV]``: the
    log-prefix at the last row of its block's first half (at the chunk's last row where
    the chunk ends before it: that block has no target)."""
    i = tl.arange(0, BT)
    source = ((i >> lvl) & 1) == 0
    mid = first + tl.minimum(((i >> (lvl + 1)) << (lvl + 1)) + (1 << lvl) - 1, last - first)
    r = _rows(u, mid, m_r, i_h, H, V, o_v, m_v)
    block = (i[:, None] >> (lvl + 1)) == (i[None, :] >> (lvl + 1))
    return source, block, r


@triton.jit
def _level_decay(source, r, b_u, b_uq, m_r, m_v):
    """A level's ``[BT, BV]`` decays ``exp(r - u_s)`` on source rows, ``exp(uq_t - r)`` on
    target rows (0 on masked rows and columns)."""
    return _decay(tl.where(source[:, None], r - b_u, b_uq - r), m_r[:, None] & m_v[None, :])


@triton.jit
def _level(u, b_u, b_uq, first, last, m_r, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v, BT: tl.constexpr, lvl):
    """``_level_blocks`` with the decays of ``_level_decay``: ``source``, ``block`` and the
    ``[BT, BV]`` decays of one read (query log-prefixes ``b_uq``)."""
    source, block, r = _level_blocks(u, first, last, m_r, i_h, H, V, o_v, m_v, BT, lvl)
    return source, block, _level_decay(source, r, b_u, b_uq, m_r, m_v)


@triton.jit
def _diagonal(a, BT: tl.constexpr):
    """The diagonal ``[BT]`` of a ``[BT, BT]`` tile."""
    i = tl.arange(0, BT)
    return tl.sum(tl.where(i[:, None] == i[None, :], a, 0.0), axis=1)


@triton.jit
def _chunk_output(q, x, v, eta, u, h_base, first, last, rows, m_r, i_h, o_v, m_v,
                  H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, READ_AFTER: tl.constexpr, HAS_ETA: tl.constexpr, PRECISION: tl.constexpr):
    """Outputs ``[BT, BV]`` fp32 of one chunk (value columns ``o_v``): the entry state's
    term (``h_base``: the chunk's entry state) and the intra-chunk pairs, level by level."""
    LEVELS: tl.constexpr = 4 + (BT >= 32) + (BT >= 64) + (BT >= 128)  # log2(BT), BT in 16..128
    dt = q.dtype.element_ty
    b_p = tl.zeros([BT, BT], dtype=tl.float32)  # P[t, s] = q_t . x_s
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = _rows(q, rows, m_r, i_h, H, K, o_k, m_k)
        b_p += tl.dot(b_q, _rows_t(x, rows, m_r, i_h, H, K, o_k, m_k), input_precision=PRECISION)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_q, b_h, input_precision=PRECISION)
    b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
    b_uq = _query_prefix(u, b_u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
    b_U = _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v, HAS_ETA)
    b_o = b_o * _decay(b_uq, m_r[:, None])
    if READ_AFTER:  # the pairs s = t, decay 1
        b_o += _diagonal(b_p, BT)[:, None] * b_U
    b_p = b_p.to(dt)
    for lvl in range(LEVELS):
        source, block, b_e = _level(u, b_u, b_uq, first, last, m_r, i_h, H, V, o_v, m_v, BT, lvl)
        b_w = (tl.where(source[:, None], b_e, 0.0) * b_U).to(dt)
        b_o += tl.where(source[:, None], 0.0, b_e) * tl.dot(tl.where(block, b_p, 0.0).to(dt), b_w,
                                                            input_precision=PRECISION)
    return b_o


@triton.jit
def chunk_cumsum(
    log_a, u, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), num_chunks, H)``: chunk-local ``u = cumsum(log_a)`` over time."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_r = rows < bos + T_n
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    la = _rows(log_a, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
    tl.store(u + (rows[:, None] * H + i_h) * V + o_v[None, :], tl.cumsum(la, axis=0),
             mask=m_r[:, None] & m_v[None, :])


@triton.jit
def state_fwd(
    x, v, eta, u, h, s0, s_final, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), cdiv(V, BV), N * H)``: every chunk's entry state into ``h``
    (``h_next = exp(u_C) * h + X^T (exp(u_C - u) * U)``)."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        b_h += tl.load(s0 + i_nh.to(tl.int64) * K * V + state_off, mask=m_kv, other=0.0)
    for i_t in range(tl.cdiv(T_n, BT)):
        tl.store(h + ((boh + i_t) * H + i_h) * K * V + state_off, b_h.to(h.dtype.element_ty), mask=m_kv)
        rows = bos + i_t * BT + tl.arange(0, BT)
        m_r = rows < bos + T_n
        last = bos + i_t * BT + tl.minimum(BT, T_n - i_t * BT) - 1
        u_last = _row(u, last, True, i_h, H, V, o_v, m_v)
        b_w = _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v, True) * _decay(
            u_last[None, :] - _rows(u, rows, m_r, i_h, H, V, o_v, m_v), m_r[:, None])
        b_xt = _rows_t(x, rows, m_r, i_h, H, K, o_k, m_k)  # [BK, BT]
        b_h = b_h * tl.exp(u_last)[None, :] + tl.dot(b_xt, b_w.to(b_xt.dtype), input_precision=PRECISION)
    if STORE_FINAL:
        tl.store(s_final + i_nh.to(tl.int64) * K * V + state_off, b_h, mask=m_kv)


@triton.jit
def output_fwd(
    q, x, v, eta, u, h, o, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, HAS_ETA: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), num_chunks, H)``: the outputs of every chunk (``HAS_ETA=False``:
    the values are ``v`` itself, ``eta`` unused)."""
    i_v, i_h = tl.program_id(0), tl.program_id(2)
    i_c = tl.program_id(1)
    i_t, boh, first, last, rows, m_r = _chunk_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT,
                                                      IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_o = _chunk_output(q, x, v, eta, u, h + ((boh + i_t) * H + i_h) * K * V, first, last, rows, m_r, i_h, o_v, m_v,
                        H, K, V, BT, BK, BV, READ_AFTER, HAS_ETA, PRECISION)
    tl.store(o + (rows[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_r[:, None] & m_v[None, :])


@triton.jit
def state_bwd(
    q, do, u, dh, ds_final, ds0, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DS_FINAL: tl.constexpr, STORE_DS0: tl.constexpr, READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), cdiv(V, BV), N * H)``: the gradient of every chunk's exit
    state into ``dh`` (``dh_prev = exp(u_C) * dh + Q^T (exp(uq) * dO)``)."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DS_FINAL:
        b_dh += tl.load(ds_final + i_nh.to(tl.int64) * K * V + state_off, mask=m_kv, other=0.0)
    for j in range(tl.cdiv(T_n, BT)):
        i_t = tl.cdiv(T_n, BT) - 1 - j
        tl.store(dh + ((boh + i_t) * H + i_h) * K * V + state_off, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        first = bos + i_t * BT
        rows = first + tl.arange(0, BT)
        m_r = rows < bos + T_n
        last = first + tl.minimum(BT, T_n - i_t * BT) - 1
        u_last = _row(u, last, True, i_h, H, V, o_v, m_v)
        b_uq = _read_prefix(u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
        b_g = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32) * _decay(b_uq, m_r[:, None])
        b_qt = _rows_t(q, rows, m_r, i_h, H, K, o_k, m_k)  # [BK, BT]
        b_dh = b_dh * tl.exp(u_last)[None, :] + tl.dot(b_qt, b_g.to(b_qt.dtype), input_precision=PRECISION)
    if STORE_DS0:
        tl.store(ds0 + i_nh.to(tl.int64) * K * V + state_off, b_dh, mask=m_kv)


@triton.jit
def dv_bwd(
    q, x, v, eta, u, h, dh, do, o, dv, deta, dlog_a, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, HAS_ETA: tl.constexpr,
    HAS_DH: tl.constexpr, STORE_DV: tl.constexpr, STORE_DETA: tl.constexpr, STORE_DLOG: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), num_chunks, H)``: ``dU`` of every chunk's sources, mapped to
    ``dv = eta * dU`` and ``deta = v * dU``, and ``d log a``: the per-step terms of the
    module docstring, summed within the chunk. ``o``: the read's values (the forward's
    outputs), for ``d uq = dO * O``. Rule 2's reads switch work off: ``HAS_ETA=False``
    (``U = v``, ``dv = dU``), ``HAS_DH=False`` (no exit-state gradient: ``dh`` unused),
    ``STORE_DV=False`` / ``STORE_DETA=False`` / ``STORE_DLOG=False`` (``dv`` / ``deta`` /
    ``d log a`` not wanted; without ``d log a``, ``o`` is not read)."""
    i_v, i_h = tl.program_id(0), tl.program_id(2)
    i_c = tl.program_id(1)
    i_t, boh, first, last, rows, m_r = _chunk_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT,
                                                      IS_VARLEN)
    LEVELS: tl.constexpr = 4 + (BT >= 32) + (BT >= 64) + (BT >= 128)  # log2(BT), BT in 16..128
    dt = q.dtype.element_ty
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_rv = m_r[:, None] & m_v[None, :]
    state = ((boh + i_t) * H + i_h) * K * V
    # the intra-chunk targets, level by level: dU_s += E_s * sum_t P[t, s] E_t do_t, with the
    # scores transposed, P^T[s, t] = x_s . q_t
    b_pt = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_pt += tl.dot(_rows(x, rows, m_r, i_h, H, K, o_k, m_k), _rows_t(q, rows, m_r, i_h, H, K, o_k, m_k),
                       input_precision=PRECISION)
    b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
    b_uq = _query_prefix(u, b_u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
    b_do = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
    b_du_intra = tl.zeros([BT, BV], dtype=tl.float32)
    if READ_AFTER:  # the pairs s = t, decay 1
        b_du_intra += _diagonal(b_pt, BT)[:, None] * b_do
    b_pt = b_pt.to(dt)
    for lvl in range(LEVELS):
        source, block, b_e = _level(u, b_u, b_uq, first, last, m_r, i_h, H, V, o_v, m_v, BT, lvl)
        b_g = (tl.where(source[:, None], 0.0, b_e) * b_do).to(dt)
        b_du_intra += tl.where(source[:, None], b_e, 0.0) * tl.dot(tl.where(block, b_pt, 0.0).to(dt), b_g,
                                                                   input_precision=PRECISION)
    # the exit state's term exp(u_C - u_s) (x_s^T dH), and colsum(h * dH) for d u_C
    b_du_state = tl.zeros([BT, BV], dtype=tl.float32)
    b_hdh = tl.zeros([BV], dtype=tl.float32)
    u_last = _row(u, last, True, i_h, H, V, o_v, m_v)
    if HAS_DH:
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            m_k = o_k < K
            m_kv = m_k[:, None] & m_v[None, :]
            b_dh = tl.load(dh + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_h = tl.load(h + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_du_state += tl.dot(_rows(x, rows, m_r, i_h, H, K, o_k, m_k), b_dh, input_precision=PRECISION)
            b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)
        b_du_state *= _decay(u_last[None, :] - b_u, m_r[:, None])
    b_dU = b_du_intra + b_du_state
    b_v = _rows(v, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
    off = (rows[:, None] * H + i_h) * V + o_v[None, :]
    if HAS_ETA:
        b_eta = _rows(eta, rows, m_r, i_h, H, V, o_v, m_v)
        b_U = b_v * b_eta
        b_dv = b_eta * b_dU
    else:
        b_U = b_v
        b_dv = b_dU
    if STORE_DV:
        tl.store(dv + off, b_dv.to(dv.dtype.element_ty), mask=m_rv)
    if STORE_DETA:
        tl.store(deta + off, b_v * b_dU, mask=m_rv)
    if STORE_DLOG:
        d_read = b_do * tl.load(o + off, mask=m_rv, other=0.0).to(tl.float32)
        d_u = -b_U * b_du_intra + tl.where(rows[:, None] == last, (tl.exp(u_last) * b_hdh)[None, :], 0.0)
        b_c = b_U * b_du_state
        if READ_AFTER:
            d_u += d_read
        # d log a_r = sum_{t >= r} du_t [+ sum_{t > r} dw_t] + sum_{s < r} c_s (rows past the chunk's end hold zeros)
        d_log = tl.sum(d_u, axis=0)[None, :] - tl.cumsum(d_u, axis=0) + d_u + tl.cumsum(b_c, axis=0) - b_c
        if not READ_AFTER:
            d_log += tl.sum(d_read, axis=0)[None, :] - tl.cumsum(d_read, axis=0)
        tl.store(dlog_a + off, d_log, mask=m_rv)


@triton.jit
def dqk_bwd(
    q, x, v, eta, u, h, dh, do, dq, dx, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), num_chunks, H)``: ``dq`` and ``dx`` of every chunk (key
    columns ``o_k``). ``D`` ``[BT, BT]`` is summed over the value blocks in a loop, level
    by level; ``dx`` is accumulated transposed (``dx^T = Q^T D``, ``[BK, BT]``), so that
    no dot result is ever transposed. Rule 2A's (rule 2 has its own, ``column_delta_kernels.
    dqk_bwd_two_reads``): the writes are ``eta * v`` and the exit state has a gradient."""
    i_k, i_h = tl.program_id(0), tl.program_id(2)
    i_c = tl.program_id(1)
    i_t, boh, first, last, rows, m_r = _chunk_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT,
                                                      IS_VARLEN)
    LEVELS: tl.constexpr = 4 + (BT >= 32) + (BT >= 64) + (BT >= 128)  # log2(BT), BT in 16..128
    dt = q.dtype.element_ty
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    state = ((boh + i_t) * H + i_h) * K * V
    # D over the value blocks, level by level: D[t, s] += sum_j (E_t do_t)[j] (E_s U_s)[j]
    b_d = tl.zeros([BT, BT], dtype=tl.float32)
    b_dd = tl.zeros([BT], dtype=tl.float32)  # D[t, t] (read after)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
        b_uq = _query_prefix(u, b_u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
        b_do = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
        b_U = _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v, True)
        if READ_AFTER:
            b_dd += tl.sum(b_do * b_U, axis=1)
        for lvl in range(LEVELS):
            source, block, b_e = _level(u, b_u, b_uq, first, last, m_r, i_h, H, V, o_v, m_v, BT, lvl)
            b_g = (tl.where(source[:, None], 0.0, b_e) * b_do).to(dt)
            b_w = (tl.where(source[:, None], b_e, 0.0) * b_U).to(dt)
            b_d += tl.where(block, tl.dot(b_g, tl.trans(b_w), input_precision=PRECISION), 0.0)
    if READ_AFTER:
        i = tl.arange(0, BT)
        b_d += tl.where(i[:, None] == i[None, :], b_dd[:, None], 0.0)
    b_d = b_d.to(dt)
    b_dq = tl.dot(b_d, _rows(x, rows, m_r, i_h, H, K, o_k, m_k), input_precision=PRECISION)
    b_dxt = tl.dot(_rows_t(q, rows, m_r, i_h, H, K, o_k, m_k), b_d, input_precision=PRECISION)
    # the entry state's read (dq) and the exit state's write (dx)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
        b_uq = _query_prefix(u, b_u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
        b_do = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
        b_ht = tl.load(h + state + o_k[None, :] * V + o_v[:, None], mask=m_k[None, :] & m_v[:, None], other=0.0)
        b_dq += tl.dot((b_do * _decay(b_uq, m_r[:, None])).to(dt), b_ht, input_precision=PRECISION)
        b_U = _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v, True)
        u_last = _row(u, last, True, i_h, H, V, o_v, m_v)
        b_dh = tl.load(dh + state + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_wc = (b_U * _decay(u_last[None, :] - b_u, m_r[:, None])).to(dt)
        b_dxt += tl.dot(b_dh, tl.trans(b_wc), input_precision=PRECISION)
    tl.store(dq + (rows[:, None] * H + i_h) * K + o_k[None, :], b_dq.to(dq.dtype.element_ty),
             mask=m_r[:, None] & m_k[None, :])
    tl.store(dx + (rows[None, :] * H + i_h) * K + o_k[:, None], b_dxt.to(dx.dtype.element_ty),
             mask=m_r[None, :] & m_k[:, None])
