r"""Fused step sizes, one program per block of ``(b, t, h)`` rows: the kernel counterpart of
``ops.step_sizes``. ``step_fwd`` / ``step_bwd`` serve the scalar rules (1, 1A),
``column_step_fwd`` / ``column_step_bwd`` the per-column rules (2, 2A), whose ``beta``,
``eta`` and ``log_a`` carry one value per value column, and ``window_step_fwd`` /
``window_step_bwd`` rule 3, whose statistic is the top eigenvalue of each window's Gram
(``top_eigenpair``) and whose step sizes are laid out per write of the window.

Per row, with the write feature ``x`` (``K`` values), ``E = ||x||^2`` and
``lambda = lam`` (``lam * E`` with ``scale_ridge``)::

    eta   = beta / (E + lambda + eps)    (0 at an invalid pair or a vanishing denominator;
                                          eta = beta without normalize)
    alpha = min(eta * lambda, 1 - decay_floor)
    log_a = log1p(-alpha) + g            (g = log_gate, or 0)

``step_fwd`` writes ``eta`` and ``log_a``; ``step_bwd`` maps their gradients to
``beta``, ``lam``, ``log_gate`` and ``x`` (``dx = dx_in + 2 x dE``, where ``dx_in`` is the
gradient ``x`` receives from the scan, so that autograd adds nothing).

With ``SHIFT`` the kernels also build the write features from the keys, for fixed-length
rows: ``x_t = k_{t-1}`` and ``x_0 = first`` (the last key carried in) or the sentinel
``0``, whose pair is invalid (``ops.pairs.write_pairs``). ``step_fwd`` then writes ``x``,
and ``step_bwd`` writes the keys' gradient ``dk_{t-1} = dx_t`` (``dk_{T-1} = 0``) and
``d first = dx_0``: no separate shift, validity mask or gradient sum is launched.
Without ``SHIFT``, ``x`` is given and ``valid`` (``[B, T]``, or ``None`` when every pair is
valid) marks its pairs.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _log1p(x):
    # log(1 + x) accurate for small |x|: log(u) * x / (u - 1) with u = 1 + x rounded.
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _feature_block(x, first, rows, m_r, o_k, T, H: tl.constexpr, K: tl.constexpr, SHIFT: tl.constexpr,
                   HAS_FIRST: tl.constexpr):
    """The write features ``[BR, BK]`` (columns ``o_k``) of ``rows``, read from ``x`` itself or,
    with ``SHIFT``, from the key row one step earlier (``first`` or zeros at ``t = 0``)."""
    m = m_r[:, None] & (o_k[None, :] < K)
    if SHIFT:
        at_start = ((rows // H) % T) == 0
        b_x = tl.load(x + (rows - H)[:, None] * K + o_k[None, :], mask=m & ~at_start[:, None], other=0.0)
        if HAS_FIRST:  # first is [B, H, K]: row (b, h) = (rows // (T * H)) * H + rows % H
            fr = (rows // (T * H)) * H + rows % H
            b_f = tl.load(first + fr[:, None] * K + o_k[None, :], mask=m & at_start[:, None], other=0.0)
            b_x = tl.where(at_start[:, None], b_f, b_x)
        return b_x
    return tl.load(x + rows[:, None] * K + o_k[None, :], mask=m, other=0.0)


@triton.jit
def _energy(x, first, rows, m_r, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
            SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr):
    """``E = ||x||^2`` ``[BR]`` of the write features of ``rows`` (``_feature_block``)."""
    E = tl.zeros([BR], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        b_x = _feature_block(x, first, rows, m_r, i_k * BK + tl.arange(0, BK), T, H, K, SHIFT,
                             HAS_FIRST).to(tl.float32)
        E += tl.sum(b_x * b_x, axis=1)
    return E


@triton.jit
def _store_feature_grad(g_x, dx, d_first, rows, o_k, m, T, H: tl.constexpr, K: tl.constexpr, SHIFT: tl.constexpr,
                        HAS_FIRST: tl.constexpr):
    """Stores the features' gradient ``g_x`` ``[BR, BK]`` (columns ``o_k``, mask ``m``) of ``rows``: row by
    row or, with ``SHIFT``, as the keys' gradient one row earlier (``dk_{T-1} = 0``) and ``d_first`` at
    ``t = 0`` (``HAS_FIRST``)."""
    g_x = g_x.to(dx.dtype.element_ty)
    if SHIFT:  # x_t = k_{t-1}: this row's gradient belongs to the key one row earlier
        at_start = ((rows // H) % T) == 0
        at_end = ((rows // H) % T) == T - 1
        tl.store(dx + (rows - H)[:, None] * K + o_k[None, :], g_x, mask=m & ~at_start[:, None])
        tl.store(dx + rows[:, None] * K + o_k[None, :], tl.zeros_like(g_x), mask=m & at_end[:, None])
        if HAS_FIRST:
            fr = (rows // (T * H)) * H + rows % H
            tl.store(d_first + fr[:, None] * K + o_k[None, :], g_x.to(d_first.dtype.element_ty),
                     mask=m & at_start[:, None])
    else:
        tl.store(dx + rows[:, None] * K + o_k[None, :], g_x, mask=m)


@triton.jit
def _feature_grad(b_x, dx_in, g_E, rows, o_k, m, K: tl.constexpr, HAS_DX_IN: tl.constexpr):
    """``dx = dx_in + 2 x dE`` on one ``[BR, BK]`` tile of features ``b_x`` (fp32)."""
    g_x = 2.0 * b_x * g_E[:, None]
    if HAS_DX_IN:
        g_x += tl.load(dx_in + rows[:, None] * K + o_k[None, :], mask=m, other=0.0).to(tl.float32)
    return g_x


@triton.jit
def _feature_grads(x, first, dx_in, dx, d_first, g_E, rows, m_r, T, H: tl.constexpr, K: tl.constexpr,
                   BK: tl.constexpr, SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_DX_IN: tl.constexpr):
    """``dx = dx_in + 2 x dE`` of ``rows``, the features read again block by block
    (``_store_feature_grad``)."""
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m = m_r[:, None] & (o_k[None, :] < K)
        b_x = _feature_block(x, first, rows, m_r, o_k, T, H, K, SHIFT, HAS_FIRST).to(tl.float32)
        _store_feature_grad(_feature_grad(b_x, dx_in, g_E, rows, o_k, m, K, HAS_DX_IN), dx, d_first, rows, o_k, m,
                            T, H, K, SHIFT, HAS_FIRST)


@triton.jit
def _pair_valid(valid, rows, m_r, T, H: tl.constexpr, SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr,
                HAS_VALID: tl.constexpr):
    if SHIFT:
        if HAS_FIRST:
            return m_r
        return m_r & (((rows // H) % T) != 0)  # the sentinel pair at t = 0
    if HAS_VALID:
        return (tl.load(valid + rows // H, mask=m_r, other=0) != 0) & m_r
    return m_r


@triton.jit
def _row_terms(x, first, valid, lam, rows, m_r, T, eps, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
               BR: tl.constexpr, NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, SHIFT: tl.constexpr,
               HAS_FIRST: tl.constexpr, HAS_VALID: tl.constexpr):
    """Per row ``[BR]``: ``E``, ``lam``, ``lambda``, the denominator ``E + lambda + eps`` and
    whether the row takes a step (a valid pair, and a positive denominator with ``NORMALIZE``)."""
    E = _energy(x, first, rows, m_r, T, H, K, BK, BR, SHIFT, HAS_FIRST)
    return _terms_of_energy(E, valid, lam, rows, m_r, T, eps, H, NORMALIZE, SCALE_RIDGE, SHIFT, HAS_FIRST, HAS_VALID)


@triton.jit
def _terms_of_energy(E, valid, lam, rows, m_r, T, eps, H: tl.constexpr, NORMALIZE: tl.constexpr,
                     SCALE_RIDGE: tl.constexpr, SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_VALID: tl.constexpr):
    """``_row_terms`` from the energies ``E`` ``[BR]``."""
    b_lam = tl.load(lam + rows, mask=m_r, other=0.0).to(tl.float32)
    ok = _pair_valid(valid, rows, m_r, T, H, SHIFT, HAS_FIRST, HAS_VALID)
    lam_eff, denom, ok = ridge_terms(E, b_lam, ok, eps, NORMALIZE, SCALE_RIDGE)
    return E, b_lam, lam_eff, denom, ok


@triton.jit
def ridge_terms(E, b_lam, ok, eps, NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr):
    """From the statistic ``E`` and ``lam``: ``lambda`` (``lam * E`` with ``SCALE_RIDGE``), the
    denominator ``E + lambda + eps``, and ``ok`` narrowed to a positive denominator (``NORMALIZE``)."""
    if SCALE_RIDGE:
        lam_eff = b_lam * E
    else:
        lam_eff = b_lam
    denom = E + lam_eff + eps
    if NORMALIZE:
        ok = ok & (denom > 0)
    return lam_eff, denom, ok


@triton.jit
def _eta(beta, off, ok, denom, NORMALIZE: tl.constexpr):
    """``eta`` of the gains at ``beta + off``, a ``[BR]`` tile (scalar rules) or ``[BR, BV]``
    (per column, ``denom`` given as ``[BR, 1]``); 0 where not ``ok``."""
    b_beta = tl.load(beta + off, mask=ok, other=0.0).to(tl.float32)
    if NORMALIZE:
        eta = tl.where(ok, b_beta / tl.where(ok, denom, 1.0), 0.0)
    else:
        eta = tl.where(ok, b_beta, 0.0)
    return eta


@triton.jit
def _eta_scale(denom, ok, NORMALIZE: tl.constexpr):
    """The per-row factor of the per-column gains, ``eta = beta * scale``: ``1 / denom``
    (``1`` without ``NORMALIZE``), 0 where the row takes no step."""
    if NORMALIZE:
        return tl.where(ok, 1.0 / tl.where(ok, denom, 1.0), 0.0)
    return tl.where(ok, 1.0, 0.0)


@triton.jit
def _eta_grads(g_eta, g_la, eta, lam_eff, denom, ok, decay_floor, NORMALIZE: tl.constexpr):
    """Backward of ``alpha = min(eta * lambda, 1 - decay_floor)``, ``log_a = log1p(-alpha)`` and
    ``eta = beta / denom``, elementwise on a ``[BR]`` or ``[BR, BV]`` tile (``lam_eff``, ``denom``
    then ``[BR, 1]``): from ``d eta`` and ``d log_a``, ``d beta`` and the ``d lambda`` (through
    ``alpha``) and ``d denom`` terms, which the caller sums over the columns (``d denom`` is 0
    without ``NORMALIZE``)."""
    alpha_raw = eta * lam_eff
    alpha = tl.minimum(alpha_raw, 1.0 - decay_floor)
    g_alpha = tl.where(alpha_raw <= 1.0 - decay_floor, -g_la / (1.0 - alpha), 0.0)
    g_eta += g_alpha * lam_eff
    g_lam_eff = g_alpha * eta
    if NORMALIZE:
        safe = tl.where(ok, denom, 1.0)
        g_beta = tl.where(ok, g_eta / safe, 0.0)
        g_denom = tl.where(ok, -g_eta * eta / safe, 0.0)
    else:
        g_beta = tl.where(ok, g_eta, 0.0)
        g_denom = tl.zeros_like(g_eta)
    return g_beta, g_lam_eff, g_denom


@triton.jit
def _lam_grads(g_lam_eff, g_E, E, b_lam, SCALE_RIDGE: tl.constexpr):
    """``d lam`` and the whole ``d E`` ``[BR]`` from ``d lambda`` and the rest of ``d E``,
    through ``lambda = lam * E`` (``SCALE_RIDGE``) or ``lambda = lam``."""
    if SCALE_RIDGE:
        g_lam = g_lam_eff * E
        g_E += g_lam_eff * b_lam
    else:
        g_lam = g_lam_eff
    return g_lam, g_E


@triton.jit
def _store_features(x, first, x_out, rows, m_r, T, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                    HAS_FIRST: tl.constexpr):
    """Writes the shifted write features of ``rows`` (``_feature_block`` with ``SHIFT``) to ``x_out``."""
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_x = _feature_block(x, first, rows, m_r, o_k, T, H, K, True, HAS_FIRST)
        tl.store(x_out + rows[:, None] * K + o_k[None, :], b_x, mask=m_r[:, None] & (o_k[None, :] < K))


@triton.jit
def step_fwd(
    x, first, valid, beta, lam, log_gate, x_out, eta, log_a, n, T, eps, decay_floor,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr,
    SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr, HAS_VALID: tl.constexpr,
):
    """Grid ``(cdiv(n, BR),)`` over the ``n = B*T*H`` rows; with ``SHIFT``, ``x`` holds the keys
    and the features are written to ``x_out``."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    if BK >= K:  # one key block: the features are read once, kept for the shifted copy
        o_k = tl.arange(0, BK)
        b_x = _feature_block(x, first, rows, m_r, o_k, T, H, K, SHIFT, HAS_FIRST)
        E = tl.sum(b_x.to(tl.float32) * b_x.to(tl.float32), axis=1)
        E, b_lam, lam_eff, denom, ok = _terms_of_energy(E, valid, lam, rows, m_r, T, eps, H, NORMALIZE, SCALE_RIDGE,
                                                        SHIFT, HAS_FIRST, HAS_VALID)
    else:
        E, b_lam, lam_eff, denom, ok = _row_terms(x, first, valid, lam, rows, m_r, T, eps, H, K, BK, BR, NORMALIZE,
                                                  SCALE_RIDGE, SHIFT, HAS_FIRST, HAS_VALID)
    b_eta = _eta(beta, rows, ok, denom, NORMALIZE)
    la = _log1p(-tl.minimum(b_eta * lam_eff, 1.0 - decay_floor))
    if HAS_GATE:
        la += tl.load(log_gate + rows, mask=m_r, other=0.0).to(tl.float32)
    tl.store(eta + rows, b_eta, mask=m_r)
    tl.store(log_a + rows, la, mask=m_r)
    if SHIFT:
        if BK >= K:
            tl.store(x_out + rows[:, None] * K + o_k[None, :], b_x, mask=m_r[:, None] & (o_k[None, :] < K))
        else:  # the features, read once more (the energy loop kept no tiles)
            _store_features(x, first, x_out, rows, m_r, T, H, K, BK, HAS_FIRST)


