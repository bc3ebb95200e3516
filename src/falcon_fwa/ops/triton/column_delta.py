r"""Autograd function over the per-column regression chunk kernels (Falcon-2).

``column_delta_chunk(q, x, v, eta, log_gate, log_a, S0, ...)`` computes, per head and value
column ``j``, ``S_t[:, j] = a_{t,j} S_{t-1}[:, j] + x_t (eta_{t,j} v_t[j] - kappa_{t,j}
x_t^T S_{t-1}[:, j])`` with ``a = exp(log_a)``, ``kappa_{t,j} = eta_{t,j} exp(g_t)`` (``g =
log_gate``, one per row; ``kappa = eta`` without it), and reads ``o_t = S_t^T q_t``
(``read_after``) or ``S_{t-1}^T q_t``. Falcon-2 is ``a = gamma exp(g)`` (``eta``, ``gamma``
per column); gradients flow to ``q``, ``x``, ``v``, ``eta``, ``log_gate``, ``log_a`` and
``S0``.

Forward: ``gram_fwd`` (the Gram of every block of ``SUB_CHUNK`` steps, shared by all
columns), ``chunk_cumsum`` (the log-prefixes), ``state_fwd`` (sequential: the per-column
solve for the write values ``D`` and the residual reads ``R``, block after block, and the
chunks' entry states), then the rule-2A ``output_fwd`` with values ``D``. Backward: the
rule-2A ``dv_bwd`` for the outputs' intra-chunk ``dD``, ``state_bwd`` (sequential: the
exit-state gradients, the adjoint ``z`` of ``D`` and the whole ``d log a``, from the
reads' values and adjoints: the saved outputs ``o``, the residual reads ``R``, ``z`` and
the exit states), then ``dqk_bwd_two_reads``: the rule-2A ``dqk_bwd`` of both reads
(outputs: queries ``q``; residual reads: queries ``x``, read before the write, upstream
``dR = -kappa z = -exp(g) dv``, formed from the values' gradient) in one launch, ``dq`` and
the whole ``dx`` stored in the inputs' dtype.

Kept for the backward: the fp32 ``u``, ``D``, ``R`` and outputs, the chunk states and the
Grams. ``eta`` too, unless the caller passes the factors the step-size kernel formed it from
(``beta`` and ``eta_scale``, ``eta = beta * eta_scale``), which the backward multiplies out
again in ``state_bwd``: 128 MiB less at B=8, T=2048, H=16, V=128.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import column_decay_kernels as cd
from . import column_delta_kernels as kern
from .chunk_index import ChunkLayout, chunk_layout
from .column_decay import _config as column_config
from .launch import (SUPPORTED_CHUNK_SIZES, cdiv, dot_precision, empty_buffer, launch_config, layout_args,
                     next_power_of_2)

__all__ = ["column_delta_chunk"]

SUB_CHUNK = 16  # steps per block of the per-column solves (and of the Gram of gram_fwd)
# The sequential kernels hold the whole key dimension (BK >= K) and BV value columns; they
# solve blocks of SUB_CHUNK steps whatever the chunk size. One entry per kernel (BV, num_warps,
# num_stages). On the H200 at K = V = 128, bf16 fwd+bwd of the op, since the tiles are [BV, BS]
# (9a41bce; earlier layouts and settings: benchmarks/results/h200_rule2_*sweep*):
#   B=8 T=2048 H=16: 64 columns, 4 warps, 3 stages: state_fwd 0.80 ms, state_bwd 1.34 (op 5.00);
#     16 columns, one warp: 0.93 and 1.43; 32 columns, 2 warps: 1.20 and 1.78.
#   B=2 T=8192 H=16 (256 programs of 16 columns for 132 SMs): 16 columns, 2 warps: state_fwd 2.51,
#     state_bwd 4.16 (op 9.53); 64 columns, 4 warps: 3.02 and 4.75.
# (benchmarks/results/h200_rule2_transposed_sweep.md). A kernel takes SEQUENTIAL_SMALL_GRID's setting
# where its 16-column grid has fewer than WIDE_GRID programs (B=8 H=16 V=128: 1,024; B=2: 256).
SEQUENTIAL = {"state_fwd": dict(BV=64, num_warps=4, num_stages=3), "state_bwd": dict(BV=64, num_warps=4, num_stages=3)}
SEQUENTIAL_SMALL_GRID = {"state_fwd": dict(BV=16, num_warps=2, num_stages=2),
                         "state_bwd": dict(BV=16, num_warps=2, num_stages=2)}
WIDE_GRID = 1024
GRAM = dict(BK=64, num_warps=4)
# ``dqk_bwd_two_reads``, one program per chunk and key block, looping over the value blocks: the
# setting of rule 2A's ``dqk_bwd`` (``column_decay.LAUNCH``), where it started; its own entry so that
# ``benchmarks/sweep_launch.py --table column_delta.LAUNCH`` sweeps it alone.
LAUNCH = {"dqk_bwd_two_reads": dict(BK=128, BV=64, num_warps=8, num_stages=1)}


_empty = empty_buffer  # module-level, so tests can poison this module's buffers


def _sequential(kernel: str, K: int, V: int, sequences_heads: int) -> dict:
    """Block sizes, warps and stages of ``state_fwd`` / ``state_bwd`` for ``sequences_heads``
    (sequences x heads) programs per value block: ``SEQUENTIAL[kernel]``, or
    ``SEQUENTIAL_SMALL_GRID[kernel]`` where its blocks give fewer than ``WIDE_GRID`` programs."""
    c, small = SEQUENTIAL[kernel], SEQUENTIAL_SMALL_GRID.get(kernel)
    if small is not None and sequences_heads * cdiv(V, small["BV"]) < WIDE_GRID:
        c = small
    BK = max(16, next_power_of_2(K))
    # the fp32 state tile [BK, BV] stays at most 128 x 64 (BK = 256: 32 columns)
    BV = min(c["BV"], max(16, next_power_of_2(V)), max(16, 8192 // BK))
    return dict(BS=SUB_CHUNK, BK=BK, BV=BV, num_warps=c["num_warps"], num_stages=c["num_stages"])


def _forward(q, x, v, eta, gate, log_a, S0, layout: ChunkLayout, read_after: bool, want_final: bool):
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
    h, D, R, S_T = _states(q, x, v, eta, gate, u, G, S0, layout, want_final)
    o = _outputs(q, x, D, u, h, layout, read_after)
    return o, G, u, h, D, R, S_T


def _states(q, x, v, eta, gate, u, G, S0, layout: ChunkLayout, want_final: bool):
    """``state_fwd``: the chunks' entry states ``h`` ``[num_chunks, H, K, V]`` (``q``'s dtype), the
    write values ``D`` and residual reads ``R`` ``[B, T, H, V]`` fp32, and the final states (or ``None``).
    ``D`` in fp32: the backward's d log a sums the outputs' ``dO O`` against ``D z``, and with ``D``
    rounded to bf16 in the outputs the log-gate gradient went over the 1e-2 bound (1.28e-2, bf16,
    chunk 128, ``test_cuda_ragged[128-64-before-128]``)."""
    H, K = q.shape[2:]
    V = v.shape[-1]
    h = _empty((layout.num_chunks, H, K, V), q)
    D, R = _empty(eta.shape, eta), _empty(eta.shape, eta)
    S_T = _empty((layout.N, H, K, V), q, torch.float32) if want_final else None
    c = _sequential("state_fwd", K, V, layout.N * H)
    kern.state_fwd[(cdiv(V, c["BV"]), layout.N * H)](
        x, v, eta, gate, u, G, h, D, R, S0, S_T, H=H, K=K, V=V, HAS_S0=S0 is not None, STORE_FINAL=want_final,
        HAS_GATE=gate is not None, PRECISION=dot_precision(q.dtype), **c, **layout_args(layout))
    return h, D, R, S_T


def _outputs(q, x, D, u, h, layout: ChunkLayout, read_after: bool):
    """The outputs ``[B, T, H, V]`` in fp32, the rule-2A ``output_fwd`` with values ``D``. fp32: the
    backward's d log a sums dO * O over a chunk, where bf16 rounding of O shows (with bf16 O the
    log-gate gradient went over the 1e-2 bound at chunk 128)."""
    H, K = q.shape[2:]
    V = D.shape[-1]
    o = _empty(D.shape, D, torch.float32)
    c = column_config("output_fwd", K, V)
    cd.output_fwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, D, None, u, h, o, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=False, PRECISION=dot_precision(q.dtype), **c, **layout_args(layout))
    return o


def _outputs_dD(q, x, D, u, do, dD, layout, read_after):
    """The rule-2A ``dv_bwd`` of the outputs (queries ``q``, values ``D``), for their
    intra-chunk gradient of ``D`` alone (no exit-state term, no ``d log a``) into ``dD``."""
    H, K = q.shape[2:]
    V = D.shape[-1]
    c = column_config("dv_bwd", K, V)
    cd.dv_bwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, D, None, u, None, None, do, None, dD, None, None, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=False, HAS_DH=False, STORE_DV=True, STORE_DETA=False, STORE_DLOG=False,
        PRECISION=dot_precision(q.dtype), **c, **layout_args(layout))


def _dqk(q, x, D, u, h, dh, do, dv, gate, layout, read_after):
    """``dqk_bwd_two_reads``: ``dq`` (the outputs' queries) and the whole ``dx`` (the
    residual reads' queries, whose upstream gradient ``-exp(g) dv`` it forms from ``dv``, the
    keys of both reads and the exit-state term through ``dh``), in ``q``'s and ``x``'s dtype."""
    H, K = q.shape[2:]
    V = D.shape[-1]
    dq, dx = _empty(q.shape, q), _empty(x.shape, x)
    c = launch_config("dqk_bwd_two_reads", K, V, LAUNCH)
    kern.dqk_bwd_two_reads[(cdiv(K, c["BK"]), layout.num_chunks, H)](
        q, x, D, u, h, dh, do, dv, gate, dq, dx, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_GATE=gate is not None, PRECISION=dot_precision(q.dtype), **c, **layout_args(layout))
    return dq, dx


def _backward(q, x, v, eta, gate, factors, S0, G, u, h, D, R, o, S_T, do, dS_T, layout: ChunkLayout,
              read_after: bool, o_private: bool):
    """``gate``: ``exp(log_gate)`` ``[B, T, H]`` fp32 or ``None`` (``kappa`` is ``eta``);
    ``factors``: ``(beta, eta_scale)`` when ``eta`` is not kept (``eta`` is then ``None``).
    ``o_private``: the fp32 outputs ``o`` are not the tensor returned to the caller, and ``deta``
    is written over them as ``state_bwd`` reads them. ``d log a`` is written over the residual
    reads ``R`` the same way (no other kernel reads them). ``S_T``: the final states (read with
    ``dS_T``). Returns the gradients of ``q``, ``x``, ``v``, ``eta``, ``log_gate`` (``None``
    without a gate), ``log_a`` and ``S0``."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    f32 = torch.float32
    # 1. the outputs' intra-chunk gradient of D (no exit-state term)
    dD_o = _empty(u.shape, u)
    _outputs_dD(q, x, D, u, do, dD_o, layout, read_after)
    # 2. reverse over chunks: exit-state gradients and the adjoint z of D, and from z: dv, deta, the gate's
    # partial sums and the whole d log a
    dh = _empty(h.shape, h)
    deta = o if o_private else _empty(u.shape, u)
    dv, dlog_a = _empty(v.shape, v), R
    dS0 = _empty(S0.shape, S0, f32) if S0 is not None else None
    c = _sequential("state_bwd", K, V, layout.N * H)
    n_vb = cdiv(V, c["BV"])
    dgate = _empty((n_vb, B * T * H), u) if gate is not None else None
    beta, scale = factors if factors is not None else (None, None)
    kern.state_bwd[(n_vb, layout.N * H)](
        q, x, v, eta, beta, scale, gate, R, u, G, do, o, dD_o, h, S_T, dh, dv, deta, dgate, dlog_a, dS_T, dS0,
        n_rows=B * T * H, H=H, K=K, V=V, HAS_DS_FINAL=dS_T is not None, STORE_DS0=dS0 is not None,
        READ_AFTER=read_after, HAS_GATE=gate is not None, ETA_FROM_BETA=factors is not None, PRECISION=prec,
        **c, **meta)
    del dD_o  # read by state_bwd alone: its fp32 buffer is free for dq and dx
    # 3. q and x gradients of both reads in one launch (outputs: queries q; residual reads: queries x,
    # read before the write, with the exit-state term)
    dq, dx = _dqk(q, x, D, u, h, dh, do, dv, gate, layout, read_after)
    dlog_gate = None if gate is None else dgate.sum(0).view(B, T, H)
    return dq, dx, dv, deta, dlog_gate, dlog_a, dS0


