r"""Rule 3 (sliding-window regression, the ParallelFlow write) on the WY kernels of rule 1.

Step ``t`` writes its ``W`` window pairs (slot ``j`` holds pair ``t - W + 1 + j``, oldest
first), every one against the state before the step::

    S_t = a_t S_{t-1} + sum_j x_{t,j} (eta_{t,j} y_{t,j} - kappa_{t,j} S_{t-1}^T x_{t,j})^T

Laid out as a sequence of ``T * W`` writes (step ``t`` on rows ``t*W .. t*W+W-1``, the
carry ``log a_t`` on the first of them and ``0`` on the others), this is the rule-1
recurrence except that writes of one step do not see one another: the WY system is
block-strictly lower, which ``delta_chunk(..., slots=W)`` solves. The query of step ``t``
sits on its last row (read after the write: it sees all ``W`` writes) or its first (read
before: it sees the earlier steps only); the other rows read nothing. The kernels read
``q`` and write ``o`` one row per step (``delta_chunk(..., query_slot=...)``), so neither
is ever laid out over the ``T * W`` rows.

The pairs are laid out once on the extended time axis ``[tail | pairs]`` (positions
``0 .. T + W - 2``; slot ``j`` of step ``t`` is position ``t + j``; ``_KeyAxis`` for the features,
``delta_chunk(..., value_prefix=...)`` for the values). Every kernel reads the features and values
in place from that axis (``delta_chunk(..., windowed=True)``): the ``T * W`` write rows are never
materialized. Their gradients sum back onto the axis in one pass each (``window_sum``); the
values' pass stores them straight onto ``v`` and the tail, the features' go there with the window
Grams' gradient (``_KeyAxis``).
The per-write scalars ``eta``, ``kappa`` and the carry are formed time-major (``[B, T, W, H]``,
the rows' order) from the step sizes, which are time-major themselves.
The window Gram ``G_t[i, j] = x_{t+i} . x_{t+j}`` comes from one kernel over the axis
(``delta_kernels.window_gram_fwd``; its backward also adds the axis' gradient from the scan and
splits the sum onto the keys and the tail, ``_KeyAxis``), and its top eigenvalue from
repeated squaring (``ops.step_sizes.top_eigenvalue_by_squaring``, as one kernel:
``step_sizes.top_eigenvalue_triton``; no eigensolver, no host synchronization). Gradients
of the step sizes come from autograd. The cost is that of a rule-1 scan ``W`` times as
long.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..rules import get_rule
from ..step_sizes import gains_from_statistic
from . import delta_kernels as wy
from .delta import SLOT_COUNTS, delta_chunk
from .launch import cdiv, next_power_of_2
from .sliding import _ext_rows, window_prefix
from .step_sizes import top_eigenvalue_triton
from .window_sum import axis_concat

__all__ = ["sliding_delta_chunk", "SLOT_COUNTS"]


def _slot_rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, T, W]`` -> ``[B, T * W, H]`` (step ``t``'s slots on rows ``t*W ..``): a view when
    ``t`` is laid out time-major (``[B, T, W, H]`` in memory, as the step sizes come), else a copy."""
    B, H, T, W = t.shape
    return t.permute(0, 2, 3, 1).contiguous().view(B, T * W, H)


