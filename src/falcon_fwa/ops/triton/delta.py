r"""Autograd function over the WY chunk kernels (Falcon-1).

``delta_chunk(q, x, v, eta, kappa, log_a, S0, ...)`` computes, per head,
``S_t = a_t S_{t-1} + x_t (eta_t v_t - kappa_t S_{t-1}^T x_t)^T`` with
``a_t = exp(log_a_t)`` and reads ``o_t = S_t^T q_t`` (``read_after``) or
``S_{t-1}^T q_t``. Falcon-1 is ``a = gamma exp(g)``, ``kappa = eta exp(g)``
(``kappa=None`` without a gate: kappa is eta, read from eta's buffer, its gradient summed into
eta's); gradients flow to ``q``, ``x``, ``v``, ``eta``, ``kappa``, ``log_a`` and ``S0``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernel_limits import SLOT_COUNTS
from . import delta_kernels as wy
from . import scalar_decay_kernels as sd
from .chunk_index import ChunkLayout, chunk_layout
from .launch import LAUNCH, SUPPORTED_CHUNK_SIZES, cdiv, dot_precision, launch_config, layout_args, next_power_of_2
from .window_sum import axis_concat, window_sum

__all__ = ["delta_chunk", "SLOT_COUNTS"]

# Warps of ``wy_bwd`` for four-byte inputs, which take no launch table (module-level so that a diagnosis
# can vary them). Triton 3.4-3.7.0 is known to miscompile fla's WY backward at chunk 64 with 4 warps on
# Hopper; this kernel runs 4 warps for 16-bit inputs (FULL_K_16BIT*), checked on an H200 against float64.
WY_WARPS = {"wy_bwd": 8}
# Launch settings of the WY forward, by the precision of its products and, for 16-bit inputs, the write
# layout (one write per step: rule 1; grouped writes: rule 3). An entry names either ``wy_fwd`` (one
# launch: the inverse and the products) or ``wy_inverse`` and ``wy_apply`` (two launches: the inverse,
# then the products over a grid of column blocks, at the apply kernel's own occupancy). Exact fp32
# products run on the FMA units with their operands in registers: 64-wide blocks spill for sm_90 at 4 or
# 8 warps. On an H200 at B=8, T=2048, H=16, K=V=128: exact fp32 1.25 ms at 16-wide blocks and 4 warps
# (32-wide at 8 warps: 1.67 ms). bf16: 0.245 ms in one launch at 4 warps (0.52 at 8); 0.170 ms in two, the
# inverse at one warp (0.200 at 2 warps, 0.27 at 4) and the products over 128-wide blocks at 4 warps;
# rule 3 0.968 -> 0.679 ms (benchmarks/results/h200-wy-forward-3100709.md, h200-wy-forward-sweep-33a2d94.md).
# ``benchmarks/bench_wy_forward.py`` times one launch against two; ``benchmarks/sweep_launch.py`` sweeps
# an entry (``--table delta.WY_FWD_LAUNCH.16bit --kernels wy_apply``).
WY_FWD_LAUNCH = {
    "ieee": {"wy_fwd": dict(BK=16, BV=16, num_warps=4, num_stages=3)},
    "tf32": {"wy_fwd": dict(BK=64, BV=64, num_warps=4, num_stages=3)},
    "16bit": {"wy_inverse": dict(BK=64, num_warps=1, num_stages=2),
              "wy_apply": dict(BK=128, BV=128, num_warps=4, num_stages=3)},
    "16bit_grouped": {"wy_inverse": dict(BK=64, num_warps=1, num_stages=2),
                      "wy_apply": dict(BK=128, BV=128, num_warps=4, num_stages=3)},
}
# The largest chunk the WY kernels run: a request for 128 runs at 64 (the result is the same up to
# rounding). At 128 the fp32 kernels take 6.5 minutes to compile for sm_90 (even at K = V = 16;
# benchmarks/kernel_resources.py), and no GPU run of them at 128 ever finished.
WY_MAX_CHUNK = 64


# Value block, warps and pipeline stages of the kernels that hold the whole key dimension, for 16-bit
# inputs at K <= 128 (BK is always the whole key dimension: a sweep's BK is ignored).
# From H200 sweeps at B=8, T=2048, H=16, K=V=128 (bf16), each kernel's outputs checked against the previous
# setting's (``benchmarks/sweep_launch.py --table delta.FULL_K_16BIT``): state_fwd 0.159 -> 0.131 ms
# (benchmarks/results/h200_rule1_launch_sweep_26e24eb.txt), 0.131 -> 0.118 ms at two stages (two blocks per SM;
# h200_launch_sweep_29a.txt); state_bwd, which also forms the reads' part of
# dD since the twenty-third run, 0.294 ms at 32 columns -> 0.222 ms at 64 (h200.md, twenty-third run);
# wy_bwd 0.429 ms at 8 warps -> 0.282 ms at 4 (h200_launch_sweep_2ae1a89.txt).
FULL_K_16BIT = {"state_fwd": dict(BV=64, num_warps=4, num_stages=2), "state_bwd": dict(BV=64, num_warps=4, num_stages=2),
                "wy_bwd": dict(BV=64, num_warps=4, num_stages=3)}
# The same for grouped writes (slots > 1, rule 3), from a sweep of falcon-3 at that shape, window 4
# (benchmarks/results/h200_rule3_launch_sweep_f5fb5b2.txt): state_fwd 0.615 -> 0.462 ms, wy_bwd 2.391 ->
# 2.254 ms, against (32, 4, 3); state_bwd with the reads' part of dD: 0.87 ms, the fastest of seven
# settings (h200.md, twenty-third run); wy_bwd at 4 warps as rule 1's (h200.md, twenty-fifth run).
FULL_K_16BIT_GROUPED = {"state_fwd": dict(BV=64, num_warps=4, num_stages=2),
                        "state_bwd": dict(BV=64, num_warps=4, num_stages=2),
                        "wy_bwd": dict(BV=64, num_warps=4, num_stages=3)}
# Where the state kernels' grid is small: fewer than SMALL_GRID sequences x heads (B=4 or B=2 at H=16;
# B=8 is 128), whose ``cdiv(V, 64)`` programs per sequence and head leave most of the 132 SMs of an H100
# or H200 idle, narrower value blocks. From H100 sweeps (bf16, K = V = 128, forward+backward, device ms
# inside the op): rule 1 at B=2, T=8192 (benchmarks/results/h100_rule1_b2_state_sweep_c374794.txt):
# state_fwd 0.321 -> 0.263 ms at 16 columns and 2 warps, state_bwd 0.663 -> 0.487 at 32 columns and 4
# warps (op 2.145 -> about 1.90); rule 3 at B=4 (h100_rule3_b4_state_sweep_c992b76.txt): state_fwd
# 0.387 -> 0.335 at 32 columns and 2 warps, state_bwd fastest at the wide-grid setting (kept).
SMALL_GRID = 128
FULL_K_16BIT_SMALL_GRID = {"state_fwd": dict(BV=16, num_warps=2, num_stages=2),
                           "state_bwd": dict(BV=32, num_warps=4, num_stages=2)}
FULL_K_16BIT_GROUPED_SMALL_GRID = {"state_fwd": dict(BV=32, num_warps=2, num_stages=2)}
# The same for 16-bit inputs at 128 < K <= 256 (a 256-row key tile), one write per step or grouped, from a
# sweep of falcon-1 at B=4, T=2048, H=16, K=V=256 (h200_launch_sweep_2ae1a89.txt): state_fwd 0.722 -> 0.386
# ms, state_bwd 1.946 -> 0.990, wy_bwd 0.583 -> 0.435, against (16, 8, 2). At most two stages: at three,
# state_bwd needs 248 KB of shared memory in bf16, above an sm_90 block's 227 KB.
FULL_K_16BIT_256 = {"state_fwd": dict(BV=32, num_warps=4, num_stages=2),
                    "state_bwd": dict(BV=32, num_warps=4, num_stages=2),
                    "wy_bwd": dict(BV=64, num_warps=8, num_stages=1)}


# Launch settings of the scalar-decay kernels that read the write values D (``output_fwd``, ``dqk_bwd``),
# one table for one write per step (rule 1) and one for grouped writes (rule 3), apart from rule 1A's
# (``launch.LAUNCH``, where they started) so that each can be set for its own row layout. Values from an
# H200 sweep inside each op at the shape above, bf16 (``benchmarks/sweep_launch.py``;
# benchmarks/results/h200_wy_scalar_launch_sweep_9ef2ca8.txt): rule 3 output_fwd 0.428 -> 0.404 ms,
# rule 1 output_fwd 0.122 -> 0.112 ms; dqk_bwd fastest at rule 1A's setting for both. Swept again on an
# H100 at 2800565 (benchmarks/results/h100_rule3_scalar_sweep_2800565.txt): rule 3's dqk_bwd over the whole
# key dimension (BK=128) 1.257 -> 1.012 ms at B=8 and 0.632 -> 0.509 at B=4, its output_fwd at 64 x 128
# blocks 0.392 -> 0.362 and 0.198 -> 0.181; rule 1's unchanged (dqk_bwd at BK=128: 0.352 -> 0.488 ms).
SCALAR_LAUNCH = {
    "one": dict(output_fwd=dict(BK=64, BV=128, num_warps=4, num_stages=2), dqk_bwd=dict(LAUNCH["dqk_bwd"])),
    "grouped": dict(output_fwd=dict(BK=64, BV=128, num_warps=4, num_stages=2),
                    dqk_bwd=dict(BK=128, BV=64, num_warps=4, num_stages=2)),
}


def _scalar(name: str, K: int, V: int, slots: int) -> dict:
    """``SCALAR_LAUNCH``'s setting of kernel ``name`` for ``slots`` writes per step."""
    return launch_config(name, K, V, SCALAR_LAUNCH["one" if slots == 1 else "grouped"])


