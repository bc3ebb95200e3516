r"""Triton kernels of the chunk form with one scalar decay per step (Falcon-1A).

With the write key ``kk_s = eta_s x_s`` and the carry ``a_t`` (``log_a`` =
``log gamma_t + g_t``), a chunk of ``BT`` steps entered with state ``h`` computes,
using chunk-local log-prefixes ``u_t = sum_{r <= t} log a_r`` (``w_t = u_{t-1}``)::

    o_t    = exp(uq_t) q_t^T h + sum_{s in M(t)} exp(uq_t - u_s) (q_t . kk_s) v_s
    h_next = exp(u_C) h + sum_s exp(u_C - u_s) kk_s v_s^T

with ``uq = u``, ``M(t) = {s <= t}`` (read after write) or ``uq = w``,
``M(t) = {s < t}`` (read before write). Only non-positive exponents are ever
evaluated. Tensors are time-major ``[B, T, H, D]`` (``B = 1`` with packed
sequences); states are ``[num_chunks, H, K, V]``.

With ``delayed = ((x_pre, x_delay), (v_pre, v_delay))`` the kernels read ``x`` and ``v``
late, in place: row ``t`` of a sequence is row ``t`` of the concatenation ``[x_pre | x]``
along time (``x_pre`` ``[N, x_delay, H, K]`` first, then the sequence's rows), so its rows
``t >= x_delay`` are rows ``t - x_delay`` of ``x`` (likewise ``v``). ``dx`` and ``dv`` are then
the gradients of the delayed rows. The default ``delayed=None`` reads the rows as they are
(one launch argument, so the kernels of rule 1A pay nothing for it).

Kernels: ``state_fwd`` (entry state of every chunk, sequential over chunks),
``output_fwd`` (all chunks at once), ``state_bwd`` (gradient of every chunk's exit
state, reverse over chunks), ``dv_bwd``, ``dqk_bwd`` and ``dlog_bwd`` (the gradient
of the log carries from the per-step ``du`` by a chunk-local reverse cumsum).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _sequence(i_n, cu_seqlens, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """First row, length and first chunk index of sequence ``i_n``."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T_n = (tl.load(cu_seqlens + i_n + 1) - tl.load(cu_seqlens + i_n)).to(tl.int32)
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        T_n = T
        boh = i_n.to(tl.int64) * tl.cdiv(T, BT)
    return bos, T_n, boh


@triton.jit
def _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence, chunk-in-sequence and the sequence bounds for a per-chunk program."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int32)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int32)
    else:
        nt = tl.cdiv(T, BT)
        i_n = i_c // nt
        i_t = i_c % nt
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    return i_n, i_t, bos, T_n, boh


@triton.jit
def _query_rows(bos, o_t, m_t, QSLOTS: tl.constexpr, QREAD: tl.constexpr):
    """Rows of ``q``, ``do``, ``o`` and ``dq`` for steps ``o_t`` and their mask: the rows
    themselves, or, with ``QSLOTS > 1`` (one query per group of ``QSLOTS`` rows, on the group's
    row ``QREAD``: the rule-3 layout), row ``r // QSLOTS`` for the rows ``r`` of slot ``QREAD``
    and nothing for the others (they read zeros, as a zero query would)."""
    r = bos + o_t
    if QSLOTS == 1:
        return r, m_t
    return r // QSLOTS, m_t & (r % QSLOTS == QREAD)


@triton.jit
def _query_tile(bos, i_t, o_t, m_t, T_n, uq, BT: tl.constexpr, BQ: tl.constexpr, QSLOTS: tl.constexpr,
                QREAD: tl.constexpr):
    """The query rows a chunk reads, as a tile of ``BQ`` rows: their rows of ``q`` / ``o``, their
    mask, their chunk-local write row ``p`` and ``uq`` there. ``BQ = BT``: one per write row, as
    ``_query_rows`` gives them (rows off the read slot masked). ``BQ = BT // QSLOTS`` (rule 3's
    layout): the steps' query rows alone, packed (``p = j * QSLOTS + QREAD``), so that the products
    of the reads take no masked rows."""
    if BQ == BT:
        qr, m_q = _query_rows(bos, o_t, m_t, QSLOTS, QREAD)
        return qr, m_q, tl.arange(0, BT), uq
    o_j = tl.arange(0, BQ)
    p = o_j * QSLOTS + QREAD
    uq_j = tl.sum(tl.where(tl.arange(0, BT)[None, :] == p[:, None], uq[None, :], 0.0), axis=1)
    return (bos + i_t * BT) // QSLOTS + o_j, (i_t * BT + p) < T_n, p, uq_j


