"""``FalconCache``: the decoding cache of a whole model, one :class:`LayerCache` per layer.

It holds, per batch row, each recurrent layer's :class:`~falcon_fwa.FalconState` and
short-convolution buffers (constant size: decoding is ``O(1)`` per token) or each
attention layer's keys and values, plus the number of real tokens each row has
seen (``seen``, for positions) and the number of input columns consumed
(``num_positions``, counting pads; ``generate()`` slices its inputs with it).

It follows the parts of ``transformers``' ``Cache`` interface that ``generate()``
uses (``get_seq_length``, ``reorder_cache``, ``batch_select_indices``,
``batch_repeat_interleave``) without subclassing it, since its contents are not
key/value tensors.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ..layers.layer_cache import LayerCache

__all__ = ["FalconCache"]


class FalconCache:
    """The decoding cache of a model: ``cache[i]`` is layer ``i``'s :class:`LayerCache`; ``seen``
    ``[B]`` counts each row's real tokens, ``num_positions`` the input columns consumed."""

    is_compileable = False
    is_croppable = False

    def __init__(self, num_layers: int):
        self.layers: List[LayerCache] = [LayerCache() for _ in range(num_layers)]
        self.seen: Optional[torch.Tensor] = None  # [B] real tokens per row
        self.num_positions = 0
        # the model whose layers this filled cache was last checked against (a weak reference; see
        # FalconForCausalLM._check_cache_fits): a decoding loop checks it once, not at every step
        self.checked_for = None

    def __getstate__(self) -> dict:
        """What ``pickle`` and ``torch.save`` store: everything but ``checked_for`` (a weak reference, which
        cannot be pickled; a loaded or copied cache is checked again against the model it is given to)."""
        return {**self.__dict__, "checked_for": None}

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> LayerCache:
        return self.layers[layer_idx]

    @property
    def is_linear(self) -> List[bool]:
        """One ``True`` per layer (``transformers``' flag for caches that need no input slicing)."""
        # Every layer handles its own history: generate() must not slice inputs for it.
        return [True] * len(self.layers)

    @property
    def empty(self) -> bool:
        """Whether no token has been recorded yet (``advance`` not called)."""
        return self.seen is None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Input columns consumed so far (pads included)."""
        return self.num_positions

    @torch.compiler.disable
    def advance(self, real_tokens: torch.Tensor, columns: int) -> None:
        """Record ``real_tokens`` ``[B]`` new real tokens per row over ``columns`` input columns.

        Left out of ``torch.compile``: traced, the Python counter ``num_positions`` becomes a
        guard and a compiled decoding loop would recompile at every token."""
        self.seen = real_tokens.clone() if self.seen is None else self.seen + real_tokens.to(self.seen.device)
        self.num_positions += columns

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep / reorder / repeat the batch rows ``indices`` ``[N]`` in every layer and in ``seen``."""
        for layer in self.layers:
            layer.select_rows(indices)
        if self.seen is not None:
            self.seen = self.seen.index_select(0, indices.to(self.seen.device))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search's reordering: ``batch_select_indices(beam_idx)``."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place, ``[B] -> [B * repeats]`` (``num_return_sequences``)."""
        if self.seen is not None:
            n = self.seen.shape[0]
            self.batch_select_indices(torch.arange(n, device=self.seen.device).repeat_interleave(repeats))

    def detach(self) -> "FalconCache":
        """Detach every recurrent state (truncated backpropagation through time)."""
        for layer in self.layers:
            if layer.state is not None:
                layer.state = layer.state.detach()
            layer.conv = {k: v.detach() for k, v in layer.conv.items()}
            if layer.keys is not None:
                layer.keys, layer.values = layer.keys.detach(), layer.values.detach()
        return self
