r"""Triton kernels of the chunk form of the regression rule with per-column step sizes (Falcon-2).

Per head and value column ``j``, with the carry ``a_{t,j}`` (``log_a`` = ``log gamma_{t,j} + g_t``)
and the residual gain ``kappa_{t,j}`` (``eta_{t,j} exp(g_t)``), the state column follows::

    S_t[:, j] = a_{t,j} S_{t-1}[:, j] + x_t d_{t,j},     d_{t,j} = eta_{t,j} y_t[j] - kappa_{t,j} R_{t,j}

where ``R_{t,j} = x_t^T S_{t-1}[:, j]`` is the read of the write key at the state before
the step. Every column is a scalar-decay delta rule of its own; all of them share the
keys, so a block of steps shares one Gram matrix ``G = X X^T`` and differs per column
only in its decays. With log-prefixes ``u_{t,j}`` (inclusive, chunk-local) and
``w_{t,j} = u_{t-1,j}``, a block ``I`` of ``BS`` steps entered with the state ``h`` (at the
log-prefix ``r``) solves, per column, the unit lower-triangular system::

    R[p, j] = exp(w[p, j] - r_j) (X_I h)[p, j] + sum_{s in I, s < p} G[p, s] exp(w[p, j] - u[s, j]) d[s, j]
    d[p, j] = eta[p, j] y[p, j] - kappa[p, j] R[p, j]

i.e. ``(I + N_j) d_j = eta_j y_j - kappa_j exp(w_j - r_j) (X_I h)_j`` with ``N_j[p, s] =
kappa[p, j] exp(w[p, j] - u[s, j]) G[p, s]`` (``s < p``). The right-hand side depends on
``h``, so ``state_fwd`` solves it inside the sequential pass, block after block, by forward
substitution on ``[BV, BS]`` register tiles (``BV`` columns at once, the block's steps on the
last axis, so that taking a step's entries is a reduce within a few lanes; the state is
carried transposed, ``[BV, BK]``, so that no tile is ever transposed). The block's part of the
reads is carried as ``A_p = sum_{s < i} G[p, s] exp(u_{i-1} - u_s) d_s``: step ``i`` reads
``R_i`` off row ``i`` of ``A`` (``w_i = u_{i-1}``), then sets ``A <- a_i A + G[:, i] d_i`` with
the step's own carry ``a_i = exp(u_i - u_{i-1}) <= 1``: one ``exp`` per column and step, not
one per pair of rows. The block then carries
``h <- exp(r' - r) h + X_I^T (exp(r' - u_I) d_I)`` (``r'``: the log-prefix at the block's
end). The substitution works on blocks of ``BS`` steps whatever the chunk size; the
entry state of every chunk goes to ``h`` for the outputs, which are the per-column-decay
reads of ``ops.triton.column_decay_kernels`` with the values ``D``. ``gram_fwd`` stores
the ``BS x BS`` diagonal blocks of the Gram.

Backward, with ``dD_o`` the outputs' gradient of ``D`` from within the chunk: walking the
blocks backwards with ``g`` the gradient of the state at a block's end (without the
outputs of the chunk, which ``dD_o`` holds), the adjoint ``z`` of ``d`` solves, per column,
``(I + N_j)^T z_j = dD_o_j + exp(r'_j - u_j) (X_I g)_j`` (backward substitution,
``state_bwd``, with the same carried tile walked from the block's last row down); the
reads ``R`` get ``dR = -kappa z``, ``g <- exp(r' - r) g + X_I^T (exp(w - r) dR)``, and at
the chunk's start ``dh = g + Q^T (exp(uq) dO)``. With ``kappa = eta exp(g_t)``, ``state_bwd``
also stores::

    dy = eta z,   deta = (y - exp(g) R) z,   d g_t = -sum_j kappa R z

and the whole ``d log a`` (see ``state_bwd``). The gradients
of ``q`` and ``x`` (as query and as key) are those of two per-column-decay reads with values
``D``: the outputs (queries ``q``, ``dO``) and the residual reads (queries ``x``, read before
the write, ``dR = -exp(g) dy``, formed from the stored ``dy``), from ``dqk_bwd_two_reads`` for
both at once. ``dD_o`` is the rule-2A ``dv_bwd``
of the outputs. Only
non-positive exponents are ever evaluated. Tensors are time-major ``[B, T, H, D]``; states
are ``[num_chunks, H, K, V]``; ``G`` is ``[B, T, H, BS]`` fp32 (row ``p`` holds
``x_p . x_s`` for the ``BS`` rows ``s`` of its block).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .column_decay_kernels import (_chunk_program, _decay, _level_blocks, _level_decay, _read_prefix, _row, _rows,
                                   _rows_t)
from .scalar_decay_kernels import _chunk_of_program, _sequence


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
def gram_fwd(
    x, G, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(num_chunks * BT // BS, H)``: ``G[p, s] = x_p . x_s`` within every block of
    ``BS`` steps (fp32)."""
    i_p, i_h = tl.program_id(0), tl.program_id(1)
    i_s, i_t, first, end, last, rows, m_r, boh, n_sub, n_diag = _subchunk_program(
        i_p, cu_seqlens, chunk_indices, chunk_offsets, T, BT, BS, IS_VARLEN)
    b_g = tl.zeros([BS, BS], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_g += tl.dot(_rows(x, rows, m_r, i_h, H, K, o_k, m_k), _rows_t(x, rows, m_r, i_h, H, K, o_k, m_k),
                      input_precision=PRECISION)
    tl.store(G + (rows[:, None] * H + i_h) * BS + tl.arange(0, BS)[None, :], b_g, mask=m_r[:, None])


@triton.jit
def _gram_column(G, rows, m_rows, i, i_h, H: tl.constexpr, BS: tl.constexpr):
    """Column ``i`` of the block's Gram, ``[BS]``: ``x_p . x_{b0 + i}`` for the block's rows ``p``
    (the Gram is symmetric: also row ``i``; 0 on rows past the end)."""
    return tl.load(G + (rows * H + i_h) * BS + i, mask=m_rows, other=0.0)


@triton.jit
def _block(u, first, last, b0, end, i_h, H: tl.constexpr, V: tl.constexpr, BS: tl.constexpr, o_v, m_v):
    """A block of ``BS`` steps starting at row ``b0`` of the chunk starting at ``first``:
    its rows and mask, the log-prefix ``r`` before it (0 at the chunk's start) and the one at
    its end ``r'`` (at most the chunk's last row)."""
    rows = b0 + tl.arange(0, BS)
    m_r = rows < end
    r_in = _row(u, b0 - 1, b0 > first, i_h, H, V, o_v, m_v)
    r_out = _row(u, tl.minimum(b0 + BS - 1, last), True, i_h, H, V, o_v, m_v)
    return rows, m_r, r_in, r_out


@triton.jit
def _prev_t(u, rows, m_r, first, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v):
    """``u`` at the row before each of ``rows``, transposed ``[BV, BS]`` (0 at the chunk's first row
    ``first``: ``w = u_{t-1}``, chunk-local)."""
    return _rows_t(u, rows - 1, m_r & (rows > first), i_h, H, V, o_v, m_v)


@triton.jit
def _gate_rows(gate, rows, m_rows, i_h, H: tl.constexpr):
    """The residual gate ``exp(g_t)`` of ``rows`` ``[R]`` (``gate`` ``[B, T, H]`` fp32; 0 past the end)."""
    return tl.load(gate + rows * H + i_h, mask=m_rows, other=0.0)


@triton.jit
def _residual_gain(b_eta, gate, rows, m_rows, i_h, H: tl.constexpr, HAS_GATE: tl.constexpr):
    """``kappa = eta exp(g_t)`` on a transposed ``[BV, BS]`` tile of ``eta`` (``eta`` itself without a gate)."""
    if HAS_GATE:
        return b_eta * _gate_rows(gate, rows, m_rows, i_h, H)[None, :]
    return b_eta


@triton.jit
def _read_grad_rows(dv, gate, rows, m_rows, i_h, H: tl.constexpr, V: tl.constexpr, o_v, m_v,
                    HAS_GATE: tl.constexpr):
    """The residual reads' upstream gradient ``dR = -kappa z = -exp(g_t) dv`` (``dv = eta z``) on the
    ``[R, BV]`` tile of ``rows``, from the values' gradient as stored."""
    b_dv = _rows(dv, rows, m_rows, i_h, H, V, o_v, m_v).to(tl.float32)
    if HAS_GATE:
        return -b_dv * _gate_rows(gate, rows, m_rows, i_h, H)[:, None]
    return -b_dv


@triton.jit
def state_fwd(
    x, v, eta, gate, u, G, h, D, R, s0, s_final, cu_seqlens, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, HAS_S0: tl.constexpr, STORE_FINAL: tl.constexpr, HAS_GATE: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * H)`` with ``BK >= K`` (the whole key dimension): block after
    block, the per-column solve for ``D`` and ``R`` (fp32) and the state carry; every
    chunk's entry state into ``h``. Tiles are transposed, ``[BV, BS]`` (columns by steps), and
    the state ``[BV, BK]``: each step takes its row with a reduce along a tile's last axis."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    end = bos + T_n
    o_s = tl.arange(0, BS)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    state_off = o_k[None, :] * V + o_v[:, None]  # [BV, BK]: element (j, k) of the state S[k, j]
    b_h = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_S0:
        b_h += tl.load(s0 + i_nh.to(tl.int64) * K * V + state_off, mask=m_vk, other=0.0)
    for i_t in range(tl.cdiv(T_n, BT)):
        tl.store(h + ((boh + i_t) * H + i_h) * K * V + state_off, b_h.to(h.dtype.element_ty), mask=m_vk)
        first = bos + i_t * BT
        n_steps = tl.minimum(BT, T_n - i_t * BT)
        last = first + n_steps - 1
        for i_b in range(0, tl.cdiv(n_steps, BS)):
            b0 = first + i_b * BS
            rows, m_r, r_in, r_out = _block(u, first, last, b0, end, i_h, H, V, BS, o_v, m_v)
            m_vr = m_v[:, None] & m_r[None, :]
            off = (rows[None, :] * H + i_h) * V + o_v[:, None]  # [BV, BS]
            b_u = tl.load(u + off, mask=m_vr, other=0.0)
            b_w = _prev_t(u, rows, m_r, first, i_h, H, V, o_v, m_v)
            b_xt = _rows_t(x, rows, m_r, i_h, H, K, o_k, m_k)  # [BK, BS]
            b_r = tl.dot(b_h.to(b_xt.dtype), b_xt, input_precision=PRECISION) * _decay(
                b_w - r_in[:, None], m_r[None, :])
            b_eta = tl.load(eta + off, mask=m_vr, other=0.0)
            b_y = tl.load(v + off, mask=m_vr, other=0.0).to(tl.float32) * b_eta
            b_k = _residual_gain(b_eta, gate, rows, m_r, i_h, H, HAS_GATE)
            b_c = b_y - b_k * b_r  # eta y - kappa (the entry state's part of R)
            b_in = tl.zeros([BV, BS], dtype=tl.float32)  # the block's part of R, step by step
            # forward substitution, all BV columns at once, unrolled over the block's BS steps. The tile
            # b_acc holds, before step i, sum_{s < i} G[p, s] exp(u_{i-1} - u_s) d_s for every step p: its
            # column i is the block's part of R_i (w_i = u_{i-1}). Moving on to step i + 1 multiplies it by
            # exp(u_i - u_{i-1}) = a_i <= 1, one exp per column and step. Steps past the sequence's end
            # load as zeros (u_i = 0 >= u_{i-1}: carry 1), so they change nothing; d = c - kappa (b_in) is
            # formed once after the block
            b_acc = tl.zeros([BV, BS], dtype=tl.float32)
            u_prev = r_in
            for i in tl.static_range(BS):
                sel = (o_s == i)[None, :]
                d_i = tl.sum(tl.where(sel, b_c - b_k * b_acc, 0.0), axis=1)  # eta_i y_i - kappa_i R_i
                b_in = tl.where(sel, b_acc, b_in)
                u_i = _row(u, b0 + i, b0 + i < end, i_h, H, V, o_v, m_v)
                a_i = tl.exp(tl.minimum(u_i - u_prev, 0.0))
                g_i = _gram_column(G, rows, m_r, i, i_h, H, BS)  # G[p, i]
                b_acc = b_acc * a_i[:, None] + d_i[:, None] * g_i[None, :]
                u_prev = u_i
            b_d = b_c - b_k * b_in
            b_r += b_in
            tl.store(D + off, b_d, mask=m_vr)
            tl.store(R + off, b_r, mask=m_vr)
            b_x = _rows(x, rows, m_r, i_h, H, K, o_k, m_k)  # [BS, BK]
            b_wd = b_d * _decay(r_out[:, None] - b_u, m_r[None, :])
            b_h = b_h * tl.exp(r_out - r_in)[:, None] + tl.dot(b_wd.to(b_x.dtype), b_x, input_precision=PRECISION)
    if STORE_FINAL:
        tl.store(s_final + i_nh.to(tl.int64) * K * V + state_off, b_h, mask=m_vk)


@triton.jit
def state_bwd(
    q, x, v, eta, beta, scale, gate, R, u, G, do, o, dD_local, h, s_final, dh, dv, deta, dgate, dlog_a, ds_final,
    ds0, cu_seqlens, chunk_offsets, T, n_rows, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BS: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_DS_FINAL: tl.constexpr,
    STORE_DS0: tl.constexpr, READ_AFTER: tl.constexpr, HAS_GATE: tl.constexpr, ETA_FROM_BETA: tl.constexpr,
    IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), N * H)`` with ``BK >= K``: reverse over chunks and their blocks,
    the gradient of every chunk's exit state into ``dh``, the per-column transposed solve
    for the adjoint ``z`` of ``D``, ``g <- exp(r' - r) g - X_I^T (exp(w - r) kappa z)`` and,
    at the chunk's start, ``dh_prev = g + Q^T (exp(uq) dO)``. ``z`` itself is not stored:
    its products are, ``dv = eta z`` (in ``v``'s dtype; ``dqk_bwd_two_reads`` takes the reads'
    ``dR = -kappa z = -exp(g) dv`` from it), ``deta = (y - exp(g) R) z`` (fp32) and, with
    ``HAS_GATE``, the gate's ``d g_t = -sum_j R z kappa`` as one partial sum per value block,
    ``dgate[i_v, row]`` (``[cdiv(V, BV), n_rows]``, ``n_rows = B T H``). ``kappa = eta exp(g)``
    (``eta`` without a gate). With ``ETA_FROM_BETA`` the gains are not read from ``eta`` but
    formed as the step-size kernel formed them, ``eta = beta * scale`` (``scale`` ``[B, T, H]``,
    0 where the row takes no step), so the forward's ``eta`` need not be kept.
    ``deta`` may be the outputs ``o`` and ``d log a`` the reads ``R``: each element is read,
    then written, by the same program. Over ``dD_local``, once read, it writes the write values
    ``D = eta y - kappa R`` again, so that the forward's ``D`` can be freed before this kernel.

    Also the whole ``d log a``. Every exponent is a difference of chunk-local log-prefixes or a
    log-prefix alone, so, with the adjoints ``dO``, ``dR = -kappa z``, ``z`` of the outputs, the
    residual reads and ``D``, the gradient of the log-prefix at row ``m`` is::

        du_m = dO_m O_m [read after]  - D_m z_m  + dR_{m+1} R_{m+1}  [+ dO_{m+1} O_{m+1}, read before]
               + [m = last] sum_k dH[k] S_exit[k]

    (``R_t`` reads ``S_{t-1}``, at ``w_t = u_{t-1}``; ``S_exit``: the chunk's exit state, the
    next chunk's entry state in ``h`` or the final state ``s_final``, ``dH`` its gradient),
    and ``d log a_r`` sums ``du_m`` over the chunk's rows ``m >= r``: one running sum per
    column from the chunk's end backwards, block by block. ``o``: the fp32 outputs. Tiles are
    ``[BV, BS]`` and the state gradient ``[BV, BK]``, as in ``state_fwd``."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T_n, boh = _sequence(i_n, cu_seqlens, chunk_offsets, T, BT, IS_VARLEN)
    end = bos + T_n
    o_s = tl.arange(0, BS)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_vk = m_v[:, None] & m_k[None, :]
    state_off = o_k[None, :] * V + o_v[:, None]  # [BV, BK]: element (j, k) of the state S[k, j]
    b_dh = tl.zeros([BV, BK], dtype=tl.float32)
    if HAS_DS_FINAL:
        b_dh += tl.load(ds_final + i_nh.to(tl.int64) * K * V + state_off, mask=m_vk, other=0.0)
    for j in range(tl.cdiv(T_n, BT)):
        i_t = tl.cdiv(T_n, BT) - 1 - j
        tl.store(dh + ((boh + i_t) * H + i_h) * K * V + state_off, b_dh.to(dh.dtype.element_ty), mask=m_vk)
        first = bos + i_t * BT
        n_steps = tl.minimum(BT, T_n - i_t * BT)
        last = first + n_steps - 1
        # d log a, summed from the chunk's end: first the exit state's term sum_k dH S_exit
        b_exit = tl.load(h + ((boh + i_t + 1) * H + i_h) * K * V + state_off, mask=m_vk & (j > 0), other=0.0)
        b_exit = b_exit.to(tl.float32)
        if HAS_DS_FINAL:
            b_exit += tl.load(s_final + i_nh.to(tl.int64) * K * V + state_off, mask=m_vk & (j == 0), other=0.0)
        b_later = tl.sum(b_dh * b_exit, axis=1)  # [BV]: sum of du over the steps after the block
        for jb in range(0, tl.cdiv(n_steps, BS)):
            b0 = first + (tl.cdiv(n_steps, BS) - 1 - jb) * BS
            rows, m_r, r_in, r_out = _block(u, first, last, b0, end, i_h, H, V, BS, o_v, m_v)
            m_vr = m_v[:, None] & m_r[None, :]
            off = (rows[None, :] * H + i_h) * V + o_v[:, None]
            b_u = tl.load(u + off, mask=m_vr, other=0.0)
            b_xt = _rows_t(x, rows, m_r, i_h, H, K, o_k, m_k)  # [BK, BS]
            b_dd = tl.load(dD_local + off, mask=m_vr, other=0.0) + tl.dot(
                b_dh.to(b_xt.dtype), b_xt, input_precision=PRECISION) * _decay(r_out[:, None] - b_u, m_r[None, :])
            if ETA_FROM_BETA:
                b_sc = tl.load(scale + rows * H + i_h, mask=m_r, other=0.0)[None, :]
                b_eta = tl.where(b_sc != 0, tl.load(beta + off, mask=m_vr, other=0.0).to(tl.float32) * b_sc, 0.0)
            else:
                b_eta = tl.load(eta + off, mask=m_vr, other=0.0)
            b_k = _residual_gain(b_eta, gate, rows, m_r, i_h, H, HAS_GATE)
            b_w = _prev_t(u, rows, m_r, first, i_h, H, V, o_v, m_v)
            # backward substitution, all BV columns at once, unrolled over the block's BS steps. Before step
            # i, the tile b_acc holds sum_{p > i} G[p, s] exp(w_p - u_i) kappa_p z_p for every step s: its
            # column i is what z_i lacks (u_i = w_{i+1}); moving down to step i - 1 multiplies it by
            # exp(u_i - w_i) = a_i <= 1, one exp per column and step. Steps past the sequence's end have
            # kappa = 0, so kappa z = 0 there and b_acc stays 0 until the last step in the sequence
            b_kd = b_k * b_dd
            b_in = tl.zeros([BV, BS], dtype=tl.float32)  # column i: the later steps' part of z_i
            b_acc = tl.zeros([BV, BS], dtype=tl.float32)
            u_i = _row(u, b0 + BS - 1, b0 + BS - 1 < end, i_h, H, V, o_v, m_v)
            for jj in tl.static_range(BS):
                i = BS - 1 - jj
                sel = (o_s == i)[None, :]
                b_in = tl.where(sel, b_acc, b_in)
                kz_i = tl.sum(tl.where(sel, b_kd - b_k * b_acc, 0.0), axis=1)  # kappa_i z_i
                w_i = _row(u, b0 + i - 1, (b0 + i < end) & (b0 + i > first), i_h, H, V, o_v, m_v)
                a_i = tl.exp(tl.minimum(u_i - w_i, 0.0))
                g_i = _gram_column(G, rows, m_r, i, i_h, H, BS)  # G[i, s] = G[s, i]
                b_acc = b_acc * a_i[:, None] + kz_i[:, None] * g_i[None, :]
                u_i = w_i
            b_z = b_dd - b_in
            b_yv = tl.load(v + off, mask=m_vr, other=0.0).to(tl.float32)
            b_res = tl.load(R + off, mask=m_vr, other=0.0)
            b_do = tl.load(do + off, mask=m_vr, other=0.0).to(tl.float32)
            b_read = b_do * tl.load(o + off, mask=m_vr, other=0.0)  # dO O, read before deta may take o's place
            b_dread = -b_k * b_z  # dR
            tl.store(dv + off, (b_eta * b_z).to(dv.dtype.element_ty), mask=m_vr)
            # D itself, elementwise, over the dD just consumed: for dqk_bwd_two_reads, after the forward's D is freed
            b_wv = b_eta * b_yv - b_k * b_res
            tl.store(dD_local + off, b_wv, mask=m_vr)
            if HAS_GATE:  # kappa = eta exp(g): d eta = (y - exp(g) R) z, d g = sum_j -R z kappa
                tl.store(deta + off, (b_yv - _gate_rows(gate, rows, m_r, i_h, H)[None, :] * b_res) * b_z, mask=m_vr)
                tl.store(dgate + i_v * n_rows + rows * H + i_h, tl.sum(b_dread * b_res, axis=0), mask=m_r)
            else:
                tl.store(deta + off, (b_yv - b_res) * b_z, mask=m_vr)
            # du at the step itself (-D z, and dO O when reading after) and at the step before (dR R,
            # and dO O when reading before); d log a_r = the later blocks' sum + the sums over m >= r
            b_own = -b_wv * b_z
            b_prev = b_dread * b_res
            if READ_AFTER:
                b_own += b_read
            else:
                b_prev += b_read
            b_all = b_own + b_prev
            b_later += tl.sum(b_all, axis=1)
            tl.store(dlog_a + off, b_later[:, None] - tl.cumsum(b_all, axis=1) + b_own, mask=m_vr)
            b_dr = b_dread * _decay(b_w - r_in[:, None], m_r[None, :])
            b_x = _rows(x, rows, m_r, i_h, H, K, o_k, m_k)  # [BS, BK]
            b_dh = b_dh * tl.exp(r_out - r_in)[:, None] + tl.dot(b_dr.to(b_x.dtype), b_x, input_precision=PRECISION)
        # the chunk's outputs read its entry state: dh += Q^T (exp(uq) dO) (here transposed), in a pass of
        # its own over the chunk's blocks, so that no second [BV, BK] accumulator is live through the
        # substitutions
        for jb in range(0, tl.cdiv(n_steps, BS)):
            rows = first + jb * BS + tl.arange(0, BS)
            m_r = rows < end
            m_vr = m_v[:, None] & m_r[None, :]
            off = (rows[None, :] * H + i_h) * V + o_v[:, None]
            if READ_AFTER:
                b_uq = tl.load(u + off, mask=m_vr, other=0.0)
            else:
                b_uq = _prev_t(u, rows, m_r, first, i_h, H, V, o_v, m_v)
            b_g = tl.load(do + off, mask=m_vr, other=0.0).to(tl.float32) * _decay(b_uq, m_r[None, :])
            b_q = _rows(q, rows, m_r, i_h, H, K, o_k, m_k)  # [BS, BK]
            b_dh += tl.dot(b_g.to(b_q.dtype), b_q, input_precision=PRECISION)
    if STORE_DS0:
        tl.store(ds0 + i_nh.to(tl.int64) * K * V + state_off, b_dh, mask=m_vk)


@triton.jit
def dqk_bwd_two_reads(
    q, x, D, u, h, dh, do, dv, gate, dq, dx, cu_seqlens, chunk_indices, chunk_offsets, T,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    READ_AFTER: tl.constexpr, HAS_GATE: tl.constexpr, IS_VARLEN: tl.constexpr, PRECISION: tl.constexpr,
):
    """Grid ``(cdiv(K, BK), num_chunks, H)``: the rule-2A ``dqk_bwd`` of both reads with
    values ``D`` in one program per chunk and key block: ``dq`` of the outputs (queries
    ``q``, upstream ``dO``, ``READ_AFTER``) and the whole ``dx``, as the residual reads'
    queries and as the keys of both reads (residual reads: read before the write, upstream
    ``dR = -exp(g) dv``, from the values' gradient ``dv = eta z``; the exit-state term through
    ``dh``). With the reads' score gradients
    ``dP_O[t, s] = sum_j dO[t, j] exp(uq[t, j] - u[s, j]) D[s, j]`` (``s in M(t)``) and
    ``dP_R`` (the same with ``dR`` and ``w = u_{t-1}``, ``s < t``)::

        dq   = dP_O X + (exp(uq) dO) h^T
        dx^T = X^T (dP_R + dP_R^T) + Q^T dP_O + h (exp(w) dR)^T + dh (exp(u_C - u) D)^T

    One loop over the value blocks and levels sums both score gradients from shared loads
    of ``u``, ``D`` and the levels' ``r`` (one tile of decays per level when reading before
    the write, two after). ``dP_R + dP_R^T`` is one dot per level: ``Z Z^T`` on the pairs of
    a block with one source and one target, ``Z = E * D`` on source rows, ``E * dR`` on
    target rows. ``dx`` is accumulated transposed, so that no dot result is transposed;
    ``dq`` and ``dx`` are stored in ``q``'s and ``x``'s dtype."""
    i_k, i_h = tl.program_id(0), tl.program_id(2)
    i_c = tl.program_id(1)
    i_t, boh, first, last, rows, m_r = _chunk_program(i_c, cu_seqlens, chunk_indices, chunk_offsets, T, BT,
                                                      IS_VARLEN)
    LEVELS: tl.constexpr = 4 + (BT >= 32) + (BT >= 64) + (BT >= 128)  # log2(BT), BT in 16..128
    dt = q.dtype.element_ty
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < K
    state = ((boh + i_t) * H + i_h) * K * V
    b_sr = tl.zeros([BT, BT], dtype=tl.float32)  # dP_R + dP_R^T (symmetric, 0 on the diagonal)
    b_so = tl.zeros([BT, BT], dtype=tl.float32)  # dP_O
    b_dd = tl.zeros([BT], dtype=tl.float32)  # dP_O[t, t] (read after)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
        b_w = _read_prefix(u, rows, m_r, first, i_h, H, V, o_v, m_v, False)  # the residual reads' uq
        b_D = _rows(D, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
        b_dr = _read_grad_rows(dv, gate, rows, m_r, i_h, H, V, o_v, m_v, HAS_GATE)
        b_do = _rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32)
        if READ_AFTER:
            b_dd += tl.sum(b_do * b_D, axis=1)
        for lvl in range(LEVELS):
            source, block, r = _level_blocks(u, first, last, m_r, i_h, H, V, o_v, m_v, BT, lvl)
            b_er = _level_decay(source, r, b_u, b_w, m_r, m_v)
            if READ_AFTER:
                b_eo = _level_decay(source, r, b_u, b_u, m_r, m_v)
            else:
                b_eo = b_er
            b_z = b_er * tl.where(source[:, None], b_D, b_dr)  # sources: E D (both reads); targets: E dR
            b_s = tl.where(source[:, None], b_z, 0.0).to(dt)
            b_g = (tl.where(source[:, None], 0.0, b_eo) * b_do).to(dt)
            b_z = b_z.to(dt)
            cross = block & (source[:, None] != source[None, :])
            b_sr += tl.where(cross, tl.dot(b_z, tl.trans(b_z), input_precision=PRECISION), 0.0)
            b_so += tl.where(block, tl.dot(b_g, tl.trans(b_s), input_precision=PRECISION), 0.0)
    if READ_AFTER:
        i = tl.arange(0, BT)
        b_so += tl.where(i[:, None] == i[None, :], b_dd[:, None], 0.0)
    b_sr = b_sr.to(dt)
    b_so = b_so.to(dt)
    b_dq = tl.dot(b_so, _rows(x, rows, m_r, i_h, H, K, o_k, m_k), input_precision=PRECISION)
    b_dxt = tl.dot(_rows_t(x, rows, m_r, i_h, H, K, o_k, m_k), b_sr, input_precision=PRECISION)
    b_dxt += tl.dot(_rows_t(q, rows, m_r, i_h, H, K, o_k, m_k), b_so, input_precision=PRECISION)
    # the entry state's reads (dq, and dx as the residual reads' queries) and the exit state's write (dx)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_kv = m_k[:, None] & m_v[None, :]
        b_u = _rows(u, rows, m_r, i_h, H, V, o_v, m_v)
        b_w = _read_prefix(u, rows, m_r, first, i_h, H, V, o_v, m_v, False)
        if READ_AFTER:
            b_uq = b_u
        else:
            b_uq = b_w
        b_h = tl.load(h + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)  # [BK, BV]
        b_dh = tl.load(dh + state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
        b_go = (_rows(do, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32) * _decay(b_uq, m_r[:, None])).to(dt)
        b_gr = (_read_grad_rows(dv, gate, rows, m_r, i_h, H, V, o_v, m_v, HAS_GATE) * _decay(b_w, m_r[:, None])).to(dt)
        u_last = _row(u, last, True, i_h, H, V, o_v, m_v)
        b_wc = (_rows(D, rows, m_r, i_h, H, V, o_v, m_v).to(tl.float32) * _decay(u_last[None, :] - b_u, m_r[:, None])).to(dt)
        b_dq += tl.dot(b_go, tl.trans(b_h), input_precision=PRECISION)
        b_dxt += tl.dot(b_h, tl.trans(b_gr), input_precision=PRECISION)
        b_dxt += tl.dot(b_dh, tl.trans(b_wc), input_precision=PRECISION)
    tl.store(dq + (rows[:, None] * H + i_h) * K + o_k[None, :], b_dq.to(dq.dtype.element_ty),
             mask=m_r[:, None] & m_k[None, :])
    tl.store(dx + (rows[None, :] * H + i_h) * K + o_k[:, None], b_dxt.to(dx.dtype.element_ty),
             mask=m_r[None, :] & m_k[:, None])