@triton.jit
def _pair_rows(bos, o_t, i_n, T, WIN: tl.constexpr):
    """Rows of the pair tensor (``x`` or ``v``) that hold the writes ``o_t`` of sequence ``i_n``:
    ``bos + o_t``, or with ``WIN > 1`` (rows of equal length ``T``, a multiple of ``WIN``: rule 3's
    writes, ``WIN`` per step) rows of the extended axis ``[N, T // WIN + WIN - 1, H, D]``, write
    ``j*WIN + i`` (slot ``i`` of step ``j``) reading position ``j + i``, in place."""
    if WIN == 1:
        r = bos + o_t
    else:
        r = i_n.to(tl.int64) * (T // WIN + WIN - 1) + o_t // WIN + o_t % WIN
    return r


@triton.jit
def _load_keys(x, delayed, i_n, bos, o_t, m_t, i_h, o_d, m_d, T, H: tl.constexpr, D: tl.constexpr,
               TRANS: tl.constexpr, XWIN: tl.constexpr):
    """The write features of steps ``o_t`` as ``_load_rows(x, delayed, 0, ...)`` does, or with
    ``XWIN > 1`` read in place from the extended axis (``_pair_rows``; ``delayed`` unused)."""
    if XWIN == 1:
        b_x = _load_rows(x, delayed, 0, i_n, bos, o_t, m_t, i_h, o_d, m_d, H, D, TRANS)
    else:
        r = _pair_rows(bos, o_t, i_n, T, XWIN)
        if TRANS:
            b_x = tl.load(x + (r[None, :] * H + i_h) * D + o_d[:, None], mask=m_t[None, :] & m_d[:, None], other=0.0)
        else:
            b_x = tl.load(x + (r[:, None] * H + i_h) * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)
    return b_x


@triton.jit
def _load_rows(x, delayed, WHICH: tl.constexpr, i_n, bos, o_t, m_t, i_h, o_d, m_d, H: tl.constexpr,
               D: tl.constexpr, TRANS: tl.constexpr):
    """The rows of steps ``o_t`` of sequence ``i_n`` (columns ``o_d``) as a ``[BT, BD]`` tile, or
    ``[BD, BT]`` with ``TRANS``, 0 where ``m_t`` or ``m_d`` is False: rows ``bos + o_t`` of ``x``, or,
    with ``(prefix, delay) = delayed[WHICH]``, rows ``o_t`` of ``[prefix | x]`` (``delay`` prefix
    rows per sequence). The delayed read selects between whole pointer tiles (selecting row
    pointers before adding the columns would lose the vectorized access along ``o_d``)."""
    if TRANS:
        rows, cols, mask = o_t[None, :], o_d[:, None], m_t[None, :] & m_d[:, None]
    else:
        rows, cols, mask = o_t[:, None], o_d[None, :], m_t[:, None] & m_d[None, :]
    if delayed is None:
        ptr = x + ((bos + rows) * H + i_h) * D + cols
    else:
        prefix, delay = delayed[WHICH][0], delayed[WHICH][1]
        ptr = tl.where(rows < delay, prefix + ((i_n.to(tl.int64) * delay + rows) * H + i_h) * D + cols,
                       x + ((bos + rows - delay) * H + i_h) * D + cols)
    return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def _log_prefixes(log_a, eta, bos, i_t, i_h, T_n, H: tl.constexpr, BT: tl.constexpr, READ_AFTER: tl.constexpr,
                  HAS_ETA: tl.constexpr = True):
    """Chunk-local ``u`` (write side), ``uq`` (read side), ``u_C``, ``eta`` (1 without
    ``HAS_ETA``) and the row mask."""
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T_n
    la = tl.load(log_a + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    if HAS_ETA:
        et = tl.load(eta + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    else:
        et = tl.where(m_t, 1.0, 0.0)
    u = tl.cumsum(la, axis=0)
    # u at the chunk's last step, taken from the prefix itself: exp(u_last - u_s) is then exactly 1
    # at that step (tl.sum adds in another order than tl.cumsum, and under strong decays the two
    # round apart by the spacing of floats near u_last, a relative error of that size on the
    # chunk's last write)
    last = tl.minimum(BT, T_n - i_t * BT) - 1
    u_last = tl.sum(tl.where(tl.arange(0, BT) == last, u, 0.0), axis=0)
    if READ_AFTER:
        uq = u
    else:
        uq = u - la
    return u, uq, u_last, et, m_t


@triton.jit
def _read_decay(uq_j, p, u, READ_AFTER: tl.constexpr, BT: tl.constexpr):
    """``[j, s] -> exp(uq_j - u_s)`` for the query of write row ``p_j`` and the writes ``s`` it reads
    (``s <= p_j`` read after write, ``s < p_j`` before), 0 elsewhere (no positive exponent evaluated);
    with ``p = 0 .. BT-1``, the ``[t, s]`` mask of one query per row."""
    o = tl.arange(0, BT)
    if READ_AFTER:
        keep = o[None, :] <= p[:, None]
    else:
        keep = o[None, :] < p[:, None]
    return tl.exp(tl.where(keep, uq_j[:, None] - u[None, :], float("-inf")))


@triton.jit
def _read_decay_t(uq_j, p, u, READ_AFTER: tl.constexpr, BT: tl.constexpr):
    """The transpose ``[s, j]`` of ``_read_decay``, built directly."""
    o = tl.arange(0, BT)
    if READ_AFTER:
        keep = o[:, None] <= p[None, :]
    else:
        keep = o[:, None] < p[None, :]
    return tl.exp(tl.where(keep, uq_j[None, :] - u[:, None], float("-inf")))


@triton.jit
def state_fwd(
    x, v, eta, log_a, h, s0, s_final, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    delayed=None,
):
    """Grid ``(cdiv(K, BK), cdiv(V, BV), N * H)``: every chunk's entry state into ``h``."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    state_off = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        b_h += tl.load(s0 + i_nh.to(tl.int64) * K * V + state_off, mask=m_kv, other=0.0)
    for i_t in range(tl.cdiv(T_n, BT)):
        tl.store(h + ((boh + i_t) * H + i_h) * K * V + state_off, b_h.to(h.dtype.element_ty), mask=m_kv)
        u, _uq, u_last, et, m_t = _log_prefixes(log_a, eta, bos, i_t, i_h, T_n, H, BT, True)
        o_t = i_t * BT + tl.arange(0, BT)
        b_xt = _load_rows(x, delayed, 0, i_n, bos, o_t, m_t, i_h, o_k, o_k < K, H, K, True)  # [BK, BT]
        b_v = _load_rows(v, delayed, 1, i_n, bos, o_t, m_t, i_h, o_v, o_v < V, H, V, False)  # [BT, BV]
        coef = et * tl.exp(u_last - u)
        b_kt = (b_xt * coef[None, :]).to(b_v.dtype)
        b_h = b_h * tl.exp(u_last) + tl.dot(b_kt, b_v, input_precision=PRECISION)
    if STORE_FINAL:
        tl.store(s_final + i_nh.to(tl.int64) * K * V + state_off, b_h, mask=m_kv)


@triton.jit
def output_fwd(
    q, x, v, eta, log_a, h, o, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_ETA: tl.constexpr, PRECISION: tl.constexpr,
    delayed=None, QSLOTS: tl.constexpr = 1, QREAD: tl.constexpr = 0, XWIN: tl.constexpr = 1,
    QPACK: tl.constexpr = False,
):
    """Grid ``(cdiv(V, BV), num_chunks, H)``: outputs of every chunk from its entry state
    (``q`` and ``o`` on the query rows, ``_query_tile``: packed with ``QPACK``, ``BT // QSLOTS >= 16``;
    ``x`` as ``_load_keys`` reads it)."""
    BQ: tl.constexpr = BT // QSLOTS if QPACK else BT
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    u, uq, u_last, et, m_t = _log_prefixes(log_a, eta, bos, i_t, i_h, T_n, H, BT, READ_AFTER, HAS_ETA)
    qr, m_q, p, uq = _query_tile(bos, i_t, o_t, m_t, T_n, uq, BT, BQ, QSLOTS, QREAD)
    b_o = tl.zeros([BQ, BV], dtype=tl.float32)
    b_s = tl.zeros([BQ, BT], dtype=tl.float32)
    h_base = h + ((boh + i_t) * H + i_h) * K * V
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(q + (qr[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & m_k[None, :], other=0.0)
        b_xt = _load_keys(x, delayed, i_n, bos, o_t, m_t, i_h, o_k, m_k, T, H, K, True, XWIN)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & (o_v[None, :] < V), other=0.0)
        b_o += tl.dot(b_q, b_h, input_precision=PRECISION)
        b_s += tl.dot(b_q, b_xt, input_precision=PRECISION)
    b_v = _load_rows(v, delayed, 1, i_n, bos, o_t, m_t, i_h, o_v, o_v < V, H, V, False)
    b_a = b_s * _read_decay(uq, p, u, READ_AFTER, BT) * et[None, :]
    b_o = b_o * tl.exp(uq)[:, None] + tl.dot(b_a.to(b_v.dtype), b_v, input_precision=PRECISION)
    tl.store(o + (qr[:, None] * H + i_h) * V + o_v[None, :], b_o.to(o.dtype.element_ty),
             mask=m_q[:, None] & (o_v[None, :] < V))


@triton.jit
def state_bwd(
    q, do, eta, log_a, dh, ds_final, ds0, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DS_FINAL: tl.constexpr, STORE_DS0: tl.constexpr, READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr,
    HAS_ETA: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), cdiv(V, BV), N * H)``: the gradient of every chunk's exit
    state into ``dh`` (``dh_prev = exp(u_C) dh + sum_t exp(uq_t) q_t do_t^T``)."""
    i_k, i_v, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_kv = (o_k[:, None] < K) & (o_v[None, :] < V)
    state_off = o_k[:, None] * V + o_v[None, :]
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DS_FINAL:
        b_dh += tl.load(ds_final + i_nh.to(tl.int64) * K * V + state_off, mask=m_kv, other=0.0)
    for j in range(tl.cdiv(T_n, BT)):
        i_t = tl.cdiv(T_n, BT) - 1 - j
        tl.store(dh + ((boh + i_t) * H + i_h) * K * V + state_off, b_dh.to(dh.dtype.element_ty), mask=m_kv)
        _u, uq, u_last, _et, m_t = _log_prefixes(log_a, eta, bos, i_t, i_h, T_n, H, BT, READ_AFTER, HAS_ETA)
        o_t = i_t * BT + tl.arange(0, BT)
        b_qt = tl.load(q + ((bos + o_t[None, :]) * H + i_h) * K + o_k[:, None],
                       mask=m_t[None, :] & (o_k[:, None] < K), other=0.0)  # [BK, BT]
        b_do = tl.load(do + ((bos + o_t[:, None]) * H + i_h) * V + o_v[None, :],
                       mask=m_t[:, None] & (o_v[None, :] < V), other=0.0)  # [BT, BV]
        b_qt = (b_qt * tl.exp(uq)[None, :]).to(b_do.dtype)
        b_dh = b_dh * tl.exp(u_last) + tl.dot(b_qt, b_do, input_precision=PRECISION)
    if STORE_DS0:
        tl.store(ds0 + i_nh.to(tl.int64) * K * V + state_off, b_dh, mask=m_kv)


@triton.jit
def dv_bwd(
    q, x, do, eta, log_a, dh, dv, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_ETA: tl.constexpr, PRECISION: tl.constexpr,
    delayed=None,
):
    """Grid ``(cdiv(V, BV), num_chunks, H)``:
    ``dv_s = sum_{t: s in M(t)} exp(uq_t - u_s) (q_t . kk_s) do_t + exp(u_C - u_s) dh^T kk_s``
    (``x`` as ``_load_rows`` reads it). The WY kernels of rules 1 and 3 form the first term in
    their own ``state_bwd``."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_v = i_v * BV + tl.arange(0, BV)
    m_tv = (o_t[:, None] < T_n) & (o_v[None, :] < V)
    u, uq, u_last, et, m_t = _log_prefixes(log_a, eta, bos, i_t, i_h, T_n, H, BT, READ_AFTER, HAS_ETA)
    b_st = tl.zeros([BT, BT], dtype=tl.float32)  # [s, t] = x_s . q_t
    b_xd = tl.zeros([BT, BV], dtype=tl.float32)
    state = ((boh + i_t) * H + i_h) * K * V
    rows = bos + o_t
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_x = _load_rows(x, delayed, 0, i_n, bos, o_t, m_t, i_h, o_k, m_k, H, K, False)
        b_qt = tl.load(q + (rows[None, :] * H + i_h) * K + o_k[:, None], mask=m_t[None, :] & m_k[:, None], other=0.0)
        b_st += tl.dot(b_x, b_qt, input_precision=PRECISION)
        b_dh = tl.load(dh + state + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & (o_v[None, :] < V), other=0.0)
        b_xd += tl.dot(b_x, b_dh, input_precision=PRECISION)
    b_do = tl.load(do + (rows[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
    b_at = b_st * _read_decay_t(uq, tl.arange(0, BT), u, READ_AFTER, BT) * et[:, None]
    b_dv = tl.dot(b_at.to(b_do.dtype), b_do, input_precision=PRECISION) + b_xd * (et * tl.exp(u_last - u))[:, None]
    tl.store(dv + (rows[:, None] * H + i_h) * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


@triton.jit
def dqk_bwd(
    q, x, v, do, eta, log_a, h, dh, dq, dx, deta_part, du_part, dw_part,
    cu_seqlens, chunk_indices, chunk_offsets, T, n_rows,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, HAS_ETA: tl.constexpr, PRECISION: tl.constexpr,
    delayed=None, QSLOTS: tl.constexpr = 1, QREAD: tl.constexpr = 0, XWIN: tl.constexpr = 1,
    QPACK: tl.constexpr = False,
):
    """Grid ``(cdiv(K, BK), num_chunks, H)``: ``dq`` (on the query rows, ``_query_tile``: packed with
    ``QPACK``), ``dx`` (per write row; ``x`` as ``_load_keys`` reads it) and, per key block,
    partial sums of ``deta`` and of the log-prefix gradients: write side ``-kk . dkk``
    plus ``d u_C = <dh, h_next>`` at the last step into ``du``, read side ``q . dq``
    (on the query's write row) into ``du`` (read after write) or ``dw`` (read before write)."""
    BQ: tl.constexpr = BT // QSLOTS if QPACK else BT
    i_k, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    u, uq, u_last, et, m_t = _log_prefixes(log_a, eta, bos, i_t, i_h, T_n, H, BT, READ_AFTER, HAS_ETA)
    qr, m_q, p, uq = _query_tile(bos, i_t, o_t, m_t, T_n, uq, BT, BQ, QSLOTS, QREAD)
    b_ds = tl.zeros([BQ, BT], dtype=tl.float32)   # [j, s] = do_j . v_s
    b_dst = tl.zeros([BT, BQ], dtype=tl.float32)  # [s, j] = v_s . do_j
    b_dqh = tl.zeros([BQ, BK], dtype=tl.float32)  # do h^T
    b_dks = tl.zeros([BT, BK], dtype=tl.float32)  # v dh^T
    b_hdh = tl.zeros([BK], dtype=tl.float32)       # <h, dh> over this key block
    state = ((boh + i_t) * H + i_h) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_v = _load_rows(v, delayed, 1, i_n, bos, o_t, m_t, i_h, o_v, m_v, H, V, False)
        b_do = tl.load(do + (qr[:, None] * H + i_h) * V + o_v[None, :], mask=m_q[:, None] & m_v[None, :], other=0.0)
        b_vt = _load_rows(v, delayed, 1, i_n, bos, o_t, m_t, i_h, o_v, m_v, H, V, True)
        b_dot = tl.load(do + (qr[None, :] * H + i_h) * V + o_v[:, None], mask=m_q[None, :] & m_v[:, None], other=0.0)
        b_ht = tl.load(h + state + o_k[None, :] * V + o_v[:, None], mask=m_k[None, :] & m_v[:, None], other=0.0)  # [BV, BK]
        b_dht = tl.load(dh + state + o_k[None, :] * V + o_v[:, None], mask=m_k[None, :] & m_v[:, None], other=0.0)
        b_ds += tl.dot(b_do, b_vt, input_precision=PRECISION)
        b_dst += tl.dot(b_v, b_dot, input_precision=PRECISION)
        b_dqh += tl.dot(b_do, b_ht, input_precision=PRECISION)
        b_dks += tl.dot(b_v, b_dht, input_precision=PRECISION)
        b_hdh += tl.sum(b_ht.to(tl.float32) * b_dht.to(tl.float32), axis=0)
    b_q = tl.load(q + (qr[:, None] * H + i_h) * K + o_k[None, :], mask=m_q[:, None] & m_k[None, :], other=0.0)
    b_x = _load_keys(x, delayed, i_n, bos, o_t, m_t, i_h, o_k, m_k, T, H, K, False, XWIN)
    b_kk = b_x.to(tl.float32) * et[:, None]
    b_dp = (b_ds * _read_decay(uq, p, u, READ_AFTER, BT)).to(b_q.dtype)
    b_dpt = (b_dst * _read_decay_t(uq, p, u, READ_AFTER, BT)).to(b_q.dtype)
    b_dq = b_dqh * tl.exp(uq)[:, None] + tl.dot(b_dp, b_kk.to(b_q.dtype), input_precision=PRECISION)
    to_end = tl.exp(u_last - u)
    b_dkk_state = b_dks * to_end[:, None]
    b_dkk = tl.dot(b_dpt, b_q, input_precision=PRECISION) + b_dkk_state
    m_tk = m_t[:, None] & m_k[None, :]
    row = ((bos + o_t[:, None]) * H + i_h) * K + o_k[None, :]
    tl.store(dq + (qr[:, None] * H + i_h) * K + o_k[None, :], b_dq.to(dq.dtype.element_ty),
             mask=m_q[:, None] & m_k[None, :])
    tl.store(dx + row, (b_dkk * et[:, None]).to(dx.dtype.element_ty), mask=m_tk)
    # per-step partial sums over this key block, [NK, rows, H]
    d_eta = tl.sum(b_x.to(tl.float32) * b_dkk, axis=1)
    d_uq = tl.sum(b_q.to(tl.float32) * b_dq, axis=1)
    if BQ < BT:  # packed queries: each one's sum onto its write row
        d_uq = tl.sum(tl.where(tl.arange(0, BT)[:, None] == p[None, :], d_uq[None, :], 0.0), axis=1)
    d_uk = -tl.sum(b_kk * b_dkk, axis=1)
    last = tl.minimum(BT, T_n - i_t * BT) - 1
    d_last = tl.exp(u_last) * tl.sum(b_hdh, axis=0) + tl.sum(tl.sum(b_kk * b_dkk_state, axis=1), axis=0)
    d_uk += tl.where(tl.arange(0, BT) == last, d_last, 0.0)
    off = (i_k.to(tl.int64) * n_rows + bos + o_t) * H + i_h
    tl.store(deta_part + off, d_eta, mask=m_t)
    if READ_AFTER:  # the read side uses u
        tl.store(du_part + off, d_uq + d_uk, mask=m_t)
        tl.store(dw_part + off, tl.zeros_like(d_uq), mask=m_t)
    else:  # the read side uses w
        tl.store(du_part + off, d_uk, mask=m_t)
        tl.store(dw_part + off, d_uq, mask=m_t)


@triton.jit
def dlog_bwd(
    deta_part, du_part, dw_part, extra, dkappa, deta, dlog_a, cu_seqlens, chunk_indices, chunk_offsets, T, n_rows,
    H: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, NK: tl.constexpr, HAS_ETA: tl.constexpr,
    HAS_EXTRA: tl.constexpr, HAS_DKAPPA: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Grid ``(num_chunks,)``, every head of a chunk in one ``[BT, BH]`` tile (its rows are
    contiguous in memory): sum the partials (``NK`` key blocks, plus ``extra`` ``[3, rows, H]`` =
    ``deta, du, dw`` from the WY kernel, plus ``dkappa`` ``[rows, H]`` where kappa is eta
    itself); ``d log_a_r = sum_{t >= r} du_t + sum_{t > r} dw_t`` within the chunk (``u_t``
    includes ``log_a_t``, ``w_t`` does not)."""
    i_c = tl.program_id(0)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_h = tl.arange(0, BH)
    m = (o_t < T_n)[:, None] & (o_h < H)[None, :]
    row = ((bos + o_t) * H)[:, None] + o_h[None, :]
    d_eta = tl.zeros([BT, BH], dtype=tl.float32)
    du = tl.zeros([BT, BH], dtype=tl.float32)
    dw = tl.zeros([BT, BH], dtype=tl.float32)
    for i_k in range(NK):
        off = i_k * n_rows * H + row
        if HAS_ETA:
            d_eta += tl.load(deta_part + off, mask=m, other=0.0)
        du += tl.load(du_part + off, mask=m, other=0.0)
        dw += tl.load(dw_part + off, mask=m, other=0.0)
    if HAS_EXTRA:
        d_eta += tl.load(extra + row, mask=m, other=0.0)
        du += tl.load(extra + n_rows * H + row, mask=m, other=0.0)
        dw += tl.load(extra + 2 * n_rows * H + row, mask=m, other=0.0)
    if HAS_DKAPPA:
        d_eta += tl.load(dkappa + row, mask=m, other=0.0)
    total = du + dw
    d_log = tl.sum(total, axis=0)[None, :] - tl.cumsum(total, axis=0) + total - dw  # reverse cumsums
    tl.store(deta + row, d_eta, mask=m)
    tl.store(dlog_a + row, d_log, mask=m)
