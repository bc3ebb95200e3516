"""Causal softmax attention with rotary position embeddings (the Transformer baseline).

``o = softmax(q k^T / sqrt(d) + causal mask) v`` per head through torch's
``scaled_dot_product_attention``; ``q``, ``k`` rotated by RoPE at each token's
position within its sequence. Layouts (see :class:`Packing`):

* dense, no cache: one causal SDPA call over ``[B, H, T, d]``;
* packed, no cache: one SDPA call with a block-diagonal causal mask, so
  sequences packed into a row never attend to each other;
* with a cache: keys/values of each row are kept (rows may hold different
  numbers of real tokens) and each sequence attends to its own prefix.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.seqlens import sequence_bounds
from .layer_cache import LayerCache
from .packing import Packing

__all__ = ["CausalSelfAttention", "apply_rope"]


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, d]`` by the angles ``positions[b, t] * theta^{-2i/d}``
    (pairs ``(x_i, x_{i + d/2})``, the "rotate-half" convention)."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d // 2, device=x.device, dtype=torch.float64) * 2.0 / d)
    ang = positions.to(torch.float64)[..., None] * inv_freq  # [B, T, d/2]
    cos = torch.cos(ang).to(x.dtype)[:, :, None, :]
    sin = torch.sin(ang).to(x.dtype)[:, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head RoPE attention; ``forward(h, packing, cache=None)`` like ``FalconAttention``."""

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

    def forward(self, h: torch.Tensor, packing: Packing, cache: Optional[LayerCache] = None) -> torch.Tensor:
        B, T, D = h.shape
        H, d = self.num_heads, self.head_dim
        q = apply_rope(self.q_proj(h).view(B, T, H, d), packing.positions, self.rope_theta)
        k = apply_rope(self.k_proj(h).view(B, T, H, d), packing.positions, self.rope_theta)
        v = self.v_proj(h).view(B, T, H, d)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, d]
        if cache is None or cache.keys is None:  # no cached prefix: one SDPA call
            if packing.packed:
                seq = packing.seq_ids
                mask = (seq[:, None] == seq[None, :]) & torch.ones(T, T, dtype=torch.bool, device=h.device).tril()
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            else:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            if cache is not None:
                cache.keys = [k[b, :, a:e] for b, a, e, _ in self._segments(q, packing)]
                cache.values = [v[b, :, a:e] for b, a, e, _ in self._segments(q, packing)]
        else:
            o = self._cached(q, k, v, packing, cache)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, D))

    @staticmethod
    def _segments(q, packing: Packing):
        """``(batch index, start, end, cache row)`` of every sequence in the layout."""
        if packing.packed:
            bounds = sequence_bounds(packing.cu_seqlens)  # the model's declared copy inside its pass
            return [(0, a, b, int(r)) for (a, b), r in zip(zip(bounds, bounds[1:]), packing.rows.tolist())]
        return [(b, 0, q.shape[2], b) for b in range(q.shape[0])]

    def _cached(self, q, k, v, packing: Packing, cache: LayerCache) -> torch.Tensor:
        """Each sequence attends to its row's cached keys plus its own causal prefix."""
        if not packing.packed and len(cache.keys) == q.shape[0] and len({t.shape[1] for t in cache.keys}) == 1:
            # every row holds the same number of cached tokens: one batched call instead of one per row
            keys = torch.cat([torch.stack(cache.keys), k], dim=2)  # [B, H, P + L, d]
            values = torch.cat([torch.stack(cache.values), v], dim=2)
            cache.keys, cache.values = list(keys.unbind(0)), list(values.unbind(0))
            P, L = keys.shape[2] - q.shape[2], q.shape[2]
            allowed = None  # one new token sees every key
            if L > 1:
                allowed = torch.arange(P + L, device=q.device)[None, :] <= (P + torch.arange(L, device=q.device))[:, None]
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)
        outs = []
        for b, a, e, r in self._segments(q, packing):
            keys = torch.cat([cache.keys[r], k[b, :, a:e]], dim=1)
            values = torch.cat([cache.values[r], v[b, :, a:e]], dim=1)
            cache.keys[r], cache.values[r] = keys, values
            P, L = keys.shape[1] - (e - a), e - a
            allowed = torch.arange(P + L, device=q.device)[None, :] <= (P + torch.arange(L, device=q.device))[:, None]
            outs.append(F.scaled_dot_product_attention(q[b:b + 1, :, a:e], keys[None], values[None],
                                                       attn_mask=allowed))
        if packing.packed:
            return torch.cat(outs, dim=2)
        return torch.cat(outs, dim=0)
