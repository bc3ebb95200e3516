"""Causal training pairs: the shifted write feature and the sliding window.

Internal layout is head-first: ``[B, H, T, ...]``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

__all__ = ["write_pairs", "window_slots", "next_tail", "WriteSide", "write_side"]


def write_pairs(
    k: torch.Tensor,
    shift: bool,
    last_key: Optional[torch.Tensor],
    step_mask: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Write features ``x`` and pair validity.

    ``k``: ``[B, H, T, K]`` key features. With ``shift=True`` the pair written at
    step ``t`` is ``(x_t, y_t) = (phi(k_{t-1}), v_t)``; the first step of a fresh
    sequence has no prefix feature, so ``x_1 = 0`` and the pair is marked invalid
    (the boundary sentinel, ``eta_1 = 0``). A continued sequence takes
    ``x_1 = last_key`` and is valid. With ``shift=False`` the pair is ``(k_t, v_t)``
    and every step is valid.

    ``step_mask`` (``[B, T]`` bool, optional): False marks padding steps, which
    carry no pair (their step is a no-op: zero gain, unit carry).

    Returns ``x`` ``[B, H, T, K]`` and ``valid`` ``[B, T]`` (bool).
    """
    B, H, T, K = k.shape
    valid = torch.ones(B, T, dtype=torch.bool, device=k.device) if step_mask is None else step_mask.clone()
    if not shift:
        return k, valid
    first = torch.zeros(B, H, 1, K, dtype=k.dtype, device=k.device) if last_key is None else last_key.to(k.dtype)[:, :, None]
    x = torch.cat([first, k[:, :, :-1]], dim=2)
    if last_key is None:
        valid[:, 0] = False
    return x, valid


def empty_tail(x: torch.Tensor, y: torch.Tensor, n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``n`` empty pair slots for ``x`` ``[B, H, T, K]`` and ``y`` ``[B, H, T, V]``."""
    B, H = x.shape[:2]
    return (x.new_zeros(B, H, n, x.shape[-1]), y.new_zeros(B, H, n, y.shape[-1]),
            torch.zeros(B, n, dtype=torch.bool, device=x.device))


def window_slots(
    x: torch.Tensor,
    y: torch.Tensor,
    valid: torch.Tensor,
    window: int,
    tail: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the window ``I_t`` of the last ``window`` causal pairs for every step.

    Slot ``m`` of step ``t`` holds pair ``t - m`` (``m = 0`` is the current pair).
    Pairs before the segment come from ``tail = (tail_x, tail_y, tail_valid)``
    (the last ``window - 1`` pairs of the previous segment, oldest first); without
    a tail they are empty. Invalid slots (sentinel, padding, before the start) are zeroed and
    flagged.

    Returns ``xs`` ``[B, H, T, W, K]``, ``ys`` ``[B, H, T, W, V]`` and
    ``slot_valid`` ``[B, T, W]``.
    """
    B, H, T, K = x.shape
    W = window
    if W == 1:
        return x[:, :, :, None], y[:, :, :, None], valid[:, :, None]
    tx, ty, tv = empty_tail(x, y, W - 1) if tail is None else tail
    tx, ty = tx.to(x.dtype), ty.to(y.dtype)
    xe = torch.cat([tx, x], dim=2)  # [B, H, W-1+T, K]
    ye = torch.cat([ty, y], dim=2)
    ve = torch.cat([tv, valid], dim=1)  # [B, W-1+T]
    # idx[t, m] = position of pair t - m in the extended sequence
    idx = (torch.arange(T, device=x.device)[:, None] + (W - 1)) - torch.arange(W, device=x.device)[None, :]
    xs = xe[:, :, idx]  # [B, H, T, W, K]
    ys = ye[:, :, idx]
    sv = ve[:, idx]  # [B, T, W]
    m = sv[:, None, :, :, None]
    return xs.masked_fill(~m, 0.0), ys.masked_fill(~m, 0.0), sv


def next_tail(
    x: torch.Tensor,
    y: torch.Tensor,
    valid: torch.Tensor,
    window: int,
    tail: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
    lengths: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The last ``window - 1`` causal pairs after this segment (oldest first), for
    exact continuation of the sliding rules: ``(tail_x, tail_y, tail_valid)``.
    ``lengths`` ``[B]``: real steps per row when rows end in padding."""
    n = window - 1
    B, H, T = x.shape[:3]
    if tail is None:
        tail = empty_tail(x, y, n)
    xe = torch.cat([tail[0].to(x.dtype), x], dim=2)
    ye = torch.cat([tail[1].to(y.dtype), y], dim=2)
    ve = torch.cat([tail[2], valid], dim=1)
    end = torch.full((B,), T, device=x.device) if lengths is None else lengths.to(x.device)
    idx = end[:, None] + torch.arange(n, device=x.device)[None, :]  # extended positions of the last n steps
    pick = idx[:, None, :, None]
    return (xe.gather(2, pick.expand(B, H, n, xe.shape[-1])), ye.gather(2, pick.expand(B, H, n, ye.shape[-1])),
            ve.gather(1, idx))


class WriteSide(NamedTuple):
    """The pairs of one segment (``write_side``), head-first."""

    x: torch.Tensor  # [B, H, T, K] write features x_t
    valid: torch.Tensor  # [B, T] the step writes a pair
    xs: torch.Tensor  # [B, H, T, W, K] window slots (window_slots)
    ys: torch.Tensor  # [B, H, T, W, V]
    slot_valid: torch.Tensor  # [B, T, W]
    tail: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # the pairs before the segment, or None


def write_side(k: torch.Tensor, v: torch.Tensor, state, window: int, shift: bool,
               step_mask: Optional[torch.Tensor] = None) -> WriteSide:
    """``write_pairs`` and ``window_slots`` of a segment with keys ``k`` ``[B, H, T, K]`` and values ``v``
    ``[B, H, T, V]``, continuing ``state`` (a ``FalconState``: its last key and, with ``window > 1``,
    its sliding tail) or fresh (``None``)."""
    last_key = None if state is None or not shift else state.last_key
    tail = None if state is None or window == 1 else (state.tail_x, state.tail_y, state.tail_valid)
    x, valid = write_pairs(k, shift, last_key, step_mask)
    xs, ys, slot_valid = window_slots(x, v, valid, window, tail)
    return WriteSide(x, valid, xs, ys, slot_valid, tail)
