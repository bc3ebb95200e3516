r"""Rule 3 (sliding-window regression, the ParallelFlow write) on the WY kernels of rule 1.

Step ``t`` writes its ``W`` window pairs (slot ``m`` holds pair ``t - m``), every one
against the state before the step::

    S_t = a_t S_{t-1} + sum_m x_{t,m} (eta_{t,m} y_{t,m} - kappa_{t,m} S_{t-1}^T x_{t,m})^T

Laid out as a sequence of ``T * W`` writes (step ``t`` on rows ``t*W .. t*W+W-1``, the
carry ``log a_t`` on the first of them and ``0`` on the others), this is the rule-1
recurrence except that writes of one step do not see one another: the WY system is
block-strictly lower, which ``delta_chunk(..., slots=W)`` solves. The query of step ``t``
sits on its last row (read after the write: it sees all ``W`` writes) or its first (read
before: it sees the earlier steps only); the other rows read nothing.

The pairs, the window step sizes (with the top-eigenvalue statistic of the window's Gram)
and the tail that continues a segment are the PyTorch op's own (``ops.pairs``,
``ops.step_sizes``), so their gradients come from autograd; only the scan runs on the
kernels. The cost is that of a rule-1 scan ``W`` times as long.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..pairs import next_tail, window_slots, write_pairs
from ..rules import get_rule
from ..step_sizes import step_sizes
from .delta import SLOT_COUNTS, delta_chunk

__all__ = ["sliding_delta_chunk", "SLOT_COUNTS"]


def _time_major_slots(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, W, *rest]`` -> ``[B, T * W, H, *rest]`` (step ``t``'s slots on rows ``t*W ..``)."""
    B, H, T, W = t.shape[:4]
    return t.movedim(1, 3).reshape(B, T * W, H, *t.shape[4:]).contiguous()


def sliding_delta_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    log_gate: Optional[torch.Tensor],
    S0: Optional[torch.Tensor],
    last_key: Optional[torch.Tensor],
    tail: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    window: int,
    eps: float,
    decay_floor: float,
    shift: bool,
    normalize: bool,
    scale_ridge: bool,
    read_after: bool,
    chunk_size: int,
    lengths: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
):
    """Rule 3 over rows of equal length (rows may end in padding: ``lengths`` ``[B]``).

    Time-major inputs as ``sliding.sliding_chunk``: ``q``, ``k`` ``[B, T, H, K]`` (one dtype),
    ``v`` ``[B, T, H, V]``, ``beta``, ``lam``, ``log_gate`` ``[B, T, H]`` (zero on padding
    steps), ``S0`` ``[B, H, K, V]``, ``last_key`` ``[B, H, K]``, ``tail = (tail_x, tail_y,
    tail_valid)`` as in ``FalconState`` (or ``None``). ``window`` must be in ``SLOT_COUNTS``.
    Returns ``o`` ``[B, T, H, V]`` in ``q``'s dtype and, with ``output_final_state``,
    ``(S_T, tail_x, tail_y, tail_valid)``.
    """
    W = window
    if W not in SLOT_COUNTS:
        raise NotImplementedError(f"window={W} is not supported by the rule-3 kernels (supported: {SLOT_COUNTS})")
    B, T, H, K = q.shape
    dt = q.dtype
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)  # head-first, as ops.pairs takes them
    step_mask = None if lengths is None else torch.arange(T, device=q.device)[None, :] < lengths[:, None]
    x, valid = write_pairs(kh, shift, None if last_key is None else last_key.to(dt), step_mask)
    xs, ys, slot_valid = window_slots(x, vh, valid, W, tail)  # [B, H, T, W, K], [B, H, T, W, V]
    eta_slots, log_gamma = step_sizes(get_rule("3"), xs.float(), slot_valid, beta.float().transpose(1, 2),
                                      lam.float().transpose(1, 2), eps=eps, decay_floor=decay_floor,
                                      normalize=normalize, scale_ridge=scale_ridge)
    eta, log_a = eta_slots[..., 0], log_gamma[..., 0]  # [B, H, T, W], [B, H, T]
    kappa = eta
    if log_gate is not None:  # the carry gamma * exp(g); the residual is read at the gated state
        g = log_gate.float().transpose(1, 2)
        log_a = log_a + g
        kappa = eta * torch.exp(g)[..., None]
    # the carry on each step's first row, nothing on the others
    carry = torch.cat([log_a[..., None], log_a.new_zeros(B, H, T, W - 1)], -1)
    read = W - 1 if read_after else 0
    q_rows = torch.zeros(B, H, T, W, K, dtype=dt, device=q.device)
    q_rows[:, :, :, read] = q.transpose(1, 2)
    o, S_T = delta_chunk(_time_major_slots(q_rows), _time_major_slots(xs.to(dt)), _time_major_slots(ys.to(dt)),
                         _time_major_slots(eta), _time_major_slots(kappa), _time_major_slots(carry),
                         None if S0 is None else S0.float(), read_after=read_after, chunk_size=chunk_size,
                         output_final_state=output_final_state, slots=W)
    o = o.view(B, T, W, H, -1)[:, :, read]
    if not output_final_state:
        return o, None
    if W == 1:
        return o, (S_T, None, None, None)
    tx, ty, tv = next_tail(x, vh, valid, W, tail, lengths)
    return o, (S_T, tx.float(), ty.float(), tv)
