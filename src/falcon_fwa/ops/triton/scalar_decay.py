r"""Autograd function over the scalar-decay chunk kernels (Falcon-1A).

``scalar_decay_chunk(q, x, v, eta, log_a, S0, ...)`` computes, per head, the
recurrence ``S_t = a_t S_{t-1} + eta_t x_t v_t^T`` with ``a_t = exp(log_a_t)`` and
reads ``o_t = S_t^T q_t`` (``read_after``) or ``S_{t-1}^T q_t``; gradients flow to
``q``, ``x``, ``v``, ``eta``, ``log_a`` and ``S0``.

``scan_forward`` / ``scan_backward`` also read delayed pairs in place (``delayed``): the
scan's row ``t`` is then row ``t`` of ``[x_pre | x]`` and ``[v_pre | v]`` along time, which
is how rule 3A (``sliding``) feeds its pairs ``W - 1`` steps late without a shifted copy.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import scalar_decay_kernels as kern
from .chunk_index import ChunkLayout, chunk_layout
from .launch import SUPPORTED_CHUNK_SIZES, cdiv, dot_precision, launch_config, layout_args, next_power_of_2

__all__ = ["scalar_decay_chunk", "scan_forward", "scan_backward"]

Delayed = Optional[Tuple[torch.Tensor, torch.Tensor]]


def _delay_args(x: torch.Tensor, v: torch.Tensor, delayed: Delayed) -> dict:
    """Kernel arguments of the delayed read: ``delayed = (x_pre, v_pre)``, prefixes
    ``[N, m_x, H, K]`` and ``[N, m_v, H, V]`` (``m = 0`` allowed), or ``None`` (rows read as they are)."""
    if delayed is None:
        return {}
    x_pre, v_pre = delayed
    return dict(delayed=((x_pre if x_pre.numel() else x, x_pre.shape[1]),
                         (v_pre if v_pre.numel() else v, v_pre.shape[1])))


def scan_forward(q, x, v, eta, log_a, S0, layout: ChunkLayout, read_after: bool, want_final: bool,
                 delayed: Delayed = None):
    """Forward kernels (state pass, outputs): ``o``, the chunk entry states ``h`` and the final states.
    With ``delayed = (x_pre, v_pre)`` the pairs are rows ``0 .. T-1`` of ``[x_pre | x]`` and
    ``[v_pre | v]`` (read in place)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec = dot_precision(q.dtype)
    delay = _delay_args(x, v, delayed)
    h = q.new_empty(layout.num_chunks, H, K, V)
    S_T = q.new_empty(layout.N, H, K, V, dtype=torch.float32) if want_final else None
    c = launch_config("state_fwd", K, V)
    kern.state_fwd[(cdiv(K, c["BK"]), cdiv(V, c["BV"]), layout.N * H)](
        x, v, eta, log_a, h, S0, S_T, H=H, K=K, V=V, HAS_S0=S0 is not None,
        STORE_FINAL=want_final, PRECISION=prec, **c, **layout_args(layout), **delay)
    o = torch.empty_like(v)
    c = launch_config("output_fwd", K, V)
    kern.output_fwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, v, eta, log_a, h, o, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=True, PRECISION=prec, **c, **layout_args(layout), **delay)
    return o, h, S_T


