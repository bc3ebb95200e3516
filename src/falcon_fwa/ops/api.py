"""The public functional op: ``falcon_attention`` and its one-token ``falcon_step``."""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from . import read_norm
from .chunk import chunk_form
from .pairs import next_tail, write_side
from .parallel import parallel_form
from .recurrent import recurrent_form, recurrent_step
from .rules import get_rule
from .segments import other_derivative, run_segments
from .seqlens import last_steps, packed_bounds, padded_rows
from .state import TENSOR_FIELDS, FalconState
from .step_sizes import step_sizes
from .validate import (check_chunk_size, check_inputs, check_options, check_positive_int, check_sequence_tensors,
                       check_state, check_state_type, check_step_shapes, check_switches, check_tensor_types,
                       keyword_hints, plain_number)

__all__ = ["falcon_attention", "falcon_step"]


BACKENDS = ("auto", "torch", "triton")


def _triton_chunk(backend: str, q: torch.Tensor, rule: str):
    """The Triton chunk entry if ``backend`` asks for it and it may serve ``rule``, else None."""
    if backend == "auto" and not (q.is_cuda and torch.is_floating_point(q) and q.dtype != torch.float64):
        return None
    try:
        from .triton import GPU_CHECKED_RULES, falcon_chunk_triton
    except ImportError:
        if backend == "triton":
            raise
        return None
    if backend == "auto" and get_rule(rule).name not in GPU_CHECKED_RULES:
        return None
    return falcon_chunk_triton


def _short_prompt(q, k, v, beta, lam, log_gate, initial_state: Optional[FalconState], spec) -> bool:
    """Whether ``backend="auto"`` runs a chunk-form call on the fused recurrent kernel instead of
    the chunk kernels: no gradient is needed (of the inputs or of ``initial_state``) and the call
    is within ``ops.triton.SHORT_PROMPT_LIMITS[rule]`` (steps, and steps times rows times heads),
    where that kernel measured faster on a GPU (``benchmarks/bench_short_prompts.py``)."""
    from .triton import SHORT_PROMPT_LIMITS, wants_gradient
    limits = SHORT_PROMPT_LIMITS.get(spec.name)
    if limits is None or q.dim() != 4:
        return False
    B, T, H = q.shape[:3]
    if T > limits[0] or B * T * H > limits[1]:
        return False
    return not wants_gradient((q, k, v, beta, lam, log_gate), initial_state)


