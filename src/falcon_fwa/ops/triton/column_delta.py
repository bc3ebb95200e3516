r"""Autograd function over the per-column regression chunk kernels (Falcon-2).

``column_delta_chunk(q, x, v, eta, kappa, log_a, S0, ...)`` computes, per head and value
column ``j``, ``S_t[:, j] = a_{t,j} S_{t-1}[:, j] + x_t (eta_{t,j} v_t[j] - kappa_{t,j}
x_t^T S_{t-1}[:, j])`` with ``a = exp(log_a)`` and reads ``o_t = S_t^T q_t`` (``read_after``)
or ``S_{t-1}^T q_t``. Falcon-2 is ``a = gamma exp(g)``, ``kappa = eta exp(g)`` (``eta``,
``gamma`` per column); gradients flow to ``q``, ``x``, ``v``, ``eta``, ``kappa``, ``log_a``
and ``S0``.

Forward: ``gram_fwd`` (the Gram of every block of ``SUB_CHUNK`` steps, shared by all
columns), ``chunk_cumsum`` (the log-prefixes), ``state_fwd`` (sequential: the per-column
solve for the write values ``D`` and the residual reads ``R``, block after block, and the
chunks' entry states), then the rule-2A ``output_fwd`` with values ``D``. Backward: the
rule-2A ``dv_bwd`` for the outputs' intra-chunk ``dD``, ``state_bwd`` (sequential: the
exit-state gradients and the adjoint ``z`` of ``D``), then the rule-2A ``dv_bwd`` /
``dqk_bwd`` of the two reads (outputs: queries ``q``; residual reads: queries ``x``, read
before the write, upstream ``dR = -kappa z``) and ``dlog_bwd``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import column_decay_kernels as cd
from . import column_delta_kernels as kern
from .chunk_index import ChunkLayout, chunk_layout
from .column_decay import _config as column_config
from .launch import SUPPORTED_CHUNK_SIZES, cdiv, dot_precision, empty_buffer, layout_args, next_power_of_2

__all__ = ["column_delta_chunk"]

SUB_CHUNK = 16  # steps per block of the per-column solves (and of the Gram of gram_fwd)
# The sequential kernels hold the whole key dimension (BK >= K) and BV value columns;
# they solve blocks of SUB_CHUNK steps whatever the chunk size. With BK = 128 the sm_90
# build of state_bwd spills at 4 warps (255 registers) and does not at 8.
SEQUENTIAL = dict(BV=32, num_warps=4, num_warps_wide=8)
GRAM = dict(BK=64, num_warps=4)


_empty = empty_buffer  # module-level, so tests can poison this module's buffers


def _sequential(K: int, V: int) -> dict:
    """Block sizes and warps of ``state_fwd`` / ``state_bwd``."""
    BK = max(16, next_power_of_2(K))
    return dict(BS=SUB_CHUNK, BK=BK, BV=min(SEQUENTIAL["BV"], max(16, next_power_of_2(V))),
                num_warps=SEQUENTIAL["num_warps_wide" if BK >= 128 else "num_warps"])


def _forward(q, x, v, eta, kappa, log_a, S0, layout: ChunkLayout, read_after: bool, want_final: bool):
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    G = _empty((B, T, H, SUB_CHUNK), q, torch.float32)
    kern.gram_fwd[(layout.num_chunks * (layout.BT // SUB_CHUNK), H)](
        x, G, chunk_indices=layout.chunk_indices, H=H, K=K, BS=SUB_CHUNK,
        BK=min(GRAM["BK"], max(16, next_power_of_2(K))), PRECISION=prec, num_warps=GRAM["num_warps"], **meta)
    u = _empty(eta.shape, eta)
    c = column_config("elementwise", K, V)
    cd.chunk_cumsum[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        log_a, u, chunk_indices=layout.chunk_indices, H=H, V=V, **c, **meta)
    h = _empty((layout.num_chunks, H, K, V), q)
    D, R = _empty(eta.shape, eta), _empty(eta.shape, eta)
    S_T = _empty((layout.N, H, K, V), q, torch.float32) if want_final else None
    c = _sequential(K, V)
    kern.state_fwd[(cdiv(V, c["BV"]), layout.N * H)](
        x, v, eta, kappa, u, G, h, D, R, S0, S_T, H=H, K=K, V=V, HAS_S0=S0 is not None, STORE_FINAL=want_final,
        PRECISION=prec, **c, **meta)
    ones = torch.ones_like(eta)
    o = _empty(v.shape, v)
    c = column_config("output_fwd", K, V)
    cd.output_fwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, D, ones, u, h, o, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, PRECISION=prec, **c, **meta)
    return o, G, u, h, D, R, S_T


def _read_grads(query, x, D, ones, u, h, dh, d_read, dq, dx, du, dw, dc, dD, layout, read_after, K, V, H):
    """The rule-2A backward of one read ``o = read(query; states with values D)``:
    ``dD`` (intra-chunk plus the exit-state term through ``dh``), the log-prefix terms
    ``du``, ``dw``, ``dc``, and ``dq`` (the queries), ``dx`` (the keys)."""
    prec, meta = dot_precision(query.dtype), layout_args(layout)
    c = column_config("dv_bwd", K, V)
    cd.dv_bwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        query, x, D, ones, u, h, dh, d_read, dD, _empty(D.shape, D), du, dw, dc, chunk_indices=layout.chunk_indices,
        H=H, K=K, V=V, READ_AFTER=read_after, PRECISION=prec, **c, **meta)
    if dq is not None:
        c = column_config("dqk_bwd", K, V)
        cd.dqk_bwd[(cdiv(K, c["BK"]), layout.num_chunks, H)](
            query, x, D, ones, u, h, dh, d_read, dq, dx, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
            READ_AFTER=read_after, PRECISION=prec, **c, **meta)


def _backward(q, x, v, eta, kappa, S0, G, u, h, D, R, do, dS_T, layout: ChunkLayout, read_after: bool):
    H, K = q.shape[2:]
    V = v.shape[-1]
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    ones = torch.ones_like(eta)
    no_dh = torch.zeros_like(h)
    f32 = torch.float32
    # 1. the outputs' intra-chunk gradient of D (no exit-state term) and their log-prefix terms
    dD_o = _empty(eta.shape, eta)
    du_o = _empty(eta.shape, eta)
    dw_o = None if read_after else _empty(eta.shape, eta)
    _read_grads(q, x, D, ones, u, h, no_dh, do, None, None, du_o, dw_o, _empty(eta.shape, eta), dD_o, layout,
                read_after, K, V, H)
    # 2. reverse over chunks: exit-state gradients and the adjoint z of D
    dh = _empty(h.shape, h)
    z = _empty(eta.shape, eta)
    dS0 = _empty(S0.shape, S0, f32) if S0 is not None else None
    c = _sequential(K, V)
    kern.state_bwd[(cdiv(V, c["BV"]), layout.N * H)](
        q, x, kappa, u, G, do, dD_o, dh, z, dS_T, dS0, H=H, K=K, V=V, HAS_DS_FINAL=dS_T is not None,
        STORE_DS0=dS0 is not None, READ_AFTER=read_after, PRECISION=prec, **c, **meta)
    del dD_o  # read by state_bwd only: its memory serves the buffers below (peak memory)
    d_read = -kappa * z  # upstream gradient of the residual reads R
    # 3. the residual reads (queries x, read before the write) with the exit-state terms through dh
    du_r, dw_r, dc = (_empty(eta.shape, eta) for _ in range(3))
    dx_query, dx_key = _empty(x.shape, x, f32), _empty(x.shape, x, f32)
    _read_grads(x, x, D, ones, u, h, dh, d_read, dx_query, dx_key, du_r, dw_r, dc, _empty(eta.shape, eta), layout,
                False, K, V, H)
    del dh, d_read
    # 4. the outputs' q and x gradients (queries q; the exit-state term is counted in step 3)
    dq, dx_out = _empty(q.shape, q, f32), _empty(x.shape, x, f32)
    c = column_config("dqk_bwd", K, V)
    cd.dqk_bwd[(cdiv(K, c["BK"]), layout.num_chunks, H)](
        q, x, D, ones, u, h, no_dh, do, dq, dx_out, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, PRECISION=prec, **c, **meta)
    # 5. the log carries from the per-step terms of both reads
    du = du_o + du_r
    dw = dw_r if dw_o is None else dw_o + dw_r
    del du_o, du_r, dw_o, dw_r
    dlog_a = _empty(eta.shape, eta)
    c = column_config("elementwise", K, V)
    cd.dlog_bwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        du, dw, dc, dlog_a, chunk_indices=layout.chunk_indices, H=H, V=V, READ_AFTER=False, **c, **meta)
    del du, dw, dc
    dx = (dx_query + dx_key + dx_out).to(x.dtype)
    del dx_query, dx_key, dx_out
    dv = (eta * z).to(v.dtype)
    deta = v.float() * z
    dkappa = -R * z
    return dq.to(q.dtype), dx, dv, deta, dkappa, dlog_a, dS0


class _ColumnDeltaChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, kappa, log_a, S0, cu_seqlens, chunk_size, read_after, want_final):
        B, T = q.shape[:2]
        layout = chunk_layout(B, T, chunk_size, cu_seqlens)
        o, G, u, h, D, R, S_T = _forward(q, x, v, eta, kappa, log_a, S0, layout, read_after, want_final)
        ctx.save_for_backward(q, x, v, eta, kappa, S0, G, u, h, D, R)
        ctx.layout, ctx.read_after = layout, read_after
        return o, S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, x, v, eta, kappa, S0, G, u, h, D, R = ctx.saved_tensors
        grads = _backward(q, x, v, eta, kappa, S0, G, u, h, D, R, do.contiguous(),
                          None if dS_T is None else dS_T.contiguous(), ctx.layout, ctx.read_after)
        return (*grads, None, None, None, None)


def column_delta_chunk(
    q: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    kappa: torch.Tensor,
    log_a: torch.Tensor,
    S0: Optional[torch.Tensor],
    *,
    read_after: bool,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunk-parallel regression (delta) scan with one step size and decay per value column.

    ``q``, ``x`` ``[B, T, H, K]`` (``K <= 128``) and ``v`` ``[B, T, H, V]`` of one dtype
    (bf16, fp16 or fp32); ``eta``, ``kappa``, ``log_a`` ``[B, T, H, V]`` fp32 (``log_a <= 0``);
    ``S0`` ``[N, H, K, V]`` fp32 or ``None`` (``N = B``, or the number of sequences packed by
    ``cu_seqlens`` with ``B = 1``). Returns ``o`` ``[B, T, H, V]`` in ``v``'s dtype and the
    final states ``[N, H, K, V]`` fp32 (or ``None``).
    """
    if chunk_size not in SUPPORTED_CHUNK_SIZES or chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES} for the Triton kernels, got {chunk_size}")
    q, x, v = (t.contiguous() for t in (q, x, v))
    eta, kappa, log_a = (t.float().contiguous() for t in (eta, kappa, log_a))
    S0 = None if S0 is None else S0.float().contiguous()
    return _ColumnDeltaChunk.apply(q, x, v, eta, kappa, log_a, S0, cu_seqlens, chunk_size, read_after,
                                   output_final_state)
