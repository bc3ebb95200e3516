r"""Sum of per-write gradients onto an extended time axis (the backward of overlapping windows).

Rule 3 lays ``R`` steps of ``S`` writes over an extended axis of ``R + S - 1`` positions: write
``(r, j)`` (step ``r``, slot ``j``) reads position ``r + j``. The gradient of the axis is::

    out[p] = sum_{j : 0 <= p - j < R} g[p - j, j]          (p = 0 .. R + S - 2)

for ``g`` ``[B, R, S, H, D]`` (the writes' gradients, step-major). ``window_sum`` computes it
in one pass (fp32 accumulation), optionally adding a gradient ``acc`` that already lies on
the axis, and optionally storing the axis split in two: positions ``0 .. n_head - 1`` and
the rest, the latter onto ``n_body`` rows (rows past the axis are zero). This is
``torch.ops.aten.unfold_backward`` for a step of 1, without its zero-filled buffer.

Its forward counterpart for the split, ``axis_concat``, lays a few head rows and the first rows
of a body onto one axis in one pass (the concatenation that ``split`` undoes).
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
import triton
import triton.language as tl

from .launch import cdiv, interpreted, next_power_of_2

__all__ = ["window_sum", "axis_concat", "store_split"]


@triton.jit
def store_split(head, body, b_s, i_b, o_p, i_h, o_d, m_d, n_head, n_body, H: tl.constexpr, D: tl.constexpr):
    """Stores the axis positions ``o_p`` of one batch row ``i_b`` (int64) and head, columns ``o_d``
    (mask ``m_d``), ``b_s`` ``[BP, BD]``, split: ``p < n_head`` into ``head`` ``[B, n_head, H, D]``,
    the others onto row ``p - n_head`` of ``body`` ``[B, n_body, H, D]`` (positions past it dropped)."""
    tl.store(head + ((i_b * n_head + o_p[:, None]) * H + i_h) * D + o_d[None, :], b_s.to(head.dtype.element_ty),
             mask=(o_p < n_head)[:, None] & m_d[None, :])
    q = o_p - n_head
    tl.store(body + ((i_b * n_body + q[:, None]) * H + i_h) * D + o_d[None, :], b_s.to(body.dtype.element_ty),
             mask=((q >= 0) & (q < n_body))[:, None] & m_d[None, :])


@triton.jit
def window_sum_kernel(
    g, acc, head, body, R, n_head, n_body,
    H: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BP: tl.constexpr, BD: tl.constexpr, HAS_ACC: tl.constexpr,
):
    """Grid ``(cdiv(n_head + n_body, BP), B * H, cdiv(D, BD))``: positions ``p`` of one batch row and
    head; ``acc`` ``[B, R + S - 1, H, D]``; ``head`` ``[B, n_head, H, D]`` takes ``p < n_head``,
    ``body`` ``[B, n_body, H, D]`` row ``p - n_head`` the others (every load past the axis is masked,
    so those rows come out zero)."""
    i_p, i_bh, i_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    o_p = i_p * BP + tl.arange(0, BP)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    b_s = tl.zeros([BP, BD], dtype=tl.float32)
    for j in tl.static_range(S):
        r = o_p - j  # the step whose slot j reads position p
        m_r = (r >= 0) & (r < R)
        b_s += tl.load(g + (((i_b * R + r[:, None]) * S + j) * H + i_h) * D + o_d[None, :],
                       mask=m_r[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    if HAS_ACC:
        P = R + S - 1
        b_s += tl.load(acc + ((i_b * P + o_p[:, None]) * H + i_h) * D + o_d[None, :],
                       mask=(o_p < P)[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    store_split(head, body, b_s, i_b, o_p, i_h, o_d, m_d, n_head, n_body, H, D)


def window_sum(
    g: torch.Tensor,
    acc: Optional[torch.Tensor] = None,
    *,
    split: Optional[int] = None,
    n_body: Optional[int] = None,
    dtype: Optional[torch.dtype] = None,
) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """``g`` ``[B, R, S, H, D]`` -> ``out`` ``[B, R + S - 1, H, D]``, ``out[:, p] = sum_j g[:, p - j, j]``
    over the steps ``0 <= p - j < R``, plus ``acc`` ``[B, R + S - 1, H, D]`` if given; fp32
    accumulation, stored in ``dtype`` (default ``g``'s).

    With ``split = n`` the axis comes back as two tensors, ``out[:, :n]`` and the rest laid onto
    ``n_body`` rows (default ``R + S - 1 - n``; rows past the axis are zero, an axis longer than
    that is cut): the gradients of the two parts of an axis built by concatenation, each
    written once."""
    B, R, S, H, D = g.shape
    P = R + S - 1
    g = g.contiguous()
    if acc is not None:
        if tuple(acc.shape) != (B, P, H, D):
            raise ValueError(f"acc must have shape {(B, P, H, D)}, got {tuple(acc.shape)}")
        acc = acc.contiguous()
    dtype = g.dtype if dtype is None else dtype
    n_head = 0 if split is None else split
    n_body = P - n_head if n_body is None else n_body
    body = torch.empty(B, n_body, H, D, dtype=dtype, device=g.device)
    head = torch.empty(B, n_head, H, D, dtype=dtype, device=g.device) if split is not None else body
    BD = min(128, max(16, next_power_of_2(D)))
    BP = max(1, min(64, 4096 // BD))
    if interpreted(g):
        BP = min(1024, next_power_of_2(max(1, n_head + n_body)))
    if B * H and n_head + n_body:
        window_sum_kernel[(cdiv(n_head + n_body, BP), B * H, cdiv(D, BD))](
            g, acc if acc is not None else g, head if n_head else body, body, R, n_head, n_body, H=H, D=D, S=S, BP=BP, BD=BD,
            HAS_ACC=acc is not None)
    return body if split is None else (head, body)


@triton.jit
def axis_concat_kernel(head, body, out, L, n_head, n_body, E: tl.constexpr, BP: tl.constexpr, BE: tl.constexpr):
    """Grid ``(cdiv(L, BP), B, cdiv(E, BE))``: positions ``p`` of one batch row, ``E`` elements each
    (contiguous); ``p < n_head`` from ``head`` ``[B, n_head, E]``, the others from row ``p - n_head``
    of ``body`` ``[B, n_body, E]``."""
    i_p, i_b, i_e = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    o_p = i_p * BP + tl.arange(0, BP)
    o_e = i_e * BE + tl.arange(0, BE)
    m = (o_p < L)[:, None] & (o_e < E)[None, :]
    in_head = (o_p < n_head)[:, None]
    b_h = tl.load(head + (i_b * n_head + o_p[:, None]) * E + o_e[None, :], mask=m & in_head, other=0.0)
    b_b = tl.load(body + (i_b * n_body + o_p[:, None] - n_head) * E + o_e[None, :], mask=m & ~in_head, other=0.0)
    tl.store(out + (i_b * L + o_p[:, None]) * E + o_e[None, :], tl.where(in_head, b_h, b_b), mask=m)


def axis_concat(head: torch.Tensor, body: torch.Tensor, L: int) -> torch.Tensor:
    """``head`` ``[B, n, ...]`` and ``body`` ``[B, m, ...]`` (same trailing dims and dtype, ``n <= L <= n + m``)
    -> ``torch.cat([head, body[:, :L - n]], 1)`` ``[B, L, ...]``, in one launch: the inverse of
    ``window_sum(g[:, :, None], split=n, n_body=m)``."""
    B, n = head.shape[:2]
    m = body.shape[1]
    if body.shape[0] != B or head.shape[2:] != body.shape[2:] or head.dtype != body.dtype:
        raise ValueError(f"head {tuple(head.shape)} {head.dtype} and body {tuple(body.shape)} {body.dtype} must share "
                         "the batch, the trailing dims and the dtype")
    if not n <= L <= n + m:
        raise ValueError(f"L must lie in [n, n + m] = [{n}, {n + m}], got {L}")
    head, body = head.contiguous(), body.contiguous()
    out = body.new_empty(B, L, *body.shape[2:])
    E = out[0, 0].numel() if L else 0
    BE = min(1024, max(16, next_power_of_2(E)))
    BP = max(1, 4096 // BE)
    if interpreted(body):
        BP = min(1024, next_power_of_2(max(1, L)))
    if B and L and E:
        axis_concat_kernel[(cdiv(L, BP), B, cdiv(E, BE))](head, body, out, L, n, m, E=E, BP=BP, BE=BE)
    return out