class _ColumnDeltaChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, log_gate, log_a, S0, beta, eta_scale, cu_seqlens, chunk_size, read_after,
                want_final):
        B, T = q.shape[:2]
        layout = chunk_layout(B, T, chunk_size, cu_seqlens)
        gate = None if log_gate is None else torch.exp(log_gate.float()).contiguous()
        o, G, u, h, D, R, S_T = _forward(q, x, v, eta, gate, log_a, S0, layout, read_after, want_final)
        # eta is kept only when it cannot be formed again from its factors
        ctx.save_for_backward(q, x, v, None if beta is not None else eta, gate, beta, eta_scale, S0, G, u, h, D, R,
                              o, S_T)
        ctx.layout, ctx.read_after, ctx.gate_dtype = layout, read_after, None if log_gate is None else log_gate.dtype
        # 16-bit values: the caller gets a rounded copy of the fp32 outputs, which the backward may overwrite
        ctx.o_private, ctx.spent = v.dtype != torch.float32, False
        return o.to(v.dtype), S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, x, v, eta, gate, beta, eta_scale, S0, G, u, h, D, R, o, S_T = ctx.saved_tensors
        factors = None if beta is None else (beta, eta_scale)
        if ctx.spent:  # a second backward (retain_graph=True): the first wrote d log a over R (and deta over o)
            eta_now = eta if factors is None else _eta_of(beta, eta_scale)
            h, D, R, _ = _states(q, x, v, eta_now, gate, u, G, S0, ctx.layout, False)
            if ctx.o_private:
                o = _outputs(q, x, D, u, h, ctx.layout, ctx.read_after)
        ctx.spent = True
        dq, dx, dv, deta, dlog_gate, dlog_a, dS0 = _backward(
            q, x, v, eta, gate, factors, S0, G, u, h, D, R, o, S_T, do.contiguous(),
            None if dS_T is None else dS_T.contiguous(), ctx.layout, ctx.read_after, ctx.o_private)
        if dlog_gate is not None:
            dlog_gate = dlog_gate.to(ctx.gate_dtype)
        return dq, dx, dv, deta, dlog_gate, dlog_a, dS0, None, None, None, None, None, None


