"""Per-layer decoding cache: what one mixer carries from one forward call to the next.

Rows are batch rows. Recurrent mixers keep their :class:`~falcon_fwa.FalconState`
(matrix state, last key, sliding tail) and the short-convolution buffers, so a new
token costs ``O(1)`` whatever the context length; the Transformer keeps its keys
and values in buffers with a number of real tokens per row (rows may differ).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Dict, List, Optional

import torch

from ..ops import FalconState

__all__ = ["LayerCache", "scatter_rows"]


def scatter_rows(old: Optional[torch.Tensor], rows: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    """``old`` with rows ``rows`` replaced by ``new`` (``rows=None``: ``new`` replaces everything). With no
    ``old`` (the first call), ``new[n]`` goes to row ``rows[n]`` of a new tensor of ``new``'s rows: ``rows`` is
    then an ordering of ``0 .. N-1`` (a packed first call may hold its sequences in any order of the rows)."""
    if rows is None:
        return new
    if old is None:
        return torch.zeros_like(new).index_copy_(0, rows.to(new.device), new)
    return old.index_copy(0, rows.to(old.device), new.to(old.dtype))


@dataclass
class LayerCache:
    """``state``: the recurrent :class:`FalconState` (``[B, ...]``); ``conv``: short-conv
    buffers by name (``[B, W-1, C]``); ``keys`` / ``values``: ``[B, H, capacity, D]`` buffers
    whose row ``b`` holds ``lengths[b]`` real tokens (the slots after them are unused)."""

    state: Optional[FalconState] = None
    conv: Dict[str, torch.Tensor] = field(default_factory=dict)
    keys: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    lengths: Optional[List[int]] = None

    @property
    def num_rows(self) -> Optional[int]:
        """The rows the cache holds (``None`` while it holds nothing: the first call fills it)."""
        if self.state is not None:
            return self.state.S.shape[0]
        for buf in self.conv.values():
            return buf.shape[0]
        return None if self.keys is None else self.keys.shape[0]

    def store_state(self, new: FalconState, rows: Optional[torch.Tensor]) -> None:
        """Store a state returned for the cache rows ``rows`` (``None``: all rows)."""
        if rows is None:
            self.state = new
            return
        base = new if self.state is None else self.state
        updates = {}
        for f in fields(FalconState):
            old_t, new_t = getattr(self.state, f.name, None), getattr(new, f.name)
            if isinstance(getattr(base, f.name), torch.Tensor):
                updates[f.name] = scatter_rows(old_t, rows, new_t)
        self.state = replace(base, **updates)

    def store_conv(self, name: str, new: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
        """Store the short-convolution buffer ``name`` (``"q"``, ``"k"``, ``"v"``) ``[N, W-1, C]``
        returned for the cache rows ``rows`` ``[N]`` (``None``: all rows)."""
        self.conv[name] = scatter_rows(self.conv.get(name), rows, new)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / repeat rows (beam search, ``num_return_sequences``)."""
        if self.state is not None:
            self.state = self.state.index_select(index)
        self.conv = {k: v.index_select(0, index.to(v.device)) for k, v in self.conv.items()}
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index.to(self.keys.device))
            self.values = self.values.index_select(0, index.to(self.values.device))
            self.lengths = [self.lengths[i] for i in index.tolist()]

    def grow(self, slots: int) -> None:
        """Make room for ``slots`` tokens per row in ``keys`` / ``values`` (at least doubling)."""
        if self.keys.shape[2] >= slots:
            return
        capacity = max(slots, 2 * self.keys.shape[2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, :old.shape[2]] = old
            setattr(self, name, new)
