"""Decoding steps replayed from a CUDA graph.

A recurrent model's cache has a constant size (``FalconState`` and the short-convolution
buffers of every layer, and the per-row token counts), so one decoding step is the same
sequence of kernels on the same buffers at every position. :class:`GraphedDecoder` records
that sequence once as a CUDA graph and replays it per token: the host then launches one
graph instead of the dozens of kernels per layer an eager step launches, which at small
batches is most of a step's time.

The recorded step reads the cache's tensors, computes the new ones (in the graph's own
memory) and copies them back into the cache's tensors, so the cache is updated in place and
stays a valid :class:`~falcon_fwa.models.FalconCache`: eager calls may continue it (the graph
then no longer can: it reads and writes the tensors it was recorded with, which an eager call
replaces). The Transformer's key/value cache grows with the context and is not graphed.
"""
from __future__ import annotations

import copy
from dataclasses import fields, replace
from typing import Tuple

import torch

from ..models.modeling import output_object
from ..ops import FalconState

__all__ = ["GraphedDecoder", "graphable"]


def graphable(model, device: torch.device) -> Tuple[bool, str]:
    """``(True, "")`` if decoding steps of ``model`` on ``device`` can be graphed, else
    ``(False, why)``."""
    if device.type != "cuda":
        return False, "CUDA graphs need a CUDA device"
    if getattr(model.config, "mixer", None) == "transformer":
        return False, "the Transformer's key/value cache grows with the context"
    return True, ""


def _own_storage(t):
    """``t``, or a copy of it when it is a view into a larger tensor (whose memory it keeps alive)."""
    if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > t.numel() * t.element_size():
        return t.clone()
    return t


class GraphedDecoder:
    """One decoding step of ``model`` over ``cache`` (a prefilled ``FalconCache`` of a recurrent
    model on CUDA, ``B`` rows), recorded as a CUDA graph.

    ``decoder.step(tokens)`` with ``tokens`` ``[B]`` (int64, on the model's device) feeds one token
    per row, updates ``cache`` in place and returns the last position's logits ``[B, vocab]``
    (a buffer overwritten by the next step: copy it to keep it). Equal to the eager call
    ``model(input_ids=tokens[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)``.
    Recording runs two eager warm-up steps on a copy of the cache (kernel compilation and
    allocator warm-up), so ``cache`` itself only advances on ``step``. A cache tensor that is a view
    into a larger one (a prompt pass without padding leaves the short-convolution buffers and last
    keys as views of its ``[B, T, ...]`` activations) is first replaced by a copy of its own, since
    the graph writes into these tensors for as long as it is replayed. ``step`` refuses to run once
    the cache has been advanced or changed by other means (an eager call, ``batch_select_indices``).
    Record under the autograd mode of the prompt pass (``generate_text``: ``torch.inference_mode()``).
    """

    def __init__(self, model, cache, batch_size: int):
        self.model, self.cache = model, cache
        device = next(model.parameters()).device
        ok, why = graphable(model, device)
        if not ok:
            raise NotImplementedError(why)
        self.tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        cache.seen = _own_storage(cache.seen)
        for layer in cache.layers:
            if layer.state is not None:
                layer.state = replace(layer.state, **{f.name: _own_storage(getattr(layer.state, f.name))
                                                      for f in fields(FalconState)})
            layer.conv = {name: _own_storage(t) for name, t in layer.conv.items()}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            warm = copy.deepcopy(cache)
            for _ in range(2):
                self._forward(warm)
        torch.cuda.current_stream(device).wait_stream(side)
        del warm
        self.graph = torch.cuda.CUDAGraph()
        # recording runs the Python side of a step once and no kernel: the cache keeps its values, and
        # its objects are put back as they were if recording fails
        saved = (cache.seen, cache.num_positions, [(layer.state, dict(layer.conv)) for layer in cache.layers])
        try:
            with torch.cuda.graph(self.graph):
                self.logits = self._step_in_place()
        except Exception:
            cache.seen = saved[0]
            for layer, (state, conv) in zip(cache.layers, saved[2]):
                layer.state, layer.conv = state, conv
            raise
        finally:
            cache.num_positions = saved[1]
        self._seen = cache.seen

    def _forward(self, cache):
        out = self.model(input_ids=self.tokens, past_key_values=cache, use_cache=True, logits_to_keep=1,
                         **output_object(self.model))
        return out.logits[:, -1]

    def _step_in_place(self) -> torch.Tensor:
        """The eager step, then a copy of every new cache tensor into the one it replaces (the rows'
        token counts, each layer's state fields and short-convolution buffers); the cache's Python
        objects are pointed back at the old tensors."""
        cache = self.cache
        seen = cache.seen
        states = [layer.state for layer in cache.layers]
        convs = [dict(layer.conv) for layer in cache.layers]  # store_conv replaces the dict's entries
        logits = self._forward(cache)
        pairs = [(seen, cache.seen)]
        for layer, state, conv in zip(cache.layers, states, convs):
            if state is not None:
                pairs += [(getattr(state, f.name), getattr(layer.state, f.name)) for f in fields(FalconState)
                          if isinstance(getattr(state, f.name), torch.Tensor)]
            pairs += [(conv[name], layer.conv[name]) for name in conv]
            layer.state, layer.conv = state, conv
        cache.seen = seen
        for old, new in pairs:
            if new is None or old.shape != new.shape:
                raise NotImplementedError(f"a cache tensor changed in a decoding step ({tuple(old.shape)} -> "
                                          f"{None if new is None else tuple(new.shape)}): not graphable")
            old.copy_(new)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.cache.seen is not self._seen:
            raise RuntimeError("the cache was advanced or changed outside this GraphedDecoder (an eager call, "
                               "batch_select_indices, ...) since it was recorded: its graph reads and writes the "
                               "tensors the cache held then; record a new GraphedDecoder for the cache")
        self.tokens.copy_(tokens.view(-1, 1))
        self.graph.replay()
        self.cache.num_positions += 1
        return self.logits
