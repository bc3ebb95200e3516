"""Per-layer decoding cache: what one mixer carries from one forward call to the next.

Rows are batch rows. Recurrent mixers keep their :class:`~falcon_fwa.FalconState`
(matrix state, last key, sliding tail) and the short-convolution buffers, so a new
token costs ``O(1)`` whatever the context length; the Transformer keeps its keys
and values, one tensor per row (rows may hold different numbers of real tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Dict, List, Optional

import torch

from ..ops import FalconState

__all__ = ["LayerCache", "scatter_rows"]


def scatter_rows(old: Optional[torch.Tensor], rows: Optional[torch.Tensor], new: torch.Tensor) -> torch.Tensor:
    """``old`` with rows ``rows`` replaced by ``new`` (``rows=None``: ``new`` replaces everything)."""
    if rows is None or old is None:
        return new
    return old.index_copy(0, rows.to(old.device), new.to(old.dtype))


@dataclass
class LayerCache:
    """``state``: the recurrent :class:`FalconState` (``[B, ...]``); ``conv``: short-conv
    buffers by name (``[B, W-1, C]``); ``keys`` / ``values``: per row ``[H, L_b, D]``."""

    state: Optional[FalconState] = None
    conv: Dict[str, torch.Tensor] = field(default_factory=dict)
    keys: Optional[List[torch.Tensor]] = None
    values: Optional[List[torch.Tensor]] = None

    def store_state(self, new: FalconState, rows: Optional[torch.Tensor]) -> None:
        """Store a state returned for the cache rows ``rows`` (``None``: all rows)."""
        if rows is None or self.state is None:
            self.state = new
            return
        updates = {}
        for f in fields(FalconState):
            old_t, new_t = getattr(self.state, f.name), getattr(new, f.name)
            if isinstance(old_t, torch.Tensor):
                updates[f.name] = scatter_rows(old_t, rows, new_t)
        self.state = replace(self.state, **updates)

    def store_conv(self, name: str, new: torch.Tensor, rows: Optional[torch.Tensor]) -> None:
        self.conv[name] = scatter_rows(self.conv.get(name), rows, new)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / repeat rows (beam search, ``num_return_sequences``)."""
        if self.state is not None:
            self.state = self.state.index_select(index)
        self.conv = {k: v.index_select(0, index.to(v.device)) for k, v in self.conv.items()}
        if self.keys is not None:
            idx = index.tolist()
            self.keys = [self.keys[i] for i in idx]
            self.values = [self.values[i] for i in idx]
