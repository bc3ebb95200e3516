r"""Fused one-token decoding step for the scalar, non-sliding rules (1, 1A).

Per head, with the write feature ``x``, value ``y = v``, step size ``eta``, carry
``a = gamma * exp(g)`` and ``kappa = eta * exp(g)`` (``kappa = 0`` for 1A)::

    d      = eta * y - kappa * S^T x
    S_new  = a * S + x d^T
    o      = S_new^T q   (read after write)   or   S^T q   (read before write)

which is ``S' = exp(g) S``, ``S_new = gamma S' + eta x (y - S'^T x)^T`` (rule 1) or
``gamma S' + eta x y^T`` (rule 1A). The state stays in registers for the whole
update: one read and one write of ``S``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def recurrent_step(
    S, q, x, v, eta, log_a, log_gate, S_new, o,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    REGRESSION: tl.constexpr, READ_AFTER: tl.constexpr, HAS_GATE: tl.constexpr,
):
    """Grid ``(cdiv(V, BV), B * H)``; ``S``, ``S_new`` ``[B, H, K, V]`` fp32,
    ``q``, ``x`` ``[B, H, K]``, ``v``, ``o`` ``[B, H, V]``, ``eta``, ``log_a``, ``log_gate`` ``[B, H]``."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    base = i_bh.to(tl.int64) * K * V
    b_S = tl.load(S + base + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
    b_q = tl.load(q + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_x = tl.load(x + i_bh * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_bh * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_eta = tl.load(eta + i_bh)
    b_a = tl.exp(tl.load(log_a + i_bh))
    d = b_eta * b_v
    if REGRESSION:
        kappa = b_eta
        if HAS_GATE:
            kappa = kappa * tl.exp(tl.load(log_gate + i_bh).to(tl.float32))
        d -= kappa * tl.sum(b_S * b_x[:, None], axis=0)
    b_new = b_a * b_S + b_x[:, None] * d[None, :]
    tl.store(S_new + base + o_k[:, None] * V + o_v[None, :], b_new, mask=m_kv)
    if READ_AFTER:
        b_o = tl.sum(b_new * b_q[:, None], axis=0)
    else:
        b_o = tl.sum(b_S * b_q[:, None], axis=0)
    tl.store(o + i_bh * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
