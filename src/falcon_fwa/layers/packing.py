"""How a batch of token rows maps onto sequences: dense rows or one packed row.

Every mixer sees its input in one of two layouts:

* dense: ``[B, T, D]``, each row one sequence (no padding anywhere);
* packed: ``[1, N_tok, D]`` holding ``N`` sequences back to back, delimited by
  ``cu_seqlens`` ``[N + 1]`` (flash-attention's convention). Padding is removed
  before the first layer (``unpad``) and restored after the last (``repad``), so a
  pad token never reaches a write, gate, decay, short-convolution buffer or
  normalizer: there is nothing to mask.

``rows[n]`` is the cache row (batch row) that sequence ``n`` continues, and
``positions`` the index of each token within its sequence counting the cached
prefix (for RoPE). Each sequence continues a cache row of its own (two sequences
writing one row would leave it holding only one of them), so ``rows`` holds distinct
rows ``>= 0``; whether each is a row the cache holds is checked where the layout
meets a cache (:func:`layout_of`), from the host copy ``host_rows``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

import torch

from ..ops.seqlens import check_cu_seqlens, check_sequence_bounds, sequence_bounds

if TYPE_CHECKING:
    from .layer_cache import LayerCache

__all__ = ["Packing", "unpad", "repad", "cu_seqlens_from_lengths", "layout_of"]


@dataclass
class Packing:
    """Layout of the tokens a mixer receives (see the module docstring).

    ``cu_seqlens`` ``[N + 1]`` (packed) or ``None`` (dense); ``rows`` ``[N]`` (packed)
    or ``None``; ``positions`` ``[B, T]`` (dense) or ``[1, N_tok]`` (packed), int64;
    ``seq_ids`` ``[N_tok]``: sequence index of every packed token (packed only);
    ``bounds``: ``cu_seqlens`` as Python ints (packed only), read once per batch and
    declared to the op for the model's pass (``ops.seqlens.known_sequence_bounds``);
    ``host_rows``: ``rows`` as Python ints (packed only), read once per batch, so that checking
    them against each layer's cache costs no device read.
    """

    cu_seqlens: Optional[torch.Tensor]
    rows: Optional[torch.Tensor]
    positions: torch.Tensor
    seq_ids: Optional[torch.Tensor] = None
    bounds: Optional[Tuple[int, ...]] = None
    host_rows: Optional[Tuple[int, ...]] = None

    @property
    def packed(self) -> bool:
        """Whether the layout is one packed row (``cu_seqlens`` given) rather than dense rows."""
        return self.cu_seqlens is not None

    @property
    def num_sequences(self) -> int:
        """``N`` packed sequences, or the ``B`` dense rows."""
        return self.positions.shape[0] if self.cu_seqlens is None else self.cu_seqlens.numel() - 1

    @staticmethod
    def dense(batch: int, length: int, offsets: Optional[torch.Tensor], device) -> "Packing":
        """Dense rows; ``offsets`` ``[B]``: tokens already cached per row (or None)."""
        pos = torch.arange(length, device=device)[None, :].expand(batch, length)
        if offsets is not None:
            pos = pos + offsets.to(device)[:, None]
        return Packing(cu_seqlens=None, rows=None, positions=pos)

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, rows: torch.Tensor, offsets: Optional[torch.Tensor],
                        bounds: Optional[Sequence[int]] = None,
                        host_rows: Optional[Sequence[int]] = None) -> "Packing":
        """Packed sequences; ``offsets`` ``[B]`` tokens already cached per cache row; ``bounds`` and
        ``host_rows``: ``cu_seqlens``'s and ``rows``' values if the caller holds them (else read here,
        once each; they are taken as given, as the caller's copies of the tensors).

        ``cu_seqlens`` must be a 1-D integer tensor rising strictly from 0 (every sequence at least one
        token) and ``rows`` a 1-D integer tensor of one cache row per sequence, distinct and ``>= 0`` (below
        ``offsets``' length when given): otherwise a ``TypeError`` or ``ValueError`` naming the argument
        (checked on the host, from ``bounds`` and ``rows`` read once)."""
        check_cu_seqlens(cu_seqlens)
        cu = cu_seqlens.to(torch.int64)
        bounds = sequence_bounds(cu) if bounds is None else tuple(int(b) for b in bounds)
        if len(bounds) != cu.shape[0]:
            raise ValueError(f"bounds must hold the {cu.shape[0]} values of cu_seqlens, got {len(bounds)}")
        if bounds != (0,):  # [0]: a call of no sequence (every column of a padded batch a pad)
            check_sequence_bounds(bounds, bounds[-1] if bounds else 0)
        if not isinstance(rows, torch.Tensor):
            raise TypeError(f"rows must be a 1-D integer torch.Tensor (one cache row per sequence), "
                            f"got {type(rows).__name__}")
        if rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool:
            raise TypeError(f"rows must hold integers (one cache row per sequence), got {rows.dtype}")
        if tuple(rows.shape) != (len(bounds) - 1,):
            raise ValueError(f"rows must have shape [N] = ({len(bounds) - 1},), one cache row for each of the "
                             f"{len(bounds) - 1} sequences of cu_seqlens, got {tuple(rows.shape)}")
        if host_rows is None:
            host_rows = tuple(int(r) for r in rows.tolist())
        else:
            host_rows = tuple(int(r) for r in host_rows)
            if len(host_rows) != rows.shape[0]:
                raise ValueError(f"host_rows must hold the {rows.shape[0]} values of rows, got {len(host_rows)}")
        first = {}
        for n, r in enumerate(host_rows):
            if r < 0:
                raise ValueError(f"rows must hold cache rows >= 0 (a negative row is refused, not counted from "
                                 f"the end), got {r} for sequence {n}")
            if r in first:
                raise ValueError(f"rows must name a different cache row for each sequence (each sequence "
                                 f"continues a cache row of its own), got row {r} repeated, for sequences "
                                 f"{first[r]} and {n}")
            first[r] = n
        if offsets is not None and host_rows and max(host_rows) >= offsets.shape[0]:
            bad = max(host_rows)
            raise ValueError(f"rows must name cache rows below {offsets.shape[0]} (offsets holds the tokens "
                             f"cached in {offsets.shape[0]} rows), got {bad} for sequence {first[bad]}")
        lengths = cu[1:] - cu[:-1]
        total = bounds[-1]
        seq_ids = torch.repeat_interleave(torch.arange(lengths.numel(), device=cu.device), lengths)
        pos = torch.arange(total, device=cu.device) - cu[:-1][seq_ids]
        if offsets is not None:
            pos = pos + offsets.to(cu.device)[rows][seq_ids]
        return Packing(cu_seqlens=cu, rows=rows.to(cu.device), positions=pos[None, :], seq_ids=seq_ids, bounds=bounds,
                       host_rows=host_rows)

    def check_rows(self, held: int, filled: bool = False) -> None:
        """Refuse a packed layout that continues a cache row outside ``0 .. held - 1`` (``held``: the rows of
        the cache it meets; ``filled``: the cache is empty and this call fills one row per sequence, so
        ``rows`` must be an ordering of ``0 .. N - 1``): a ``ValueError`` naming ``rows``, the row and
        ``held``. Reads ``host_rows`` (``rows`` itself only for a layout built by hand without it). Dense
        rows: nothing to check."""
        if not self.packed:
            return
        rows = self.host_rows if self.host_rows is not None else tuple(int(r) for r in self.rows.tolist())
        for n, r in enumerate(rows):
            if not 0 <= r < held:
                where = (f"an empty cache is filled with one row per sequence, {held} rows" if filled
                         else f"the cache holds {held} rows")
                raise ValueError(f"rows must name cache rows 0 .. {held - 1} ({where}; a negative row is "
                                 f"refused), got {r} for sequence {n}")


def layout_of(packing: Optional[Packing], x: torch.Tensor, offsets: Optional[Sequence[int]] = None,
              name: str = "h", cache: Optional["LayerCache"] = None) -> Packing:
    """The layout a mixer runs ``x`` ``[B, T, ...]`` (the argument called ``name``) in: ``packing`` checked
    against it, or for ``None`` dense rows (``offsets``: tokens already cached per row, for the positions).
    Host-only: a ``TypeError`` unless ``packing`` is a :class:`Packing` or ``None``; a ``ValueError`` naming
    ``packing`` where its tokens are not ``x``'s (dense: ``positions`` ``[B, T]``; packed: one row of
    ``bounds[-1]`` tokens), and one naming ``rows`` where a packed sequence continues a row outside the
    cache's (:meth:`Packing.check_rows`): the ``len(offsets)`` rows of a filled key/value cache, or the rows
    of a recurrent mixer's ``cache`` (a :class:`LayerCache`; empty, the ``N`` rows its first call fills)."""
    B, T = x.shape[:2]
    if packing is not None and not isinstance(packing, Packing):
        raise TypeError(f"packing must be a Packing (or None for dense rows), got {type(packing).__name__}")
    if (packing is None or not packing.packed) and offsets is not None and len(offsets) != B:
        raise ValueError(f"cache holds {len(offsets)} rows, {name} has {B}: dense rows continue the cache row "
                         f"by row (pass a packed layout to continue other rows)")
    if packing is None:
        return Packing.dense(B, T, None if offsets is None else torch.as_tensor(offsets), x.device)
    if packing.packed:
        total = packing.bounds[-1] if packing.bounds is not None else packing.positions.shape[-1]
        if B != 1 or T != total:
            raise ValueError(f"packing holds {packing.num_sequences} packed sequences of {total} tokens in all, "
                             f"so {name} must have shape [1, {total}, ...], got {tuple(x.shape)}")
        if offsets is not None:
            packing.check_rows(len(offsets))
        if cache is not None:
            held = cache.num_rows
            packing.check_rows(packing.num_sequences if held is None else held, filled=held is None)
    elif tuple(packing.positions.shape) != (B, T):
        raise ValueError(f"packing describes dense rows of shape {tuple(packing.positions.shape)} (positions "
                         f"[B, T]), but {name} has [B, T] = {(B, T)}")
    return packing


def cu_seqlens_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """Offsets ``cu_seqlens`` ``[N + 1]`` (int64) of sequences of ``lengths`` ``[N]`` packed one after
    another: ``[0, l_0, l_0 + l_1, ..., sum(lengths)]``."""
    return torch.nn.functional.pad(lengths.to(torch.int64).cumsum(0), (1, 0))


def unpad(x: torch.Tensor, mask: torch.Tensor):
    """Gather the real tokens of ``x`` ``[B, T, ...]`` under ``mask`` ``[B, T]`` (1 = real)
    into one packed row ``[1, N_tok, ...]``.

    Returns the packed tensor, the flat token indices ``[N_tok]`` (into ``B*T``),
    ``cu_seqlens`` over the rows that hold at least one real token, and those rows.
    """
    if mask.dim() != 2 or tuple(mask.shape) != tuple(x.shape[:2]):
        raise ValueError(f"mask must have shape [B, T] = {list(x.shape[:2])} (x's first two), got {tuple(mask.shape)}")
    mask = mask.to(torch.bool)
    lengths = mask.sum(1)
    rows = torch.nonzero(lengths > 0).flatten()
    index = torch.nonzero(mask.flatten()).flatten()
    packed = x.reshape(-1, *x.shape[2:]).index_select(0, index)[None]
    return packed, index, cu_seqlens_from_lengths(lengths[rows]), rows


def repad(packed: torch.Tensor, index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Inverse of :func:`unpad`: scatter ``[1, N_tok, ...]`` back to ``[B, T, ...]`` (zeros at pads)."""
    out = packed.new_zeros(batch * length, *packed.shape[2:])
    out.index_copy_(0, index, packed[0])
    return out.view(batch, length, *packed.shape[2:])
