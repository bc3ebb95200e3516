r"""Triton kernels of the chunk form of the regression rule with a scalar step (Falcon-1).

Per chunk, with chunk-local prefixes ``u`` (inclusive) and ``w`` (exclusive) of
``log_a``, the write vectors ``D`` of the entry state ``h`` solve one unit
lower-triangular system (the WY form)::

    L = I + N,   N[p, r] = kappa_p exp(w_p - u_r) (x_p . x_r)   (r < p)
    A = L^{-1},  U = A (eta * Y),  W = A (kappa exp(w) * X),     D = U - W h

after which outputs and the exit state are those of the scalar-decay kernels with
key ``x`` and values ``D``::

    o_t    = exp(uq_t) q_t^T h + sum_{s in M(t)} exp(uq_t - u_s) (q_t . x_s) D_s
    h_next = exp(u_C) h + sum_s exp(u_C - u_s) x_s D_s^T

Kernels: ``wy_fwd`` (``A``, ``U``, ``W`` of every chunk: one Gram per chunk, ``N`` staged in ``A``
and inverted there in 16 x 16 blocks, forward substitution on the diagonal ones and
products for the rest; or the same in two launches, ``wy_inverse`` then ``wy_apply``), ``state_fwd`` (sequential: entry states and
``D``; the outputs are ``scalar_decay_kernels.output_fwd``'s), ``state_bwd`` (reverse: the whole
``dD``, its reads' part ``sum_t exp(uq_t - u_s) (q_t . x_s) do_t`` formed in the same pass, plus
``exp(u_C - u) X dh``, and ``dh_prev = exp(u_C) dh + sum_t exp(uq_t) q_t do_t^T - W^T dD``) and ``wy_bwd``
(through ``D = U - W h``, ``U``, ``W`` and ``A = L^{-1}``: ``dL = -A^T dA A^T``, each
product once). Every transposed operand is loaded as such (``wy_bwd``'s ``dG^T`` read back
from the scratch it was stored in), never ``tl.trans`` of a product. With ``WINDOWED`` the
kernels read the features and values in place from rule 3's extended time axis
(``scalar_decay_kernels._pair_rows``); everything they write is per write row.

Rule 3's step sizes: ``window_gram_fwd`` / ``window_gram_bwd`` (the window Grams
``G_t[i, j] = x_{t+i} . x_{t+j}`` straight from the extended axis, and their gradient).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .scalar_decay_kernels import (_chunk_of_program, _log_prefixes, _pair_rows, _query_tile, _read_decay_t,
                                   _sequence)
from .window_sum import store_split


@triton.jit
def _step_prefix(u, w, BT: tl.constexpr, SLOTS: tl.constexpr):
    """Exclusive log-prefix of each write's step. One step per row (``SLOTS = 1``): ``w``
    itself. ``SLOTS`` writes per step (rows ``j*SLOTS .. j*SLOTS+SLOTS-1``, the carry on the
    first): every row of step ``j`` gets the prefix before that step, ``u - la_first``."""
    if SLOTS == 1:
        return w
    o = tl.arange(0, BT)
    same = (o[None, :] // SLOTS) == (o[:, None] // SLOTS)
    return u - tl.sum(tl.where(same, (u - w)[None, :], 0.0), axis=1)


@triton.jit
def _earlier_step(rows, cols, SLOTS: tl.constexpr):
    """``[p, r]`` -> write ``r`` belongs to an earlier step than write ``p``."""
    return (cols[None, :] // SLOTS) < (rows[:, None] // SLOTS)


@triton.jit
def _decayed_gram(x, r_x, ka, u, w, i_t, i_h, T_n, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, PRECISION: tl.constexpr, SLOTS: tl.constexpr):
    """``N`` ``[BT, BT]`` fp32 of one chunk, ``N[p, r] = ka_p exp(w_p - u_r) (x_p . x_r)`` for ``r`` of an
    earlier step than ``p`` and 0 elsewhere: one Gram ``X X^T`` from ``[BT, BK] x [BK, BT]`` dots (``X^T``
    loaded as such; the chunk's features on rows ``r_x`` of ``x``), then the decays."""
    o_c = tl.arange(0, BT)
    o_t = i_t * BT + o_c
    m_t = o_t < T_n
    b_g = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_x = tl.load(x + (r_x[:, None] * H + i_h) * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_xt = tl.load(x + (r_x[None, :] * H + i_h) * K + o_k[:, None], mask=m_t[None, :] & m_k[:, None], other=0.0)
        b_g += tl.dot(b_x, b_xt, input_precision=PRECISION)
    below = _earlier_step(o_c, o_c, SLOTS)
    return tl.where(below, ka[:, None] * tl.exp(tl.where(below, w[:, None] - u[None, :], float("-inf"))) * b_g, 0.0)


@triton.jit
def _block(a0, i, j, n_rows, H: tl.constexpr, BT: tl.constexpr):
    """Pointers and row mask of the 16 x 16 block ``(i, j)`` of a chunk's ``[BT, BT]`` tile in ``A``
    (``a0``: its first row; ``n_rows``: the chunk's rows inside its sequence)."""
    o = tl.arange(0, 16)
    r = i * 16 + o
    return a0 + r[:, None] * (H * BT) + (j * 16 + o)[None, :], (r < n_rows)[:, None]


@triton.jit
def _invert_diagonal_blocks(a0, n_rows, H: tl.constexpr, BT: tl.constexpr):
    """In place: every 16 x 16 diagonal block ``N_bb`` of the chunk's tile becomes ``(I + N_bb)^{-1}``, all
    ``BT / 16`` blocks at once as one ``[BT / 16, 16, 16]`` tile, by forward substitution::

        row j = e_j - sum_{l < j} N_bb[j, l] (row l)      (j = 1 .. 15)

    ``N_bb[j, :]`` of every block is read from ``A`` (no extraction from registers)."""
    NB: tl.constexpr = BT // 16
    stride: tl.constexpr = H * BT
    o_b = tl.arange(0, NB)
    o_s = tl.arange(0, 16)
    b_ai = tl.where(o_s[None, :, None] == o_s[None, None, :], 1.0, 0.0) + tl.zeros([NB, 16, 16], dtype=tl.float32)
    for j in tl.static_range(1, 16):
        r_j = o_b * 16 + j
        n_j = tl.load(a0 + r_j[:, None] * stride + (o_b[:, None] * 16 + o_s[None, :]), mask=(r_j < n_rows)[:, None],
                      other=0.0)  # [NB, 16]: row j of every N_bb
        a_j = tl.sum(n_j[:, :, None] * b_ai, axis=1)
        b_ai = tl.where(o_s[None, :, None] == j, b_ai - a_j[:, None, :], b_ai)
    rows = o_b[:, None, None] * 16 + o_s[None, :, None]
    tl.debug_barrier()  # every row of every N_bb read before its inverse replaces it
    tl.store(a0 + rows * stride + o_b[:, None, None] * 16 + o_s[None, None, :], b_ai, mask=rows < n_rows)


@triton.jit
def _load_block(a0, i, j, n_rows, H: tl.constexpr, BT: tl.constexpr):
    """The 16 x 16 block ``(i, j)`` of a chunk's tile in ``A``, rows past the chunk's end zero."""
    p, m = _block(a0, i, j, n_rows, H, BT)
    return tl.load(p, mask=m, other=0.0)


@triton.jit
def _store_block(a0, i, j, b, n_rows, H: tl.constexpr, BT: tl.constexpr):
    p, m = _block(a0, i, j, n_rows, H, BT)
    tl.store(p, b, mask=m)


@triton.jit
def _unit_lower_inverse(a0, n_rows, H: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr):
    """In place: the chunk's tile ``N`` in ``A`` (strictly lower, zero above the diagonal) becomes
    ``(I + N)^{-1}``. Diagonal 16 x 16 blocks by ``_invert_diagonal_blocks``, then the blocks below
    the diagonal by block forward substitution, in registers (16 x 16 products)::

        A_ij = -A_ii sum_{j <= l < i} N_il A_lj       (j < i)

    Every ``N_il`` and ``A_ii`` is read before one barrier, after which the ``A_ij`` replace the
    ``N_ij``. ``BT`` is 16, 32 or 64 (``WY_MAX_CHUNK``)."""
    _invert_diagonal_blocks(a0, n_rows, H, BT)
    tl.debug_barrier()
    if BT >= 32:
        a00 = _load_block(a0, 0, 0, n_rows, H, BT)
        a11 = _load_block(a0, 1, 1, n_rows, H, BT)
        n10 = _load_block(a0, 1, 0, n_rows, H, BT)
        if BT == 64:
            a22 = _load_block(a0, 2, 2, n_rows, H, BT)
            a33 = _load_block(a0, 3, 3, n_rows, H, BT)
            n20 = _load_block(a0, 2, 0, n_rows, H, BT)
            n21 = _load_block(a0, 2, 1, n_rows, H, BT)
            n30 = _load_block(a0, 3, 0, n_rows, H, BT)
            n31 = _load_block(a0, 3, 1, n_rows, H, BT)
            n32 = _load_block(a0, 3, 2, n_rows, H, BT)
        tl.debug_barrier()  # every N_ij read by every thread before the A_ij replace them
        a10 = -tl.dot(a11, tl.dot(n10, a00, input_precision=PRECISION), input_precision=PRECISION)
        _store_block(a0, 1, 0, a10, n_rows, H, BT)
        if BT == 64:
            a21 = -tl.dot(a22, tl.dot(n21, a11, input_precision=PRECISION), input_precision=PRECISION)
            a32 = -tl.dot(a33, tl.dot(n32, a22, input_precision=PRECISION), input_precision=PRECISION)
            s20 = tl.dot(n21, a10, tl.dot(n20, a00, input_precision=PRECISION), input_precision=PRECISION)
            a20 = -tl.dot(a22, s20, input_precision=PRECISION)
            s31 = tl.dot(n32, a21, tl.dot(n31, a11, input_precision=PRECISION), input_precision=PRECISION)
            a31 = -tl.dot(a33, s31, input_precision=PRECISION)
            s30 = tl.dot(n31, a10, tl.dot(n30, a00, input_precision=PRECISION), input_precision=PRECISION)
            a30 = -tl.dot(a33, tl.dot(n32, a20, s30, input_precision=PRECISION), input_precision=PRECISION)
            _store_block(a0, 2, 0, a20, n_rows, H, BT)
            _store_block(a0, 2, 1, a21, n_rows, H, BT)
            _store_block(a0, 3, 0, a30, n_rows, H, BT)
            _store_block(a0, 3, 1, a31, n_rows, H, BT)
            _store_block(a0, 3, 2, a32, n_rows, H, BT)


@triton.jit
def _wy_coefficients(log_a, eta, kappa, i_t, i_h, bos, T_n, H: tl.constexpr, BT: tl.constexpr, SLOTS: tl.constexpr,
                     HAS_ETA: tl.constexpr = True):
    """Per write row of the chunk: ``u`` and ``w`` (``_step_prefix``), ``kappa``, the scales ``eta``
    (1 without ``HAS_ETA``) of ``Y`` and ``kappa exp(w)`` of ``X``, and the row mask."""
    o_t = i_t * BT + tl.arange(0, BT)
    u, w, _u_last, et, m_t = _log_prefixes(log_a, eta, bos, i_t, i_h, T_n, H, BT, False, HAS_ETA)
    w = _step_prefix(u, w, BT, SLOTS)
    ka = tl.load(kappa + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    return u, w, ka, et, ka * tl.exp(w), m_t


@triton.jit
def _wy_inverse(x, A, A_out, r_p, ka, u, w, m_t, i_t, i_h, bos, T_n, H: tl.constexpr, K: tl.constexpr,
                BT: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr, SLOTS: tl.constexpr,
                STORE_A_OUT: tl.constexpr):
    """``A = (I + N)^{-1}`` of one chunk, into its rows of ``A`` (fp32; ``N`` is staged there and
    inverted in place) and, with ``STORE_A_OUT``, rounded to the input dtype into ``A_out``.
    Returns the tile in the input dtype, the operand of every product that reads it."""
    o_c = tl.arange(0, BT)
    a0 = A + ((bos + i_t * BT) * H + i_h) * BT  # the chunk's first row of A; rows H * BT apart
    p_a = a0 + o_c[:, None] * (H * BT) + o_c[None, :]
    b_n = _decayed_gram(x, r_p, ka, u, w, i_t, i_h, T_n, H, K, BT, BK, PRECISION, SLOTS)
    tl.store(p_a, b_n, mask=m_t[:, None])
    tl.debug_barrier()
    _unit_lower_inverse(a0, T_n - i_t * BT, H, BT, PRECISION)
    tl.debug_barrier()
    b_a = tl.load(p_a, mask=m_t[:, None], other=0.0).to(x.dtype.element_ty)
    if STORE_A_OUT:
        tl.store(A_out + ((bos + i_t * BT) * H + i_h) * BT + o_c[:, None] * (H * BT) + o_c[None, :], b_a,
                 mask=m_t[:, None])
    return b_a


@triton.jit
def _wy_product(src, dst, b_a, scale, r_p, o_t, m_t, bos, i_h, i_d, H: tl.constexpr, D: tl.constexpr,
                BD: tl.constexpr, PRECISION: tl.constexpr):
    """Column block ``i_d`` (``BD`` wide) of ``dst = A (scale * src)``: ``src`` rows ``r_p`` of the
    chunk, ``dst`` per write row; a ``[BT, BT] x [BT, BD]`` product in ``b_a``'s dtype, fp32
    accumulation."""
    o_d = i_d * BD + tl.arange(0, BD)
    m = m_t[:, None] & (o_d[None, :] < D)
    b_s = tl.load(src + (r_p[:, None] * H + i_h) * D + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_o = tl.dot(b_a, (b_s * scale[:, None]).to(b_a.dtype), input_precision=PRECISION)
    tl.store(dst + ((bos + o_t[:, None]) * H + i_h) * D + o_d[None, :], b_o.to(dst.dtype.element_ty), mask=m)


@triton.jit
def wy_fwd(
    x, v, eta, kappa, log_a, A, A_out, U, W, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, SLOTS: tl.constexpr = 1, WINDOWED: tl.constexpr = False,
    STORE_A_OUT: tl.constexpr = False,
):
    """Grid ``(num_chunks, H)``: ``A = (I + N)^{-1}`` ``[rows, H, BT]`` fp32, ``U = A (eta Y)``
    ``[rows, H, V]`` and ``W = A (kappa exp(w) X)`` ``[rows, H, K]`` of every chunk. ``N`` is written
    into the chunk's rows of ``A`` and inverted there in place (``_unit_lower_inverse``); ``U`` and
    ``W`` are ``[BT, BT] x [BT, BV]`` products in the input dtype with fp32 accumulation. With
    ``STORE_A_OUT``, ``A`` rounded to the input dtype (the operand of those products, and of every
    product of ``wy_bwd``) is also stored in ``A_out``, laid out as ``A``. ``x`` and ``v`` are read on
    the rows ``_pair_rows`` gives (``WINDOWED``: in place on the extended axis). ``wy_inverse``
    followed by ``wy_apply`` computes the same in two launches."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    u, w, ka, et, kw, m_t = _wy_coefficients(log_a, eta, kappa, i_t, i_h, bos, T_n, H, BT, SLOTS)
    r_p = _pair_rows(bos, o_t, i_n, T, SLOTS if WINDOWED else 1)  # rows of x and v
    b_a = _wy_inverse(x, A, A_out, r_p, ka, u, w, m_t, i_t, i_h, bos, T_n, H, K, BT, BK, PRECISION, SLOTS,
                      STORE_A_OUT)
    for i_v in range(tl.cdiv(V, BV)):
        _wy_product(v, U, b_a, et, r_p, o_t, m_t, bos, i_h, i_v, H, V, BV, PRECISION)
    for i_k in range(tl.cdiv(K, BK)):
        _wy_product(x, W, b_a, kw, r_p, o_t, m_t, bos, i_h, i_k, H, K, BK, PRECISION)


@triton.jit
def wy_inverse(
    x, kappa, log_a, A, A_out, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, SLOTS: tl.constexpr = 1, WINDOWED: tl.constexpr = False,
    STORE_A_OUT: tl.constexpr = False,
):
    """Grid ``(num_chunks, H)``: ``wy_fwd``'s ``A`` (and ``A_out``) alone."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    u, w, ka, _et, _kw, m_t = _wy_coefficients(log_a, log_a, kappa, i_t, i_h, bos, T_n, H, BT, SLOTS, False)
    r_p = _pair_rows(bos, o_t, i_n, T, SLOTS if WINDOWED else 1)
    _wy_inverse(x, A, A_out, r_p, ka, u, w, m_t, i_t, i_h, bos, T_n, H, K, BT, BK, PRECISION, SLOTS, STORE_A_OUT)


@triton.jit
def wy_apply(
    x, v, eta, kappa, log_a, A, U, W, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, SLOTS: tl.constexpr = 1, WINDOWED: tl.constexpr = False,
):
    """Grid ``(num_chunks, H, cdiv(V, BV) + cdiv(K, BK))``: one column block of ``wy_fwd``'s ``U``
    (the first ``cdiv(V, BV)`` programs) or ``W`` (the rest) from the inverse ``A`` (``[rows, H,
    BT]`` in the input dtype, or fp32 for fp32 inputs, as ``wy_inverse`` leaves it)."""
    i_c, i_h, i_j = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = tl.arange(0, BT)
    u, w, ka, et, kw, m_t = _wy_coefficients(log_a, eta, kappa, i_t, i_h, bos, T_n, H, BT, SLOTS)
    r_p = _pair_rows(bos, o_t, i_n, T, SLOTS if WINDOWED else 1)
    b_a = tl.load(A + ((bos + o_t[:, None]) * H + i_h) * BT + o_c[None, :], mask=m_t[:, None],
                  other=0.0).to(x.dtype.element_ty)
    NV = tl.cdiv(V, BV)
    if i_j < NV:
        _wy_product(v, U, b_a, et, r_p, o_t, m_t, bos, i_h, i_j, H, V, BV, PRECISION)
    else:
        _wy_product(x, W, b_a, kw, r_p, o_t, m_t, bos, i_h, i_j - NV, H, K, BK, PRECISION)


@triton.jit
def state_fwd(
    x, U, W, log_a, h, D, s0, s_final, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
    XWIN: tl.constexpr = 1,
):
    """Grid ``(cdiv(V, BV), N * H)`` with ``BK >= K`` (the whole key dimension):
    entry states into ``h`` and ``D = U - W h`` into ``D``, chunk after chunk (``x`` on the rows
    ``_pair_rows(..., XWIN)`` gives)."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    state_off = o_k[:, None] * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        b_h += tl.load(s0 + i_nh.to(tl.int64) * K * V + state_off, mask=m_kv, other=0.0)
    for i_t in range(tl.cdiv(T_n, BT)):
        tl.store(h + ((boh + i_t) * H + i_h) * K * V + state_off, b_h.to(h.dtype.element_ty), mask=m_kv)
        u, _w, u_last, _et, m_t = _log_prefixes(log_a, log_a, bos, i_t, i_h, T_n, H, BT, True, False)
        o_t = i_t * BT + tl.arange(0, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_w = tl.load(W + ((bos + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_u = tl.load(U + ((bos + o_t[:, None]) * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_d = (b_u.to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PRECISION)).to(b_w.dtype)
        tl.store(D + ((bos + o_t[:, None]) * H + i_h) * V + o_v[None, :], b_d.to(D.dtype.element_ty), mask=m_tv)
        r_x = _pair_rows(bos, o_t, i_n, T, XWIN)
        b_xt = tl.load(x + (r_x[None, :] * H + i_h) * K + o_k[:, None], mask=m_t[None, :] & m_k[:, None], other=0.0)
        b_xt = (b_xt * tl.exp(u_last - u)[None, :]).to(b_w.dtype)
        b_h = b_h * tl.exp(u_last) + tl.dot(b_xt, b_d, input_precision=PRECISION)
    if STORE_FINAL:
        tl.store(s_final + i_nh.to(tl.int64) * K * V + state_off, b_h, mask=m_kv)


@triton.jit
def state_bwd(
    q, x, W, do, log_a, dD, dh, ds_final, ds0, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_DS_FINAL: tl.constexpr, STORE_DS0: tl.constexpr, READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr,
    PRECISION: tl.constexpr, QSLOTS: tl.constexpr = 1, QREAD: tl.constexpr = 0, XWIN: tl.constexpr = 1,
    QPACK: tl.constexpr = False,
):
    """Grid ``(cdiv(V, BV), N * H)`` with ``BK >= K``: reverse over chunks, the gradient of
    every exit state into ``dh`` and the whole ``dD`` (in its dtype) of the write values::

        dD_s    = sum_{t: s in M(t)} exp(uq_t - u_s) (q_t . x_s) do_t + exp(u_C - u_s) dH^T x_s
        dh_prev = exp(u_C) dH + sum_t exp(uq_t) q_t do_t^T - W^T dD

    with ``dH`` the exit state's gradient (the reads' part of ``dD`` does not feed the
    recurrence). ``q`` and ``do`` on the query rows (``scalar_decay_kernels._query_tile``: packed
    with ``QPACK``), ``x`` on the rows ``_pair_rows(..., XWIN)`` gives."""
    BQ: tl.constexpr = BT // QSLOTS if QPACK else BT
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    o_k = tl.arange(0, BK)
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
        u, uq, u_last, _et, m_t = _log_prefixes(log_a, log_a, bos, i_t, i_h, T_n, H, BT, READ_AFTER, False)
        o_t = i_t * BT + tl.arange(0, BT)
        m_tk = m_t[:, None] & m_k[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        qr, m_q, p, uq = _query_tile(bos, i_t, o_t, m_t, T_n, uq, BT, BQ, QSLOTS, QREAD)
        r_x = _pair_rows(bos, o_t, i_n, T, XWIN)
        b_x = tl.load(x + (r_x[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
        b_do = tl.load(do + (qr[:, None] * H + i_h) * V + o_v[None, :], mask=m_q[:, None] & m_v[None, :], other=0.0)
        b_qt = tl.load(q + (qr[None, :] * H + i_h) * K + o_k[:, None], mask=m_q[None, :] & m_k[:, None], other=0.0)
        # the reads' part: [s, j] = exp(uq_j - u_s) (x_s . q_j) for the writes s that query j reads
        b_st = tl.dot(b_x, b_qt, input_precision=PRECISION) * _read_decay_t(uq, p, u, READ_AFTER, BT)
        b_dd = tl.dot(tl.where(m_t[:, None], b_st, 0.0).to(b_do.dtype), b_do, input_precision=PRECISION)
        b_x = (b_x * tl.exp(u_last - u)[:, None]).to(b_do.dtype)
        b_dd += tl.dot(b_x, b_dh.to(b_do.dtype), input_precision=PRECISION)
        tl.store(dD + ((bos + o_t[:, None]) * H + i_h) * V + o_v[None, :], b_dd.to(dD.dtype.element_ty), mask=m_tv)
        b_wt = tl.load(W + ((bos + o_t[None, :]) * H + i_h) * K + o_k[:, None], mask=m_t[None, :] & m_k[:, None], other=0.0)
        b_qt = (b_qt * tl.exp(uq)[None, :]).to(b_do.dtype)
        b_dh = (b_dh * tl.exp(u_last) + tl.dot(b_qt, b_do, input_precision=PRECISION)
                - tl.dot(b_wt, b_dd.to(b_do.dtype), input_precision=PRECISION))
    if STORE_DS0:
        tl.store(ds0 + i_nh.to(tl.int64) * K * V + state_off, b_dh, mask=m_kv)


@triton.jit
def wy_bwd(
    x, v, eta, kappa, log_a, A, h, dD, dx, dv, dkappa, extra, dG, cu_seqlens, chunk_indices, chunk_offsets, T, n_rows,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, SLOTS: tl.constexpr = 1, WINDOWED: tl.constexpr = False,
):
    """Grid ``(num_chunks, H)`` with ``BK >= K``: gradients through ``D = U - W h``,
    ``U = A (eta Y)``, ``W = A (kappa exp(w) X)`` and ``A = (I + N)^{-1}``. Writes ``dv``,
    ``dkappa``, adds into ``dx`` and writes ``extra = [deta, du, dw]`` ``[3, rows, H]``::

        dU = dD,  dW = -dD h^T,  dA = dU (eta Y)^T + dW (kappa exp(w) X)^T,  dL = -A^T dA A^T

    Each product is formed once, with ``A^T``, ``Y^T``, ``h^T`` and ``X^T`` loaded as such. The
    Gram's gradient ``dG`` (``[p, r]``, ``r`` before ``p``) enters ``dx`` through ``dG + dG^T``:
    ``dG`` is staged in the scratch ``dG`` (laid out as ``A``, in its dtype; it may be ``A`` itself,
    whose rows of the chunk are read into registers first and not again) and read back
    transposed. ``x`` and ``v`` are read as in ``wy_fwd`` (``WINDOWED``); ``dx`` and ``dv`` are per
    write row."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    o_t = i_t * BT + tl.arange(0, BT)
    o_c = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    u, w, ka, et, kw, m_t = _wy_coefficients(log_a, eta, kappa, i_t, i_h, bos, T_n, H, BT, SLOTS)
    # dot operands in the input dtype (the tensor cores' native type for 16-bit inputs), fp32 accumulation
    dt = x.dtype.element_ty
    b_at = tl.load(A + ((bos + o_t[None, :]) * H + i_h) * BT + o_c[:, None], mask=m_t[None, :], other=0.0).to(dt)
    state = ((boh + i_t) * H + i_h) * K * V
    b_da = tl.zeros([BT, BT], dtype=tl.float32)  # dA
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)  # dW = -dD h^T
    d_eta = tl.zeros([BT], dtype=tl.float32)
    r_p = _pair_rows(bos, o_t, i_n, T, SLOTS if WINDOWED else 1)  # rows of x and v
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        rows_v = ((bos + o_t[:, None]) * H + i_h) * V + o_v[None, :]
        b_dd = tl.load(dD + rows_v, mask=m_tv, other=0.0).to(dt)
        b_y = tl.load(v + (r_p[:, None] * H + i_h) * V + o_v[None, :], mask=m_tv, other=0.0)
        b_yt = tl.load(v + (r_p[None, :] * H + i_h) * V + o_v[:, None], mask=m_t[None, :] & m_v[:, None],
                       other=0.0).to(dt)
        b_ht = tl.load(h + state + o_k[None, :] * V + o_v[:, None], mask=m_k[None, :] & m_v[:, None], other=0.0).to(dt)
        b_da += tl.dot(b_dd, b_yt, input_precision=PRECISION)
        b_atdu = tl.dot(b_at, b_dd, input_precision=PRECISION)  # A^T dU
        tl.store(dv + rows_v, (b_atdu * et[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        d_eta += tl.sum(b_y.to(tl.float32) * b_atdu, axis=1)
        b_dw -= tl.dot(b_dd, b_ht, input_precision=PRECISION)
    b_da = b_da * et[None, :]
    rows_k = ((bos + o_t[:, None]) * H + i_h) * K + o_k[None, :]
    m_tk = m_t[:, None] & m_k[None, :]
    b_x = tl.load(x + (r_p[:, None] * H + i_h) * K + o_k[None, :], mask=m_tk, other=0.0)
    b_xt = tl.load(x + (r_p[None, :] * H + i_h) * K + o_k[:, None], mask=m_t[None, :] & m_k[:, None], other=0.0)
    b_dw16 = b_dw.to(dt)
    b_da += tl.dot(b_dw16, b_xt, input_precision=PRECISION) * kw[None, :]
    b_atdw = tl.dot(b_at, b_dw16, input_precision=PRECISION)  # A^T dW
    b_dx = b_atdw * kw[:, None]
    d_kw = tl.sum(b_x.to(tl.float32) * b_atdw, axis=1)
    d_kappa = d_kw * tl.exp(w)
    d_w = d_kw * kw
    # dL = -A^T dA A^T, restricted to the strict lower triangle (earlier steps)
    b_dl = -tl.dot(tl.dot(b_at, b_da.to(dt), input_precision=PRECISION).to(dt), b_at, input_precision=PRECISION)
    b_g = tl.dot(b_x, b_xt, input_precision=PRECISION)
    strict = _earlier_step(o_c, o_c, SLOTS)  # [p, r]: r before p
    dec = tl.exp(tl.where(strict, w[:, None] - u[None, :], float("-inf")))
    b_dn = tl.where(strict, b_dl, 0.0)
    d_kappa += tl.sum(b_dn * dec * b_g, axis=1)
    b_dnn = b_dn * dec * b_g * ka[:, None]  # dN * N
    d_w += tl.sum(b_dnn, axis=1)
    d_u = -tl.sum(b_dnn, axis=0)
    b_dg = tl.where(m_t[:, None], b_dn * dec * ka[:, None], 0.0)  # dG (rows past the sequence: 0, as reloaded)
    tl.debug_barrier()  # every thread's reads of A done before dG (possibly A's rows) replaces them
    tl.store(dG + ((bos + o_t[:, None]) * H + i_h) * BT + o_c[None, :], b_dg.to(dG.dtype.element_ty),
             mask=m_t[:, None])
    tl.debug_barrier()  # every row of dG stored before it is read back transposed
    b_dg += tl.load(dG + ((bos + o_t[None, :]) * H + i_h) * BT + o_c[:, None], mask=m_t[None, :],
                    other=0.0).to(tl.float32)
    b_dx += tl.dot(b_dg.to(dt), b_x, input_precision=PRECISION)
    b_dx += tl.load(dx + rows_k, mask=m_tk, other=0.0).to(tl.float32)
    tl.store(dx + rows_k, b_dx.to(dx.dtype.element_ty), mask=m_tk)
    row = (bos + o_t) * H + i_h
    tl.store(dkappa + row, d_kappa, mask=m_t)
    tl.store(extra + row, d_eta, mask=m_t)
    tl.store(extra + n_rows * H + row, d_u, mask=m_t)
    if SLOTS > 1:  # w_p = u_p - la(first write of p's step): its gradient, summed per step, onto that write
        same = (o_c[None, :] // SLOTS) == (o_c[:, None] // SLOTS)
        d_w = tl.where(o_c % SLOTS == 0, tl.sum(tl.where(same, d_w[None, :], 0.0), axis=1), 0.0)
    tl.store(extra + 2 * n_rows * H + row, d_w, mask=m_t)


# ---- rule 3: the window Grams of the step sizes ----

@triton.jit
def window_gram_fwd(
    x, valid, G, T, L,
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):
    """Grid ``(cdiv(T, BT), B * H)``: ``G[b, t, h, i, j] = x_{t+i} . x_{t+j}`` ``[B, T, H, W, W]``
    fp32 from the pairs ``x`` ``[B, L, H, K]`` on the extended axis (``L = T + W - 1``; slot ``i`` of
    step ``t`` at position ``t + i``), a pair with ``valid[b, p]`` False counting as zero. Each key
    block loads the ``[BT, W]`` window rows once and every slot's rows once more."""
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    o_w = tl.arange(0, W)
    pos = o_t[:, None] + o_w[None, :]  # [BT, W]
    ok = tl.load(valid + i_b.to(tl.int64) * L + pos, mask=m_t[:, None], other=0) != 0
    rows = (i_b.to(tl.int64) * L + pos) * H + i_h
    b_g = tl.zeros([BT, W, W], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_w = tl.load(x + rows[:, :, None] * K + o_k[None, None, :], mask=ok[:, :, None] & m_k[None, None, :],
                      other=0.0).to(tl.float32)  # [BT, W, BK]
        for j in tl.static_range(W):
            ok_j = tl.load(valid + i_b.to(tl.int64) * L + o_t + j, mask=m_t, other=0) != 0
            b_j = tl.load(x + ((i_b.to(tl.int64) * L + o_t[:, None] + j) * H + i_h) * K + o_k[None, :],
                          mask=ok_j[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # slot j's rows [BT, BK]
            col = tl.sum(b_w * b_j[:, None, :], axis=2)  # [BT, W]: G[:, :, j]
            b_g += tl.where(o_w[None, None, :] == j, col[:, :, None], 0.0)
    p_g = G + (((i_b.to(tl.int64) * T + o_t[:, None, None]) * H + i_h) * W + o_w[None, :, None]) * W + o_w[None, None, :]
    tl.store(p_g, b_g, mask=m_t[:, None, None])


@triton.jit
def window_gram_bwd(
    x, valid, vec, d_top, acc, head, body, T, L, n_head, n_body,
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, BP: tl.constexpr, BK: tl.constexpr,
):
    """Grid ``(cdiv(n_head + n_body, BP), B * H, cdiv(K, BK))``: the gradient of the pairs ``x``
    ``[B, L, H, K]`` through the top eigenvalues of their window Grams (``d G_t = d_top_t v_t
    v_t^T``, ``vec`` ``[B, T, H, W]`` the unit eigenvectors, ``d_top`` ``[B, T, H]``), plus ``acc``
    (``[B, L, H, K]``, the gradient the pairs get elsewhere)::

        dx_p = acc_p + [p valid] sum_e c_e(p) x_{p+e},   c_e(p) = 2 sum_i d_top_{p-i} v_{p-i,i} v_{p-i,i+e}

    over the lags ``e`` in ``(-W, W)`` and the steps ``0 <= p - i < T``, invalid pairs counting
    as zero. Stored split as ``window_sum`` stores an axis: ``p < n_head`` into ``head``
    ``[B, n_head, H, K]``, the others onto row ``p - n_head`` of ``body`` ``[B, n_body, H, K]``
    (positions past the axis: zero)."""
    i_p, i_bh, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    o_p = i_p * BP + tl.arange(0, BP)
    m_p = o_p < L
    o_w = tl.arange(0, W)
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    row0 = i_b.to(tl.int64) * L
    t = o_p[:, None] - o_w[None, :]  # [BP, W]: the step whose slot i holds pair p
    m_s = (t >= 0) & (t < T)
    r_t = (i_b.to(tl.int64) * T + t) * H + i_h  # the row (b, t, h) of d_top and vec
    s_i = 2.0 * tl.load(d_top + r_t, mask=m_s, other=0.0) * tl.load(vec + r_t * W + o_w[None, :], mask=m_s, other=0.0)
    b_dx = tl.zeros([BP, BK], dtype=tl.float32)
    for e_i in tl.static_range(2 * W - 1):
        e = e_i - (W - 1)  # a constant of the unrolled loop (Triton 3.6 refuses a reassigned tl.constexpr)
        j = o_w[None, :] + e
        m = m_s & (j >= 0) & (j < W)
        c = tl.sum(s_i * tl.load(vec + r_t * W + j, mask=m, other=0.0), axis=1)  # [BP]
        q = o_p + e
        m_q = (q >= 0) & (q < L)
        ok = tl.load(valid + row0 + q, mask=m_q, other=0) != 0
        b_x = tl.load(x + ((row0 + q[:, None]) * H + i_h) * K + o_k[None, :], mask=ok[:, None] & m_k[None, :],
                      other=0.0).to(tl.float32)
        b_dx += c[:, None] * b_x
    ok = tl.load(valid + row0 + o_p, mask=m_p, other=0) != 0
    b_dx = tl.where(ok[:, None], b_dx, 0.0)
    b_dx += tl.load(acc + ((row0 + o_p[:, None]) * H + i_h) * K + o_k[None, :], mask=m_p[:, None] & m_k[None, :],
                    other=0.0).to(tl.float32)
    store_split(head, body, b_dx, i_b.to(tl.int64), o_p, i_h, o_k, m_k, n_head, n_body, H, K)