class _KeyAxis(torch.autograd.Function):
    """The keys' extended axis and its window Grams, one node: ``x_ext`` ``[B, L, H, K]``, the
    concatenation ``[prefix | body]`` cut to ``L`` rows (``axis_concat``: one launch that reads each
    row once; ``torch.cat`` of a few prefix rows and a long body ran at a sixth of the copy
    bandwidth on an H200), and ``G`` ``[B, T, H, W, W]`` fp32,
    ``G_t[i, j] = x_{t+i} . x_{t+j}`` (``T = L - W + 1``; a pair with ``valid_ext`` False counts as
    zero): ``delta_kernels.window_gram_fwd``. The backward receives the axis' gradient from the
    scan and the Grams' together and forms their sum, split onto ``prefix`` and ``body``, in one
    launch (``window_gram_bwd``): autograd would add the two gradients on the axis in a pass of
    its own, and the split would be a third (rows of ``body`` past the axis get zero)."""

    @staticmethod
    def forward(ctx, prefix, body, valid_ext, L, W):
        x_ext = axis_concat(prefix, body, L)
        B, _, H, K = x_ext.shape
        T = L - W + 1
        G = x_ext.new_empty(B, T, H, W, W, dtype=torch.float32)
        BT, BK = max(1, 64 // W), min(64, max(16, next_power_of_2(K)))
        if not x_ext.is_cuda:  # Triton's interpreter: its cost is per program and op, not per element
            BT = min(1024, next_power_of_2(T))
        wy.window_gram_fwd[(cdiv(T, BT), B * H)](x_ext, valid_ext, G, T, L, H=H, K=K, W=W, BT=BT, BK=BK)
        ctx.save_for_backward(x_ext, valid_ext)
        ctx.W, ctx.n_pre, ctx.n_body = W, prefix.shape[1], body.shape[1]
        return x_ext, G

    @staticmethod
    @once_differentiable
    def backward(ctx, d_ext, dG):
        x_ext, valid_ext = ctx.saved_tensors
        B, L, H, K = x_ext.shape
        W, n_pre, n_body = ctx.W, ctx.n_pre, ctx.n_body
        d_pre = x_ext.new_empty(B, n_pre, H, K)
        d_body = x_ext.new_empty(B, n_body, H, K)
        BP, BK = 32, min(64, max(16, next_power_of_2(K)))
        if not x_ext.is_cuda:  # the interpreter (see forward)
            BP = min(1024, next_power_of_2(n_pre + n_body))
        wy.window_gram_bwd[(cdiv(n_pre + n_body, BP), B * H, cdiv(K, BK))](
            x_ext, valid_ext, dG.contiguous(), d_ext.contiguous(), d_pre if n_pre else d_body, d_body,
            L - W + 1, L, n_pre, n_body, H=H, K=K, W=W, BP=BP, BK=BK)
        return d_pre, d_body, None, None, None


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
    # [B, T + n, H, K] and the window Grams [B, T, H, W, W]
    x_ext, gram = _KeyAxis.apply(x_pre, k, valid_ext, T + n, W)
    slot_valid = valid_ext.unfold(1, W, 1)  # [B, T, W]: slot j of step t is the pair at t + j

    # step sizes: mu_t = lambda_max(G_t) / B_t, then the shared gains and clamp; every [B, H, T]
    # tensor below is a view of a time-major [B, T, H] one (as beta, lam and the gate come)
    count = slot_valid.sum(-1).clamp(min=1)[..., None]  # [B, T, 1]
    stat = (top_eigenvalue_triton(gram) / count).transpose(1, 2)
    eta_slots, log_gamma = gains_from_statistic(get_rule("3"), stat, slot_valid, beta.float().transpose(1, 2),
                                                lam.float().transpose(1, 2), eps=eps, decay_floor=decay_floor,
                                                normalize=normalize, scale_ridge=scale_ridge)
    eta = _slot_rows(eta_slots[..., 0])  # [B, T * W, H]
    log_a = log_gamma[..., 0].transpose(1, 2)  # [B, T, H]
    kappa = eta
    if log_gate is not None:  # the carry gamma * exp(g); the residual is read at the gated state
        g = log_gate.float()
        log_a = log_a + g
        kappa = (eta.view(B, T, W, H) * torch.exp(g)[:, :, None]).reshape(B, T * W, H)
    # the carry on each step's first row, nothing on the others; the query on the read row only
    carry = log_a if W == 1 else F.pad(log_a.contiguous()[:, :, None], (0, 0, 0, W - 1)).reshape(B, T * W, H)
    read = W - 1 if read_after else 0
    # the pairs read in place from the axes; the values' axis [y_pre | v] is built inside the scan, whose
    # backward sums the writes' gradients straight onto y_pre and v
    o, S_T = delta_chunk(q, x_ext, v, eta, kappa, carry, None if S0 is None else S0.float(), read_after=read_after,
                         chunk_size=chunk_size, output_final_state=output_final_state, slots=W, windowed=True,
                         query_slot=None if W == 1 else read, value_prefix=y_pre if n else None)
    if not output_final_state:
        return o, None
    if W == 1:
        return o, (S_T, None, None, None)
    # the last W-1 pairs of every row (oldest first): extended positions end .. end + n - 1
    end = torch.full((B,), T, device=dev) if lengths is None else lengths.to(dev)
    idx = end[:, None] + torch.arange(n, device=dev)[None, :]  # [B, n]
    rows = torch.arange(B, device=dev)[:, None]
    return o, (S_T, x_ext[rows, idx].transpose(1, 2).float(), _ext_rows(y_pre, v, idx).transpose(1, 2).float(),
               valid_ext.gather(1, idx))
