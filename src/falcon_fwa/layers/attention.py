"""Causal softmax attention with rotary position embeddings (the Transformer baseline).

``o = softmax(q k^T / sqrt(d) + causal mask) v`` per head through torch's
``scaled_dot_product_attention``; ``q``, ``k`` rotated by RoPE at each token's
position within its sequence. Layouts (see :class:`Packing`):

* dense, no cache: one causal SDPA call over ``[B, H, T, d]``;
* packed, no cache: one causal SDPA call per sequence, so sequences packed
  into a row never attend to each other (and cost what they would alone); above
  ``MAX_CALLS_PER_ROW`` sequences, where the calls' launch cost would dominate,
  one call with a block-diagonal causal mask;
* with a cache: keys/values of each row are kept in ``[rows, H, capacity, d]``
  buffers with a length per row (rows may hold different numbers of real tokens);
  new tokens are written in place and each sequence attends to its own prefix.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..ops.seqlens import sequence_bounds
from .layer_cache import LayerCache
from .packing import Packing, layout_of

# Attention over a growing cache (decoding) leaves out cuDNN's kernel: it builds a plan for every new
# key length, and every decoding step brings one. On an H200 (torch 2.11, transformer-124m, bf16, batch 1)
# the first pass over 48 new lengths took 50 ms per step, the same lengths again 11 ms.
_CACHED_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _cached_attention(q, k, v, attn_mask=None):
    with sdpa_kernel(_CACHED_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

__all__ = ["CausalSelfAttention", "apply_rope", "MAX_CALLS_PER_ROW"]

MAX_CALLS_PER_ROW = 64  # packed sequences attended one call each; more share one masked call


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, d]`` by the angles ``positions[b, t] * theta^{-2i/d}``
    (pairs ``(x_i, x_{i + d/2})``, the "rotate-half" convention); ``d`` must be even."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"x must have an even last dimension (RoPE rotates pairs of dims), got {tuple(x.shape)}")
    inv_freq = theta ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float64) * 2.0 / d)
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [B, T, d/2]
    cos = torch.cos(ang).to(x.dtype)[:, :, None, :]
    sin = torch.sin(ang).to(x.dtype)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head RoPE attention; ``forward(h, packing=None, cache=None)`` like ``FalconAttention``:
    ``h`` ``[B, T, D]`` (``[1, N_tok, D]`` packed) -> ``[B, T, D]``, ``H = num_heads`` heads of
    ``D / H`` dims; ``cache`` (a :class:`LayerCache`) holds the keys and values. ``packing=None``: dense
    rows, whose positions continue the tokens ``cache`` holds per row."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.rope_theta = config.rope_theta
        d = config.hidden_size
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, h: torch.Tensor, packing: Optional[Packing] = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        if h.dim() != 3 or h.shape[-1] != self.q_proj.in_features:
            raise ValueError(f"h must have shape [B, T, hidden_size={self.q_proj.in_features}], got {tuple(h.shape)}")
        if cache is not None and not isinstance(cache, LayerCache):
            raise TypeError(f"cache must be a LayerCache (or None: no keys carried to the next call), "
                            f"got {type(cache).__name__}")
        # a filled cache: rows below its row count; an empty one: rows 0 .. N-1, one per sequence (as the
        # recurrent mixers' caches take them)
        packing = layout_of(packing, h, None if cache is None else cache.lengths,
                            cache=cache if cache is not None and cache.keys is None else None)
        B, T, D = h.shape
        H, d = self.num_heads, self.head_dim
        q = apply_rope(self.q_proj(h).view(B, T, H, d), packing.positions, self.rope_theta)
        k = apply_rope(self.k_proj(h).view(B, T, H, d), packing.positions, self.rope_theta)
        v = self.v_proj(h).view(B, T, H, d)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
        if cache is None or cache.keys is None:  # no cached prefix: one SDPA call
            if packing.packed and packing.num_sequences <= MAX_CALLS_PER_ROW:
                # one causal call per sequence: O(sum n_i^2) work and memory, not O(N_tok^2) for a
                # block-diagonal mask over the whole packed row (and flash-eligible: no mask tensor)
                bounds = packing.bounds if packing.bounds is not None else sequence_bounds(packing.cu_seqlens)
                o = torch.cat([F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], is_causal=True)
                               for a, e in zip(bounds, bounds[1:])], dim=2)
            elif packing.packed:  # many short sequences: one call with a block-diagonal causal mask
                seq = packing.seq_ids
                mask = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if cache is not None:
                self._store_prefix(k, v, packing, cache)
        else:
            o = self._cached(q, k, v, packing, cache)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, D))

    @staticmethod
    def _segments(q, packing: Packing):
        """``(batch index, start, end, cache row)`` of every sequence in the layout."""
        if packing.packed:
            bounds = sequence_bounds(packing.cu_seqlens)  # the model's declared copy inside its pass
            rows = packing.host_rows if packing.host_rows is not None else packing.rows.tolist()
            return [(0, a, b, int(r)) for (a, b), r in zip(zip(bounds, bounds[1:]), rows)]
        return [(b, 0, q.shape[2], b) for b in range(q.shape[0])]

    def _store_prefix(self, k, v, packing: Packing, cache: LayerCache) -> None:
        """The first call's keys and values into the cache's buffers (row ``r`` of each sequence;
        ``LayerCache.grow`` makes room for later tokens)."""
        if not packing.packed:
            cache.keys = k.clone(memory_format=torch.contiguous_format)
            cache.values = v.clone(memory_format=torch.contiguous_format)
            cache.lengths = [k.shape[2]] * k.shape[0]
            return
        segments = self._segments(k, packing)
        rows = 1 + max(r for _, _, _, r in segments)
        longest = max(e - a for _, a, e, _ in segments)
        cache.keys = k.new_zeros(rows, k.shape[1], longest, k.shape[3])
        cache.values = torch.zeros_like(cache.keys)
        cache.lengths = [0] * rows
        for b, a, e, r in segments:
            cache.keys[r, :, :e - a], cache.values[r, :, :e - a] = k[b, :, a:e], v[b, :, a:e]
            cache.lengths[r] = e - a

    def _cached(self, q, k, v, packing: Packing, cache: LayerCache) -> torch.Tensor:
        """Each sequence attends to its row's cached keys plus its own causal prefix. The new keys
        and values are written into the cache's buffers (grown by doubling when full), in place
        unless autograd may still need them."""
        L = q.shape[2]
        # the buffers keep the dtype of the call that filled them (a prefill under autocast, steps without it,
        # or the reverse): the new keys and values are stored in it, and read back in the queries' dtype
        k, v = k.to(cache.keys.dtype), v.to(cache.values.dtype)
        if torch.is_grad_enabled() and (k.requires_grad or cache.keys.requires_grad):
            # earlier calls' attention may still need the buffers for backward: write into copies
            cache.keys, cache.values = cache.keys.clone(), cache.values.clone()
        if not packing.packed and len(cache.lengths) == q.shape[0]:
            # dense rows, row b = cache row b: one scatter of the new keys, one attention call
            start = torch.tensor(cache.lengths, device=q.device)  # [B] tokens cached per row
            end = max(cache.lengths) + L
            cache.grow(end)
            pos = start[:, None] + torch.arange(L, device=q.device)  # [B, L]: where the new tokens go
            index = pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
            cache.keys.scatter_(2, index, k)
            cache.values.scatter_(2, index, v)
            cache.lengths = [n + L for n in cache.lengths]
            allowed = None  # one new token per row, every row equally long: every key is visible
            if L > 1 or len(set(cache.lengths)) > 1:
                allowed = (torch.arange(end, device=q.device)[None, None, :] <= pos[:, :, None])[:, None]  # [B,1,L,end]
            return _cached_attention(q, cache.keys[:, :, :end].to(q.dtype), cache.values[:, :, :end].to(q.dtype),
                                     attn_mask=allowed)
        segments = self._segments(q, packing)
        cache.grow(max(cache.lengths[r] + e - a for _, a, e, r in segments))
        outs = []
        for b, a, e, r in segments:
            P, n = cache.lengths[r], e - a
            cache.keys[r, :, P:P + n], cache.values[r, :, P:P + n] = k[b, :, a:e], v[b, :, a:e]
            cache.lengths[r] = P + n
            allowed = torch.arange(P + n, device=q.device)[None, :] <= (P + torch.arange(n, device=q.device))[:, None]
            outs.append(_cached_attention(q[b:b + 1, :, a:e], cache.keys[r:r + 1, :, :P + n].to(q.dtype),
                                          cache.values[r:r + 1, :, :P + n].to(q.dtype), attn_mask=allowed))
        if packing.packed:
            return torch.cat(outs, dim=2)
        return torch.cat(outs, dim=0)

