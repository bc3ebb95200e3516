r"""Time-segmented recomputation: the op over a long sequence in ``n`` pieces.

The state (``FalconState``: ``S``, the shifted key's carry, the sliding tail, the read
normalizer ``z``) is all a piece needs from the ones before it, so the sequence can run piece
by piece, each piece starting from the state the previous one returned. That is exact: the op
continues a state to the rounding of where its chunks fall.

    pieces:   [ 0, c_1 ) [ c_1, c_2 ) ... [ c_{n-1}, T )
    state:    S_0 --piece 1--> S_{c_1} --piece 2--> ... --piece n--> S_T

Under autograd the pieces form one node (``_Pieces``). Its forward runs them without a graph
and keeps only the states at the cuts (``n - 1`` of them, ``[B, H, K, V]`` fp32 each, and the
small carries). Its backward takes the pieces last to first: it runs piece ``i``'s forward
again from the state at cut ``i`` with a graph, backpropagates into it the output's gradient
on the piece and the gradient of the state it handed on (from piece ``i + 1``), and so gets
the gradient of the piece's inputs and of its entry state, which goes on to piece ``i - 1``.
The chunk form's intermediates (per-chunk states, WY terms, write values) are then alive for
one piece at a time, about ``1/n`` of what one call holds, for one more forward of the op.
Whatever the op keeps for its backward, and however its own nodes free it, lives and dies
inside one piece's graph. The pieces run again under the autocast the forward ran under, so the
gradients are those of the function the forward computed. A second-order gradient
(``create_graph=True``: the backward itself recorded) runs the pieces again as one graph from the
node's inputs, whose gradients are then functions of them: the memory of one whole call. Under
``torch.func``'s transforms, which take no node without ``setup_context``, the pieces run one after the
other without the node, recorded by the transform as one graph: the memory of one whole call too; so do
they for dual tensors of forward-mode AD (``torch.autograd.forward_ad``; the node has no ``jvp``).

Cuts fall on whole chunks (``segment_bounds``), so that only the last piece may end in a
partial chunk, as the whole sequence would.

Packed sequences (``cu_seqlens``) are cut between sequences only (``packed_groups``): each piece
is a group of whole sequences, a packed call of its own with its rows of the initial state, and
nothing passes from one piece to the next. A sequence longer than a piece stays whole.
"""
from __future__ import annotations

from contextlib import ExitStack
from dataclasses import replace
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .seqlens import known_sequence_bounds, packed_bounds
from .state import TENSOR_FIELDS, FalconState

__all__ = ["segment_bounds", "packed_groups", "run_segments", "other_derivative"]

# the node takes and returns the state's tensors in the order of TENSOR_FIELDS (tail_valid is a mask: no gradient)
# _Pieces.apply(call, bounds, initial_state, want_final, holder, q, k, v, beta, lam, log_gate, *state tensors)
N_OPTIONS, N_INPUTS = 5, 6


