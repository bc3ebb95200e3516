"""Chunk bookkeeping shared by the chunk kernels: which sequence and which chunk
of it every kernel program owns, for fixed-length batches and for packed
variable-length sequences (``cu_seqlens``).

Both need ``cu_seqlens`` on the host: reading it from the GPU waits for every queued
kernel, which leaves the GPU idle while the host launches the next ones. A model
passes the same ``cu_seqlens`` tensor to each of its layers, so the host copy and
the layouts are kept per tensor object (``_per_tensor``): one device read per batch
instead of one per layer and call."""
from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

__all__ = ["ChunkLayout", "chunk_layout", "sequence_bounds"]

_CACHE: "OrderedDict[tuple, tuple]" = OrderedDict()
_CACHE_SIZE = 64


def _per_tensor(t: torch.Tensor, what, build: Callable):
    """``build()``, kept while the tensor object ``t`` lives unmodified: keyed by its identity and
    its version counter (an in-place write bumps it), checked through a weak reference, so a new
    tensor at a recycled id or address never hits. Tensors without a version counter (inference
    mode) and traced code are not cached."""
    if torch.compiler.is_compiling():
        return build()
    try:
        key = (id(t), t._version, what)
    except RuntimeError:  # inference tensors do not track versions
        return build()
    hit = _CACHE.get(key)
    if hit is not None and hit[0]() is t:
        _CACHE.move_to_end(key)
        return hit[1]
    value = build()
    _CACHE[key] = (weakref.ref(t), value)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return value


def sequence_bounds(cu_seqlens: torch.Tensor) -> Tuple[int, ...]:
    """``cu_seqlens`` as a tuple of Python ints (one device read per tensor object)."""
    return _per_tensor(cu_seqlens, "bounds", lambda: tuple(int(b) for b in cu_seqlens.tolist()))


@dataclass
class ChunkLayout:
    """``N`` sequences cut into chunks of ``BT`` steps (each sequence on its own).

    * ``T``: steps per sequence (fixed-length) or the packed length (varlen).
    * ``num_chunks``: chunks over all sequences, the first dimension of the
      per-chunk state buffers ``[num_chunks, H, K, V]``.
    * ``cu_seqlens`` ``[N + 1]`` int32 sequence offsets (``None`` when fixed-length),
      ``chunk_offsets`` ``[N + 1]`` int32 index of each sequence's first chunk and
      ``chunk_indices`` ``[num_chunks, 2]`` int32 rows ``(sequence, chunk in sequence)``.
    """

    N: int
    T: int
    BT: int
    num_chunks: int
    max_chunks: int
    cu_seqlens: Optional[torch.Tensor]
    chunk_offsets: Optional[torch.Tensor]
    chunk_indices: Optional[torch.Tensor]

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens is not None


def chunk_layout(B: int, T: int, BT: int, cu_seqlens: Optional[torch.Tensor]) -> ChunkLayout:
    """Layout of ``B`` rows of ``T`` steps, or of the sequences packed by ``cu_seqlens``."""
    if cu_seqlens is None:
        nt = -(-T // BT)
        return ChunkLayout(N=B, T=T, BT=BT, num_chunks=B * nt, max_chunks=nt, cu_seqlens=None,
                           chunk_offsets=None, chunk_indices=None)
    return _per_tensor(cu_seqlens, ("layout", T, BT), lambda: _varlen_layout(T, BT, cu_seqlens))


def _varlen_layout(T: int, BT: int, cu_seqlens: torch.Tensor) -> ChunkLayout:
    bounds = torch.tensor(sequence_bounds(cu_seqlens), dtype=torch.int64)
    lengths = bounds[1:] - bounds[:-1]
    nt = (lengths + BT - 1) // BT
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(nt, 0)])
    seq = torch.repeat_interleave(torch.arange(len(nt)), nt)
    within = torch.arange(int(offsets[-1])) - offsets[:-1][seq]
    device = cu_seqlens.device
    return ChunkLayout(
        N=len(nt), T=T, BT=BT, num_chunks=int(offsets[-1]), max_chunks=int(nt.max()),
        cu_seqlens=bounds.to(device=device, dtype=torch.int32),
        chunk_offsets=offsets.to(device=device, dtype=torch.int32),
        chunk_indices=torch.stack([seq, within], 1).to(device=device, dtype=torch.int32).contiguous(),
    )
