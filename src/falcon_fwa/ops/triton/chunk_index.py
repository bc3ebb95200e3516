"""Chunk bookkeeping shared by the chunk kernels: which sequence and which chunk
of it every kernel program owns, for fixed-length batches and for packed
variable-length sequences (``cu_seqlens``). A packed layout is built from the host
copy of ``cu_seqlens`` (``ops.seqlens``): inside the model's
``known_sequence_bounds`` block it is built once per batch and shared by every layer."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..seqlens import memo, sequence_bounds

__all__ = ["ChunkLayout", "chunk_layout"]


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
    return memo(cu_seqlens, ("chunk_layout", T, BT), lambda: _varlen_layout(T, BT, cu_seqlens))


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