@triton.jit
def step_bwd(
    x, first, valid, beta, lam, d_eta, d_log_a, dx_in, dx, d_first, d_beta, d_lam, n, T, eps, decay_floor,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_DX_IN: tl.constexpr,
):
    """Grid ``(cdiv(n, BR),)``; the gate's gradient is ``d_log_a`` itself. Writes ``dx`` (row by
    row), or with ``SHIFT`` the keys' gradient ``dx`` one row earlier and ``d_first`` at
    ``t = 0`` (``HAS_FIRST``)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    if BK >= K:  # one key block: the features are read once, kept for their gradient
        o_k = tl.arange(0, BK)
        b_x = _feature_block(x, first, rows, m_r, o_k, T, H, K, SHIFT, HAS_FIRST).to(tl.float32)
        E, b_lam, lam_eff, denom, ok = _terms_of_energy(tl.sum(b_x * b_x, axis=1), valid, lam, rows, m_r, T, eps, H,
                                                        NORMALIZE, SCALE_RIDGE, SHIFT, HAS_FIRST, HAS_VALID)
    else:
        E, b_lam, lam_eff, denom, ok = _row_terms(x, first, valid, lam, rows, m_r, T, eps, H, K, BK, BR, NORMALIZE,
                                                  SCALE_RIDGE, SHIFT, HAS_FIRST, HAS_VALID)
    b_eta = _eta(beta, rows, ok, denom, NORMALIZE)
    g_eta = tl.load(d_eta + rows, mask=m_r, other=0.0)
    g_la = tl.load(d_log_a + rows, mask=m_r, other=0.0)
    g_beta, g_lam_eff, g_denom = _eta_grads(g_eta, g_la, b_eta, lam_eff, denom, ok, decay_floor, NORMALIZE)
    g_E = tl.zeros([BR], dtype=tl.float32)
    if NORMALIZE:  # denom = E + lambda + eps
        g_E += g_denom
        g_lam_eff += g_denom
    g_lam, g_E = _lam_grads(g_lam_eff, g_E, E, b_lam, SCALE_RIDGE)
    tl.store(d_beta + rows, g_beta.to(d_beta.dtype.element_ty), mask=m_r)
    tl.store(d_lam + rows, g_lam.to(d_lam.dtype.element_ty), mask=m_r)
    if BK >= K:
        m = m_r[:, None] & (o_k[None, :] < K)
        _store_feature_grad(_feature_grad(b_x, dx_in, g_E, rows, o_k, m, K, HAS_DX_IN), dx, d_first, rows, o_k, m,
                            T, H, K, SHIFT, HAS_FIRST)
    else:
        _feature_grads(x, first, dx_in, dx, d_first, g_E, rows, m_r, T, H, K, BK, SHIFT, HAS_FIRST, HAS_DX_IN)


@triton.jit
def column_step_fwd(
    x, first, valid, beta, lam, log_gate, x_out, eta, log_a, scale, n, T, eps, decay_floor,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr, SHIFT: tl.constexpr,
    HAS_FIRST: tl.constexpr, HAS_VALID: tl.constexpr,
):
    """Grid ``(cdiv(n, BR), cdiv(V, BV))`` over the ``n = B*T*H`` rows, the per-column rules
    (2, 2A): per value column ``eta = beta * scale`` with the row's ``scale = 1 / (E + lambda +
    eps)`` (0 where the row takes no step), ``log_a = log1p(-min(eta * lambda, 1 - decay_floor)) +
    g`` (``beta`` ``[n, V]``). The programs of the first column block also write ``scale`` ``[n]``
    (so that a later kernel can form ``eta`` again, to the bit, from ``beta``) and, with ``SHIFT``,
    the features to ``x_out``."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    o_v = tl.program_id(1) * BV + tl.arange(0, BV)
    m_v = o_v < V
    E, b_lam, lam_eff, denom, ok_rows = _row_terms(x, first, valid, lam, rows, m_r, T, eps, H, K, BK, BR, NORMALIZE,
                                                   SCALE_RIDGE, SHIFT, HAS_FIRST, HAS_VALID)
    ok = ok_rows[:, None] & m_v[None, :]
    m = m_r[:, None] & m_v[None, :]
    off = rows[:, None] * V + o_v[None, :]
    b_scale = _eta_scale(denom, ok_rows, NORMALIZE)
    b_eta = tl.where(ok, tl.load(beta + off, mask=ok, other=0.0).to(tl.float32) * b_scale[:, None], 0.0)
    la = _log1p(-tl.minimum(b_eta * lam_eff[:, None], 1.0 - decay_floor))
    if HAS_GATE:
        la += tl.load(log_gate + rows, mask=m_r, other=0.0).to(tl.float32)[:, None]
    tl.store(eta + off, b_eta, mask=m)
    tl.store(log_a + off, la, mask=m)
    if tl.program_id(1) == 0:
        tl.store(scale + rows, b_scale, mask=m_r)
        if SHIFT:
            _store_features(x, first, x_out, rows, m_r, T, H, K, BK, HAS_FIRST)


