"""``falcon_chunk_triton``: the chunk form of ``falcon_attention`` on the Triton kernels.

The step sizes (``eta``, the clamped decay ``gamma``, the equations of ``ops.step_sizes``)
and the scan are kernels, each an autograd function (for rule 2 one function holds both:
``column_delta.column_delta_steps``), so gradients reach ``beta``,
``lam``, ``log_gate``, ``k``, the initial state and its last key. The pairs (shifted
keys, sentinel, last-key carry) are built inside the step-size kernel for the non-sliding
rules on fixed-length rows (``step_sizes.shifted_step_sizes``), in PyTorch otherwise
(packed sequences; the sliding rules in ``sliding.window_prefix``).
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from ..kernel_limits import MAX_WY_HEAD_DIM
from ..rules import get_rule
from ..seqlens import last_steps, packed_bounds, padded_rows
from ..state import FalconState
from ..validate import check_inputs, check_state, check_state_type, plain_number
from .column_decay import column_decay_chunk
from .column_delta import column_delta_steps
from .delta import delta_chunk
from .launch import SUPPORTED_CHUNK_SIZES
from .scalar_decay import scalar_decay_chunk
from .sliding import sliding_chunk
from .shift import shift_rows
from .sliding_delta import sliding_delta_chunk
from .step_sizes import feature_step_sizes, shifted_step_sizes

__all__ = ["falcon_chunk_triton", "TRITON_RULES", "GPU_CHECKED_RULES", "TRITON_DTYPES"]

TRITON_RULES = ("1", "1A", "2", "2A", "3", "3A")  # rules with chunk kernels
# Rules whose kernels have passed the float64 checks on a GPU; backend="auto" uses only these. On an
# H200, each rule's kernel tests (tests/test_triton_*.py: switches, states, packed sequences, chunk
# sizes, benchmark-sized and ragged head dims; outputs and gradients against the float64 recurrent
# form) and its full benchmark shape passed. A few CUDA cases were stopped by time limits before they
# finished (test_triton_wy_backward.py's head-dim-128 cases, test_triton_sliding_inplace.py's fp32
# cases); benchmarks/results/h200_tests.md lists them and what ran where.
GPU_CHECKED_RULES: tuple = ("1A", "1", "2A", "2", "3A", "3")
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _interpreting() -> bool:
    """Whether the kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` now (the interpreter reads
    it at each launch) and when the kernels and Triton's own helpers (``tl.zeros``) were defined, at import
    (``triton.jit`` reads it there; ``import falcon_fwa`` imports triton). Set only later, they stay built for
    a GPU, and a CPU tensor ended in Triton's 'Cannot call @triton.jit'd outside of the scope of a kernel'."""
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return False
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    from .step_size_kernels import _log1p
    return isinstance(_log1p, InterpretedFunction) and isinstance(tl.zeros, InterpretedFunction)


# The kernels form gamma = 1 - min(eta lam, 1 - decay_floor) in float32, where 1 - decay_floor is
# not represented below this floor (it may round to 1: a zero decay); the PyTorch forms also clamp
# in log space and take any floor.
MIN_DECAY_FLOOR = 2.0 ** -24


def check_kernel_dtypes(what: str, q, k, v, beta, lam, log_gate, *, query: str = "q") -> None:
    """``NotImplementedError`` naming the first of the op's tensors whose dtype ``what`` (the chunk
    kernels or the step kernel) does not take. float64 anywhere is refused, not cast down: float64
    inputs compute in float64, so ``backend="auto"`` falls back to the PyTorch forms for them
    whichever argument holds it. The first tensor is called ``query`` (``falcon_trace``: its keys)."""
    for name, t in ((query, q), ("k", k), ("v", v), ("beta", beta), ("lam", lam), ("log_gate", log_gate)):
        if t is not None and t.dtype not in TRITON_DTYPES:
            raise NotImplementedError(f"{name}.dtype={t.dtype} is not supported by {what} "
                                      f"(supported: bf16, fp16, fp32)")


def check_kernel_support(what: str, q, k, v, beta, lam, log_gate, initial_state, decay_floor, *,
                         query: str = "q") -> None:
    """``NotImplementedError`` for what no kernel of ``what`` (the chunk kernels or the fused recurrent
    kernel) covers, naming it, so callers can fall back: a decay floor the float32 clamp cannot hold,
    a dtype, a device, a float64 state. The first tensor is called ``query``, as in ``check_inputs``."""
    if decay_floor < MIN_DECAY_FLOOR:
        raise NotImplementedError(f"decay_floor={decay_floor!r} is below {MIN_DECAY_FLOOR:.3g}, where 1 - decay_floor "
                                  f"rounds to 1 in the float32 of {what} (the PyTorch forms support it)")
    check_kernel_dtypes(what, q, k, v, beta, lam, log_gate, query=query)
    if not (q.is_cuda or (_interpreting() and q.device.type == "cpu")):
        late = ("; it was set after that import" if q.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
                else "")
        raise NotImplementedError(f"backend='triton': CUDA tensors are needed by {what}, and {query} is on {q.device} "
                                  f"(on CPU, set TRITON_INTERPRET=1 before importing falcon_fwa or triton{late}); "
                                  "backend='auto' or 'torch' runs the PyTorch forms there")
    if initial_state is not None and initial_state.S.dtype == torch.float64:
        raise NotImplementedError(f"initial_state.S.dtype=float64 is not supported by {what}")


def _check_supported(q, k, v, beta, lam, log_gate, rule, chunk_size, initial_state, decay_floor) -> None:
    """Raise for what the kernels do not cover, naming the switch, so callers can fall back."""
    spec = get_rule(rule)
    if spec.name not in TRITON_RULES:
        raise NotImplementedError(f"rule={spec.name!r} has no Triton kernel (supported: {TRITON_RULES})")
    if spec.regression and q.shape[-1] > MAX_WY_HEAD_DIM:
        raise NotImplementedError(f"head dim K={q.shape[-1]} is above {MAX_WY_HEAD_DIM}, the largest the rule-"
                                  f"{spec.name} kernels hold in one tile")
    if chunk_size not in SUPPORTED_CHUNK_SIZES:
        raise NotImplementedError(f"chunk_size={chunk_size} is not supported by the Triton kernels "
                                  f"(supported: {SUPPORTED_CHUNK_SIZES})")
    check_kernel_support("the Triton kernels", q, k, v, beta, lam, log_gate, initial_state, decay_floor)


def _shifted_keys(k, shift, last_key, starts):
    """Write features ``x`` ``[B, T, H, K]`` and pair validity ``[B, T]``, time-major.

    ``starts``: first row of every sequence (``[0]`` for fixed-length rows; a device
    tensor for packed ones, so that no host-to-device copy waits on the stream); a
    sequence starts from ``last_key`` (``[N, H, K]``, valid pair) or from the
    sentinel (``x = 0``, invalid)."""
    B, T = k.shape[:2]
    valid = torch.ones(B, T, dtype=torch.bool, device=k.device)
    if not shift:
        return k, valid
    if len(starts) == 1 and last_key is not None:
        first = last_key.to(k.dtype)[:, None]
    else:
        first = k.new_zeros(B, 1, *k.shape[2:])
    x = shift_rows(k, first)
    if len(starts) > 1:  # packed sequences (B = 1): every sequence starts fresh or from its last key
        idx = torch.as_tensor(starts, device=k.device)
        fill = k.new_zeros(len(starts), *k.shape[2:]) if last_key is None else last_key.to(k.dtype)
        x = x.index_put((torch.zeros_like(idx), idx), fill)
    if last_key is None:
        if len(starts) == 1:
            valid[:, 0] = False
        else:
            valid[:, idx] = False
    return x, valid


# Left out of ``torch.compile`` graphs: traced, the kernel launches are handed to inductor, which
# fails to rebuild them (their tuple and defaulted ``tl.constexpr`` arguments), so a compiled
# model stops at its first forward. Untraced, the op runs as one opaque call between the compiled
# regions around it (projections, short convolutions, norms and gates), forward and backward.
@torch.compiler.disable
def falcon_chunk_triton(
    q: torch.Tensor,
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
    read: str = "after",
    scale_ridge: bool = False,
    initial_state: Optional[FalconState] = None,
    output_final_state: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    validate: bool = True,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """``falcon_attention(..., form="chunk")`` on the Triton kernels: the same arguments, less
    those that choose the path or run around it (``form``, ``backend``; ``eps_attn``, the normalized
    read, and ``segments`` are applied by ``falcon_attention`` around this call), plus ``validate``;
    the same shapes and result (``o`` ``[B, T, H, V]`` in ``v``'s dtype, the final state in fp32).

    Supported: rules "1A" (scalar-decay masked attention, any head dims), "2A" (one
    decay per value column, any head dims; ``ops.triton.column_decay``), "1" (WY
    form, one triangular solve per chunk, key dim ``K <= 256``), "2" (per-column
    regression: a Gram shared by the value columns, one triangular solve per column
    and block of 16 steps in the sequential pass, ``K <= 256``;
    ``ops.triton.column_delta``), "3A" (the
    rule-1A scan over completed window pairs plus the band of open pairs, as
    kernels; ``window`` up to 65, ``ops.triton.sliding.MAX_WINDOW``) and "3" (the
    rule-1 WY kernels over the ``T * window`` window writes, those of one step
    uncoupled; ``window`` in {1, 2, 4, 8, 16}, ``K <= 256``;
    ``ops.triton.sliding_delta``); every switch
    (``shift``, ``normalize``, ``log_gate``, ``read``, ``scale_ridge``,
    ``initial_state`` with the last-key carry, ``output_final_state``,
    ``cu_seqlens``); bf16/fp16/fp32 inputs (``k``, ``v`` are
    cast to ``q``'s dtype; fp32 accumulation); ``chunk_size`` in {16, 32, 64, 128}
    (the WY kernels of rules 1 and 3 run a request for 128 as 64: ``delta.WY_MAX_CHUNK``).
    Anything else raises ``NotImplementedError`` naming the switch.

    ``validate=False`` skips ``ops.validate.check_inputs`` and the check of
    ``initial_state``, for callers that ran them already; what the kernels support
    is always checked.
    """
    window, chunk_size, eps, decay_floor = map(plain_number, (window, chunk_size, eps, decay_floor))  # numpy's too
    spec = get_rule(rule)
    if validate:  # bad arguments raise what the PyTorch forms raise, before the kernels' own limits are checked
        check_inputs(q, k, v, beta, lam, log_gate, spec, window=window, form="chunk", chunk_size=chunk_size,
                     eps=eps, decay_floor=decay_floor, read=read, initial_state=None, shift=shift)
        if initial_state is not None:
            check_state_type(initial_state)
    _check_supported(q, k, v, beta, lam, log_gate, rule, chunk_size, initial_state, decay_floor)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is not None:
        bounds = packed_bounds(q, cu_seqlens)
        cu_seqlens = cu_seqlens.to(q.device)  # the kernels index it on the device
        starts, ends = bounds[:-1], bounds[1:]
    else:
        starts, ends = [0], [T]
    N = len(starts) if cu_seqlens is not None else B
    W = window if spec.sliding else 1
    if initial_state is not None and validate:
        check_state(initial_state, spec, window=W, shift=shift, B=N, H=H, K=K, V=V, device=q.device)
    if spec.sliding:
        return _sliding(q, k, v, beta, lam, log_gate, initial_state, cu_seqlens, starts, ends, rule=spec.name, window=W,
                        eps=eps,
                        decay_floor=decay_floor, shift=shift, normalize=normalize, scale_ridge=scale_ridge,
                        read_after=read == "after", chunk_size=chunk_size, output_final_state=output_final_state)

    out_dtype = v.dtype
    k, v = k.to(q.dtype), v.to(q.dtype)
    last_key = None if initial_state is None or not shift else initial_state.last_key
    steps = dict(eps=eps, decay_floor=decay_floor, normalize=normalize, scale_ridge=scale_ridge)
    S0 = None if initial_state is None else initial_state.S
    scan = dict(read_after=read == "after", chunk_size=chunk_size, cu_seqlens=cu_seqlens,
                output_final_state=output_final_state)
    in_kernel_shift = shift and cu_seqlens is None  # pairs and step sizes in one kernel
    if not in_kernel_shift:
        x, valid = _shifted_keys(k, shift, last_key, starts if cu_seqlens is None else cu_seqlens[:-1].long())
    if spec.regression and spec.per_column:  # rule 2: the step sizes and the scan in one node (column_delta_steps)
        if in_kernel_shift:
            o, S_T = column_delta_steps(q, k, v, beta, lam, log_gate, S0, first=last_key, valid=None, shift=True,
                                        **steps, **scan)
        else:
            o, S_T = column_delta_steps(q, x, v, beta, lam, log_gate, S0, first=None, valid=valid, shift=False,
                                        **steps, **scan)
        return _finish(o, S_T, out_dtype, spec, shift, k, cu_seqlens, output_final_state)
    if in_kernel_shift:
        x, eta, log_a, _ = shifted_step_sizes(k, last_key, beta, lam, log_gate, **steps)
    else:
        eta, log_a, _ = feature_step_sizes(x, valid, beta, lam, log_gate, **steps)
    if spec.regression:  # rule 1: the residual is read at the gated state, kappa = eta exp(g)
        kappa = None if log_gate is None else eta * torch.exp(log_gate.float())  # None: kappa is eta
        o, S_T = delta_chunk(q, x, v, eta, kappa, log_a, S0, **scan)
    elif spec.per_column:  # rule 2A: eta and the decay per value column
        o, S_T = column_decay_chunk(q, x, v, eta, log_a, S0, **scan)
    else:
        o, S_T = scalar_decay_chunk(q, x, v, eta, log_a, S0, **scan)
    return _finish(o, S_T, out_dtype, spec, shift, k, cu_seqlens, output_final_state)


def _finish(o, S_T, out_dtype, spec, shift, k, cu_seqlens, output_final_state):
    """The outputs in ``out_dtype`` and the final :class:`FalconState` of a non-sliding rule (or ``None``)."""
    final = None
    if output_final_state:
        last = last_steps(k, cu_seqlens=cu_seqlens).float() if shift else None
        final = FalconState(rule=spec.name, window=1, shift=shift, S=S_T, last_key=last)
    return o.to(out_dtype), final


def _sliding(q, k, v, beta, lam, log_gate, initial_state, cu_seqlens, starts, ends, *, rule, window, eps,
             decay_floor, shift, normalize, scale_ridge, read_after, chunk_size, output_final_state):
    """Rules 3A (``sliding.sliding_chunk``) and 3 (``sliding_delta.sliding_delta_chunk``). Packed
    sequences are unpacked into right-padded rows (padding steps are no-ops: zero ``beta``,
    ``lam``, ``log_gate``), run as one batch and packed back."""
    st = initial_state
    S0 = None if st is None else st.S
    last_key = None if st is None or not shift else st.last_key
    tail = None if st is None or window == 1 else (st.tail_x, st.tail_y, st.tail_valid)
    out_dtype = v.dtype
    k, v = k.to(q.dtype), v.to(q.dtype)
    lengths = None
    if cu_seqlens is not None:
        first = cu_seqlens[:-1].long()
        lengths = cu_seqlens[1:].long() - first
        unpack, real = padded_rows(first, lengths, max(e - s for s, e in zip(starts, ends)))
        q, k, v, beta, lam, log_gate = map(unpack, (q, k, v, beta, lam, log_gate))
    scan = sliding_chunk if rule == "3A" else sliding_delta_chunk
    o, final = scan(q, k, v, beta, lam, log_gate, S0, last_key, tail, window=window, eps=eps,
                    decay_floor=decay_floor, shift=shift, normalize=normalize, scale_ridge=scale_ridge,
                    read_after=read_after, chunk_size=chunk_size, lengths=lengths,
                    output_final_state=output_final_state)
    if cu_seqlens is not None:
        o = o[real][None]
    state = None
    if output_final_state:
        S_T, tx, ty, tv = final
        last = last_steps(k, lengths=lengths).float() if shift else None
        state = FalconState(rule=rule, window=window, shift=shift, S=S_T, last_key=last, tail_x=tx, tail_y=ty,
                            tail_valid=tv)
    return o.to(out_dtype), state