def scan_backward(q, x, v, eta, log_a, h, S0, do, dS_T, layout: ChunkLayout, read_after: bool,
                  delayed: Delayed = None):
    """Backward kernels: ``dq, dx, dv, deta, dlog_a, dS0`` from ``do`` and ``dS_T`` (``h`` from the
    forward). With ``delayed`` (as in ``scan_forward``) ``dx`` and ``dv`` ``[B, T, ...]`` are the
    gradients of the delayed rows ``0 .. T-1`` of ``[x_pre | x]`` and ``[v_pre | v]``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec = dot_precision(q.dtype)
    meta = layout_args(layout)
    delay = _delay_args(x, v, delayed)
    dh = q.new_empty(layout.num_chunks, H, K, V)
    dS0 = torch.empty_like(S0, dtype=torch.float32) if S0 is not None else None
    c = launch_config("state_bwd", K, V)
    kern.state_bwd[(cdiv(K, c["BK"]), cdiv(V, c["BV"]), layout.N * H)](
        q, do, eta, log_a, dh, dS_T, dS0, H=H, K=K, V=V, HAS_DS_FINAL=dS_T is not None,
        STORE_DS0=dS0 is not None, READ_AFTER=read_after, HAS_ETA=True, PRECISION=prec, **c, **meta)
    dv = torch.empty_like(v)
    c = launch_config("dv_bwd", K, V)
    kern.dv_bwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, do, eta, log_a, dh, dv, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=True, PRECISION=prec, **c, **meta, **delay)
    dq, dx = torch.empty_like(q), torch.empty_like(x)
    rows = B * T
    c = launch_config("dqk_bwd", K, V)
    NK = cdiv(K, c["BK"])
    parts = q.new_empty(3, NK, rows, H, dtype=torch.float32)
    kern.dqk_bwd[(NK, layout.num_chunks, H)](
        q, x, v, do, eta, log_a, h, dh, dq, dx, parts[0], parts[1], parts[2],
        chunk_indices=layout.chunk_indices, n_rows=rows, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=True, PRECISION=prec, **c, **meta, **delay)
    deta, dlog_a = torch.empty_like(eta), torch.empty_like(log_a)
    kern.dlog_bwd[(layout.num_chunks,)](
        parts[0], parts[1], parts[2], None, None, deta, dlog_a, chunk_indices=layout.chunk_indices, n_rows=rows,
        H=H, BH=next_power_of_2(H), NK=NK, HAS_ETA=True, HAS_EXTRA=False, HAS_DKAPPA=False, **meta)
    return dq, dx, dv, deta, dlog_a, dS0


class _ScalarDecayChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, log_a, S0, cu_seqlens, chunk_size, read_after, want_final):
        B, T = q.shape[:2]
        layout = chunk_layout(B, T, chunk_size, cu_seqlens)
        o, h, S_T = scan_forward(q, x, v, eta, log_a, S0, layout, read_after, want_final)
        ctx.save_for_backward(q, x, v, eta, log_a, h, S0)
        ctx.layout, ctx.read_after = layout, read_after
        return o, S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, x, v, eta, log_a, h, S0 = ctx.saved_tensors
        dq, dx, dv, deta, dlog_a, dS0 = scan_backward(
            q, x, v, eta, log_a, h, S0, do.contiguous(), None if dS_T is None else dS_T.contiguous(),
            ctx.layout, ctx.read_after)
        return dq, dx, dv, deta, dlog_a, dS0, None, None, None, None


def scalar_decay_chunk(
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
    """Chunk-parallel scalar-decay fast-weight scan.

    ``q``, ``x`` ``[B, T, H, K]`` and ``v`` ``[B, T, H, V]`` of one dtype (bf16, fp16
    or fp32); ``eta``, ``log_a`` ``[B, T, H]`` fp32 (``log_a <= 0``); ``S0``
    ``[N, H, K, V]`` fp32 or ``None`` (``N = B``, or the number of sequences packed
    by ``cu_seqlens`` with ``B = 1``). Returns ``o`` ``[B, T, H, V]`` in ``v``'s dtype
    and the final states ``[N, H, K, V]`` fp32 (or ``None``).
    """
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES} for the Triton kernels, got {chunk_size}")
    q, x, v = (t.contiguous() for t in (q, x, v))
    eta, log_a = (t.float().contiguous() for t in (eta, log_a))
    S0 = None if S0 is None else S0.float().contiguous()
    return _ScalarDecayChunk.apply(q, x, v, eta, log_a, S0, cu_seqlens, chunk_size, read_after, output_final_state)