def _floor_gate(log_gate: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``log_gate`` floored where ``exp`` is exactly 0 in the compute dtype ``dtype`` (one below the log of
    the smallest subnormal: -104.28 in float32, -745.44 in float64). The parallel and chunk forms
    take ``exp`` of differences of prefix sums of the log decays: a gate of ``-inf`` (a hard
    reset, ``exp(g) = 0``) would give ``-inf - (-inf) = NaN`` there, and a huge finite one would
    cancel the precision of every later difference in its chunk. The floor changes no value of
    the recurrence; positive and NaN gates pass through to the checks, and so does a gate that
    is not a floating-point tensor (``clamp`` would turn an integer one into a float silently)."""
    if log_gate is None or not log_gate.is_floating_point():
        return log_gate
    info = torch.finfo(dtype)
    # a sum of logs, not the log of the subnormal itself: under flush-to-zero (torch.set_flush_denormal(True),
    # or a library loaded with it) that product is 0 in Python's arithmetic too
    return log_gate.clamp(min=math.log(info.smallest_normal) + math.log(info.eps) - 1.0)


def _compute_dtype(*ts: Optional[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in ts) else torch.float32


def _outside_inference(tensors, state):
    """``tensors`` and ``state`` with a copy of each tensor made under ``torch.inference_mode()`` (the state
    of a call or a cache made during inference, an input made there), when gradients are recorded: autograd
    cannot save an inference tensor for the backward, and the forms save their inputs and the state as they
    are when they need no cast. Anything else passes as it is, so an ordinary call copies nothing."""
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():  # nothing is recorded: they may stay
        return tensors, state

    def usable(t):
        return t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t

    tensors = tuple(map(usable, tensors))
    if isinstance(state, FalconState) and any(isinstance(getattr(state, f), torch.Tensor)
                                              and getattr(state, f).is_inference() for f in TENSOR_FIELDS):
        state = state._map(usable)
    return tensors, state


# Left out of ``torch.compile`` graphs, as its Triton kernels always were (``ops.triton.api``): traced by
# inductor, the PyTorch forms of rules 2, 2A and 3 inside a compiled layer gave wrong gradients or wrote
# out of bounds on the CPU (torch 2.13: ``free(): invalid next size``), while each piece compiled alone
# was right. Untraced, the op runs as one eager call between the compiled regions around it.
@torch.compiler.disable
@keyword_hints(state="initial_state")
def falcon_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    lam: torch.Tensor,
    *,
    rule: str = "1A",
    window: int = 4,
    form: str = "chunk",
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
    backend: str = "auto",
    eps_attn: Optional[float] = None,
    segments: int = 1,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    r"""Falcon fast-weight attention (paper, Section 4, "Naming and formula summary").

    Shapes (``B`` batch, ``T`` steps, ``H`` heads, ``K`` key and ``V`` value dims): ``q``,
    ``k`` ``[B, T, H, K]`` and ``v`` ``[B, T, H, V]`` are features after ``phi`` (apply a
    feature map before the call); ``beta`` ``[B, T, H]`` (``[B, T, H, V]`` for the
    per-column rules "2" and "2A"); ``lam`` ``[B, T, H]`` the actual ridge coefficient
    ``lambda_t >= 0`` (the dimensionless ``lambda-bar_t`` with ``scale_ridge=True``);
    ``log_gate`` ``[B, T, H]``, ``g_t <= 0``. Returns ``o`` ``[B, T, H, V]`` in ``v``'s dtype
    and the final :class:`FalconState` (or ``None``; its fields and their shapes are listed
    there) in the compute dtype: ``S`` ``[B, H, K, V]``, one row per sequence
    (``[N, H, K, V]`` with ``cu_seqlens``). Mixed input dtypes: the PyTorch forms
    compute in float64 when any input is float64, else float32; the Triton kernels take ``k``
    and ``v`` in ``q``'s dtype (``docs/ops.md``, "Precision").

    The pair written at step ``t`` is ``(x_t, y_t) = (k_{t-1}, v_t)`` with the
    sentinel ``x_1 = 0, eta_1 = 0`` on a fresh sequence (Section 3, Appendix C.5;
    ``shift=False``: ``(k_t, v_t)``). With ``E_t`` the rule's normalization statistic,
    the step size ``eta_t = beta_t / (E_t + lambda_t + eps)`` (Eqs. 3.4, 4.8, 4.9, 4.18; for
    rules 2 and 3 the unnumbered equations of Sections 4.2 and 4.4),
    the clamped carry ``gamma_t = 1 - min(eta_t lambda_t, 1 - decay_floor)`` (Eq. 4.20,
    ``epsilon_gamma = decay_floor``) and ``S' = exp(g_t) S_{t-1}``:

    ====  =====================================================================
    1     ``S_t = gamma_t S' + eta_t x_t (y_t - S'^T x_t)^T``, ``E_t = ||x_t||^2``
          (Eqs. 3.3, 3.4)
    2     column ``c``: ``s_t = gamma_{t,c} s' + eta_{t,c} x_t (y_{t,c} - s'^T x_t)``,
          ``E_t = ||x_t||^2`` shared by the columns (Eq. 4.4, Section 4.2)
    3     ``S_t = gamma_t S' + eta_t/B_t sum_{j in I_t} x_j (y_j - S'^T x_j)^T``,
          ``E_t = mu_t = lambda_max(X_t^T X_t)/B_t`` (Eq. 4.14, Section 4.4)
    1A    ``S_t = gamma_t S' + eta_t x_t y_t^T``, ``E_t = ||x_t||^2`` (Eqs. 4.6, 4.8)
    2A    column ``c``: ``s_t = gamma_{t,c} s' + eta_{t,c} y_{t,c} x_t``,
          ``E_t = ||x_t||^2`` (Eqs. 4.7, 4.9)
    3A    ``S_t = gamma_t S' + eta_t/B_t sum_{j in I_t} x_j y_j^T``,
          ``E_t = Ebar_t = sum_{j in I_t} ||x_j||^2 / B_t`` (Eqs. 4.18, 4.19)
    ====  =====================================================================

    with the window ``I_t = {j : max(2, t-window+1) <= j <= t}`` (Section 4.4; the paper's
    ``B`` is ``window``, not the batch size; from ``j = 1`` with ``shift=False``; pairs of
    the previous segment count after a continuation, Appendix C.7), ``B_t = |I_t|``, and the
    read ``o_t = S_t^T q_t`` (``read="after"``, RAW) or ``S_{t-1}^T q_t`` (``"before"``, RBW;
    Appendix C.5); with ``eps_attn``, the normalized read
    ``o_t = S_t^T q_t / (z_t^T q_t + eps_attn)`` of the inner-product rules (Eq. 2.3,
    Appendix C.1), ``z`` written like ``S`` with values of one (``ops/read_norm.py``). The
    recurrent form is this scan line by line (``ops/recurrent.py``; Algorithms 2 and 5).

    Args:
        q: read features ``phi(q_t)`` ``[B, T, H, K]``.
        k: write features ``phi(k_t)`` ``[B, T, H, K]``; step ``t`` writes under ``k_{t-1}``.
        v: values ``v_t`` (targets ``y_t``) ``[B, T, H, V]``.
        beta: the dimensionless gain ``beta_t`` (``(0, 2)`` for the descent guarantee,
            Section 3.2; not checked) ``[B, T, H]``, ``[B, T, H, V]`` for rules 2, 2A.
        lam: the ridge ``lambda_t >= 0`` (or ``lambda-bar_t``, ``scale_ridge``) ``[B, T, H]``.
        rule: "1", "2", "3", "1A", "2A" or "3A" (default "1A").
        window: the window ``B`` of the sliding rules 3 and 3A (default 4; ignored otherwise).
        form: "recurrent" (the scan, the definition), "parallel" (masked
            attention / WY / ParallelFlow over the whole sequence, ``O(T^2)``) or
            "chunk" (SSD-style chunk-parallel, the default; Algorithms 1, 3, 4 and 8).
            All three compute the same function.
        chunk_size: chunk length of the chunk form (default 64); ``T`` need not divide by it.
        eps: stabilizer ``epsilon >= 0`` in the step-size denominator (default 1e-6).
        decay_floor: ``epsilon_gamma`` of the positive-decay clamp, in (0, 1) (default 1e-3;
            Eq. 4.20).
        shift: next-latent pair ``(k_{t-1}, v_t)`` (True) or same-step ``(k_t, v_t)``.
        normalize: NLMS / energy-normalized ``eta`` (True) or ``eta = beta``: the step size's
            normalization (the normalized *read*, a denominator on ``o_t``, is ``eps_attn``).
        log_gate: optional extra decay ``exp(g_t)`` applied to the state before
            the rule's update (Gated DeltaNet, Mamba-2); ``g_t = -inf`` resets the state.
        read: "after" (read-after-write, the paper's convention) or "before".
        scale_ridge: ``lam`` is ``lambda-bar`` and ``lambda_t = lambda-bar * E_t``
            (Section 4.1, Appendix C.1; ``E_t`` detached for the sliding rules, Appendix C.6).
        initial_state: a state returned by an earlier call, to continue exactly; or
            ``FalconState.fresh(S, ...)``, a new sequence (opened by the sentinel with ``shift=True``) from the fast
            weights ``S``.
        output_final_state: also return the state after the last step.
        cu_seqlens: ``[N + 1]`` int offsets of ``N`` sequences packed into one row
            (``B = 1``), as in flash-attention: each sequence starts fresh (its own
            sentinel) or from row ``n`` of ``initial_state``, and the final state
            has one row per sequence.
        backend: "torch" (the PyTorch forms), "triton" (the Triton chunk kernels for
            ``form="chunk"``, the fused recurrent kernel for ``form="recurrent"``, which
            computes no gradients and is meant for short prompts; ``form="parallel"``
            raises ``ValueError``, a switch the kernels do not take raises
            ``NotImplementedError`` naming it) or "auto" (the
            kernels for ``form="chunk"`` on CUDA where they exist and have been checked
            on a GPU, and for prompts short enough, ``ops.triton.SHORT_PROMPT_LIMITS``,
            without gradients, the fused recurrent kernel; else PyTorch).
        eps_attn: ``None`` (the denominator-free read, the paper's default) or the
            stabilizer ``>= 0`` of the normalized read (Eq. 2.3, Appendix C.1; rules 1A,
            2A, 3A). Its state carries ``z`` (``FalconState.z``). Safe where ``z_t^T q_t``
            stays positive, as with nonnegative features.
        segments: run the sequence in this many pieces of whole chunks, each from the state the
            one before it returned (``ops/segments.py``). Under autograd the forward keeps only
            the states at the cuts, and the backward runs each piece's forward again before its
            own backward, so the op's intermediates live for one piece at a time (about
            ``1/segments`` of the memory they take, for one more forward; under ``torch.func``'s
            transforms and forward-mode AD the pieces run as one graph, with the memory of one call). The result is the
            same up to rounding. ``1`` (the default) runs the sequence whole. With
            ``cu_seqlens`` the pieces are groups of whole sequences, cut at the sequence
            boundaries nearest to equal parts (a sequence longer than a piece stays whole).

    Known recurrences as special cases: DeltaNet = rule "1", ``shift=False,
    normalize=False``, ``lam=0``; Gated DeltaNet = the same with ``log_gate``;
    linear attention = rule "1A", ``shift=False, normalize=False``, ``lam=0``,
    ``beta=1`` (normalized linear attention with ``eps_attn``); Mamba-2's SSD recurrence = the same with ``beta=dt`` and
    ``log_gate = dt * A`` (``A < 0``); RetNet = linear attention with a fixed
    per-head ``log_gate``.
    """
    # numpy's scalars as Python numbers (the kernels take those only); anything else goes to the checks
    window, chunk_size, eps, decay_floor, segments, eps_attn = map(
        plain_number, (window, chunk_size, eps, decay_floor, segments, eps_attn))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and form == "parallel":
        raise ValueError("backend='triton' runs the chunk form (its kernels) or the recurrent form (the fused "
                         "recurrent kernel, inference only); got form='parallel'")
    check_tensor_types(q, k, v, beta, lam, log_gate)
    if cu_seqlens is not None and (q.is_meta or getattr(cu_seqlens, "is_meta", False)):
        raise ValueError("cu_seqlens: packed sequences are laid out from the values of their offsets, which the meta "
                         "device does not hold; on it, run the op on [B, T, ...] rows without cu_seqlens")
    (q, k, v, beta, lam, log_gate), initial_state = _outside_inference((q, k, v, beta, lam, log_gate), initial_state)
    check_switches(shift=shift, normalize=normalize, scale_ridge=scale_ridge, output_final_state=output_final_state)
    check_positive_int("segments", segments)
    if segments > 1 and q.dim() == 4:  # (a q of another shape goes on, to be refused by the checks below)
        check_chunk_size(chunk_size)
        # the whole call's tensors, before the pieces cut them (a longer v would be cut silently)
        check_sequence_tensors(q, k, v, beta, lam, log_gate, get_rule(rule))
        if initial_state is not None:  # the pieces read its fields before any piece checks it
            check_state_type(initial_state)
        options = dict(rule=rule, window=window, form=form, chunk_size=chunk_size, eps=eps, decay_floor=decay_floor,
                       shift=shift, normalize=normalize, read=read, scale_ridge=scale_ridge, backend=backend,
                       eps_attn=eps_attn)

        def piece(q, k, v, beta, lam, log_gate, *, initial_state, output_final_state, cu_seqlens=None):
            return falcon_attention(q, k, v, beta, lam, log_gate=log_gate, initial_state=initial_state,
                                    output_final_state=output_final_state, cu_seqlens=cu_seqlens, **options)
        return run_segments(piece, (q, k, v, beta, lam, log_gate), initial_state, output_final_state,
                            segments=segments, chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    spec = get_rule(rule)
    done = _read_normalizer(eps_attn, spec, v)
    if eps_attn is None:
        read_norm.refuse_normalizer_state(initial_state, "initial_state")
    else:
        q, k, v, beta, initial_state = read_norm.extend(q, k, v, beta, lam, log_gate, initial_state, spec,
                                                        axes=("B", "T", "H"), name="initial_state", window=window,
                                                        shift=shift, packed=cu_seqlens is not None)
    log_gate = _floor_gate(log_gate, _compute_dtype(q, k, v, beta, lam, log_gate))
    kernel_args = dict(rule=rule, window=window, eps=eps, decay_floor=decay_floor, shift=shift, normalize=normalize,
                       log_gate=log_gate, read=read, scale_ridge=scale_ridge, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, validate=True)
    if backend != "torch" and form == "chunk":  # "auto" never swaps the recurrent or parallel form for the kernels
        kernels = _triton_chunk(backend, q, rule)
        if kernels is not None and backend == "auto" and other_derivative((q, k, v, beta, lam, log_gate),
                                                                          initial_state):
            kernels = None  # forward-mode tangents, torch.func: the PyTorch forms take them, no kernel does
        if kernels is not None and backend == "auto" and _short_prompt(q, k, v, beta, lam, log_gate, initial_state,
                                                                       spec):
            from .triton import falcon_recurrent_triton
            check_chunk_size(chunk_size)  # what the chunk form would have refused (the fused kernel has no chunks)
            try:
                return done(falcon_recurrent_triton(q, k, v, beta, lam, **kernel_args))
            except NotImplementedError:
                pass
        if kernels is not None:
            try:
                return done(kernels(q, k, v, beta, lam, chunk_size=chunk_size, **kernel_args))
            except NotImplementedError:
                if backend == "triton":
                    raise
    if backend == "triton" and form == "recurrent":
        from .triton import falcon_recurrent_triton
        check_chunk_size(chunk_size)  # unused there, but refused as on the other backend
        return done(falcon_recurrent_triton(q, k, v, beta, lam, **kernel_args))
    options = dict(spec=spec, window=window if spec.sliding else 1, form=form, chunk_size=chunk_size, eps=eps,
                   decay_floor=decay_floor, shift=shift, normalize=normalize, read=read, scale_ridge=scale_ridge)
    if cu_seqlens is not None:
        return done(_varlen(q, k, v, beta, lam, log_gate, initial_state, output_final_state, cu_seqlens=cu_seqlens,
                            **options))
    check_inputs(q, k, v, beta, lam, log_gate, spec, window=window, form=form, chunk_size=chunk_size, eps=eps,
                 decay_floor=decay_floor, read=read, initial_state=initial_state, shift=shift)
    return done(_torch_forms(q, k, v, beta, lam, log_gate, initial_state, output_final_state, **options))


def _read_normalizer(eps_attn: Optional[float], spec, v: torch.Tensor):
    """What turns the op's result into the caller's: itself for the denominator-free read, else
    ``read_norm.split`` for values of ``V`` columns (``eps_attn`` checked here)."""
    if eps_attn is None:
        return lambda out: out
    read_norm.check_eps_attn(eps_attn, spec)
    V, dtype = v.shape[-1], v.dtype
    return lambda out: read_norm.split(out, V=V, spec=spec, eps_attn=eps_attn, dtype=dtype)


def _torch_forms(q, k, v, beta, lam, log_gate, initial_state, output_final_state, *, spec, window, form, chunk_size,
                 eps, decay_floor, shift, normalize, read, scale_ridge, lengths=None):
    """The PyTorch forms on checked inputs. ``lengths`` ``[B]``: real steps per row when
    rows end in padding (padding steps are no-ops and never reach the state)."""
    W = window
    dt = _compute_dtype(q, k, v, beta, lam, log_gate)
    B, T, H, K = q.shape
    V = v.shape[-1]

    def head_first(t):
        return None if t is None else t.to(dt).transpose(1, 2)

    qh, kh, vh, beta_h, lam_h, gate_h = map(head_first, (q, k, v, beta, lam, log_gate))
    st = initial_state
    S0 = q.new_zeros(B, H, K, V, dtype=dt) if st is None else st.S.to(dt)
    step_mask = None if lengths is None else torch.arange(T, device=q.device)[None, :] < lengths[:, None]

    x, valid, xs, ys, slot_valid, tail = write_side(kh, vh, st, W, shift, step_mask)
    eta_slots, log_gamma = step_sizes(spec, xs, slot_valid, beta_h, lam_h, eps=eps, decay_floor=decay_floor,
                                      normalize=normalize, scale_ridge=scale_ridge)
    read_after = read == "after"
    if form == "recurrent":
        o, S_T = recurrent_form(qh, xs, ys, eta_slots, log_gamma, gate_h, S0, regression=spec.regression,
                                read_after=read_after)
    else:
        log_a = log_gamma if gate_h is None else log_gamma + gate_h[..., None]
        kappa = None
        if spec.regression:
            kappa = eta_slots if gate_h is None else eta_slots * torch.exp(gate_h)[..., None, None]
        if form == "parallel":
            o, S_T = parallel_form(qh, xs, ys, eta_slots, kappa, log_a, S0, read_after=read_after)
        else:
            o, S_T = chunk_form(qh, xs, ys, eta_slots, kappa, log_a, S0, read_after=read_after, chunk_size=chunk_size)

    final = None
    if output_final_state:
        last = last_steps(kh.transpose(1, 2), lengths=lengths) if shift else None  # kh is [B, H, T, K]
        final = FalconState(rule=spec.name, window=W, shift=shift, S=S_T, last_key=last)
        if W > 1:
            final.tail_x, final.tail_y, final.tail_valid = next_tail(x, vh, valid, W, tail, lengths)
    return o.transpose(1, 2).to(v.dtype), final


def _varlen(q, k, v, beta, lam, log_gate, initial_state, output_final_state, *, cu_seqlens, spec, window, form,
            chunk_size, eps, decay_floor, shift, normalize, read, scale_ridge):
    """Packed sequences: unpacked into right-padded rows (padding steps are no-ops),
    run as one batch, and packed back. Options as ``_torch_forms``'s."""
    bounds = packed_bounds(q, cu_seqlens)
    N = len(bounds) - 1
    check_inputs(q, k, v, beta, lam, log_gate, spec, window=window, form=form, chunk_size=chunk_size, eps=eps,
                 decay_floor=decay_floor, read=read, initial_state=None, shift=shift)
    if initial_state is not None:
        check_state_type(initial_state)
        if initial_state.batch_size != N:
            raise ValueError(f"initial_state has {initial_state.batch_size} rows, but cu_seqlens holds {N} sequences")
        check_state(initial_state, spec, window=window, shift=shift, B=N, H=q.shape[2], K=q.shape[3], V=v.shape[3],
                    device=q.device)
    starts = torch.tensor(bounds[:-1], device=q.device)
    lengths = torch.tensor(bounds[1:], device=q.device) - starts
    unpack, real = padded_rows(starts, lengths, max(b1 - b0 for b0, b1 in zip(bounds, bounds[1:])))
    o, final = _torch_forms(*map(unpack, (q, k, v, beta, lam, log_gate)), initial_state, output_final_state,
                            spec=spec, window=window, form=form, chunk_size=chunk_size, eps=eps,
                            decay_floor=decay_floor, shift=shift, normalize=normalize, read=read,
                            scale_ridge=scale_ridge, lengths=lengths)
    return o[real][None], final


@keyword_hints(initial_state="state")
def falcon_step(
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
    backend: str = "auto",
    validate: bool = True,
    eps_attn: Optional[float] = None,
) -> Tuple[torch.Tensor, FalconState]:
    """One decoding step in ``O(1)``: ``q``, ``k`` ``[B, H, K]``, ``v`` ``[B, H, V]``,
    ``beta`` ``[B, H]`` (``[B, H, V]`` for 2/2A), ``lam`` and ``log_gate`` ``[B, H]``.
    ``state=None`` starts a fresh sequence (the sentinel step ``x_1 = 0, eta_1 = 0``). Returns
    ``o`` ``[B, H, V]`` (``v``'s dtype) and the new state (``S`` ``[B, H, K, V]``, in the compute
    dtype); identical to ``falcon_attention(form="recurrent")`` token by token: one step ``t`` of
    the table in ``falcon_attention``'s docstring (for rule 1, Algorithm 5, lines 2-7: ``eta_t``
    by Eq. 3.4, ``S_t = gamma_t S' + eta_t x_t r_t^T`` by Eq. 3.3 with the clamp of Eq. 4.20),
    then the read ``o_t = S_t^T q_t`` (``read="before"``: ``S_{t-1}^T q_t``).

    Keywords, their defaults and meanings as in ``falcon_attention``; the state is passed as
    ``state`` (``falcon_attention``: ``initial_state``), and the new state is always returned.
    ``eps_attn``: the normalized read, as in ``falcon_attention`` (the state then carries ``z``).
    ``backend="auto"`` uses the fused Triton step (``ops.triton.STEP_RULES``: the rules checked on
    a GPU) on CUDA when no gradient is needed, and the PyTorch step otherwise; ``"triton"`` forces
    it for any rule.

    The arguments are checked as ``falcon_attention``'s (shapes with a time axis of one
    step; ``lam >= 0``, ``log_gate <= 0``; the state's configuration) on every backend;
    ``validate=False`` skips the tensors' shapes and values, for callers whose inputs are valid by
    construction, such as the model's layers, where the checks would add a few small device launches
    to every layer of every decoded token (``falcon_attention`` always checks: once per
    sequence, not per token); the state (its type, configuration, shapes and device), the on/off
    switches and the options that are not tensors (``read``, ``window``, ``eps``, ``decay_floor``),
    all host-only, are checked always."""
    window, eps, decay_floor, eps_attn = map(plain_number, (window, eps, decay_floor, eps_attn))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    check_tensor_types(q, k, v, beta, lam, log_gate)
    (q, k, v, beta, lam, log_gate), state = _outside_inference((q, k, v, beta, lam, log_gate), state)
    check_switches(shift=shift, normalize=normalize, scale_ridge=scale_ridge, validate=validate)
    if state is not None:
        check_state_type(state, "state")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            want = "[B, H, V]" if name == "v" else "[B, H, K]"
            raise ValueError(f"{name} must have shape {want} (one token), got {tuple(getattr(t, 'shape', ()))}")
    spec = get_rule(rule)
    check_options(spec, window=window, eps=eps, decay_floor=decay_floor, read=read)
    W = window if spec.sliding else 1
    done = _read_normalizer(eps_attn, spec, v)
    if eps_attn is None:
        read_norm.refuse_normalizer_state(state, "state")
    else:
        q, k, v, beta, state = read_norm.extend(q, k, v, beta, lam, log_gate, state, spec, axes=("B", "H"),
                                                name="state", window=window, shift=shift)
    if validate:
        check_step_shapes(q, k, v, beta, lam, log_gate, spec)
        check_inputs(*(None if t is None else t[:, None] for t in (q, k, v, beta, lam, log_gate)), spec,
                     window=window, form="recurrent", chunk_size=1, eps=eps, decay_floor=decay_floor, read=read,
                     initial_state=None, shift=shift)
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        try:
            from .triton import STEP_RULES, falcon_step_triton
            if backend == "auto" and spec.name not in STEP_RULES:
                raise NotImplementedError(f"rule {spec.name!r} has not been checked on a GPU")
            return done(falcon_step_triton(q, k, v, beta, lam, state=state, rule=rule, window=window, eps=eps,
                                           decay_floor=decay_floor, shift=shift, normalize=normalize,
                                           log_gate=log_gate, read=read, scale_ridge=scale_ridge))
        except (ImportError, NotImplementedError):
            if backend == "triton":
                raise
    if state is not None:  # host-only, so also with validate=False (the fused step checks it on its own)
        check_state(state, spec, window=W, shift=shift, B=q.shape[0], H=q.shape[1], K=q.shape[2], V=v.shape[2],
                    device=q.device, name="state")
    return done(_torch_step(q, k, v, beta, lam, log_gate, state, spec=spec, window=W, eps=eps,
                            decay_floor=decay_floor, shift=shift, normalize=normalize, read=read,
                            scale_ridge=scale_ridge))


def cast_to(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` in ``dtype``, without dispatching a cast when it already is (``None`` stays ``None``):
    a decoding step would otherwise make dozens of no-op calls per layer."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _torch_step(q, k, v, beta, lam, log_gate, state, *, spec, window, eps, decay_floor, shift, normalize, read,
                scale_ridge):
    """The recurrent form's computation for one token on checked inputs, without its sequence
    plumbing: the inputs ``[B, H, ...]`` are already head-first, and a time axis of length one is
    added only for the window and step-size helpers shared with the other forms."""
    W = window
    dt = _compute_dtype(q, k, v, beta, lam, log_gate)
    k_in = k
    q, k, v_c, beta, lam, log_gate = (cast_to(t, dt) for t in (q, k, v, beta, lam, log_gate))
    B, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1]) if state is None else cast_to(state.S, dt)
    vh = v_c[:, :, None]
    xh, valid, xs, ys, slot_valid, tail = write_side(k[:, :, None], vh, state, W, shift)  # [B, H, 1, ...]
    eta_slots, log_gamma = step_sizes(spec, xs, slot_valid, beta[:, :, None], lam[:, :, None], eps=eps,
                                      decay_floor=decay_floor, normalize=normalize, scale_ridge=scale_ridge)
    o, S = recurrent_step(q, xs[:, :, 0], ys[:, :, 0], eta_slots[:, :, 0], torch.exp(log_gamma[:, :, 0]),
                          None if log_gate is None else torch.exp(log_gate), S, regression=spec.regression,
                          read_after=read == "after")
    # the state keeps k_t in a tensor of its own: the caller's k may be a buffer it refills with the next token
    last_key = None if not shift else k.clone() if k is k_in else k
    new_state = FalconState(rule=spec.name, window=W, shift=shift, S=S, last_key=last_key)
    if W > 1:
        new_state.tail_x, new_state.tail_y, new_state.tail_valid = next_tail(xh, vh, valid, W, tail)
    return cast_to(o, v.dtype), new_state
