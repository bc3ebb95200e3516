r"""Autograd function over the per-column decay chunk kernels (Falcon-2A).

``column_decay_chunk(q, x, v, eta, log_a, S0, ...)`` computes, per head and value
column ``j``, the recurrence ``S_t[:, j] = a_{t,j} S_{t-1}[:, j] + eta_{t,j} x_t v_t[j]``
with ``a = exp(log_a)`` and reads ``o_t = S_t^T q_t`` (``read_after``) or
``S_{t-1}^T q_t``; gradients flow to ``q``, ``x``, ``v``, ``eta``, ``log_a`` and ``S0``.
Falcon-2A's ``eta`` and ``log_a`` come from ``step_sizes`` (one fused kernel each way).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import column_decay_kernels as kern
from .chunk_index import ChunkLayout, chunk_layout
from .launch import SUPPORTED_CHUNK_SIZES, cdiv, dot_precision, empty_buffer, launch_config, layout_args

__all__ = ["column_decay_chunk"]

# Per kernel: key/value block sizes (capped by the head dims), warps and pipeline stages.
# output_fwd / dv_bwd run one program per chunk and value block, dqk_bwd one per chunk and
# key block (its loops over the value blocks build D once per key block).
# On an H200 with Triton 3.6, 32 value columns miscompiled at K = V = 64 (a single key block):
# output_fwd gave wrong outputs at 8 warps and an illegal memory access at 4
# (benchmarks/results/h200_rule2a_pick_42d45d2.txt), dv_bwd wrong log-decay gradients for rule 2
# (h200_rule2_pick_e371101.txt). The settings below passed those checks, and took at the benchmark
# shape (B=8, T=2048, H=16, K=V=128, bf16) 0.596 ms (output_fwd), 0.96 ms (dv_bwd) and 0.62 ms
# (dqk_bwd), against 0.777, 1.18 and 0.79 ms at 32 columns.
LAUNCH = {
    "state_fwd": dict(BK=64, BV=32, num_warps=4, num_stages=2),
    "state_bwd": dict(BK=64, BV=32, num_warps=4, num_stages=2),
    "output_fwd": dict(BK=64, BV=64, num_warps=4, num_stages=2),
    "dv_bwd": dict(BK=64, BV=64, num_warps=4, num_stages=2),
    "dqk_bwd": dict(BK=128, BV=64, num_warps=8, num_stages=1),
    "elementwise": dict(BV=64, num_warps=4),  # chunk_cumsum
}


def _config(name: str, K: int, V: int) -> dict:
    return launch_config(name, K, V, LAUNCH)


_empty = empty_buffer  # module-level, so tests can poison this module's buffers


def _forward(q, x, v, eta, log_a, S0, layout: ChunkLayout, read_after: bool, want_final: bool):
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    u = _empty(eta.shape, eta)
    c = _config("elementwise", K, V)
    kern.chunk_cumsum[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        log_a, u, chunk_indices=layout.chunk_indices, H=H, V=V, **c, **meta)
    h = _empty((layout.num_chunks, H, K, V), q)
    S_T = _empty((layout.N, H, K, V), q, torch.float32) if want_final else None
    c = _config("state_fwd", K, V)
    kern.state_fwd[(cdiv(K, c["BK"]), cdiv(V, c["BV"]), layout.N * H)](
        x, v, eta, u, h, S0, S_T, H=H, K=K, V=V, HAS_S0=S0 is not None, STORE_FINAL=want_final,
        PRECISION=prec, **c, **meta)
    o = _empty(v.shape, v)
    c = _config("output_fwd", K, V)
    kern.output_fwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, v, eta, u, h, o, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=True, PRECISION=prec, **c, **meta)
    return o, u, h, S_T


def _backward(q, x, v, eta, u, h, S0, o, do, dS_T, layout: ChunkLayout, read_after: bool):
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    dh = _empty((layout.num_chunks, H, K, V), q)
    dS0 = _empty(S0.shape, S0, torch.float32) if S0 is not None else None
    c = _config("state_bwd", K, V)
    kern.state_bwd[(cdiv(K, c["BK"]), cdiv(V, c["BV"]), layout.N * H)](
        q, do, u, dh, dS_T, dS0, H=H, K=K, V=V, HAS_DS_FINAL=dS_T is not None, STORE_DS0=dS0 is not None,
        READ_AFTER=read_after, PRECISION=prec, **c, **meta)
    dv, deta, dlog_a = _empty(v.shape, v), _empty(eta.shape, eta), _empty(eta.shape, eta)
    c = _config("dv_bwd", K, V)
    kern.dv_bwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, v, eta, u, h, dh, do, o, dv, deta, dlog_a, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=True, HAS_DH=True, STORE_DV=True, STORE_DETA=True, STORE_DLOG=True,
        PRECISION=prec, **c, **meta)
    dq, dx = _empty(q.shape, q), _empty(x.shape, x)
    c = _config("dqk_bwd", K, V)
    kern.dqk_bwd[(cdiv(K, c["BK"]), layout.num_chunks, H)](
        q, x, v, eta, u, h, dh, do, dq, dx, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, PRECISION=prec, **c, **meta)
    return dq, dx, dv, deta, dlog_a, dS0


class _ColumnDecayChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, log_a, S0, cu_seqlens, chunk_size, read_after, want_final):
        B, T = q.shape[:2]
        layout = chunk_layout(B, T, chunk_size, cu_seqlens)
        o, u, h, S_T = _forward(q, x, v, eta, log_a, S0, layout, read_after, want_final)
        ctx.save_for_backward(q, x, v, eta, u, h, S0, o)
        ctx.layout, ctx.read_after = layout, read_after
        return o, S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, x, v, eta, u, h, S0, o = ctx.saved_tensors
        dq, dx, dv, deta, dlog_a, dS0 = _backward(
            q, x, v, eta, u, h, S0, o, do.contiguous(), None if dS_T is None else dS_T.contiguous(),
            ctx.layout, ctx.read_after)
        return dq, dx, dv, deta, dlog_a, dS0, None, None, None, None


def column_decay_chunk(
    q: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    log_a: torch.Tensor,
    S0: Optional[torch.Tensor],
    *,
    read_after: bool,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunk-parallel fast-weight scan with one decay per value column.

    ``q``, ``x`` ``[B, T, H, K]`` and ``v`` ``[B, T, H, V]`` of one dtype (bf16, fp16
    or fp32); ``eta``, ``log_a`` ``[B, T, H, V]`` fp32 (``log_a <= 0``); ``S0``
    ``[N, H, K, V]`` fp32 or ``None`` (``N = B``, or the number of sequences packed
    by ``cu_seqlens`` with ``B = 1``). Returns ``o`` ``[B, T, H, V]`` in ``v``'s dtype
    and the final states ``[N, H, K, V]`` fp32 (or ``None``).
    """
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES} for the Triton kernels, got {chunk_size}")
    q, x, v = (t.contiguous() for t in (q, x, v))
    eta, log_a = (t.float().contiguous() for t in (eta, log_a))
    S0 = None if S0 is None else S0.float().contiguous()
    return _ColumnDecayChunk.apply(q, x, v, eta, log_a, S0, cu_seqlens, chunk_size, read_after, output_final_state)
