"""Host copies of ``cu_seqlens``, the offsets of packed variable-length sequences.

The varlen paths need the sequence boundaries as Python ints (to cut sequences, to
lay out chunks). Reading them from a GPU tensor waits for every queued kernel, so a
model that reads them at every layer leaves the GPU idle once per layer while the
host launches the next kernels. A caller that already holds the boundaries on the
host (the model reads them once per batch) declares them for the duration of a
block with :func:`known_sequence_bounds`; inside it, :func:`sequence_bounds` and
:func:`memo` answer for that tensor object without a device read. Outside such a
block every call reads the tensor, so a direct caller of the op never sees a stale
copy.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch

__all__ = ["sequence_bounds", "known_sequence_bounds", "memo", "packed_bounds", "padded_rows", "last_steps"]

_LOCAL = threading.local()


def _registry() -> dict:
    if not hasattr(_LOCAL, "known"):
        _LOCAL.known = {}
    return _LOCAL.known


def _entry(cu_seqlens: torch.Tensor) -> Optional[tuple]:
    if torch.compiler.is_compiling():
        return None
    hit = _registry().get(id(cu_seqlens))
    return hit if hit is not None and hit[0] is cu_seqlens else None


def check_sequence_bounds(bounds: Sequence[int], total: int) -> None:
    """``bounds`` must rise strictly from 0 to ``total`` (every sequence at least one token)."""
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T = {total}, got {list(bounds)}")


def check_cu_seqlens(cu_seqlens) -> None:
    """``cu_seqlens`` must be a 1-D integer tensor (``TypeError``/``ValueError`` naming it; a
    float tensor would be cut to integers and a list has no device)."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a 1-D integer torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool:
        raise TypeError(f"cu_seqlens must hold integers, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1:
        raise ValueError(f"cu_seqlens must have shape [N + 1], got {tuple(cu_seqlens.shape)}")


def sequence_bounds(cu_seqlens: torch.Tensor, total: Optional[int] = None) -> Tuple[int, ...]:
    """``cu_seqlens`` ``[N + 1]`` as a tuple of Python ints: the declared host copy inside
    :func:`known_sequence_bounds` for this tensor object, else read from the tensor. With
    ``total``, checked to rise strictly from 0 to ``total``."""
    check_cu_seqlens(cu_seqlens)
    hit = _entry(cu_seqlens)
    bounds = hit[1] if hit is not None else tuple(int(b) for b in cu_seqlens.tolist())
    if total is not None:
        check_sequence_bounds(bounds, total)
    return bounds


def memo(cu_seqlens: torch.Tensor, key, build: Callable):
    """``build()``, computed once per ``key`` for ``cu_seqlens`` inside its
    :func:`known_sequence_bounds` block (every call outside one builds anew)."""
    hit = _entry(cu_seqlens)
    if hit is None:
        return build()
    if key not in hit[2]:
        hit[2][key] = build()
    return hit[2][key]


@contextlib.contextmanager
def known_sequence_bounds(cu_seqlens: Optional[torch.Tensor], bounds: Optional[Sequence[int]]) -> Iterator[None]:
    """Within the block, ``bounds`` stand for the values of the tensor object ``cu_seqlens``
    (which the caller must not write to inside it); quantities derived from them through
    :func:`memo` are shared by every call in the block. ``None`` for either does nothing."""
    if cu_seqlens is None or bounds is None or torch.compiler.is_compiling():
        yield
        return
    known = _registry()
    key = id(cu_seqlens)
    outer = known.get(key)
    known[key] = (cu_seqlens, tuple(int(b) for b in bounds), {})
    try:
        yield
    finally:
        if outer is None:
            known.pop(key, None)
        else:
            known[key] = outer


def packed_bounds(q: torch.Tensor, cu_seqlens: torch.Tensor) -> Tuple[int, ...]:
    """:func:`sequence_bounds` of the sequences packed in ``q``, which must be ``[1, total, H, K]``
    (``ValueError`` naming ``q`` otherwise)."""
    if q.dim() != 4 or q.shape[0] != 1:
        raise ValueError(f"q must have shape [1, total, H, K] with cu_seqlens (the sequences packed into one row), "
                         f"got {tuple(q.shape)}")
    return sequence_bounds(cu_seqlens, q.shape[1])


def padded_rows(starts: torch.Tensor, lengths: torch.Tensor, L: int
                ) -> Tuple[Callable[[Optional[torch.Tensor]], Optional[torch.Tensor]], torch.Tensor]:
    """Packed sequences as right-padded rows, for the forms that run a batch of rows.

    ``starts``, ``lengths`` ``[N]`` (int64, on the tensors' device): where each sequence begins in
    the packed axis and how many steps it has; ``L``: the longest. Returns ``unpack``, which maps a
    packed ``[1, total, ...]`` tensor to ``[N, L, ...]`` with zeros past each sequence's end (``None``
    stays ``None``), and ``real`` ``[N, L]``, the steps that exist: ``o[real][None]`` packs rows back."""
    steps = torch.arange(L, device=starts.device)[None, :]
    real = steps < lengths[:, None]
    pos = torch.where(real, starts[:, None] + steps, torch.zeros_like(steps))

    def unpack(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        rows = t[0][pos]
        return rows.masked_fill(~real.view(*real.shape, *([1] * (rows.dim() - 2))), 0.0)

    return unpack, real


def last_steps(x: torch.Tensor, *, cu_seqlens: Optional[torch.Tensor] = None,
               lengths: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Each sequence's last step of ``x`` ``[B, T, ...]``: ``x[:, -1]`` ``[B, ...]``; with ``cu_seqlens``
    (``x`` packed ``[1, total, ...]``) the step before each end, ``[N, ...]``; with ``lengths`` ``[B]``
    (right-padded rows) step ``lengths[b] - 1`` of row ``b``. The shifted key a state carries
    (``FalconState.last_key``) is this step of the keys, in a tensor of its own: a view of ``x`` would
    change with it when the caller refills its key buffer for the next segment."""
    if cu_seqlens is not None:
        return x[0, cu_seqlens[1:].long() - 1]
    if lengths is not None:
        return x[torch.arange(x.shape[0], device=x.device), lengths - 1]
    return x[:, -1].clone()
