r"""The normalized read of the inner-product rules (the paper's Eq. 2.3 and Appendix C.1).

The op's default read is denominator-free, ``o_t = S_t^T q_t``. The normalized read
divides it by a second fast state ``z`` written like ``S`` with every value equal to one::

    o_t = S_t^T q_t / (z_t^T q_t + eps_attn),     z_t = gamma_t exp(g_t) z_{t-1} + eta_t x_t

(1A; 3A averages the window's features, ``eta_t / B_t sum_{j in I_t} x_j``; 2A keeps one
``z`` per value column, ``z_{t,c} = gamma_{t,c} exp(g_t) z_{t-1,c} + eta_{t,c} x_t``).
With ``eta = 1`` and ``lambda = 0`` this is causal normalized linear attention
(``z_t = sum_{s <= t} x_s``). ``z`` is the rule's own recurrence on values of one, so it
is computed by the same forms and kernels on the value columns extended by ones
(``extend``: one column for 1A and 3A, ``V`` columns with the gains repeated for 2A, then zero
columns up to a multiple of 16) and split off afterwards (``split``). The regression rules have
no such state: their write depends on the values through the residual.

The denominator is safe only where ``z_t^T q_t`` stays positive, as with elementwise
nonnegative features (Appendix C.2); ``eps_attn`` adds to it as written, and a zero
denominator gives ``inf`` or NaN as any division does. The first step of a fresh sequence with
``shift=True`` (the sentinel ``x_1 = 0``) or ``read="before"`` reads the empty memory,
``0 / (0 + eps_attn)``: NaN with ``eps_attn = 0``; with both, the first two steps do (step 2 reads
``S_1``, which the sentinel left empty).

Numerator and denominator are the extended op's output columns, so they are formed in the
output's dtype before the division. float16 inputs are therefore widened to float32 first
(``extend``): ``S_t^T q_t`` and ``z_t^T q_t`` grow with the context (``z^T q`` is a sum of
attention weights) and pass float16's largest value, 65504, long before their ratio does.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional, Tuple

import torch

from .rules import RuleSpec
from .state import FalconState
from .validate import check_shapes, check_state, check_state_type

__all__ = ["check_eps_attn", "refuse_normalizer_state", "extend", "split"]


def check_eps_attn(eps_attn, spec: RuleSpec) -> None:
    """``eps_attn`` must be a finite number >= 0, and the rule an inner-product one."""
    if isinstance(eps_attn, bool) or not isinstance(eps_attn, (int, float)) or not math.isfinite(eps_attn) \
            or eps_attn < 0:
        raise ValueError(f"eps_attn must be a finite number >= 0 (or None for the denominator-free read), "
                         f"got {eps_attn!r}")
    if spec.regression:
        raise ValueError(f"eps_attn (the normalized read, Appendix C.1) applies to the inner-product rules 1A, 2A "
                         f"and 3A; rule {spec.name!r} is a regression rule, whose write has no normalizer state")


def refuse_normalizer_state(state: Optional[FalconState], name: str) -> None:
    """A state that carries ``z`` continues a normalized read only."""
    if state is not None and getattr(state, "z", None) is not None:
        raise ValueError(f"{name} carries the read normalizer z of a call with eps_attn; pass eps_attn to continue it")


def _z_columns(spec: RuleSpec, V: int) -> Tuple[int, int]:
    """``(n, pad)``: ``n`` columns of ``z`` (one, or ``V`` for 2A) and ``pad`` zero columns after them,
    so that the extended rows hold a multiple of 16 values. Rows of ``V + 1`` two-byte values are
    not 16-byte aligned, and the kernels' loads of them were several times slower (B=8, T=2048,
    H=16, V=128, bf16 on an H200: 4.3x the denominator-free time, forward+backward, for 1A)."""
    n = V if spec.per_column else 1
    return n, -(V + n) % 16


def _ones_then_zeros(t: torch.Tensor, n: int, pad: int) -> torch.Tensor:
    """``t`` ``[..., V]`` followed by ``n`` columns of ones and ``pad`` of zeros."""
    lead = t.shape[:-1]
    return torch.cat([t, t.new_ones(*lead, n), t.new_zeros(*lead, pad)], dim=-1)


def _widen(t: torch.Tensor) -> torch.Tensor:
    """float16 -> float32 (module docstring); other dtypes as they are."""
    return t.float() if t.dtype == torch.float16 else t


def extend(q, k, v, beta, lam, log_gate, state: Optional[FalconState], spec: RuleSpec, *, axes: Tuple[str, ...],
           name: str, window: int, shift: bool, packed: bool = False
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Optional[FalconState]]:
    """``(q, k, v_ext, beta_ext, state_ext)``. Values ``[..., V]`` -> ``[..., V + n + pad]``: ``n``
    columns of ones (``n = 1``, or ``V`` for 2A, whose gains ``beta`` ``[..., V]`` are repeated for
    them) and ``pad`` of zeros (``_z_columns``), and the state ``(S, z)`` -> ``[S | z | 0]`` (the
    tail's values of the sliding rules extended the same way); float16 ``q``, ``k``, ``v`` are
    widened to float32 (module docstring). Works on sequences (``axes`` ``("B", "T", "H")``) and
    single steps (``("B", "H")``) alike. The shapes, and the state against this configuration
    (``window``, ``shift``; its rows against ``q``'s unless ``packed``, where ``cu_seqlens``
    counts them), are checked first, so that an error names the caller's ``V``, not the extended
    one."""
    check_shapes(q, k, v, beta, lam, log_gate, spec, axes)
    q, k, v = _widen(q), _widen(k), _widen(v)
    V = v.shape[-1]
    n, pad = _z_columns(spec, V)
    v_ext = _ones_then_zeros(v, n, pad)
    beta_ext = torch.cat([beta, beta, beta.new_zeros(*beta.shape[:-1], pad)], dim=-1) if spec.per_column else beta
    if state is None:
        return q, k, v_ext, beta_ext, None
    check_state_type(state, name)
    if state.z is None:
        raise ValueError(f"{name} has no read normalizer z: it comes from a call without eps_attn")
    if state.S.shape[-1] != V:
        raise ValueError(f"{name}.S has {state.S.shape[-1]} value columns, but v has {V}")
    H, K = q.shape[-2:]
    check_state(state, spec, window=window if spec.sliding else 1, shift=shift,
                B=state.S.shape[0] if packed else q.shape[0], H=H, K=K, V=V, device=q.device, name=name)
    want = (*state.S.shape[:-1], n) if spec.per_column else tuple(state.S.shape[:-1])
    if tuple(state.z.shape) != want:
        raise ValueError(f"{name}.z must have shape {'[B, H, K, V]' if spec.per_column else '[B, H, K]'} = {want}, "
                         f"got {tuple(state.z.shape)}")
    z = state.z if spec.per_column else state.z[..., None]
    S_ext = torch.cat([state.S, z.to(state.S.dtype), state.S.new_zeros(*state.S.shape[:-1], pad)], dim=-1)
    tail_y = None if state.tail_y is None else _ones_then_zeros(state.tail_y, n, pad)
    return q, k, v_ext, beta_ext, replace(state, S=S_ext, tail_y=tail_y, z=None)


def split(out: Tuple[torch.Tensor, Optional[FalconState]], *, V: int, spec: RuleSpec,
          eps_attn: float, dtype: torch.dtype) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """``(o_ext, state_ext)`` of the extended values -> the normalized read ``o`` ``[..., V]``
    in ``dtype`` (the caller's ``v``'s) and the state with ``z`` split off ``S``."""
    o_ext, state = out
    n, _ = _z_columns(spec, V)
    num, den = o_ext[..., :V], o_ext[..., V:V + n]
    acc = torch.promote_types(o_ext.dtype, torch.float32)  # a 16-bit read divides in float32
    o = (num.to(acc) / (den.to(acc) + eps_attn)).to(dtype)
    if state is None:
        return o, None
    z = state.S[..., V:V + n]
    return o, replace(state, S=state.S[..., :V], z=z if spec.per_column else z[..., 0],
                      tail_y=None if state.tail_y is None else state.tail_y[..., :V])
