r"""Time-segmented recomputation: the op over a long sequence in ``n`` pieces.

The state ``S`` (with the shifted key's carry and the sliding tail, ``FalconState``) is all a
segment needs from the ones before it, so the sequence can run piece by piece, each piece
starting from the state the previous one returned. That is exact: the op continues a state
to the bit of its recurrence (up to the rounding of where its chunks fall).

Under autograd each piece runs inside ``torch.utils.checkpoint`` (non-reentrant): its
forward keeps only its inputs and the state it started from, and the backward runs the
piece's forward again, from that state, just before its own backward. The intermediates of
the chunk form (the per-chunk states, the WY terms, the write values) are then alive for one
piece at a time: about ``1/n`` of the whole, for one more forward. Without autograd the
pieces simply run one after the other, which bounds a long prefill's scratch the same way.

    pieces:   [ 0, c_1 ) [ c_1, c_2 ) ... [ c_{n-1}, T )
    state:    S_0 --piece 1--> S_{c_1} --piece 2--> ... --piece n--> S_T

Segments are cut at whole chunks (``segment_bounds``), so that only the last one may end in
a partial chunk, as the whole sequence would.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint

from .state import FalconState

__all__ = ["segment_bounds", "run_segments", "check_segments"]


def check_segments(segments, cu_seqlens: Optional[torch.Tensor]) -> None:
    """``segments`` must be an integer >= 1, and 1 with packed sequences (``ValueError``)."""
    if isinstance(segments, bool) or not isinstance(segments, int) or segments < 1:
        raise ValueError(f"segments must be an integer >= 1, got {segments!r}")
    if segments > 1 and cu_seqlens is not None:
        raise ValueError(f"segments={segments} needs rows of equal length; with cu_seqlens, pass segments=1")


def segment_bounds(T: int, segments: int, chunk_size: int) -> List[int]:
    """Cut points ``0 = c_0 < c_1 < ... < c_m = T`` of at most ``segments`` pieces of equal length,
    that length rounded up to whole chunks of ``chunk_size`` steps (``m`` is smaller where ``T``
    has fewer chunks than ``segments``)."""
    per = -(-T // segments)  # ceil
    per = -(-per // chunk_size) * chunk_size
    return list(range(0, T, per)) + [T] if T > 0 else [0, 0]


def run_segments(
    call: Callable[..., Tuple[torch.Tensor, Optional[FalconState]]],
    tensors: Tuple[Optional[torch.Tensor], ...],
    initial_state: Optional[FalconState],
    output_final_state: bool,
    *,
    segments: int,
    chunk_size: int,
) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """``call(*pieces, initial_state=..., output_final_state=...)`` over the pieces of
    ``tensors`` (``[B, T, ...]`` each, or ``None``) cut along ``T`` by ``segment_bounds``, the
    state handed from piece to piece. Returns the outputs concatenated along ``T`` and the last
    piece's state (``None`` unless ``output_final_state``).

    With gradients enabled, every piece is checkpointed: its forward runs again in the backward.
    The pieces are views made by one ``torch.split`` per tensor, whose backward concatenates the
    pieces' gradients in one pass (a slice per piece would add a zero-filled copy of the whole
    tensor per piece)."""
    T = tensors[0].shape[1]
    bounds = segment_bounds(T, segments, chunk_size)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    if len(sizes) == 1:
        return call(*tensors, initial_state=initial_state, output_final_state=output_final_state)
    pieces = [[None] * len(sizes) if t is None else t.split(sizes, dim=1) for t in tensors]
    grad = torch.is_grad_enabled()
    state, outs = initial_state, []
    for i in range(len(sizes)):
        args = [p[i] for p in pieces]
        want = output_final_state or i < len(sizes) - 1
        if grad:
            o, state = checkpoint(call, *args, initial_state=state, output_final_state=want, use_reentrant=False)
        else:
            o, state = call(*args, initial_state=state, output_final_state=want)
        outs.append(o)
    return torch.cat(outs, dim=1), state if output_final_state else None