def segment_bounds(T: int, segments: int, chunk_size: int) -> List[int]:
    """Cut points ``0 = c_0 < c_1 < ... < c_m = T`` of at most ``segments`` pieces of equal length,
    that length rounded up to whole chunks of ``chunk_size`` steps (``m`` is smaller where ``T``
    has fewer chunks than ``segments``)."""
    per = -(-T // segments)  # ceil
    per = -(-per // chunk_size) * chunk_size
    return list(range(0, T, per)) + [T] if T > 0 else [0, 0]


def packed_groups(bounds: Sequence[int], segments: int) -> List[int]:
    """Groups of whole packed sequences: indices ``0 = s_0 < s_1 < ... < s_m = N`` of the sequences
    that open each group, for the sequence offsets ``bounds`` ``[N + 1]``. Each cut is the sequence
    boundary nearest to one of the equal cuts ``j * total / segments``; cuts that coincide count
    once, so ``m <= segments``."""
    N, total = len(bounds) - 1, bounds[-1]
    cuts = [0]
    for j in range(1, segments):
        target = j * total / segments
        s = min(range(1, N), key=lambda i: abs(bounds[i] - target), default=None)
        if s is not None and s > cuts[-1]:
            cuts.append(s)
    return cuts + [N]


def _state_tensors(state: Optional[FalconState]) -> Tuple[Optional[torch.Tensor], ...]:
    return tuple(None if state is None else getattr(state, f) for f in TENSOR_FIELDS)


def _with_tensors(template: FalconState, tensors: Sequence[Optional[torch.Tensor]]) -> FalconState:
    return replace(template, **dict(zip(TENSOR_FIELDS, tensors)))


def _piece(t: Optional[torch.Tensor], a: int, b: int) -> Optional[torch.Tensor]:
    return None if t is None else t[:, a:b]


def _run_pieces(call, bounds: Sequence[int], state: Optional[FalconState], want_final: bool, inputs):
    """The pieces one after the other: the outputs, the state at every piece's entry and the last state."""
    cuts, outs = [], []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        cuts.append(state)
        last = i == len(bounds) - 2
        o, state = call(*(_piece(t, a, b) for t in inputs), initial_state=state,
                        output_final_state=want_final or not last)
        outs.append(o)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), cuts, state


class _Pieces(torch.autograd.Function):
    """``(o, *final state tensors)`` of ``call`` over the pieces ``bounds`` of the inputs
    ``(q, k, v, beta, lam, log_gate)`` from the initial state's tensors (see the module). The
    final state's configuration goes into ``holder["template"]``."""

    @staticmethod
    def forward(ctx, call, bounds, initial_state, want_final, holder, *flat):
        inputs, start = flat[:N_INPUTS], flat[N_INPUTS:]
        # (the state's tensors come as arguments of their own, for autograd to see them)
        state = None if initial_state is None else _with_tensors(initial_state, start)
        with torch.no_grad():
            o, cuts, state = _run_pieces(call, bounds, state, want_final, inputs)
        ctx.call, ctx.bounds, ctx.want_final, ctx.cuts = call, bounds, want_final, cuts
        ctx.autocast = _autocast_now(inputs[0].device.type)
        # the initial state's tensors saved as the inputs are: the backward reads them again (piece 1 runs from them),
        # so writing into them in between is autograd's error, as for one call, not a gradient of other values
        ctx.save_for_backward(*inputs, *start)
        holder["template"] = state
        # the final state's tensors may be views of the inputs (the last key): the node returns copies
        final = tuple(None if t is None else t.clone() for t in _state_tensors(state if want_final else None))
        if final[TENSOR_FIELDS.index("tail_valid")] is not None:
            ctx.mark_non_differentiable(final[TENSOR_FIELDS.index("tail_valid")])
        return (o, *final)

    @staticmethod
    def backward(ctx, do, *d_final):
        with _autocast_as(ctx.autocast):
            if torch.is_grad_enabled():  # create_graph=True: gradients that are functions of the inputs
                return _backward_with_graph(ctx, do, d_final)
            return _backward_by_pieces(ctx, do, d_final)


def _saved(ctx) -> Tuple[Tuple[Optional[torch.Tensor], ...], List[Optional[FalconState]]]:
    """The node's saved inputs and its states at the cuts, the first one (the initial state) of its saved tensors."""
    saved = ctx.saved_tensors
    cuts = list(ctx.cuts)
    if cuts[0] is not None:
        cuts[0] = _with_tensors(cuts[0], saved[N_INPUTS:])
    return saved[:N_INPUTS], cuts


def _backward_by_pieces(ctx, do, d_final):
    """``_Pieces.backward``: the pieces last to first, each run again from the state at its entry."""
    inputs, cuts = _saved(ctx)
    wants = ctx.needs_input_grad[N_OPTIONS:N_OPTIONS + N_INPUTS]
    pieces: List[List[torch.Tensor]] = [[] for _ in inputs]  # the inputs' gradients, last piece first
    d_state = d_final if ctx.want_final else (None,) * len(TENSOR_FIELDS)
    for i in reversed(range(len(ctx.bounds) - 1)):
        # one piece per call: its output, graph and gradients are gone before the next piece runs
        d_state = _piece_backward(ctx, i, inputs, cuts[i], wants, do, d_state, pieces)
    # concatenated once every piece is done: buffers of the whole length taken at the start would add a
    # piece's worth of gradients to the peak, which lies inside a piece's backward
    grads = [torch.cat(p[::-1], dim=1) if p else None for p in pieces]
    return (*(None,) * N_OPTIONS, *grads, *d_state)


def _piece_backward(ctx, i: int, inputs, entry: Optional[FalconState], wants, do, d_state,
                    pieces) -> List[Optional[torch.Tensor]]:
    """Piece ``i`` of ``_Pieces`` again, from the state ``entry`` at its entry, with a graph; backpropagate the
    output's gradient on the piece and ``d_state`` (that of the state it handed on) into it. Appends
    the inputs' gradients on the piece to ``pieces`` and returns that of its entry state."""
    a, b = ctx.bounds[i], ctx.bounds[i + 1]
    last = i == len(ctx.bounds) - 2
    with torch.enable_grad():
        leaves = [None if t is None else t[:, a:b].detach().requires_grad_(w) for t, w in zip(inputs, wants)]
        entry_leaves = [None if entry is None or getattr(entry, f) is None else
                        getattr(entry, f).detach().requires_grad_(f != "tail_valid" and (i > 0 or _wants_state(ctx, j)))
                        for j, f in enumerate(TENSOR_FIELDS)]
        state = None if entry is None else _with_tensors(entry, entry_leaves)
        o, out_state = ctx.call(*leaves, initial_state=state, output_final_state=ctx.want_final or not last)
        outputs, upstream = [o], [do[:, a:b]]
        for t, g in zip(_state_tensors(out_state), d_state):
            if t is not None and g is not None and t.requires_grad:
                outputs.append(t)
                upstream.append(g)
        wrt = [t for t in leaves + entry_leaves if t is not None and t.requires_grad]
        found = list(torch.autograd.grad(outputs, wrt, upstream, allow_unused=True)) if wrt else []
    found.reverse()
    for n, t in enumerate(leaves):
        if t is not None and t.requires_grad:
            g = found.pop()
            pieces[n].append(torch.zeros_like(t) if g is None else g)
    return [found.pop() if t is not None and t.requires_grad else None for t in entry_leaves]


def _backward_with_graph(ctx, do, d_final):
    """``_Pieces.backward`` under ``create_graph=True``: the pieces again, one after the other from the
    node's own inputs and initial state with a graph through them all, and the gradients taken with a
    graph, so that they can be differentiated again."""
    inputs, cuts = _saved(ctx)
    start = cuts[0]
    o, _, final = _run_pieces(ctx.call, ctx.bounds, start, ctx.want_final, inputs)
    outputs, upstream = [o], [do]
    if ctx.want_final:
        for t, g in zip(_state_tensors(final), d_final):
            if t is not None and g is not None and t.requires_grad:
                outputs.append(t)
                upstream.append(g)
    tensors = [*inputs, *_state_tensors(start)]
    wrt = [n for n, t in enumerate(tensors) if t is not None and ctx.needs_input_grad[N_OPTIONS + n]]
    found = torch.autograd.grad(outputs, [tensors[n] for n in wrt], upstream, allow_unused=True, create_graph=True)
    grads: List[Optional[torch.Tensor]] = [None] * len(tensors)
    for n, g in zip(wrt, found):
        grads[n] = torch.zeros_like(tensors[n]) if g is None else g
    return (*(None,) * N_OPTIONS, *grads)


def _autocast_now(device_type: str) -> List[Tuple[str, bool, torch.dtype]]:
    """The autocast state (enabled, dtype) of the inputs' device type and of the CPU, to run the pieces
    again under in the backward (which runs outside the forward's ``torch.autocast``)."""
    kinds = dict.fromkeys((device_type, "cpu"))
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in kinds
            if torch.amp.is_autocast_available(d)]


