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

What the backward reads, and when it lets go of it (B=8, T=2048, H=16, V=128: 128 MiB per
``[B, T, H, V]`` fp32 tensor): ``dv_bwd`` reads ``D``, which is freed after it; ``state_bwd``
forms ``D = eta y - kappa R`` again, elementwise, over the outputs' ``dD`` as it consumes it,
for ``dqk_bwd_two_reads``, and writes ``d eta`` over the fp32 outputs and ``d log a`` over
``R``; the Grams go after ``state_bwd``. ``eta`` is kept only when it cannot be formed again
from its factors (``beta`` and ``eta_scale``, ``eta = beta * eta_scale``, as the step-size
kernel formed it). ``column_delta_steps`` is rule 2 from the keys: the step sizes and the scan
in one autograd node, so that ``eta``, ``log_a`` (summed in place into ``u``) and the shifted
keys (over which ``dqk_bwd_two_reads`` writes ``dx``) are its own buffers, each freed or reused
as soon as it has been read for the last time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from . import column_decay_kernels as cd
from . import column_delta_kernels as kern
from .chunk_index import ChunkLayout, chunk_layout
from .column_decay import _config as column_config
from .launch import (SUPPORTED_CHUNK_SIZES, cdiv, dot_precision, empty_buffer, launch_config, layout_args,
                     next_power_of_2)
from .step_sizes import check_first, prepare_inputs, step_flags, step_sizes_backward, step_sizes_forward

__all__ = ["column_delta_chunk", "column_delta_steps"]

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


def _check_chunk_size(chunk_size: int) -> None:
    if chunk_size not in SUPPORTED_CHUNK_SIZES or chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES} for the Triton kernels, got {chunk_size}")


