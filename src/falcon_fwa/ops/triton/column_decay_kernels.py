r"""Triton kernels of the chunk form with one decay per value column (Falcon-2A).

Per head, with the write values ``U_s = eta_s * v_s`` (``[V]``, elementwise) and the
column carries ``a_{t,j}`` (``log_a`` = ``log gamma_{t,j} + g_t``), the state column
``j`` follows ``S_t[:, j] = a_{t,j} S_{t-1}[:, j] + x_t U_t[j]``. A chunk of ``BT``
steps entered with state ``h``, with chunk-local log-prefixes ``u_{t,j} = sum_{r <= t}
log a_{r,j}`` (``u``, written by ``chunk_cumsum``), computes::

    o[t, j] = exp(uq[t, j]) (q_t^T h)[j] + sum_{s in M(t)} (q_t . x_s) exp(uq[t, j] - u[s, j]) U[s, j]
    h_next  = exp(u_C) * h + X^T (exp(u_C - u) * U)

with ``uq_t = u_t``, ``M(t) = {s <= t}`` (read after write) or ``uq_t = u_{t-1}``,
``M(t) = {s < t}`` (read before write). The decay of the intra-chunk term depends on
the column, so it is no ``BT x BT`` mask: the chunk is cut into sub-chunks of ``BS``
steps. For a target sub-chunk ``I`` every earlier source of the chunk factors through
one log-prefix, ``r_I`` at the row before ``I`` (``u`` is non-increasing in time)::

    exp(uq_t - u_s) = exp(uq_t - r_I) * exp(r_I - u_s)          (t in I, s before I, both factors <= 1)

so all earlier sub-chunks are one dot, ``exp(uq_I - r_I) * (P_I< @ (exp(r_I - u_<) * U_<))``
with the scores ``P_I< = Q_I X_<^T`` of the earlier rows. The diagonal block ``J = I``
takes the decays ``exp(uq_t - u_s)`` (``s in M(t)``) as one ``[BS, BS, BV]`` tile and
sums ``P[t, s] * decay * U[s]`` over ``s``. Only non-positive exponents are ever
evaluated. Tensors are time-major ``[B, T, H, D]`` (``B = 1`` with packed sequences);
states are ``[num_chunks, H, K, V]``.

Backward, with ``dH`` the gradient of a chunk's exit state and
``D[t, s] = sum_j do[t, j] exp(uq[t, j] - u[s, j]) U[s, j]`` (same split)::

    dh     = exp(u_C) * dH + Q^T (exp(uq) * dO)                         (state_bwd)
    dq_t   = h (exp(uq_t) * do_t) + sum_{s in M(t)} D[t, s] x_s          (dqk_bwd)
    dx_s   = sum_{t: s in M(t)} D[t, s] q_t + dH (exp(u_C - u_s) * U_s)  (dqk_bwd)
    dU[s, j] = sum_{t: s in M(t)} (q_t . x_s) exp(uq[t, j] - u[s, j]) do[t, j]
               + exp(u_C,j - u[s, j]) (x_s^T dH)[j]                      (dv_bwd)

The sums over later targets go through ``r``, the log-prefix at the end of the source's
sub-chunk (one dot for all later sub-chunks), the sums over earlier sources through the
log-prefix before the target's sub-chunk, and the diagonal block through the same
``[BS, BS, BV]`` decay tile as the forward (summed over ``t`` for ``dU``, over the value
columns for ``D``). ``dv = eta * dU``, ``deta = v * dU``. Every term of ``o[t, j]``
carries ``exp(uq[t, j])``, so ``d uq = dO * O`` (``O`` the forward's output, in ``v``'s
dtype; recomputed in fp32 when not given); the intra-chunk term gives ``d u_s = -U_s *
dU^intra_s``; ``h_next`` gives ``d u_C = exp(u_C) colsum(h * dH) + sum_s c_s`` with
``c_s = U_s * dU^state_s``, and ``d u_s = -c_s``. Since
``u_t = sum_{r <= t} log a_r``, ``dlog_bwd`` assembles, within the chunk::

    d log a_r = sum_{t >= r} du_t + sum_{t > r} dw_t + sum_{s < r} c_s

(``du_t = [read after] do_t * o_t - U_t * dU^intra_t``, plus ``exp(u_C) colsum(h * dH)``
at the last step; ``dw_t = do_t * o_t`` when reading before the write, whose ``uq_t`` is
``u_{t-1}``; the pair ``+c_s`` at ``u_C``, ``-c_s`` at ``u_s`` reaches exactly the steps
after ``s``).

Kernels: ``step_fwd``/``step_bwd`` (the per-column step sizes of ``ops.step_sizes``),
``chunk_cumsum``, ``state_fwd`` (entry state of every chunk, sequential over chunks),
``output_fwd`` (one program per sub-chunk and value block), ``state_bwd`` (reverse over
chunks), ``dv_bwd`` (per sub-chunk and value block), ``dqk_bwd`` (per sub-chunk and key
block) and ``dlog_bwd``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .scalar_decay_kernels import _chunk_of_program, _sequence
from .step_size_kernels import _energy, _log1p


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
def _decay(delta, keep):
    """``exp(delta)`` where ``keep`` (``delta <= 0`` there), 0 elsewhere; never ``exp`` of a positive."""
    return tl.exp(tl.where(keep, delta, float("-inf")))


@triton.jit
def _dots(a, b, rows_a, m_a, rows_b, m_b, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
          RA: tl.constexpr, RB: tl.constexpr, PRECISION: tl.constexpr):
    """``[RA, RB]`` fp32 inner products ``a[rows_a] . b[rows_b]`` over the key dimension."""
    s = tl.zeros([RA, RB], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        s += tl.dot(_rows(a, rows_a, m_a, i_h, H, K, o_k, m_k), _rows_t(b, rows_b, m_b, i_h, H, K, o_k, m_k),
                    input_precision=PRECISION)
    return s


@triton.jit
def _writes(v, eta, rows, m_rows, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v):
    """``U = eta * v`` ``[R, BV]`` fp32."""
    return _rows(v, rows, m_rows, i_h, H, V, o_v, m_v).to(tl.float32) * _rows(eta, rows, m_rows, i_h, H, V, o_v, m_v)


@triton.jit
def _writes_t(v, eta, rows, m_rows, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v):
    """The transpose ``[BV, R]`` of ``_writes``, loaded directly."""
    return (_rows_t(v, rows, m_rows, i_h, H, V, o_v, m_v).to(tl.float32)
            * _rows_t(eta, rows, m_rows, i_h, H, V, o_v, m_v))


@triton.jit
def _pairs(rows, m_rows, READ_AFTER: tl.constexpr):
    """``[BS, BS]`` mask of the diagonal block's (target ``t``, source ``s``) pairs:
    ``s <= t`` (read after) or ``s < t`` (read before), both real rows."""
    if READ_AFTER:
        causal = rows[None, :] <= rows[:, None]
    else:
        causal = rows[None, :] < rows[:, None]
    return causal & m_rows[:, None] & m_rows[None, :]


@triton.jit
def _pair_decay(b_uq, b_u, keep):
    """``[BS, BS, BV]`` decays ``exp(uq[t, j] - u[s, j])`` of the diagonal block (target
    ``t``, source ``s``) where ``keep[t, s]``, 0 elsewhere; never ``exp`` of a positive."""
    return tl.exp(tl.where(keep[:, :, None], b_uq[:, None, :] - b_u[None, :, :], float("-inf")))


@triton.jit
def _transposed(a, BS: tl.constexpr):
    """``a^T`` of a ``[BS, BS]`` fp32 tile, by selection rather than ``tl.trans`` (whose
    result some Hopper builds of Triton mishandle as a dot operand)."""
    o = tl.arange(0, BS)
    return tl.sum(tl.where(o[:, None, None] == o[None, None, :], a[:, :, None], 0.0), axis=0)


@triton.jit
def _subchunk_output(q, x, v, eta, u, h_base, rows, m_r, b_uq, first, end, i_s, i_h, o_v, m_v,
                     H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     BS: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr, PRECISION: tl.constexpr):
    """Outputs ``[BS, BV]`` fp32 of sub-chunk ``i_s`` (rows ``rows``) from the chunk's
    entry state (``h_base``), the earlier sub-chunks (one dot through the log-prefix
    ``r`` at the row before this sub-chunk) and its own diagonal block."""
    dt = q.dtype.element_ty
    b_o = tl.zeros([BS, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = _rows(q, rows, m_r, i_h, H, K, o_k, m_k)
        b_h = tl.load(h_base + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_o += tl.dot(b_q, b_h, input_precision=PRECISION)
    b_o = b_o * _decay(b_uq, m_r[:, None])
    start = first + i_s * BS  # this sub-chunk's first row
    if (i_s > 0) & (start < end):
        src = first + tl.arange(0, BT)
        m_src = src < start
        r = _row(u, start - 1, True, i_h, H, V, o_v, m_v)
        b_p = _dots(q, x, rows, m_r, src, m_src, i_h, H, K, BK, BS, BT, PRECISION)  # [t, s]
        b_w = _writes(v, eta, src, m_src, i_h, H, V, o_v, m_v) * _decay(
            r[None, :] - _rows(u, src, m_src, i_h, H, V, o_v, m_v), m_src[:, None])
        b_o += _decay(b_uq - r[None, :], m_r[:, None]) * tl.dot(b_p.to(dt), b_w.to(dt), input_precision=PRECISION)
    b_p = _dots(q, x, rows, m_r, rows, m_r, i_h, H, K, BK, BS, BS, PRECISION)  # the diagonal block [t, s]
    b_e = _pair_decay(b_uq, _rows(u, rows, m_r, i_h, H, V, o_v, m_v), _pairs(rows, m_r, READ_AFTER))
    b_o += tl.sum(b_p[:, :, None] * b_e * _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v)[None, :, :], axis=1)
    return b_o


@triton.jit
def _subchunk_program(i_p, cu_seqlens, chunk_indices, chunk_offsets, T, BT: tl.constexpr, BS: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    """For a per-sub-chunk program: sub-chunk index, chunk index in its sequence, the
    chunk's first row, the sequence end (absolute rows), the chunk's last row, the
    sub-chunk's rows and their mask, the first chunk of the sequence, the number of
    sub-chunks holding steps and the number of steps in this one (0 past the end)."""
    NS: tl.constexpr = BT // BS
    i_c = i_p // NS
    i_s = i_p % NS
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    first = bos + i_t * BT
    end = bos + T_n
    steps = tl.minimum(BT, T_n - i_t * BT)
    last = first + steps - 1
    rows = first + i_s * BS + tl.arange(0, BS)
    n_sub = tl.cdiv(steps, BS)
    n_diag = tl.maximum(tl.minimum(steps - i_s * BS, BS), 0)
    return i_s, i_t, first, end, last, rows, rows < end, boh, n_sub, n_diag


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
        b_w = _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v) * _decay(
            u_last[None, :] - _rows(u, rows, m_r, i_h, H, V, o_v, m_v), m_r[:, None])
        b_xt = _rows_t(x, rows, m_r, i_h, H, K, o_k, m_k)  # [BK, BT]
        b_h = b_h * tl.exp(u_last)[None, :] + tl.dot(b_xt, b_w.to(b_xt.dtype), input_precision=PRECISION)
    if STORE_FINAL:
        tl.store(s_final + i_nh.to(tl.int64) * K * V + state_off, b_h, mask=m_kv)


@triton.jit
def output_fwd(
    q, x, v, eta, u, h, o, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), num_chunks * BT // BS, H)``: outputs of every sub-chunk."""
    i_v, i_p, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_t, first, end, last, rows, m_r, boh, n_sub, n_diag = _subchunk_program(
        i_p, cu_seqlens, chunk_indices, chunk_offsets, T, BT, BS, IS_VARLEN)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_uq = _read_prefix(u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
    h_base = h + ((boh + i_t) * H + i_h) * K * V
    b_o = _subchunk_output(q, x, v, eta, u, h_base, rows, m_r, b_uq, first, end, i_s, i_h, o_v, m_v,
                           H, K, V, BT, BK, BS, BV, READ_AFTER, PRECISION)
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
    q, x, v, eta, u, h, dh, do, dv, deta, du, dw, dc, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr, o=None,
):
    """Grid ``(cdiv(V, BV), num_chunks * BT // BS, H)``: ``dU`` of every sub-chunk's
    sources, mapped to ``dv = eta * dU`` and ``deta = v * dU``, and the per-step terms of
    the log-prefix gradient (``du``, ``dw``, ``dc``; see the module docstring). ``o``: the
    forward's outputs, for ``d uq = dO * O`` (``None``: recomputed here in fp32)."""
    i_v, i_p, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_t, first, end, last, rows, m_r, boh, n_sub, n_diag = _subchunk_program(
        i_p, cu_seqlens, chunk_indices, chunk_offsets, T, BT, BS, IS_VARLEN)
    dt = q.dtype.element_ty
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_rv = m_r[:, None] & m_v[None, :]
    state = ((boh + i_t) * H + i_h) * K * V
    b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
    b_uq = _read_prefix(u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
    b_do = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
    u_last = _row(u, last, True, i_h, H, V, o_v, m_v)
    # the exit state's term: exp(u_C - u_s) (x_s^T dH), and colsum(h * dH) for d u_C (read by
    # the sub-chunk holding the chunk's last row only)
    stop = first + i_s * BS + BS  # the first row after this sub-chunk
    has_last = (last >= stop - BS) & (last < stop)
    b_xdh = tl.zeros([BS, BV], dtype=tl.float32)
    b_hdh = tl.zeros([BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_kv = (o_k[:, None] < K) & m_v[None, :]
        b_x = _rows(x, rows, m_r, i_h, H, K, o_k, o_k < K)
        b_dh = tl.load(dh + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_h = tl.load(h + state + o_k[:, None] * V + o_v[None, :], mask=tl.where(has_last, m_kv, False), other=0.0)
        b_xdh += tl.dot(b_x, b_dh, input_precision=PRECISION)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=0)
    b_du_state = b_xdh * _decay(u_last[None, :] - b_u, m_r[:, None])
    # the later sub-chunks' targets, in one dot through r, the log-prefix at the end of this
    # sub-chunk (a partial last sub-chunk has no later target: r is read at its last real row)
    r = _row(u, tl.minimum(stop - 1, last), True, i_h, H, V, o_v, m_v)
    b_du_intra = tl.zeros([BS, BV], dtype=tl.float32)
    if stop <= last:
        tgt = first + tl.arange(0, BT)
        m_tgt = (tgt >= stop) & (tgt < end)
        b_pt = _dots(x, q, rows, m_r, tgt, m_tgt, i_h, H, K, BK, BS, BT, PRECISION)  # [s, t]
        b_g = _rows(do, tgt, m_tgt, i_h, H, V, o_v, m_v).to(tl.float32) * _decay(
            _read_prefix(u, tgt, m_tgt, first, i_h, H, V, o_v, m_v, READ_AFTER) - r[None, :], m_tgt[:, None])
        b_du_intra = _decay(r[None, :] - b_u, m_r[:, None]) * tl.dot(b_pt.to(dt), b_g.to(dt),
                                                                    input_precision=PRECISION)
    b_p = _dots(q, x, rows, m_r, rows, m_r, i_h, H, K, BK, BS, BS, PRECISION)  # the diagonal block [t, s]
    b_e = _pair_decay(b_uq, b_u, _pairs(rows, m_r, READ_AFTER))
    b_du_intra += tl.sum(b_p[:, :, None] * b_e * b_do[:, None, :], axis=0)
    b_dU = b_du_intra + b_du_state
    b_v = _rows(v, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
    b_eta = _rows(eta, rows, m_r, i_h, H, V, o_v, m_v)
    off = (rows[:, None] * H + i_h) * V + o_v[None, :]
    tl.store(dv + off, (b_eta * b_dU).to(dv.dtype.element_ty), mask=m_rv)
    tl.store(deta + off, b_v * b_dU, mask=m_rv)
    b_U = b_v * b_eta
    if o is not None:
        b_o = tl.load(o + off, mask=m_rv, other=0.0).to(tl.float32)
    else:
        b_o = _subchunk_output(q, x, v, eta, u, h + state, rows, m_r, b_uq, first, end, i_s, i_h, o_v, m_v,
                               H, K, V, BT, BK, BS, BV, READ_AFTER, PRECISION)
    d_read = b_do * b_o
    d_u = -b_U * b_du_intra + tl.where(rows[:, None] == last, (tl.exp(u_last) * b_hdh)[None, :], 0.0)
    if READ_AFTER:
        d_u += d_read
    else:
        tl.store(dw + off, d_read, mask=m_rv)
    tl.store(du + off, d_u, mask=m_rv)
    tl.store(dc + off, b_U * b_du_state, mask=m_rv)


@triton.jit
def dqk_bwd(
    q, x, v, eta, u, h, dh, do, dq, dx, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, READ_AFTER: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), num_chunks * BT // BS, H)``: ``dq`` of every sub-chunk's
    targets and ``dx`` of its sources. ``D`` (summed over the value blocks) is built in
    three parts: the rows of this sub-chunk's targets against the earlier sources
    (through the log-prefix at the row before it), the columns of its sources against
    the later targets (through the log-prefix at its end) and the diagonal block."""
    i_k, i_p, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_s, i_t, first, end, last, rows, m_r, boh, n_sub, n_diag = _subchunk_program(
        i_p, cu_seqlens, chunk_indices, chunk_offsets, T, BT, BS, IS_VARLEN)
    dt = q.dtype.element_ty
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    state = ((boh + i_t) * H + i_h) * K * V
    start = first + i_s * BS  # this sub-chunk's first row
    stop = start + BS  # and the first row after it
    chunk = first + tl.arange(0, BT)
    keep = _pairs(rows, m_r, READ_AFTER)
    b_dq = tl.zeros([BS, BK], dtype=tl.float32)
    b_dx = tl.zeros([BS, BK], dtype=tl.float32)
    b_dd = tl.zeros([BS, BS], dtype=tl.float32)  # D[t, s] of the diagonal block
    for i_v in range(tl.cdiv(V, BV)):  # the entry and exit states, and the diagonal block
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[None, :] & m_v[:, None]
        b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
        b_uq = _read_prefix(u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER)
        u_last = _row(u, last, True, i_h, H, V, o_v, m_v)
        b_do = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
        b_U = _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v)
        b_ht = tl.load(h + state + o_k[None, :] * V + o_v[:, None], mask=m_kv, other=0.0)  # [BV, BK]
        b_dht = tl.load(dh + state + o_k[None, :] * V + o_v[:, None], mask=m_kv, other=0.0)
        b_dq += tl.dot((b_do * _decay(b_uq, m_r[:, None])).to(dt), b_ht.to(dt), input_precision=PRECISION)
        b_dx += tl.dot((b_U * _decay(u_last[None, :] - b_u, m_r[:, None])).to(dt), b_dht.to(dt),
                       input_precision=PRECISION)
        b_dd += tl.sum(b_do[:, None, :] * _pair_decay(b_uq, b_u, keep) * b_U[None, :, :], axis=2)
    b_dq += tl.dot(b_dd.to(dt), _rows(x, rows, m_r, i_h, H, K, o_k, m_k).to(dt), input_precision=PRECISION)
    b_dx += tl.dot(_transposed(b_dd, BS).to(dt), _rows(q, rows, m_r, i_h, H, K, o_k, m_k).to(dt),
                   input_precision=PRECISION)
    if (i_s > 0) & (start < end):  # earlier sources, through r_in = u at the row before this sub-chunk
        m_src = chunk < start
        b_drow = tl.zeros([BS, BT], dtype=tl.float32)  # D[t, s]: targets here, earlier sources
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            r_in = _row(u, start - 1, True, i_h, H, V, o_v, m_v)
            b_g = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32) * _decay(
                _read_prefix(u, rows, m_r, first, i_h, H, V, o_v, m_v, READ_AFTER) - r_in[None, :], m_r[:, None])
            b_wt = _writes_t(v, eta, chunk, m_src, i_h, H, V, o_v, m_v) * _decay(
                r_in[:, None] - _rows_t(u, chunk, m_src, i_h, H, V, o_v, m_v), m_src[None, :])  # [BV, s]
            b_drow += tl.dot(b_g.to(dt), b_wt.to(dt), input_precision=PRECISION)
        b_dq += tl.dot(b_drow.to(dt), _rows(x, chunk, m_src, i_h, H, K, o_k, m_k).to(dt),
                       input_precision=PRECISION)
    if stop <= last:  # later targets, through r_out = u at the end of this sub-chunk
        m_tgt = (chunk >= stop) & (chunk < end)
        b_dcol = tl.zeros([BS, BT], dtype=tl.float32)  # D[t, s] transposed: sources here, later targets
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            r_out = _row(u, stop - 1, True, i_h, H, V, o_v, m_v)
            b_w = _writes(v, eta, rows, m_r, i_h, H, V, o_v, m_v) * _decay(
                r_out[None, :] - _rows(u, rows, m_r, i_h, H, V, o_v, m_v), m_r[:, None])
            if READ_AFTER:
                b_uqt = _rows_t(u, chunk, m_tgt, i_h, H, V, o_v, m_v)  # [BV, t]
            else:  # chunk - 1 stays inside the chunk where m_tgt holds: later targets are never the first row
                b_uqt = _rows_t(u, chunk - 1, m_tgt, i_h, H, V, o_v, m_v)
            b_gt = _rows_t(do, chunk, m_tgt, i_h, H, V, o_v, m_v).to(tl.float32) * _decay(
                b_uqt - r_out[:, None], m_tgt[None, :])  # [BV, t]
            b_dcol += tl.dot(b_w.to(dt), b_gt.to(dt), input_precision=PRECISION)
        b_dx += tl.dot(b_dcol.to(dt), _rows(q, chunk, m_tgt, i_h, H, K, o_k, m_k).to(dt),
                       input_precision=PRECISION)
    off = (rows[:, None] * H + i_h) * K + o_k[None, :]
    tl.store(dq + off, b_dq.to(dq.dtype.element_ty), mask=m_r[:, None] & m_k[None, :])
    tl.store(dx + off, b_dx.to(dx.dtype.element_ty), mask=m_r[:, None] & m_k[None, :])


@triton.jit
def dlog_bwd(
    du, dw, dc, dlog_a, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, READ_AFTER: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), num_chunks, H)``: ``d log a_r = sum_{t >= r} du_t +
    sum_{t > r} dw_t + sum_{s < r} dc_s`` within the chunk."""
    i_v, i_c, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_t, bos, T_n, boh = _chunk_of_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT, IS_VARLEN)
    rows = bos + i_t * BT + tl.arange(0, BT)
    m_r = rows < bos + T_n
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    b_du = _rows(du, rows, m_r, i_h, H, V, o_v, m_v)
    b_dc = _rows(dc, rows, m_r, i_h, H, V, o_v, m_v)
    d_log = tl.sum(b_du, axis=0)[None, :] - tl.cumsum(b_du, axis=0) + b_du + tl.cumsum(b_dc, axis=0) - b_dc
    if not READ_AFTER:
        b_dw = _rows(dw, rows, m_r, i_h, H, V, o_v, m_v)
        d_log += tl.sum(b_dw, axis=0)[None, :] - tl.cumsum(b_dw, axis=0)
    tl.store(dlog_a + (rows[:, None] * H + i_h) * V + o_v[None, :], d_log, mask=m_r[:, None] & m_v[None, :])


@triton.jit
def _row_terms(x, valid, lam, rows, m_r, eps, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
               NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr):
    """Per row: ``E = ||x||^2``, ``lam``, ``lambda``, the denominator and whether the row
    takes a step (a valid pair, and a positive denominator with ``NORMALIZE``)."""
    E = _energy(x, rows, m_r, K, BK, BR)
    b_lam = tl.load(lam + rows, mask=m_r, other=0.0).to(tl.float32)
    if SCALE_RIDGE:
        lam_eff = b_lam * E
    else:
        lam_eff = b_lam
    denom = E + lam_eff + eps
    ok = (tl.load(valid + rows // H, mask=m_r, other=0) != 0) & m_r
    if NORMALIZE:
        ok = ok & (denom > 0)
    return E, b_lam, lam_eff, denom, ok


@triton.jit
def _column_eta(beta, rows, ok_rows, denom, o_v, m_v, V: tl.constexpr, NORMALIZE: tl.constexpr):
    """``eta`` ``[BR, BV]`` of the columns ``o_v`` and its mask."""
    ok = ok_rows[:, None] & m_v[None, :]
    b_beta = tl.load(beta + rows[:, None] * V + o_v[None, :], mask=ok, other=0.0).to(tl.float32)
    if NORMALIZE:
        eta = tl.where(ok, b_beta / tl.where(ok, denom[:, None], 1.0), 0.0)
    else:
        eta = tl.where(ok, b_beta, 0.0)
    return ok, eta


@triton.jit
def step_fwd(
    x, valid, beta, lam, log_gate, eta, log_a, n, eps, decay_floor,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """Grid ``(cdiv(n, BR), cdiv(V, BV))`` over the ``n = B*T*H`` rows: per value column
    ``eta = beta / (E + lambda + eps)`` (0 at an invalid pair or a vanishing denominator;
    ``beta`` without ``NORMALIZE``), ``log_a = log1p(-min(eta * lambda, 1 - decay_floor)) + g``
    with ``E = ||x||^2`` and ``lambda = lam`` (``lam * E`` with ``SCALE_RIDGE``)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    o_v = tl.program_id(1) * BV + tl.arange(0, BV)
    m_v = o_v < V
    E, b_lam, lam_eff, denom, ok_rows = _row_terms(x, valid, lam, rows, m_r, eps, H, K, BK, BR, NORMALIZE,
                                                   SCALE_RIDGE)
    ok, b_eta = _column_eta(beta, rows, ok_rows, denom, o_v, m_v, V, NORMALIZE)
    la = _log1p(-tl.minimum(b_eta * lam_eff[:, None], 1.0 - decay_floor))
    if HAS_GATE:
        la += tl.load(log_gate + rows, mask=m_r, other=0.0).to(tl.float32)[:, None]
    m = m_r[:, None] & m_v[None, :]
    off = rows[:, None] * V + o_v[None, :]
    tl.store(eta + off, b_eta, mask=m)
    tl.store(log_a + off, la, mask=m)


@triton.jit
def step_bwd(
    x, valid, beta, lam, d_eta, d_log_a, dx, d_beta, d_lam, d_gate, n, eps, decay_floor,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr,
):
    """Grid ``(cdiv(n, BR),)``: ``d beta`` per column; ``d lam``, ``d log_gate`` (the row
    sum of ``d log_a``) and ``dx = 2 x dE`` summed over the value columns."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    g_E = tl.zeros([BR], dtype=tl.float32)
    g_lam_eff = tl.zeros([BR], dtype=tl.float32)
    g_gate = tl.zeros([BR], dtype=tl.float32)
    E, b_lam, lam_eff, denom, ok_rows = _row_terms(x, valid, lam, rows, m_r, eps, H, K, BK, BR, NORMALIZE,
                                                   SCALE_RIDGE)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        ok, b_eta = _column_eta(beta, rows, ok_rows, denom, o_v, m_v, V, NORMALIZE)
        m = m_r[:, None] & m_v[None, :]
        off = rows[:, None] * V + o_v[None, :]
        g_eta = tl.load(d_eta + off, mask=m, other=0.0)
        g_la = tl.load(d_log_a + off, mask=m, other=0.0)
        g_gate += tl.sum(g_la, axis=1)
        alpha_raw = b_eta * lam_eff[:, None]
        alpha = tl.minimum(alpha_raw, 1.0 - decay_floor)
        g_alpha = tl.where(alpha_raw <= 1.0 - decay_floor, -g_la / (1.0 - alpha), 0.0)
        g_eta += g_alpha * lam_eff[:, None]
        g_lam_eff += tl.sum(g_alpha * b_eta, axis=1)
        if NORMALIZE:
            safe = tl.where(ok, denom[:, None], 1.0)
            g_beta = tl.where(ok, g_eta / safe, 0.0)
            g_denom = tl.sum(tl.where(ok, -g_eta * b_eta / safe, 0.0), axis=1)
            g_E += g_denom
            g_lam_eff += g_denom
        else:
            g_beta = tl.where(ok, g_eta, 0.0)
        tl.store(d_beta + off, g_beta, mask=m)
    if SCALE_RIDGE:
        g_lam = g_lam_eff * E
        g_E += g_lam_eff * b_lam
    else:
        g_lam = g_lam_eff
    tl.store(d_lam + rows, g_lam, mask=m_r)
    tl.store(d_gate + rows, g_gate, mask=m_r)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_r[:, None] & (o_k[None, :] < K)
        b_x = tl.load(x + rows[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(dx + rows[:, None] * K + o_k[None, :], (2.0 * b_x * g_E[:, None]).to(dx.dtype.element_ty), mask=m)