def _full_k(name: str, K: int, V: int, dtype: torch.dtype, slots: int,
            sequences_heads: Optional[int] = None) -> Tuple[int, int, int, int]:
    """Kernel ``name`` (``state_fwd``, ``state_bwd`` or ``wy_bwd``), which holds the whole key
    dimension: ``BK >= K``, ``BV``, warps and pipeline stages. 16-bit inputs take ``FULL_K_16BIT``
    (one write per step: rule 1 and the delta-rule baselines) or ``FULL_K_16BIT_GROUPED`` (grouped
    writes: rule 3) at ``K <= 128``, ``FULL_K_16BIT_256`` above; the state kernels, one program per
    sequence, head and value block, take the ``*_SMALL_GRID`` entry of their table, where it has
    one, when ``sequences_heads`` (sequences x heads) is below ``SMALL_GRID``. Four-byte inputs run ``wy_bwd`` at
    ``WY_WARPS``' warps, and take fewer pipeline stages than Triton's three where ``state_bwd`` would
    need more shared memory than the 227 KB of an sm_90 block: two at ``BK = 128`` (246 KB at three),
    one at ``BK = 256`` (266 KB at two) (``benchmarks/kernel_resources.py``)."""
    BK = max(16, next_power_of_2(K))
    if dtype.itemsize == 2 and BK <= 256:
        c = (FULL_K_16BIT_256 if BK > 128 else FULL_K_16BIT if slots == 1 else FULL_K_16BIT_GROUPED)[name]
        if BK <= 128 and sequences_heads is not None and sequences_heads < SMALL_GRID:
            small = FULL_K_16BIT_SMALL_GRID if slots == 1 else FULL_K_16BIT_GROUPED_SMALL_GRID
            c = small.get(name, c)
        return BK, max(16, min(c["BV"], next_power_of_2(V))), c["num_warps"], c["num_stages"]
    BV = max(16, min(32, next_power_of_2(V), 4096 // BK))
    stages = 3 if BK <= 64 or dtype.itemsize < 4 else 2 if BK <= 128 else 1
    warps = WY_WARPS["wy_bwd"] if name == "wy_bwd" else 4 if BK <= 128 else 8
    return BK, BV, warps, stages


def _wy_fwd_key(dtype: torch.dtype, prec: str, slots: int) -> str:
    """``WY_FWD_LAUNCH``'s entry for inputs of ``dtype`` with products in ``prec``."""
    if dtype.itemsize == 2:
        return "16bit" if slots == 1 else "16bit_grouped"
    return prec


def wy_forward(x, v, eta, kappa, log_a, layout: ChunkLayout, slots: int, windowed: bool = False):
    """The WY forward over every chunk of ``layout``: ``A = (I + N)^{-1}`` ``[B, T, H, BT]`` (row
    ``t`` holds its chunk's row of the inverse), ``U = A (eta Y)`` ``[B, T, H, V]`` and
    ``W = A (kappa exp(w) X)`` ``[B, T, H, K]`` in the inputs' dtype (``delta_kernels``), over the
    ``T = layout.T`` write rows, in one launch or two (``WY_FWD_LAUNCH``). With ``windowed``, ``x``
    and ``v`` are ``[B, T // slots + slots - 1, H, D]`` (``delta_chunk``).

    The inverse is formed in fp32. For 16-bit inputs it is returned rounded to the inputs'
    dtype, as every product that reads it takes it (here and in ``wy_bwd``): the fp32 scratch
    is freed on return, and what the backward keeps is half its size."""
    B, _, H, K = x.shape
    T, V = layout.T, v.shape[-1]
    prec = dot_precision(x.dtype)
    A = x.new_empty(B, T, H, layout.BT, dtype=torch.float32)  # also the scratch of N (written before read)
    A_out = A if x.dtype == torch.float32 else torch.empty_like(A, dtype=x.dtype)
    U, W = x.new_empty(B, T, H, V, dtype=v.dtype), x.new_empty(B, T, H, K)
    table = WY_FWD_LAUNCH[_wy_fwd_key(x.dtype, prec, slots)]
    rows = dict(chunk_indices=layout.chunk_indices, H=H, K=K, PRECISION=prec, SLOTS=slots, WINDOWED=windowed,
                **layout_args(layout))
    if "wy_fwd" in table:
        c = launch_config("wy_fwd", K, V, table)
        wy.wy_fwd[(layout.num_chunks, H)](x, v, eta, kappa, log_a, A, A_out, U, W, V=V, STORE_A_OUT=A_out is not A,
                                          **c, **rows)
        return A_out, U, W
    c = launch_config("wy_inverse", K, V, table)
    wy.wy_inverse[(layout.num_chunks, H)](x, kappa, log_a, A, A_out, STORE_A_OUT=A_out is not A, **c, **rows)
    c = launch_config("wy_apply", K, V, table)
    wy.wy_apply[(layout.num_chunks, H, cdiv(V, c["BV"]) + cdiv(K, c["BK"]))](
        x, v, eta, kappa, log_a, A_out, U, W, V=V, **c, **rows)
    del A  # the fp32 scratch (16-bit inputs)
    return A_out, U, W


def _query_args(slots: int, query_slot: Optional[int], BT: int) -> dict:
    """The query-row arguments of the kernels that read ``q`` / ``do`` or write ``o`` / ``dq``
    (``scalar_decay_kernels._query_tile``): one query per step on row ``query_slot``, the steps'
    query rows packed where a chunk of ``BT`` rows holds at least 16 steps (the smallest tile a
    product takes)."""
    if query_slot is None:
        return {}
    return dict(QSLOTS=slots, QREAD=query_slot, QPACK=BT // slots >= 16)


def _key_args(slots: int, windowed: bool) -> dict:
    """The feature-row argument of the kernels that read ``x`` (``scalar_decay_kernels._pair_rows``):
    with ``windowed``, in place from the extended axis, ``slots`` writes per step."""
    return dict(XWIN=slots) if windowed else {}


def _forward(q, x, v, eta, kappa, log_a, S0, layout: ChunkLayout, read_after: bool, want_final: bool, slots: int,
             windowed: bool, query_slot: Optional[int]):
    B, _, H, K = x.shape
    V = v.shape[-1]
    prec, meta, xa = dot_precision(q.dtype), layout_args(layout), _key_args(slots, windowed)
    A, U, W = wy_forward(x, v, eta, eta if kappa is None else kappa, log_a, layout, slots, windowed)
    h = q.new_empty(layout.num_chunks, H, K, V)
    D = torch.empty_like(U)
    S_T = q.new_empty(layout.N, H, K, V, dtype=torch.float32) if want_final else None
    BK, BV, warps, stages = _full_k("state_fwd", K, V, q.dtype, slots, layout.N * H)
    wy.state_fwd[(cdiv(V, BV), layout.N * H)](
        x, U, W, log_a, h, D, S0, S_T, H=H, K=K, V=V, BK=BK, BV=BV, HAS_S0=S0 is not None,
        STORE_FINAL=want_final, PRECISION=prec, num_warps=warps, num_stages=stages, **meta, **xa)
    o = D.new_empty(B, q.shape[1], H, V)
    c = _scalar("output_fwd", K, V, slots)
    sd.output_fwd[(cdiv(V, c["BV"]), layout.num_chunks, H)](
        q, x, D, None, log_a, h, o, chunk_indices=layout.chunk_indices, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=False, PRECISION=prec, **c, **meta,
        **_query_args(slots, query_slot, layout.BT), **xa)
    return o, A, W, h, D, S_T


def _backward(q, x, v, eta, kappa, log_a, S0, A, W, h, D, do, dS_T, layout: ChunkLayout, read_after: bool,
              slots: int, windowed: bool, query_slot: Optional[int], value_split: Optional[Tuple[int, int]] = None):
    B, _, H, K = x.shape
    T, V = layout.T, v.shape[-1]
    qa, xa = _query_args(slots, query_slot, layout.BT), _key_args(slots, windowed)
    prec, meta = dot_precision(q.dtype), layout_args(layout)
    # the write values' gradient (the reads' part and the exit states' part, in one reverse pass), in the
    # inputs' dtype, in which wy_bwd's and dqk_bwd's products take it
    dD = torch.empty_like(D)
    dh = q.new_empty(layout.num_chunks, H, K, V)
    dS0 = torch.empty_like(S0, dtype=torch.float32) if S0 is not None else None
    BK, BV, warps, stages = _full_k("state_bwd", K, V, q.dtype, slots, layout.N * H)
    wy.state_bwd[(cdiv(V, BV), layout.N * H)](
        q, x, W, do, log_a, dD, dh, dS_T, dS0, H=H, K=K, V=V, BK=BK, BV=BV,
        HAS_DS_FINAL=dS_T is not None, STORE_DS0=dS0 is not None, READ_AFTER=read_after, PRECISION=prec,
        num_warps=warps, num_stages=stages, **meta, **qa, **xa)
    # dx per write row (windowed: summed onto the axis below) into W's buffer: W was read by state_bwd only
    dq, dx = torch.empty_like(q), W
    rows = B * T
    c = _scalar("dqk_bwd", K, V, slots)
    NK = cdiv(K, c["BK"])
    parts = q.new_empty(3, NK, rows, H, dtype=torch.float32)
    sd.dqk_bwd[(NK, layout.num_chunks, H)](
        q, x, D, do, None, log_a, h, dh, dq, dx, parts[0], parts[1], parts[2],
        chunk_indices=layout.chunk_indices, n_rows=rows, H=H, K=K, V=V,
        READ_AFTER=read_after, HAS_ETA=False, PRECISION=prec, **c, **meta, **qa, **xa)
    del dh  # read by dqk_bwd only
    dv = D  # per write row (windowed: summed onto the axis below) into D's buffer: D was read by dqk_bwd only
    dkappa = torch.empty_like(eta)  # kappa=None (kappa is eta): summed into deta by dlog_bwd
    extra = q.new_empty(3, rows, H, dtype=torch.float32)
    # wy_bwd stages the Gram's gradient, read back transposed, in A's own rows (each program reads its
    # chunk's A first): no scratch buffer. A, W and D are spent here (_DeltaChunk.backward recomputes them
    # for a second backward)
    BK, BV, warps, stages = _full_k("wy_bwd", K, V, q.dtype, slots)
    wy.wy_bwd[(layout.num_chunks, H)](
        x, v, eta, eta if kappa is None else kappa, log_a, A, h, dD, dx, dv, dkappa, extra, A,
        chunk_indices=layout.chunk_indices, n_rows=rows, H=H, K=K, V=V, BK=BK, BV=BV, PRECISION=prec, SLOTS=slots,
        WINDOWED=windowed, num_warps=warps, num_stages=stages, **meta)
    if windowed:  # write j*slots + i read position j + i: sum the writes' gradients onto the axis
        if slots > 1:
            dx = window_sum(dx.view(B, T // slots, slots, H, K))
        if value_split is not None:  # ... and the values' straight onto the two parts the axis was built from
            dv = window_sum(dv.view(B, T // slots, slots, H, V), split=value_split[0], n_body=value_split[1])
        elif slots > 1:
            dv = window_sum(dv.view(B, T // slots, slots, H, V))
    # the decay's gradient (the reads' partials and the WY kernel's, summed within each chunk) and eta's
    deta, dlog_a = torch.empty_like(eta), torch.empty_like(log_a)
    sd.dlog_bwd[(layout.num_chunks,)](
        parts[0], parts[1], parts[2], extra, dkappa, deta, dlog_a, chunk_indices=layout.chunk_indices, n_rows=rows,
        H=H, BH=next_power_of_2(H), NK=NK, HAS_ETA=False, HAS_EXTRA=True, HAS_DKAPPA=kappa is None, **meta)
    return dq, dx, dv, deta, None if kappa is None else dkappa, dlog_a, dS0


class _DeltaChunk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, x, v, eta, kappa, log_a, S0, cu_seqlens, chunk_size, read_after, want_final, slots, windowed,
                query_slot, value_prefix):
        B, T = eta.shape[:2]  # the write rows (windowed: x and v lie on the shorter extended axis)
        layout = chunk_layout(B, T, chunk_size, cu_seqlens)
        ctx.value_split = None
        if value_prefix is not None:  # the value axis [value_prefix | v], built here, its gradient split back
            ctx.value_split = (value_prefix.shape[1], v.shape[1])
            v = axis_concat(value_prefix, v, T // slots + slots - 1)
        o, A, W, h, D, S_T = _forward(q, x, v, eta, kappa, log_a, S0, layout, read_after, want_final, slots,
                                      windowed, query_slot)
        ctx.save_for_backward(q, x, v, eta, kappa, log_a, S0, A, W, h, D)
        ctx.layout, ctx.read_after, ctx.slots, ctx.windowed = layout, read_after, slots, windowed
        ctx.query_slot, ctx.spent = query_slot, False
        return o, S_T

    @staticmethod
    def backward(ctx, do, dS_T):
        q, x, v, eta, kappa, log_a, S0, A, W, h, D = ctx.saved_tensors
        if ctx.spent:  # a second backward (retain_graph=True): the first one wrote its gradients over A, W, D
            _o, A, W, h, D, _S = _forward(q, x, v, eta, kappa, log_a, S0, ctx.layout, ctx.read_after, False,
                                          ctx.slots, ctx.windowed, ctx.query_slot)
        ctx.spent = True
        grads = _backward(q, x, v, eta, kappa, log_a, S0, A, W, h, D, do.contiguous(),
                          None if dS_T is None else dS_T.contiguous(), ctx.layout, ctx.read_after, ctx.slots,
                          ctx.windowed, ctx.query_slot, ctx.value_split)
        dq, dx, dv, *rest = grads
        d_prefix = None
        if ctx.value_split is not None:
            d_prefix, dv = dv
        return (dq, dx, dv, *rest, None, None, None, None, None, None, None, d_prefix)


def delta_chunk(
    q: torch.Tensor,
    x: torch.Tensor,
    v: torch.Tensor,
    eta: torch.Tensor,
    kappa: Optional[torch.Tensor],
    log_a: torch.Tensor,
    S0: Optional[torch.Tensor],
    *,
    read_after: bool,
    chunk_size: int = 64,
    cu_seqlens: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    slots: int = 1,
    windowed: bool = False,
    query_slot: Optional[int] = None,
    value_prefix: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Chunk-parallel regression (delta) scan with scalar step sizes.

    ``slots`` > 1: rows come in groups of ``slots`` writes of one step (rows ``j*slots ..
    j*slots+slots-1``; every sequence length a multiple of ``slots``; ``log_a`` nonzero only
    on a group's first row), which all see the state before their step, not one another:
    the rule-3 layout (``ops.triton.sliding_delta``). ``slots`` must divide 16.

    ``windowed`` (rows of equal length, no ``cu_seqlens``): ``x`` and ``v``
    are ``[B, T // slots + slots - 1, H, D]`` (the extended axis of rule 3) and write ``j*slots
    + i`` takes its pair from row ``j + i`` of both (the writes are the overlapping windows of
    ``slots`` consecutive rows, read in place); their gradients are summed onto that axis
    (``window_sum``). ``T`` is then the number of write rows, that of ``eta``.

    ``value_prefix`` ``[B, n, H, V]`` (with ``windowed``): ``v`` is then the body of the value axis
    (``[B, m, H, V]``, ``n + m >= T // slots + slots - 1``) and the axis is ``[value_prefix | v]``
    cut to its length, built here; the gradients of ``value_prefix`` and ``v`` come out of the
    pass that sums the writes' gradients (``v``'s rows past the axis get zero).

    ``query_slot`` (with ``slots`` > 1): ``q`` is ``[B, T // slots, H, K]``, one query per
    step, read on row ``j*slots + query_slot`` of its group (the other rows read nothing, as
    zero queries would); ``o`` is then ``[B, T // slots, H, V]``, one output per step.

    ``chunk_size`` 128 runs as 64 (``WY_MAX_CHUNK``).

    ``q``, ``x`` ``[B, T, H, K]`` and ``v`` ``[B, T, H, V]`` of one dtype; ``eta``,
    ``kappa``, ``log_a`` ``[B, T, H]`` fp32 (``kappa=None``: kappa is eta); ``S0`` ``[N, H, K, V]`` fp32 or ``None``.
    Returns ``o`` ``[B, T, H, V]`` and the final states ``[N, H, K, V]`` fp32 (or ``None``).

    The backward writes its gradients over buffers the forward kept and it no longer reads
    (the inverse, ``W``, ``D``): a second backward through the same graph (``retain_graph=True``)
    recomputes them first, at the cost of one forward.
    """
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {SUPPORTED_CHUNK_SIZES} for the Triton kernels, got {chunk_size}")
    if slots not in SLOT_COUNTS:
        raise ValueError(f"slots must be one of {SLOT_COUNTS} (a divisor of 16), got {slots}")
    T = eta.shape[1]  # write rows
    if slots > 1:  # whole steps only: every sequence a multiple of ``slots`` rows
        if T % slots:
            raise ValueError(f"with slots={slots}, T={T} must be a multiple of slots")
        if cu_seqlens is not None and bool((cu_seqlens % slots).any()):
            raise ValueError(f"with slots={slots}, every cu_seqlens boundary must be a multiple of slots")
    if windowed:
        if cu_seqlens is not None:
            raise ValueError("windowed needs rows of equal length (cu_seqlens=None)")
        L = T // slots + slots - 1
        if x.shape[1] != L:
            raise ValueError(f"with windowed, x must have T // slots + slots - 1 = {L} rows (T = {T} write rows), "
                             f"got {x.shape[1]}")
        if value_prefix is None and v.shape[1] != L:
            raise ValueError(f"with windowed, v must have T // slots + slots - 1 = {L} rows (T = {T} write rows), "
                             f"got {v.shape[1]}")
        if value_prefix is not None and not (value_prefix.shape[1] <= L <= value_prefix.shape[1] + v.shape[1]):
            raise ValueError(f"with value_prefix, the axis of {L} rows must lie between value_prefix's "
                             f"{value_prefix.shape[1]} rows and those plus v's {v.shape[1]}")
    elif value_prefix is not None:
        raise ValueError("value_prefix needs windowed=True")
    else:
        for name, t in (("x", x), ("v", v)):
            if t.shape[1] != T:
                raise ValueError(f"{name} must have T = {T} rows (those of eta), got {t.shape[1]}")
    if query_slot is not None:
        if not 0 <= query_slot < slots or slots == 1:
            raise ValueError(f"query_slot must be in [0, slots) with slots > 1, got query_slot={query_slot}, "
                             f"slots={slots}")
        if q.shape[1] != T // slots:
            raise ValueError(f"with query_slot, q must have T // slots = {T // slots} rows, got {q.shape[1]}")
    chunk_size = min(chunk_size, WY_MAX_CHUNK)
    q, x, v = (t.contiguous() for t in (q, x, v))
    eta, log_a = eta.float().contiguous(), log_a.float().contiguous()
    kappa = None if kappa is None else kappa.float().contiguous()
    S0 = None if S0 is None else S0.float().contiguous()
    return _DeltaChunk.apply(q, x, v, eta, kappa, log_a, S0, cu_seqlens, chunk_size, read_after, output_final_state,
                             slots, windowed, query_slot, value_prefix)