def _gate_of(log_gate: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The residual gate ``exp(g)`` ``[B, T, H]`` fp32 that the sequential kernels read (``None``: no gate)."""
    return None if log_gate is None else torch.exp(log_gate.float()).contiguous()


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


def _forward(q, x, v, eta, gate, log_a, S0, layout: ChunkLayout, read_after: bool, want_final: bool,
             u_over_log_a: bool = False):
    """The fp32 outputs, the final states (or ``None``) and a dict of what the backward reads: the
    Grams ``G``, the log-prefixes ``u``, the entry states ``h``, ``D``, ``R`` and the fp32 outputs
    ``o`` (``_backward`` empties it as it goes). ``u_over_log_a``: ``log_a`` is the caller's own
    buffer, and the log-prefixes are summed into it in place."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    G = _empty((B, T, H, SUB_CHUNK), q, torch.float32)
    kern.gram_fwd[(layout.num_chunks * (layout.BT // SUB_CHUNK), H)](
        x, G, chunk_indices=layout.chunk_indices, H=H, K=K, BS=SUB_CHUNK,
        BK=min(GRAM["BK"], max(16, next_power_of_2(K))), PRECISION=prec, num_warps=GRAM["num_warps"], **meta)
    u = log_a if u_over_log_a else _empty(log_a.shape, log_a)
    c = column_config("elementwise", K, V)
    cd.chunk_cumsum[(cdiv(V, c["BV"]), layout.num_chunks, H)](  # each program reads its tile before writing it
        log_a, u, chunk_indices=layout.chunk_indices, H=H, V=V, **c, **meta)
    h, D, R, S_T = _states(q, x, v, eta, gate, u, G, S0, layout, want_final)
    o = _outputs(q, x, D, u, h, layout, read_after)
    return o, S_T, dict(G=G, u=u, h=h, D=D, R=R, o=o)


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


def _dqk(q, x, D, u, h, dh, do, dv, gate, layout, read_after, dx_over_x: bool = False):
    """``dqk_bwd_two_reads``: ``dq`` (the outputs' queries) and the whole ``dx`` (the
    residual reads' queries, whose upstream gradient ``-exp(g) dv`` it forms from ``dv``, the
    keys of both reads and the exit-state term through ``dh``), in ``q``'s and ``x``'s dtype.
    ``dx_over_x``: ``dx`` is written over ``x`` (each program reads its rows and key columns of
    ``x`` before it writes the same ones of ``dx``)."""
    H, K = q.shape[2:]
    V = D.shape[-1]
    dq, dx = _empty(q.shape, q), (x if dx_over_x else _empty(x.shape, x))
    c = launch_config("dqk_bwd_two_reads", K, V, LAUNCH)
    kern.dqk_bwd_two_reads[(cdiv(K, c["BK"]), layout.num_chunks, H)](
        q, x, D, u, h, dh, do, dv, gate, dq, dx, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_GATE=gate is not None, PRECISION=dot_precision(q.dtype), **c, **layout_args(layout))
    return dq, dx


def _backward(q, x, v, kept: dict, S0, S_T, do, dS_T, layout: ChunkLayout, read_after: bool, *, o_private: bool,
              dx_over_x: bool):
    """The gradients of ``q``, ``x``, ``v``, ``eta``, ``log_gate`` (``None`` without a gate),
    ``log_a`` and ``S0``. ``kept``: what ``_forward`` returned, plus ``eta`` (or ``None``),
    ``factors`` (``(beta, eta_scale)``, or ``None`` when ``eta`` is kept) and ``gate``
    (``exp(log_gate)`` ``[B, T, H]`` fp32 or ``None``: ``kappa`` is ``eta``); each entry is
    taken out when read for the last time, so that it is freed then if the caller keeps no other
    reference. ``o_private``: the fp32 outputs ``o`` are not the tensor returned to the caller,
    and ``deta`` is written over them as ``state_bwd`` reads them; ``d log a`` is written over
    the residual reads ``R`` the same way. ``S_T``: the final states (read with ``dS_T``)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    f32 = torch.float32
    u, h, R, o, gate = kept.pop("u"), kept.pop("h"), kept.pop("R"), kept.pop("o"), kept.pop("gate")
    # 1. the outputs' intra-chunk gradient of D (no exit-state term), the last read of the forward's D
    dD = _empty(u.shape, u)
    D = kept.pop("D")
    _outputs_dD(q, x, D, u, do, dD, layout, read_after)
    del D
    # 2. reverse over chunks: exit-state gradients and the adjoint z of D, and from z: dv, deta, the gate's
    # partial sums and the whole d log a; D formed again over dD
    dh = _empty(h.shape, h)
    deta = o if o_private else _empty(u.shape, u)
    dv, dlog_a = _empty(v.shape, v), R
    dS0 = _empty(S0.shape, S0, f32) if S0 is not None else None
    c = _sequential("state_bwd", K, V, layout.N * H)
    n_vb = cdiv(V, c["BV"])
    dgate = _empty((n_vb, B * T * H), u) if gate is not None else None
    eta, factors, G = kept.pop("eta"), kept.pop("factors"), kept.pop("G")
    beta, scale = factors if factors is not None else (None, None)
    kern.state_bwd[(n_vb, layout.N * H)](
        q, x, v, eta, beta, scale, gate, R, u, G, do, o, dD, h, S_T, dh, dv, deta, dgate, dlog_a, dS_T, dS0,
        n_rows=B * T * H, H=H, K=K, V=V, HAS_DS_FINAL=dS_T is not None, STORE_DS0=dS0 is not None,
        READ_AFTER=read_after, HAS_GATE=gate is not None, ETA_FROM_BETA=factors is not None, PRECISION=prec,
        **c, **meta)
    del eta, factors, beta, scale, G, R, o
    # 3. q and x gradients of both reads in one launch (outputs: queries q; residual reads: queries x,
    # read before the write, with the exit-state term), with the D that state_bwd formed
    dq, dx = _dqk(q, x, dD, u, h, dh, do, dv, gate, layout, read_after, dx_over_x)
    dlog_gate = None if gate is None else dgate.sum(0).view(B, T, H)
    return dq, dx, dv, deta, dlog_gate, dlog_a, dS0


def _chunk_forward(q, x, v, eta, log_gate, log_a, S0, beta, eta_scale, layout, read_after, want_final):
    """``_forward`` for ``column_delta_chunk``, with what its backward reads besides: ``eta`` only when it
    cannot be formed again from its factors (``beta``, ``eta_scale``), the factors, the gate."""
    gate = _gate_of(log_gate)
    factors = None if beta is None else (beta, eta_scale)
    o, S_T, kept = _forward(q, x, v, eta, gate, log_a, S0, layout, read_after, want_final)
    kept.update(eta=None if factors is not None else eta, factors=factors, gate=gate)
    return o, S_T, kept


class _ColumnDeltaChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, log_gate, log_a, S0, beta, eta_scale, cu_seqlens, chunk_size, read_after,
                want_final):
        B, T = q.shape[:2]
        layout = chunk_layout(B, T, chunk_size, cu_seqlens)
        o, S_T, kept = _chunk_forward(q, x, v, eta, log_gate, log_a, S0, beta, eta_scale, layout, read_after,
                                      want_final)
        # the fp32 outputs through save_for_backward: with fp32 values they are the returned tensor itself
        ctx.save_for_backward(q, x, v, kept["eta"], log_gate, log_a, S0, beta, eta_scale, S_T, kept.pop("o"))
        ctx.kept, ctx.layout, ctx.read_after = kept, layout, read_after
        # 16-bit values: the caller gets a rounded copy of the fp32 outputs, which the backward may overwrite
        ctx.o_private = v.dtype != torch.float32
        return o.to(v.dtype), S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, x, v, eta, log_gate, log_a, S0, beta, eta_scale, S_T, o = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, None
        if kept is None:  # a second backward (retain_graph=True): the first one used up what the forward kept
            _, _, kept = _chunk_forward(q, x, v, eta if beta is None else _eta_of(beta, eta_scale), log_gate, log_a,
                                        S0, beta, eta_scale, ctx.layout, ctx.read_after, False)
        else:
            kept["o"] = o
        del o
        dq, dx, dv, deta, dlog_gate, dlog_a, dS0 = _backward(
            q, x, v, kept, S0, S_T, do.contiguous(), None if dS_T is None else dS_T.contiguous(), ctx.layout,
            ctx.read_after, o_private=ctx.o_private, dx_over_x=False)
        if dlog_gate is not None:
            dlog_gate = dlog_gate.to(log_gate.dtype)
        return dq, dx, dv, deta, dlog_gate, dlog_a, dS0, None, None, None, None, None, None


def _eta_of(beta: torch.Tensor, eta_scale: torch.Tensor) -> torch.Tensor:
    """``eta = beta * eta_scale`` per value column, 0 where the row's scale is 0: the product the
    step-size kernel and ``state_bwd`` form, to the bit (one fp32 multiplication)."""
    scale = eta_scale[..., None]
    return torch.where(scale != 0, beta.float() * scale, torch.zeros((), device=beta.device))


@dataclass(frozen=True)
class _Options:
    """The switches of ``column_delta_steps``, fixed for one call (``flags``: the step kernels')."""
    eps: float
    decay_floor: float
    flags: dict
    layout: ChunkLayout
    read_after: bool
    want_final: bool
    gate_dtype: Optional[torch.dtype]


def _steps_and_scan(q, src, v, beta, lam, log_gate, S0, first, valid, opt: _Options, want_final: bool):
    """The step sizes (``step_sizes_forward``) and the scan's forward on them: the fp32 outputs, the
    final states and what the backward reads (``_forward``'s dict, with the shifted keys ``x``, the
    factors of ``eta`` and the gate). ``eta`` is dropped on return and ``u`` is summed over ``log_a``."""
    x, eta, log_a, scale = step_sizes_forward(src, first, valid, beta, lam, log_gate, eps=opt.eps,
                                              decay_floor=opt.decay_floor, flags=opt.flags)
    gate = _gate_of(log_gate)
    o, S_T, kept = _forward(q, x, v, eta, gate, log_a, S0, opt.layout, opt.read_after, want_final, u_over_log_a=True)
    kept.update(x=x, eta=None, factors=(beta, scale), gate=gate)
    return o, S_T, kept


class _ColumnDeltaSteps(torch.autograd.Function):
    """Rule 2 from the keys (or the write features): the step sizes and the scan in one node."""

    @staticmethod
    def forward(ctx, q, src, v, beta, lam, log_gate, S0, first, valid, opt: _Options):
        o, S_T, kept = _steps_and_scan(q, src, v, beta, lam, log_gate, S0, first, valid, opt, opt.want_final)
        ctx.save_for_backward(q, src, v, beta, lam, log_gate, S0, first, valid, S_T, kept.pop("o"))  # as above
        ctx.kept, ctx.opt = kept, opt
        ctx.o_private = v.dtype != torch.float32  # as in _ColumnDeltaChunk
        return o.to(v.dtype), S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, src, v, beta, lam, log_gate, S0, first, valid, S_T, o = ctx.saved_tensors
        opt = ctx.opt
        kept, ctx.kept = ctx.kept, None
        if kept is None:  # a second backward (retain_graph=True): the first one used up what the forward kept
            _, _, kept = _steps_and_scan(q, src, v, beta, lam, log_gate, S0, first, valid, opt, False)
        else:
            kept["o"] = o
        del o
        x = kept.pop("x")
        # with shift, x holds the node's own shifted keys, and dx can take their place
        dq, dx, dv, deta, dlog_gate, dlog_a, dS0 = _backward(
            q, x, v, kept, S0, S_T, do.contiguous(), None if dS_T is None else dS_T.contiguous(), opt.layout,
            opt.read_after, o_private=ctx.o_private, dx_over_x=opt.flags["SHIFT"])
        del x
        d_src, d_first, d_beta, d_lam, d_gate = step_sizes_backward(
            src, first, valid, beta, lam, opt.gate_dtype, deta, dlog_a, dx, eps=opt.eps, decay_floor=opt.decay_floor,
            flags=opt.flags)
        if d_gate is not None:  # through the decay (the step sizes) and through the residual gain (the scan)
            d_gate = (d_gate.float() + dlog_gate).to(opt.gate_dtype)
        return dq, d_src, dv, d_beta, d_lam, d_gate, dS0, d_first, None, None


def column_delta_steps(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    S0: Optional[torch.Tensor],
    *,
    first: Optional[torch.Tensor],
    valid: Optional[torch.Tensor],
    shift: bool,
    eps: float,
    decay_floor: float,
    normalize: bool,
    scale_ridge: bool,
    read_after: bool,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Falcon-2 on the kernels from the keys: the per-column step sizes (``step_sizes``, the
    equations of ``ops.step_sizes``) and ``column_delta_chunk``'s scan in one autograd node.

    ``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]`` of one dtype; ``beta`` ``[B, T, H, V]``;
    ``lam``, ``log_gate`` (or ``None``) ``[B, T, H]``; ``S0`` ``[N, H, K, V]`` fp32 or ``None``.
    With ``shift`` the write features are the keys shifted in the kernel, ``x_t = k_{t-1}``,
    ``x_0 = first`` (``[B, H, K]``, the carried last key) or the invalid sentinel 0 (fixed-length
    rows only); without it ``k`` holds the features themselves and ``valid`` ``[B, T]`` (bool, or
    ``None``: every pair valid) marks their pairs. Returns the outputs in ``v``'s dtype and the
    final states ``[N, H, K, V]`` fp32 (or ``None``); differentiable in ``q``, ``k``, ``v``,
    ``beta``, ``lam``, ``log_gate``, ``S0`` and ``first``.

    Gains and decays as ``step_sizes.feature_step_sizes``; the residual gain ``kappa = eta
    exp(log_gate)``. The step sizes' fp32 ``eta`` lives only until the scan's forward has read it
    (the backward forms it again from ``beta``), ``log_a`` becomes the log-prefixes in place, and
    the backward writes the shifted keys' gradient over them: 1,024 MiB instead of 1,105 at
    B=8, T=2048, H=16, K=V=128 in bf16.
    """
    _check_chunk_size(chunk_size)
    if shift and cu_seqlens is not None:
        raise ValueError("shift=True shifts fixed-length rows in the kernel; with cu_seqlens pass the shifted "
                         "features as k, shift=False and their validity")
    if first is not None and not shift:
        raise ValueError("first (the carried last key) goes with shift=True")
    check_first(first, k)
    B, T = q.shape[:2]
    q, v = q.contiguous(), v.contiguous()
    src, first, valid, beta, lam, log_gate = prepare_inputs(k, first, valid, beta, lam, log_gate)
    S0 = None if S0 is None else S0.float().contiguous()
    opt = _Options(eps=float(eps), decay_floor=float(decay_floor),
                   flags=step_flags(normalize=normalize, scale_ridge=scale_ridge, shift=shift, first=first,
                                    valid=valid),
                   layout=chunk_layout(B, T, chunk_size, cu_seqlens), read_after=read_after,
                   want_final=output_final_state, gate_dtype=None if log_gate is None else log_gate.dtype)
    return _ColumnDeltaSteps.apply(q, src, v, beta, lam, log_gate, S0, first, valid, opt)


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
    _check_chunk_size(chunk_size)
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
