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

The pairs are laid out once on the extended time axis ``[tail | pairs]`` and the step's
``W`` rows are slices of it. The window Gram of step ``t`` has ``W`` distinct lags,
``G_t[i, j] = c_{|i-j|}(t - min(i, j))`` with ``c_d(p) = x_p . x_{p-d}``, so it is
assembled from ``W`` lag products instead of a batched product of window slots, and its
top eigenvalue comes from repeated squaring (``ops.step_sizes.top_eigenvalue_by_squaring``,
as one kernel: ``step_sizes.top_eigenvalue_triton``; no eigensolver, no host
synchronization). Gradients of the pairs and step sizes
come from autograd; only the scan runs on the kernels. The cost is that of a rule-1 scan
``W`` times as long.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..rules import get_rule
from ..step_sizes import gains_from_statistic
from .delta import SLOT_COUNTS, delta_chunk
from .sliding import window_prefix
from .step_sizes import top_eigenvalue_triton

__all__ = ["sliding_delta_chunk", "SLOT_COUNTS"]


def _time_major_slots(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, W]`` -> ``[B, T * W, H]`` (step ``t``'s slots on rows ``t*W ..``)."""
    B, H, T, W = t.shape
    return t.permute(0, 2, 3, 1).reshape(B, T * W, H).contiguous()


def _window_rows(ext: torch.Tensor, W: int, T: int) -> torch.Tensor:
    """``ext`` ``[B, T + W - 1, H, D]`` (extended axis) -> ``[B, T * W, H, D]``: row
    ``t*W + m`` is slot ``m`` of step ``t``, the pair at extended position ``t + W-1 - m``."""
    n = W - 1
    return torch.stack([ext[:, n - m:n - m + T] for m in range(W)], 2).flatten(1, 2)


def _window_gram(x_ext: torch.Tensor, valid_ext: torch.Tensor, W: int, T: int) -> torch.Tensor:
    """Window Grams ``[B, H, T, W, W]`` (fp32) of the pairs ``x_ext`` ``[B, T + W - 1, H, K]``
    with validity ``valid_ext`` ``[B, T + W - 1]`` (invalid pairs count as zero), from the
    ``W`` lag products ``c_d(p) = x_p . x_{p-d}``."""
    B, L, H = x_ext.shape[:3]
    xf, vf = x_ext.float(), valid_ext.float()
    lags = []
    for d in range(W):
        prod = (xf[:, d:] * xf[:, :L - d]).sum(-1) * (vf[:, d:] * vf[:, :L - d])[..., None]  # [B, L-d, H]
        lags.append(torch.cat([prod.new_zeros(B, d, H), prod], 1))
    c = torch.stack(lags, -1).transpose(1, 2)  # [B, H, L, W]: c[..., p, d] = c_d(p)
    i = torch.arange(W, device=x_ext.device)
    lag = (i[:, None] - i[None, :]).abs()  # [W, W]
    pos = torch.arange(T, device=x_ext.device)[:, None, None] + (W - 1) - torch.minimum(i[:, None], i[None, :])
    return c[:, :, pos, lag]  # [B, H, T, W, W]


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
    Padding rows of ``q``, ``k``, ``v`` must be finite (the op passes zeros there): their
    pairs carry zero gains, but they still enter the kernels' products, where a NaN times a
    zero gain stays NaN. Empty tail slots may hold anything (they are zeroed here).
    Returns ``o`` ``[B, T, H, V]`` in ``q``'s dtype and, with ``output_final_state``,
    ``(S_T, tail_x, tail_y, tail_valid)``.
    """
    W, n = window, window - 1
    if W not in SLOT_COUNTS:
        raise NotImplementedError(f"window={W} is not supported by the rule-3 kernels (supported: {SLOT_COUNTS})")
    B, T, H, K = q.shape
    dev = q.device
    # the extended axis [tail | pairs]: x_p = k_{p-1} (shift) or k_p
    x_pre, y_pre, valid_ext = window_prefix(q, k, v, last_key, tail, lengths, window=W, shift=shift)
    x_ext = torch.cat([x_pre, k[:, :T + n - x_pre.shape[1]]], 1)  # [B, T + n, H, K]
    y_ext = torch.cat([y_pre, v], 1)
    slot = torch.arange(T, device=dev)[:, None] + n - torch.arange(W, device=dev)[None, :]  # [T, W]
    slot_valid = valid_ext[:, slot]  # [B, T, W]

    # step sizes: mu_t = lambda_max(G_t) / B_t, then the shared gains and clamp
    count = slot_valid.sum(-1).clamp(min=1)[:, None, :]  # [B, 1, T]
    stat = top_eigenvalue_triton(_window_gram(x_ext, valid_ext, W, T)) / count
    eta_slots, log_gamma = gains_from_statistic(get_rule("3"), stat, slot_valid, beta.float().transpose(1, 2),
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
    q_rows = q.new_zeros(B, T, W, H, K)
    q_rows[:, :, read] = q
    o, S_T = delta_chunk(q_rows.flatten(1, 2), _window_rows(x_ext, W, T), _window_rows(y_ext, W, T),
                         _time_major_slots(eta), _time_major_slots(kappa), _time_major_slots(carry),
                         None if S0 is None else S0.float(), read_after=read_after, chunk_size=chunk_size,
                         output_final_state=output_final_state, slots=W)
    o = o.view(B, T, W, H, -1)[:, :, read]
    if not output_final_state:
        return o, None
    if W == 1:
        return o, (S_T, None, None, None)
    # the last W-1 pairs of every row (oldest first): extended positions end .. end + n - 1
    end = torch.full((B,), T, device=dev) if lengths is None else lengths.to(dev)
    idx = end[:, None] + torch.arange(n, device=dev)[None, :]  # [B, n]
    rows = torch.arange(B, device=dev)[:, None]
    return o, (S_T, x_ext[rows, idx].transpose(1, 2).float(), y_ext[rows, idx].transpose(1, 2).float(),
               valid_ext.gather(1, idx))