@triton.jit
def column_step_bwd(
    x, first, valid, beta, lam, d_eta, d_log_a, dx_in, dx, d_first, d_beta, d_lam, d_gate, n, T, eps, decay_floor,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, SHIFT: tl.constexpr, HAS_FIRST: tl.constexpr,
    HAS_VALID: tl.constexpr, HAS_DX_IN: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """Grid ``(cdiv(n, BR),)``: ``d beta`` per column; ``d lam``, ``d log_gate`` (the row sum
    of ``d log_a``) and the features' gradient (``_feature_grads``) summed over the columns."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    g_E = tl.zeros([BR], dtype=tl.float32)
    g_lam_eff = tl.zeros([BR], dtype=tl.float32)
    g_gate = tl.zeros([BR], dtype=tl.float32)
    E, b_lam, lam_eff, denom, ok_rows = _row_terms(x, first, valid, lam, rows, m_r, T, eps, H, K, BK, BR, NORMALIZE,
                                                   SCALE_RIDGE, SHIFT, HAS_FIRST, HAS_VALID)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        ok = ok_rows[:, None] & m_v[None, :]
        m = m_r[:, None] & m_v[None, :]
        off = rows[:, None] * V + o_v[None, :]
        b_eta = _eta(beta, off, ok, denom[:, None], NORMALIZE)
        g_eta = tl.load(d_eta + off, mask=m, other=0.0)
        g_la = tl.load(d_log_a + off, mask=m, other=0.0)
        g_gate += tl.sum(g_la, axis=1)
        g_beta, g_lam_c, g_denom_c = _eta_grads(g_eta, g_la, b_eta, lam_eff[:, None], denom[:, None], ok,
                                                decay_floor, NORMALIZE)
        g_lam_eff += tl.sum(g_lam_c, axis=1)
        if NORMALIZE:  # denom = E + lambda + eps
            g_denom = tl.sum(g_denom_c, axis=1)
            g_E += g_denom
            g_lam_eff += g_denom
        tl.store(d_beta + off, g_beta.to(d_beta.dtype.element_ty), mask=m)
    g_lam, g_E = _lam_grads(g_lam_eff, g_E, E, b_lam, SCALE_RIDGE)
    tl.store(d_lam + rows, g_lam.to(d_lam.dtype.element_ty), mask=m_r)
    if HAS_GATE:
        tl.store(d_gate + rows, g_gate.to(d_gate.dtype.element_ty), mask=m_r)
    _feature_grads(x, first, dx_in, dx, d_first, g_E, rows, m_r, T, H, K, BK, SHIFT, HAS_FIRST, HAS_DX_IN)


@triton.jit
def _column(m, k, W: tl.constexpr):
    """Column ``k`` of each ``[W, W]`` matrix of ``m`` ``[BR, W, W]`` -> ``[BR, W]`` (exact selection)."""
    o = tl.arange(0, W)
    return tl.sum(tl.where(o[None, None, :] == k, m, 0.0), axis=2)


@triton.jit
def top_eigenpair(g, W: tl.constexpr, SQUARINGS: tl.constexpr, BR: tl.constexpr):
    """Top eigenpair of each symmetric PSD ``[W, W]`` matrix of ``g`` ``[BR, W, W]`` fp32 -> ``lambda``
    ``[BR]`` and the unit eigenvector ``[BR, W]``: the kernel counterpart of
    ``ops.step_sizes.top_eigenvalue_by_squaring``. ``M = G / max_i G_ii`` is squared ``SQUARINGS``
    times at unit trace (``M M = sum_k m_k m_k^T`` over its columns, ``M`` symmetric), ``v`` = ``G``
    times the column of ``M`` with the largest diagonal entry, normalized; ``lambda = v^T G v``. Zero
    rows and columns (padding slots) change neither."""
    o = tl.arange(0, W)
    eye = o[None, :, None] == o[None, None, :]
    tiny = 1.1754943508222875e-38
    # G up to a scale, entries <= 1 (the trace could overflow where no entry does)
    g0 = g / tl.maximum(tl.max(tl.sum(tl.where(eye, g, 0.0), axis=2), axis=1), tiny)[:, None, None]
    m = g0
    for _ in range(SQUARINGS):
        p = tl.zeros([BR, W, W], dtype=tl.float32)
        for k in tl.static_range(W):
            c = _column(m, k, W)
            p += c[:, :, None] * c[:, None, :]
        m = p / tl.maximum(tl.sum(tl.sum(tl.where(eye, p, 0.0), axis=2), axis=1), tiny)[:, None, None]
    diag = tl.sum(tl.where(eye, m, 0.0), axis=2)  # [BR, W]
    top = tl.max(diag, axis=1)
    # the first column whose diagonal entry is the largest (as torch.argmax picks)
    first = tl.min(tl.where(diag == top[:, None], o[None, :], W), axis=1)
    v = tl.sum(tl.where(o[None, None, :] == first[:, None, None], m, 0.0), axis=2)
    v = tl.sum(g0 * v[:, None, :], axis=2)  # G v, up to the scale
    v = v / tl.maximum(tl.sqrt(tl.sum(v * v, axis=1)), tiny)[:, None]
    lam = tl.sum(tl.sum(g * v[:, :, None] * v[:, None, :], axis=2), axis=1)
    return lam, v


# ---- rule 3: the step sizes of the window writes ----

@triton.jit
def _window_terms(lam_max, valid_ext, lam, rows, m_r, T, eps, H: tl.constexpr, W: tl.constexpr,
                  NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr):
    """Per row ``(b, t, h)`` of rule 3, from the Grams' top eigenvalues ``lam_max`` ``[BR]``: the slots' validity ``[BR, W]`` (slot ``j`` of step ``t``
    is the pair at extended position ``t + j``), their count ``B_t`` clamped to 1, and
    ``_terms_of_energy``'s terms with ``E = mu_t = lambda_max(G_t) / B_t`` (the multiplier of
    ``scale_ridge`` is ``E`` too; the backward treats it as a constant, Appendix C.6). A row
    takes a step where its window holds a pair."""
    bt = rows // H
    o_w = tl.arange(0, W)
    pos = (bt // T) * (T + W - 1) + bt % T
    slot_ok = tl.load(valid_ext + pos[:, None] + o_w[None, :], mask=m_r[:, None], other=0) != 0
    count = tl.sum(slot_ok.to(tl.float32), axis=1)
    cnt = tl.maximum(count, 1.0)
    E = lam_max / cnt
    b_lam = tl.load(lam + rows, mask=m_r, other=0.0).to(tl.float32)
    lam_eff, denom, ok = ridge_terms(E, b_lam, m_r & (count > 0), eps, NORMALIZE, SCALE_RIDGE)
    return slot_ok, cnt, E, lam_eff, denom, ok


@triton.jit
def window_step_fwd(
    gram, valid_ext, beta, lam, log_gate, eta, kappa, carry, top, vec, n, T, eps, decay_floor, log_floor,
    H: tl.constexpr, W: tl.constexpr, SQUARINGS: tl.constexpr, BR: tl.constexpr,
    NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """Grid ``(cdiv(n, BR),)`` over the ``n = B*T*H`` rows ``(b, t, h)`` of rule 3, time-major. From the
    window Grams ``gram`` ``[n, W, W]`` fp32: their top eigenpair (``top_eigenpair``; ``top`` ``[n]``,
    ``vec`` ``[n, W]``, kept for the backward), then per row::

        mu    = lambda_max(G_t) / B_t,  eta = beta / (mu + lambda + eps)   (0 without a pair)
        log_a = max(log1p(-min(eta * lambda, 1 - decay_floor)), log decay_floor) + g

    and per write ``(b, t, j, h)`` (``[B, T, W, H]``, the scan's row order): ``eta_j = eta [j
    valid] / B_t``, ``kappa_j = eta_j exp(g)`` (``HAS_GATE``; without a gate kappa is eta) and the
    carry ``log_a`` on slot 0, zero on the others."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    o_w = tl.arange(0, W)
    g = tl.load(gram + rows[:, None, None] * (W * W) + o_w[None, :, None] * W + o_w[None, None, :],
                mask=m_r[:, None, None], other=0.0)
    lam_max, v = top_eigenpair(g, W, SQUARINGS, BR)
    tl.store(top + rows, lam_max, mask=m_r)
    tl.store(vec + rows[:, None] * W + o_w[None, :], v, mask=m_r[:, None])
    slot_ok, cnt, E, lam_eff, denom, ok = _window_terms(lam_max, valid_ext, lam, rows, m_r, T, eps, H, W, NORMALIZE,
                                                        SCALE_RIDGE)
    b_eta = _eta(beta, rows, ok, denom, NORMALIZE)
    la = tl.maximum(_log1p(-tl.minimum(b_eta * lam_eff, 1.0 - decay_floor)), log_floor)
    e_slots = tl.where(slot_ok, b_eta[:, None] / cnt[:, None], 0.0)  # [BR, W]
    off = ((rows // H)[:, None] * W + o_w[None, :]) * H + (rows % H)[:, None]
    m = m_r[:, None]
    tl.store(eta + off, e_slots, mask=m)
    if HAS_GATE:
        b_g = tl.load(log_gate + rows, mask=m_r, other=0.0).to(tl.float32)
        la += b_g
        tl.store(kappa + off, e_slots * tl.exp(b_g)[:, None], mask=m)
    tl.store(carry + off, tl.where(o_w[None, :] == 0, la[:, None], 0.0), mask=m)


@triton.jit
def window_step_bwd(
    top, valid_ext, beta, lam, log_gate, d_eta, d_kappa, d_carry, d_top, d_beta, d_lam, d_gate,
    n, T, eps, decay_floor, log_floor,
    H: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, NORMALIZE: tl.constexpr, SCALE_RIDGE: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    """Grid ``(cdiv(n, BR),)``: the backward of ``window_step_fwd`` from the writes' gradients
    ``d_eta``, ``d_carry`` and (``HAS_GATE``) ``d_kappa`` ``[B, T, W, H]``: ``d_beta``,
    ``d_lam``, ``d_gate`` ``[n]`` and ``d_top`` ``[n]``, the gradient of ``lambda_max(G_t)``
    (``d mu / B_t``; ``d G_t = d_top v v^T`` is formed where the Grams' backward needs it)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < n
    o_w = tl.arange(0, W)
    lam_max = tl.load(top + rows, mask=m_r, other=0.0)
    slot_ok, cnt, E, lam_eff, denom, ok = _window_terms(lam_max, valid_ext, lam, rows, m_r, T, eps, H, W, NORMALIZE,
                                                        SCALE_RIDGE)
    b_eta = _eta(beta, rows, ok, denom, NORMALIZE)
    off = ((rows // H)[:, None] * W + o_w[None, :]) * H + (rows % H)[:, None]
    m = m_r[:, None]
    g_slots = tl.load(d_eta + off, mask=m, other=0.0)
    g_carry = tl.sum(tl.load(d_carry + off, mask=m & (o_w[None, :] == 0), other=0.0), axis=1)
    if HAS_GATE:
        e_g = tl.exp(tl.load(log_gate + rows, mask=m_r, other=0.0).to(tl.float32))
        g_k = tl.load(d_kappa + off, mask=m, other=0.0)
        g_slots += g_k * e_g[:, None]
        g_gate = g_carry + tl.sum(tl.where(slot_ok, g_k * (b_eta * e_g / cnt)[:, None], 0.0), axis=1)
        tl.store(d_gate + rows, g_gate.to(d_gate.dtype.element_ty), mask=m_r)
    g_eta = tl.sum(tl.where(slot_ok, g_slots, 0.0), axis=1) / cnt
    la_raw = _log1p(-tl.minimum(b_eta * lam_eff, 1.0 - decay_floor))
    g_la = tl.where(la_raw >= log_floor, g_carry, 0.0)
    g_beta, g_lam_eff, g_denom = _eta_grads(g_eta, g_la, b_eta, lam_eff, denom, ok, decay_floor, NORMALIZE)
    g_lam_eff += g_denom  # denom = E + lambda + eps (g_denom is 0 without NORMALIZE)
    if SCALE_RIDGE:  # lambda = lam * E, E held constant
        g_lam = g_lam_eff * E
    else:
        g_lam = g_lam_eff
    tl.store(d_beta + rows, g_beta.to(d_beta.dtype.element_ty), mask=m_r)
    tl.store(d_lam + rows, g_lam.to(d_lam.dtype.element_ty), mask=m_r)
    tl.store(d_top + rows, g_denom / cnt, mask=m_r)
