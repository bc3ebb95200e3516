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
``0 .. T + W - 2``; slot ``j`` of step ``t`` is position ``t + j``; ``_WindowWrites`` for the
features, ``delta_chunk(..., value_prefix=...)`` for the values). Every kernel reads the features
and values in place from that axis (``delta_chunk(..., windowed=True)``): the ``T * W`` write rows
are never materialized. The values' gradients sum back onto ``v`` and the tail in one pass
(``window_sum``), the features' go there with the step sizes' gradient (``_WindowWrites``).

The step sizes come from the window Grams ``G_t[i, j] = x_{t+i} . x_{t+j}`` (one kernel over the
axis, ``delta_kernels.window_gram_fwd``) and their top eigenvalues by repeated squaring
(``ops.step_sizes.top_eigenvalue_by_squaring``; no eigensolver, no host synchronization), in
one kernel with the gains that writes ``eta``, ``kappa`` and the carry per write, time-major
(``[B, T, W, H]``, the rows' order): ``step_sizes.window_steps_forward``. Their backward is one
kernel too, whose gradient of the top eigenvalues the Grams' backward takes. The cost is that of
a rule-1 scan ``W`` times as long.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import delta_kernels as wy
from .delta import SLOT_COUNTS, delta_chunk
from .launch import cdiv, interpreted, next_power_of_2
from .sliding import _ext_rows, window_prefix
from .step_sizes import window_steps_backward, window_steps_forward
from .window_sum import axis_concat

__all__ = ["sliding_delta_chunk", "SLOT_COUNTS"]


class _WindowWrites(torch.autograd.Function):
    """The keys' extended axis and the per-write step sizes of rule 3, one node.

    Forward: ``x_ext`` ``[B, L, H, K]``, the concatenation ``[prefix | body]`` cut to ``L`` rows
    (``axis_concat``: one launch that reads each row once; ``torch.cat`` of a few prefix rows and a
    long body ran at a sixth of the copy bandwidth on an H200); the window Grams ``G_t[i, j] =
    x_{t+i} . x_{t+j}`` ``[B, T, H, W, W]`` fp32 (``T = L - W + 1``; a pair with ``valid_ext`` False
    counts as zero; ``delta_kernels.window_gram_fwd``), never returned; and from their top
    eigenvalues the step sizes per write, ``eta``, ``kappa`` (``None`` without a gate) and the
    carry ``[B, T * W, H]`` (``step_sizes.window_steps_forward``). Backward: the step sizes'
    gradient gives that of the top eigenvalues (``d G_t = d_top_t v_t v_t^T``, never formed), and one
    launch (``window_gram_bwd``) adds it to the axis' gradient from the scan, split onto ``prefix`` and
    ``body`` (rows of ``body`` past the axis get zero): autograd would add the two gradients on the
    axis in a pass of its own, and the split would be a third."""

    @staticmethod
    def forward(ctx, prefix, body, valid_ext, beta, lam, log_gate, L, W, steps):
        x_ext = axis_concat(prefix, body, L)
        B, _, H, K = x_ext.shape
        T = L - W + 1
        G = x_ext.new_empty(B, T, H, W, W, dtype=torch.float32)
        BT, BK = max(1, 64 // W), min(64, max(16, next_power_of_2(K)))
        if interpreted(x_ext):
            BT = min(1024, next_power_of_2(T))
        wy.window_gram_fwd[(cdiv(T, BT), B * H)](x_ext, valid_ext, G, T, L, H=H, K=K, W=W, BT=BT, BK=BK)
        eta, kappa, carry, top, vec = window_steps_forward(G, valid_ext, beta, lam, log_gate, **steps)
        ctx.save_for_backward(x_ext, valid_ext, beta, lam, log_gate, top, vec)
        ctx.W, ctx.n_pre, ctx.n_body, ctx.steps = W, prefix.shape[1], body.shape[1], steps
        return x_ext, eta, kappa, carry

    @staticmethod
    @once_differentiable
    def backward(ctx, d_ext, d_eta, d_kappa, d_carry):
        x_ext, valid_ext, beta, lam, log_gate, top, vec = ctx.saved_tensors
        B, L, H, K = x_ext.shape
        W, n_pre, n_body = ctx.W, ctx.n_pre, ctx.n_body
        d_top, d_beta, d_lam, d_gate = window_steps_backward(top, valid_ext, beta, lam, log_gate, d_eta, d_kappa,
                                                              d_carry, **ctx.steps)
        d_pre = x_ext.new_empty(B, n_pre, H, K)
        d_body = x_ext.new_empty(B, n_body, H, K)
        BP, BK = 32, min(64, max(16, next_power_of_2(K)))
        if interpreted(x_ext):
            BP = min(1024, next_power_of_2(n_pre + n_body))
        wy.window_gram_bwd[(cdiv(n_pre + n_body, BP), B * H, cdiv(K, BK))](
            x_ext, valid_ext, vec, d_top, d_ext.contiguous(), d_pre if n_pre else d_body, d_body,
            L - W + 1, L, n_pre, n_body, H=H, K=K, W=W, BP=BP, BK=BK)
        return d_pre, d_body, None, d_beta, d_lam, d_gate, None, None, None


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
    # the axis [B, T + n, H, K] and the step sizes per write [B, T * W, H] (step t on rows t*W ..): from the
    # top eigenvalue of each window's Gram, mu_t = lambda_max(G_t) / B_t; kappa is None without a gate
    steps = dict(eps=eps, decay_floor=decay_floor, normalize=normalize, scale_ridge=scale_ridge)
    x_ext, eta, kappa, carry = _WindowWrites.apply(x_pre, k, valid_ext, beta.contiguous(), lam.contiguous(),
                                                   None if log_gate is None else log_gate.contiguous(), T + n, W,
                                                   steps)
    # the query on the read row only
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
