"""The recurrent form on the fused kernel (``recurrent_kernels.fused_recurrent``), for inference:
``falcon_recurrent_triton`` runs a segment of tokens (short prompts), ``falcon_step_triton``
one decoding step. Both cover the six rules and every switch of the op; neither computes
gradients (``NotImplementedError``, so callers can fall back)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernel_limits import MAX_FUSED_HEAD_DIM, MAX_FUSED_WINDOW
from ..rules import get_rule
from ..seqlens import last_steps, packed_bounds
from ..segments import other_derivative
from ..state import FalconState
from ..validate import check_inputs, check_options, check_state, check_state_type, plain_number
from . import recurrent_kernels as kern
from .api import TRITON_RULES, check_kernel_support
from .launch import cdiv, next_power_of_2

__all__ = ["falcon_recurrent_triton", "falcon_step_triton", "wants_gradient", "STEP_RULES", "SHORT_PROMPT_LIMITS",
           "MAX_FUSED_WINDOW", "MAX_FUSED_HEAD_DIM"]

# Rules whose fused kernel ``falcon_step(backend="auto")`` takes on CUDA: those checked on a GPU
# against the float64 recurrent form (tests/test_triton_recurrent.py; benchmarks/results/h200_tests.md).
STEP_RULES: tuple = ("1", "1A", "2", "2A", "3", "3A")
# Per rule, the calls that backend="auto" runs on the fused kernel instead of the chunk kernels when no
# gradient is needed: at most max_T steps (all sequences together) and at most max_token_heads of
# B * T * H. On an H200 (benchmarks/results/h200-short-prompts.md: bf16, H=6, K=V=128, a model's prompt
# pass) the fused kernel was 1.4-12x faster at every such length, with a margin below the measured
# crossovers: one program walks a sequence's steps, so its time grows with T at small batches and with
# B * T * H once the programs fill the GPU, while the chunk kernels' time stays near their launch cost.
SHORT_PROMPT_LIMITS: dict = {"1": (128, 12288), "1A": (256, 24576), "2": (128, 12288), "2A": (128, 12288),
                            "3": (128, 6144), "3A": (256, 24576)}
_EIGEN_SQUARINGS = 20  # rule 3's window statistic, as ops.step_sizes.top_eigenvalue_by_squaring


def wants_gradient(tensors, state: Optional[FalconState]) -> bool:
    """Whether autograd would need a gradient of any of ``tensors`` or of ``state``'s tensors, or another
    derivative is taken through them (``segments.other_derivative``)."""
    if other_derivative(tensors, state):
        return True
    if not torch.is_grad_enabled():
        return False
    # a state of the wrong type is refused by the checks after this
    return any(t is not None and t.requires_grad for t in tensors) or bool(getattr(state, "requires_grad", False))


def _check_fused(spec, window, q, k, v, beta, lam, log_gate, initial_state, decay_floor) -> None:
    """``NotImplementedError`` naming what the fused kernel does not cover."""
    if spec.name not in TRITON_RULES:
        raise NotImplementedError(f"rule={spec.name!r} has no fused recurrent kernel")
    if spec.sliding and window > MAX_FUSED_WINDOW:
        raise NotImplementedError(f"window={window} is above {MAX_FUSED_WINDOW}, the largest the fused recurrent "
                                  "kernel unrolls")
    if q.shape[-1] > MAX_FUSED_HEAD_DIM:
        raise NotImplementedError(f"head dim K={q.shape[-1]} is above {MAX_FUSED_HEAD_DIM}, the largest the fused "
                                  "recurrent kernel holds in one tile")
    check_kernel_support("the fused recurrent kernel", q, k, v, beta, lam, log_gate, initial_state, decay_floor)
    if wants_gradient((q, k, v, beta, lam, log_gate), initial_state):
        raise NotImplementedError("the fused recurrent kernel computes no gradients (requires_grad inputs or state, "
                                  "forward-mode tangents, torch.func transforms)")
    if initial_state is not None and initial_state.z is not None:
        raise ValueError("the state carries the read normalizer z: continue it through falcon_attention or "
                         "falcon_step with eps_attn, which extend the values for it")


# Left out of torch.compile graphs, as the chunk op (ops/triton/api.py): the launch runs as one opaque call.
@torch.compiler.disable
def falcon_recurrent_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    rule: str = "1A",
    window: int = 4,
    eps: float = 1e-6,
    decay_floor: float = 1e-3,
    shift: bool = True,
    normalize: bool = True,
    log_gate: Optional[torch.Tensor] = None,
    read: str = "after",
    scale_ridge: bool = False,
    initial_state: Optional[FalconState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """``falcon_attention(..., form="recurrent")`` on the fused kernel; same arguments, shapes and
    result (``o`` ``[B, T, H, V]`` in ``v``'s dtype; the final state in fp32). Every token of a
    sequence runs in one program per head and block of value columns, the state in registers, so
    the cost grows with ``T`` one step at a time: meant for decoding and short prompts, where the
    chunk kernels' launches cost more than the steps. Inference only.

    ``validate=False`` skips ``ops.validate.check_inputs`` and the check of ``initial_state``;
    the options that are not tensors and what the kernel supports are always checked."""
    window, eps, decay_floor = map(plain_number, (window, eps, decay_floor))  # numpy's scalars as Python numbers
    spec = get_rule(rule)
    check_options(spec, window=window, eps=eps, decay_floor=decay_floor, read=read)  # host-only: always
    if validate:
        check_inputs(q, k, v, beta, lam, log_gate, spec, window=window, form="recurrent", chunk_size=1, eps=eps,
                     decay_floor=decay_floor, read=read, initial_state=None, shift=shift)
        if initial_state is not None:
            check_state_type(initial_state)
    W = window if spec.sliding else 1
    _check_fused(spec, W, q, k, v, beta, lam, log_gate, initial_state, decay_floor)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is not None:
        N = len(packed_bounds(q, cu_seqlens)) - 1
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    else:
        N = B
    st = initial_state
    if st is not None and validate:
        check_state(st, spec, window=W, shift=shift, B=N, H=H, K=K, V=V, device=q.device)
    dev = q.device
    first = None if st is None or not shift or st.last_key is None else st.last_key.contiguous()
    tail = None
    if st is not None and W > 1:
        tail = (st.tail_x.contiguous(), st.tail_y.contiguous(), st.tail_valid.to(torch.uint8).contiguous())
    o = v.new_empty(B, T, H, V)
    S_T = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    tail_out = (None, None, None)
    if output_final_state and W > 1:
        tail_out = (torch.empty(N, H, W - 1, K, dtype=torch.float32, device=dev),
                    torch.empty(N, H, W - 1, V, dtype=torch.float32, device=dev),
                    torch.empty(N, W - 1, dtype=torch.uint8, device=dev))
    BK = max(16, next_power_of_2(K))
    BV = max(16, min(next_power_of_2(V), 4096 // BK))  # [BK, BV] fp32 tiles: the state, its update
    contiguous = [None if t is None else t.contiguous() for t in (q, k, v, beta, lam, log_gate)]
    kern.fused_recurrent[(N * H, cdiv(V, BV))](
        *contiguous, None if st is None else st.S.float().contiguous(), first, *(tail or (None, None, None)),
        o, S_T, *tail_out, cu_seqlens, T, float(eps), float(decay_floor),
        H=H, K=K, V=V, BK=BK, BV=BV, W=W, WP=next_power_of_2(W), REGRESSION=spec.regression,
        PER_COLUMN=spec.per_column, TOP_EIGEN=spec.sliding and spec.regression and W > 1, NORMALIZE=bool(normalize),
        SCALE_RIDGE=bool(scale_ridge), HAS_GATE=log_gate is not None, SHIFT=bool(shift), HAS_FIRST=first is not None,
        HAS_TAIL=tail is not None, HAS_S0=st is not None, READ_AFTER=read == "after",
        STORE_STATE=bool(output_final_state), IS_VARLEN=cu_seqlens is not None, SQUARINGS=_EIGEN_SQUARINGS,
        num_warps=4)
    if not output_final_state:
        return o, None
    last = last_steps(k, cu_seqlens=cu_seqlens).float() if shift else None
    final = FalconState(rule=spec.name, window=W, shift=shift, S=S_T, last_key=last)
    if W > 1:
        final.tail_x, final.tail_y, final.tail_valid = tail_out[0], tail_out[1], tail_out[2].bool()
    return o, final


def falcon_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    state: Optional[FalconState] = None,
    rule: str = "1A",
    window: int = 4,
    eps: float = 1e-6,
    decay_floor: float = 1e-3,
    shift: bool = True,
    normalize: bool = True,
    log_gate: Optional[torch.Tensor] = None,
    read: str = "after",
    scale_ridge: bool = False,
) -> Tuple[torch.Tensor, FalconState]:
    """One decoding step on the fused kernel: ``q``, ``k`` ``[B, H, K]``, ``v`` ``[B, H, V]``,
    ``beta`` ``[B, H]`` (``[B, H, V]`` for 2/2A), ``lam``, ``log_gate`` ``[B, H]``; ``state=None``
    starts a fresh sequence. Returns ``o`` ``[B, H, V]`` (``v``'s dtype) and the new state (fp32
    ``S``), equal to ``falcon_step``. No gradients (``NotImplementedError``)."""
    if q.dim() != 3:
        raise ValueError(f"q must have shape [B, H, K], got {tuple(q.shape)}")
    window = plain_number(window)
    spec = get_rule(rule)
    if state is not None:
        check_state(state, spec, window=window if spec.sliding else 1, shift=shift, B=q.shape[0], H=q.shape[1],
                    K=q.shape[2], V=v.shape[2], device=q.device, name="state")
    o, final = falcon_recurrent_triton(
        q[:, None], k[:, None], v[:, None], beta[:, None], lam[:, None], rule=rule, window=window, eps=eps,
        decay_floor=decay_floor, shift=shift, normalize=normalize,
        log_gate=None if log_gate is None else log_gate[:, None], read=read, scale_ridge=scale_ridge,
        initial_state=state, output_final_state=True, validate=False)
    return o[:, 0], final