def _eta_of(beta: torch.Tensor, eta_scale: torch.Tensor) -> torch.Tensor:
    """``eta = beta * eta_scale`` per value column, 0 where the row's scale is 0: the product the
    step-size kernel and ``state_bwd`` form, to the bit (one fp32 multiplication)."""
    scale = eta_scale[..., None]
    return torch.where(scale != 0, beta.float() * scale, torch.zeros((), device=beta.device))


def column_delta_chunk(
    q: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    log_a: torch.Tensor,
    S0: Optional[torch.Tensor],
    *,
    read_after: bool,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    beta: Optional[torch.Tensor] = None,
    eta_scale: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunk-parallel regression (delta) scan with one step size and decay per value column.

    ``q``, ``x`` ``[B, T, H, K]`` (``K <= 256``) and ``v`` ``[B, T, H, V]`` of one dtype
    (bf16, fp16 or fp32); ``eta``, ``log_a`` ``[B, T, H, V]`` fp32 (``log_a <= 0``);
    ``log_gate`` ``[B, T, H]`` or ``None``: the residual gain ``kappa = eta exp(log_gate)``
    (``kappa = eta`` without it); ``S0`` ``[N, H, K, V]`` fp32 or ``None`` (``N = B``, or the
    number of sequences packed by ``cu_seqlens`` with ``B = 1``). Returns ``o`` ``[B, T, H, V]``
    in ``v``'s dtype and the final states ``[N, H, K, V]`` fp32 (or ``None``).

    ``beta`` ``[B, T, H, V]`` and ``eta_scale`` ``[B, T, H]`` fp32 (both or neither): the
    factors ``eta`` was formed from, ``eta = beta * eta_scale`` where ``eta_scale != 0`` and 0
    elsewhere, to the bit (``step_sizes.feature_step_sizes`` returns such a scale). The backward
    then forms ``eta`` from them instead of keeping it. They receive no gradient: ``eta``'s
    reaches them through the step sizes' own backward.

    With 16-bit values the backward writes ``deta`` over the fp32 outputs it kept, and in every
    dtype ``d log a`` over the residual reads; a second backward through the same graph
    (``retain_graph=True``) recomputes them first.
    """
    if chunk_size not in SUPPORTED_CHUNK_SIZES or chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES} for the Triton kernels, got {chunk_size}")
    if (beta is None) != (eta_scale is None):
        raise ValueError("beta and eta_scale go together (the factors of eta = beta * eta_scale), "
                         f"got beta={'None' if beta is None else 'a tensor'} and "
                         f"eta_scale={'None' if eta_scale is None else 'a tensor'}")
    if beta is not None:
        want = (*eta.shape[:-1],)
        if tuple(beta.shape) != tuple(eta.shape) or tuple(eta_scale.shape) != want:
            raise ValueError(f"beta must have eta's shape {tuple(eta.shape)} and eta_scale {want}, got "
                             f"{tuple(beta.shape)} and {tuple(eta_scale.shape)}")
        beta, eta_scale = beta.detach().contiguous(), eta_scale.detach().float().contiguous()
    q, x, v = (t.contiguous() for t in (q, x, v))
    eta, log_a = eta.float().contiguous(), log_a.float().contiguous()
    log_gate = None if log_gate is None else log_gate.contiguous()
    S0 = None if S0 is None else S0.float().contiguous()
    return _ColumnDeltaChunk.apply(q, x, v, eta, log_gate, log_a, S0, beta, eta_scale, cu_seqlens, chunk_size,
                                   read_after, output_final_state)
