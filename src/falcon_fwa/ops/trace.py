"""``falcon_trace``: the online learner inside ``falcon_attention``, step by step.

The paper reads a layer's state ``S`` as a linear model trained online, one token at a time,
on the causal pairs ``(x_t, y_t) = (phi(k_{t-1}), v_t)``. For the arguments of
``falcon_attention`` (without ``q``: nothing is read), ``falcon_trace`` returns what that
learner does at every step ``t`` and head:

* ``eta``: the step size ``eta_t = beta_t / (E_t + lambda_t + eps)`` (Eqs. 3.4, 4.8, 4.9, 4.18;
  ``beta_t`` itself with ``normalize=False``; 0 at the sentinel and where the denominator is 0);
* ``gamma``: the carry ``gamma_t = 1 - min(eta_t lambda_t, 1 - decay_floor)`` (Eq. 4.20), and
  ``clamped``, where the positive-decay clamp holds (``gamma_t`` at ``decay_floor``);
* ``prediction``: ``p_t = S'^T x_t``, the value the memory gives the newest pair's feature
  before the step writes it, with ``S' = exp(g_t) S_{t-1}`` (the state the regression rules
  read their residual at): the paper's fast-memory prediction ``yhat_t = S_{t-1}^T x_t``
  (Section 3, Appendix C.5; Algorithm 5, line 4) when there is no gate;
* ``residual`` ``r_t = y_t - p_t`` (Eq. 3.3) and ``loss`` ``l_t = ||r_t||^2 / 2``: the squared
  error of Eq. 3.1 without its ridge term, whose normalized gradient step rules 1-3 take (for
  rules 1A-3A, how well the memory recalls ``y_t`` from its key before storing it).

The step sizes come from the same code as the op's; the predictions are one more call of the op
(``read="before"`` at the queries ``x_t``), on the same backend, with the inputs in the compute dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import torch

from .api import _compute_dtype, _outside_inference, falcon_attention
from .pairs import write_side
from .rules import get_rule
from .state import FalconState
from .step_sizes import log_carry, step_sizes
from .validate import check_inputs, check_switches, keyword_hints, plain_number

__all__ = ["FalconTrace", "falcon_trace"]


@dataclass
class FalconTrace:
    """Per-step quantities of the online learner (``falcon_trace``), batch-first.

    ``eta``, ``gamma``, ``clamped``: ``[B, T, H]`` (``[B, T, H, V]`` for the per-column rules
    "2" and "2A"); ``prediction``, ``residual``: ``[B, T, H, V]``; ``loss``: ``[B, T, H]``;
    ``valid``: ``[B, T]``, the steps that write a new pair (False at the sentinel, where
    ``residual`` and ``loss`` are NaN). Floating tensors are in the compute dtype (float32, or
    float64 for float64 inputs)."""

    eta: torch.Tensor
    gamma: torch.Tensor
    clamped: torch.Tensor
    prediction: torch.Tensor
    residual: torch.Tensor
    loss: torch.Tensor
    valid: torch.Tensor


@keyword_hints(state="initial_state")
def falcon_trace(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    rule: str = "1A",
    window: int = 4,
    chunk_size: int = 64,
    eps: float = 1e-6,
    decay_floor: float = 1e-3,
    shift: bool = True,
    normalize: bool = True,
    log_gate: Optional[torch.Tensor] = None,
    scale_ridge: bool = False,
    initial_state: Optional[FalconState] = None,
    backend: str = "auto",
) -> FalconTrace:
    """The online learner of ``falcon_attention`` with these arguments, step by step (module
    docstring). Shapes and keywords as in ``falcon_attention``: ``k`` ``[B, T, H, K]``, ``v``
    ``[B, T, H, V]``, ``beta`` ``[B, T, H]`` (``[B, T, H, V]`` for rules "2", "2A"), ``lam`` and
    ``log_gate`` ``[B, T, H]``; ``initial_state`` continues a segment, also one of a normalized
    read (``eps_attn``): its normalizer ``z`` takes no part in the learner, whose state ``S`` is
    the same with either read. One row per sequence (no ``cu_seqlens``). Returns a
    :class:`FalconTrace`: ``eta``, ``gamma``, ``clamped`` ``[B, T, H]`` (``[B, T, H, V]`` for
    rules "2", "2A"), ``prediction``, ``residual`` ``[B, T, H, V]``, ``loss`` ``[B, T, H]``,
    ``valid`` ``[B, T]``.

    Positional ``k, v, beta, lam`` are ``falcon_attention``'s without ``q``; its keywords
    ``form``, ``read``, ``eps_attn``, ``output_final_state``, ``cu_seqlens`` and ``segments``
    are not taken (the predictions are read before the write, on the chunk form)."""
    window, chunk_size, eps, decay_floor = map(plain_number, (window, chunk_size, eps, decay_floor))
    spec = get_rule(rule)
    W = window if spec.sliding else 1
    check_switches(shift=shift, normalize=normalize, scale_ridge=scale_ridge)
    # tensors made under inference_mode copied where gradients are recorded, as the op does
    (k, v, beta, lam, log_gate), initial_state = _outside_inference((k, v, beta, lam, log_gate), initial_state)
    check_inputs(k, k, v, beta, lam, log_gate, spec, window=W, form="chunk", chunk_size=chunk_size, eps=eps,
                 decay_floor=decay_floor, read="before", initial_state=initial_state, shift=shift, query="k")
    if backend == "triton":
        # the kernels' refusals of a dtype or a device, named for these arguments: the op is called below with
        # q = the write features and every input cast to the compute dtype, which its own checks would name
        from .triton.api import check_kernel_support  # an ImportError without Triton, as from falcon_attention
        check_kernel_support("the Triton kernels", k, k, v, beta, lam, log_gate, initial_state, decay_floor,
                             query="k")
    if initial_state is not None and initial_state.z is not None:
        initial_state = replace(initial_state, z=None)
    dt = _compute_dtype(k, v, beta, lam, log_gate)
    kh, vh, beta_h, lam_h = (t.to(dt).transpose(1, 2) for t in (k, v, beta, lam))
    side = write_side(kh, vh, initial_state, W, shift)
    eta_slots, log_gamma = step_sizes(spec, side.xs, side.slot_valid, beta_h, lam_h, eps=eps,
                                      decay_floor=decay_floor, normalize=normalize, scale_ridge=scale_ridge)

    def batch_first(t):  # [B, H, T, Vd] -> [B, T, H] or [B, T, H, V]
        t = t.transpose(1, 2)
        return t if spec.per_column else t[..., 0]

    eta = batch_first(eta_slots.sum(-2))  # the slots' weights [j in I_t] / B_t sum to 1
    gamma = batch_first(torch.exp(log_gamma))
    # the clamp holds log gamma_t at the carry of alpha_t = 1 - decay_floor (in the compute dtype, as
    # step_sizes forms it); an unclamped step, alpha_t < 1 - decay_floor, lies above it
    held = log_carry(torch.tensor(1.0 - decay_floor, dtype=dt, device=log_gamma.device), decay_floor)
    clamped = batch_first(log_gamma <= held)

    # the write features as queries, read before the step; every input in the compute dtype, so that the
    # op's output (in v's dtype) is not rounded to bfloat16 or float16 on the way
    x = side.x.transpose(1, 2)
    prediction, _ = falcon_attention(x, *(t.to(dt) for t in (k, v, beta, lam)), rule=rule, window=window,
                                     chunk_size=chunk_size, eps=eps, decay_floor=decay_floor, shift=shift,
                                     normalize=normalize, log_gate=None if log_gate is None else log_gate.to(dt),
                                     read="before", scale_ridge=scale_ridge, initial_state=initial_state,
                                     backend=backend)
    if log_gate is not None:
        prediction = prediction * torch.exp(log_gate.to(dt))[..., None]
    missing = ~side.valid[:, :, None, None]
    residual = (v.to(dt) - prediction).masked_fill(missing, math.nan)
    loss = 0.5 * residual.square().sum(-1)
    return FalconTrace(eta=eta, gamma=gamma, clamped=clamped, prediction=prediction, residual=residual, loss=loss,
                       valid=side.valid)
