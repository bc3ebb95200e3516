"""Packing the token stream into fixed-length training rows.

Row ``i`` of a shard is the window ``tokens[i*L : i*L + L + 1]``: inputs are its first ``L``
tokens, targets its last ``L`` (the next token at every position). Two packings:

- ``"eos"``: rows are independent sequences; documents inside a row are separated only by
  the end-of-text token (the recurrent state flows across documents).
- ``"cu_seqlens"``: the rows of a batch are concatenated into one sequence of ``B*L`` tokens
  with ``cu_seqlens`` offsets at every row start and every document start, so the state is
  reset and the boundary sentinel (x_1 = 0) holds at every document start. Because each
  document opens with end-of-text, no target crosses a boundary.
"""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

from .shards import TokenShards

PACKINGS = ("eos", "cu_seqlens")


class PackedRows:
    """All rows of length ``seq_len`` (+1 target) of a shard folder, addressable by index."""

    def __init__(self, shards: TokenShards, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.shards, self.seq_len = shards, seq_len
        counts = [max(0, (len(s.tokens) - 1) // seq_len) for s in shards.shards]
        self.offsets = np.cumsum([0] + counts)
        if self.offsets[-1] == 0:
            raise ValueError(f"{shards.folder!r} holds {shards.n_tokens} tokens: fewer than one row of seq_len={seq_len}")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def row(self, index: int):
        """(tokens int64 [L+1], doc_starts: positions 0 < p < L where a document begins)."""
        s = int(np.searchsorted(self.offsets, index, side="right") - 1)
        shard = self.shards.shards[s]
        a = (index - int(self.offsets[s])) * self.seq_len
        tokens = np.asarray(shard.tokens[a:a + self.seq_len + 1], dtype=np.int64)
        lo, hi = np.searchsorted(shard.doc_starts, [a + 1, a + self.seq_len])
        return tokens, shard.doc_starts[lo:hi] - a


def collate(rows: Sequence, packing: str) -> dict:
    """Batch of rows -> ``input_ids``/``targets`` [B, L] (``"eos"``) or [1, B*L] + ``cu_seqlens`` (int32).

    ``targets[:, t]`` is the token after ``input_ids[:, t]``: already shifted, so it is not the
    model's ``labels`` argument (which ``FalconForCausalLM`` shifts itself); the trainer scores
    ``logits`` against it directly."""
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    tokens = torch.from_numpy(np.stack([t for t, _ in rows]))
    batch = {"input_ids": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
    if packing == "cu_seqlens":
        L = tokens.shape[1] - 1
        cuts: List[int] = []
        for r, (_, starts) in enumerate(rows):
            cuts.append(r * L)
            cuts.extend(int(p) + r * L for p in starts)
        cuts.append(len(rows) * L)
        batch = {k: v.reshape(1, -1) for k, v in batch.items()}
        batch["cu_seqlens"] = torch.tensor(cuts, dtype=torch.int32)
    return batch


class RowOrder:
    """Deterministic sample order: epoch ``e`` visits the rows in ``permutation(seed, e)``.

    Sample ``n`` (global, counted across epochs) is row ``perm_e[n % N]`` with ``e = n // N``,
    so the data position is one integer and resuming needs nothing else.
    """

    def __init__(self, n_rows: int, seed: int, shuffle: bool = True):
        self.n_rows, self.seed, self.shuffle = n_rows, seed, shuffle
        self._epoch, self._perm = -1, None

    def __getitem__(self, n: int) -> int:
        epoch, i = divmod(n, self.n_rows)
        if not self.shuffle:
            return i
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_rows)
            self._epoch = epoch
        return int(self._perm[i])


class BatchStream:
    """Micro-batches for one rank: micro-step ``m`` takes global samples
    ``[(m * world + rank) * B, ... + B)``; ``position`` is the next micro-step."""

    def __init__(self, rows: PackedRows, *, micro_batch: int, packing: str, seed: int,
                 rank: int = 0, world_size: int = 1, shuffle: bool = True, position: int = 0):
        if packing not in PACKINGS:
            raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
        self.rows, self.micro_batch, self.packing = rows, micro_batch, packing
        self.rank, self.world_size = rank, world_size
        self.order = RowOrder(len(rows), seed, shuffle)
        self.position = position

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        first = (self.position * self.world_size + self.rank) * self.micro_batch
        batch = collate([self.rows.row(self.order[n]) for n in range(first, first + self.micro_batch)], self.packing)
        self.position += 1
        return batch