def _autocast_as(state: List[Tuple[str, bool, torch.dtype]]) -> ExitStack:
    stack = ExitStack()
    for device_type, enabled, dtype in state:
        stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
    return stack


def _wants_state(ctx, j: int) -> bool:
    """Whether the node's ``j``-th initial-state tensor (``TENSOR_FIELDS[j]``) asks for a gradient."""
    return ctx.needs_input_grad[N_OPTIONS + N_INPUTS + j]


def _functorch_active() -> bool:
    """Whether a ``torch.func`` transform is running (where ``_Pieces.apply`` would raise)."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return active is not None and active()


def _has_tangents(tensors) -> bool:
    """Whether one of ``tensors`` is a dual tensor of ``torch.autograd.forward_ad`` (a tangent at the current level)."""
    from torch.autograd import forward_ad
    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level entered: no tensor carries a tangent
        return False  # (host time per decoding step: 0.4 us instead of 2.6 for six tensors on a CPU)
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def other_derivative(tensors, state: Optional[FalconState]) -> bool:
    """Whether a derivative other than autograd's reverse mode is taken through ``tensors`` or ``state``'s
    tensors: one carries a forward-mode tangent (``torch.autograd.forward_ad``; also under ``torch.no_grad``),
    or a ``torch.func`` transform runs. Neither the pieces' node (``_Pieces``) nor a kernel takes either: the
    fused kernel is no autograd node (the tangent would be dropped), the chunk kernels' nodes have no ``jvp``
    and no ``setup_context``."""
    return _functorch_active() or _has_tangents((*tensors, *_state_tensors(state)))


def _apply_pieces(call, bounds: Sequence[int], tensors, state: Optional[FalconState], want_final: bool):
    """``call`` over the pieces ``bounds`` of ``tensors`` from ``state``: under autograd as the node
    ``_Pieces`` (each piece's forward runs again in the backward), else one piece after the other.
    Under ``torch.func``'s transforms (``grad``, ``vjp``, ``jvp``, ``jacrev``, ``vmap``), which take no
    ``autograd.Function`` without ``setup_context``, the pieces also run one after the other, their graph
    recorded by the transform as one call's: the same function and gradients, without the memory bound. So do
    inputs that carry forward-mode tangents (``torch.autograd.forward_ad``), which the node (no ``jvp``) cannot take."""
    if not torch.is_grad_enabled() or other_derivative(tensors, state):
        o, _, state = _run_pieces(call, bounds, state, want_final, tensors)
        return o, state if want_final else None
    holder: dict = {}
    o, *final = _Pieces.apply(call, bounds, state, want_final, holder, *tensors, *_state_tensors(state))
    return o, _with_tensors(holder["template"], final) if want_final else None


def run_segments(
    call: Callable[..., Tuple[torch.Tensor, Optional[FalconState]]],
    tensors: Tuple[Optional[torch.Tensor], ...],
    initial_state: Optional[FalconState],
    output_final_state: bool,
    *,
    segments: int,
    chunk_size: int,
    cu_seqlens: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """``call(q, k, v, beta, lam, log_gate, initial_state=..., output_final_state=...)`` over the
    pieces of ``tensors`` (``[B, T, ...]`` each, ``log_gate`` may be ``None``) cut along ``T`` by
    ``segment_bounds``, the state handed from piece to piece. Returns the outputs concatenated
    along ``T`` and the last piece's state (``None`` unless ``output_final_state``). Under
    autograd, as one node that runs each piece's forward again in its backward.

    With ``cu_seqlens`` (``[1, total, ...]`` tensors): ``call`` also takes ``cu_seqlens=``, and the
    pieces are groups of whole sequences (``packed_groups``), each run as its own packed call and
    recomputed in the backward on its own; the final state has one row per sequence, as one call's."""
    if cu_seqlens is not None:
        return _run_packed(call, tensors, initial_state, output_final_state, segments=segments,
                           cu_seqlens=cu_seqlens)
    T = tensors[0].shape[1]
    bounds = segment_bounds(T, segments, chunk_size)
    if len(bounds) == 2:
        return call(*tensors, initial_state=initial_state, output_final_state=output_final_state)
    return _apply_pieces(call, bounds, tensors, initial_state, output_final_state)


def _run_packed(call, tensors, initial_state: Optional[FalconState], output_final_state: bool, *, segments: int,
                cu_seqlens: torch.Tensor) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """``run_segments`` for packed sequences: groups of whole sequences, each a packed call of its own.
    The groups' offsets are formed on the device from ``cu_seqlens`` and declared with their host
    values (``known_sequence_bounds``), so that no group reads them back."""
    bounds = packed_bounds(tensors[0], cu_seqlens)  # q [1, total, H, K] (the caller's shape in its refusal)
    if initial_state is not None and initial_state.batch_size != len(bounds) - 1:  # before its rows are picked
        raise ValueError(f"initial_state has {initial_state.batch_size} rows, but cu_seqlens holds "
                         f"{len(bounds) - 1} sequences")
    groups = packed_groups(bounds, segments)
    if len(groups) == 2:
        return call(*tensors, initial_state=initial_state, output_final_state=output_final_state,
                    cu_seqlens=cu_seqlens)
    sizes = [bounds[b] - bounds[a] for a, b in zip(groups, groups[1:])]
    parts = [[None] * len(sizes) if t is None else t.split(sizes, dim=1) for t in tensors]
    outs, finals = [], []
    for g, (a, b) in enumerate(zip(groups, groups[1:])):
        cu = cu_seqlens[a:b + 1] - cu_seqlens[a]
        local = tuple(x - bounds[a] for x in bounds[a:b + 1])
        rows = None if initial_state is None else initial_state.index_select(
            torch.arange(a, b, device=initial_state.S.device))

        def group_call(*args, initial_state, output_final_state, cu=cu, local=local):
            with known_sequence_bounds(cu, local):
                return call(*args, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu)

        o, final = _apply_pieces(group_call, [0, sizes[g]], [p[g] for p in parts], rows, output_final_state)
        outs.append(o)
        finals.append(final)
    return torch.cat(outs, dim=1), FalconState.cat(finals) if output_final_state else None
