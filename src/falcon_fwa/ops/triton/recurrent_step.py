"""``falcon_step_triton``: ``falcon_step`` for decoding on the fused kernels
(step sizes, then the state update and read in one pass over ``S``). Inference only."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..rules import get_rule
from ..state import FalconState
from ..validate import check_state
from . import recurrent_step_kernels as kern
from .api import _interpreting, check_kernel_dtypes
from .step_sizes import feature_step_sizes
from .launch import cdiv, next_power_of_2

__all__ = ["falcon_step_triton", "STEP_RULES"]

STEP_RULES = ("1", "1A")


def falcon_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    state: Optional[FalconState],
    rule: str = "1A",
    eps: float = 1e-6,
    decay_floor: float = 1e-3,
    shift: bool = True,
    normalize: bool = True,
    log_gate: Optional[torch.Tensor] = None,
    read: str = "after",
    scale_ridge: bool = False,
) -> Tuple[torch.Tensor, FalconState]:
    """One decoding step: ``q``, ``k`` ``[B, H, K]``, ``v`` ``[B, H, V]``, ``beta``,
    ``lam``, ``log_gate`` ``[B, H]``; ``state=None`` starts a fresh sequence. Returns
    ``o`` ``[B, H, V]`` (``v``'s dtype) and the new state (fp32 ``S``), equal to
    ``falcon_step``. Rules "1" and "1A"; no gradients (raises ``NotImplementedError``
    naming what is unsupported, so callers can fall back)."""
    spec = get_rule(rule)
    if spec.name not in STEP_RULES:
        raise NotImplementedError(f"rule={spec.name!r} has no fused step kernel (supported: {STEP_RULES})")
    if read not in ("after", "before"):
        raise ValueError(f"read must be 'after' or 'before', got {read!r}")
    check_kernel_dtypes("the step kernel", q, k, v, beta, lam, log_gate)
    if not (q.is_cuda or (_interpreting() and q.device.type == "cpu")):
        raise NotImplementedError(f"the step kernel needs CUDA tensors (q is on {q.device})")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, beta, lam, log_gate)):
        raise NotImplementedError("the fused step kernel computes no gradients (requires_grad inputs)")
    if q.dim() != 3:
        raise ValueError(f"q must have shape [B, H, K], got {tuple(q.shape)}")
    B, H, K = q.shape
    V = v.shape[-1]
    if state is not None:
        check_state(state, spec, window=1, shift=shift, B=B, H=H, K=K, V=V)

    if shift:
        x = k.new_zeros(B, H, K) if state is None else state.last_key.to(k.dtype)
    else:
        x = k
    valid = torch.full((B,), state is not None or not shift, dtype=torch.bool, device=q.device)
    gate = None if log_gate is None else log_gate.float().contiguous()
    eta, log_a = feature_step_sizes(x[:, None], valid[:, None], beta[:, None], lam[:, None],
                                    None if gate is None else gate[:, None], eps=eps, decay_floor=decay_floor,
                                    normalize=normalize, scale_ridge=scale_ridge)
    S = q.new_zeros(B, H, K, V, dtype=torch.float32) if state is None else state.S.float().contiguous()
    S_new = torch.empty_like(S)
    o = v.new_empty(B, H, V)
    BK = max(16, next_power_of_2(K))
    BV = min(max(16, next_power_of_2(V)), 8192 // BK)
    kern.recurrent_step[(cdiv(V, BV), B * H)](
        S, q.contiguous(), x.contiguous(), v.contiguous(), eta, log_a, gate, S_new, o, H=H, K=K, V=V, BK=BK, BV=BV,
        REGRESSION=spec.regression, READ_AFTER=read == "after", HAS_GATE=gate is not None,
        num_warps=4)
    return o, FalconState(rule=spec.name, window=1, shift=shift, S=S_new, last_key=k if shift else None)
