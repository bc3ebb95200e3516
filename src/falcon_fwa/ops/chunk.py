"""SSD-style chunk-parallel form.

The sequence is cut into chunks of ``chunk_size`` steps (the last one padded with
no-op steps: zero gain, unit carry). Three phases, as in Algorithms 1, 3 and 4:

1. every chunk's masked-parallel block (``parallel.prepare_block``), all chunks at
   once, with log-prefixes restarted at 0 in each chunk;
2. the chunk-to-chunk state recurrence ``S_(k+1) = exp(u_C) S_k + X^T diag(exp(u_C - u)) (U - W S_k)``,
   written as the affine map ``S_(k+1) = G_k S_k + b_k`` whose ``G_k``, ``b_k`` are formed
   for all chunks at once, so that the sequential loop is one small matmul per chunk;
3. every chunk's outputs from its entry state, all chunks at once.

No product of decays ever spans more than one chunk.

Per-column rules (2, 2A) carry one system per value column, so their block tensors grow
with ``V`` (rule 2 at B=8, T=2048, H=16, K=V=128 would hold about 15e9 elements at once).
Their columns are independent scans that share ``q`` and the write keys: when the blocks
would exceed ``BLOCK_ELEMENTS`` elements, the form runs a few columns at a time, and under
autograd recomputes each group's intermediates in the backward (activation checkpointing),
so that one group's are alive at a time (under ``torch.func``'s gradient transforms, which take no
saved-tensor hooks, the groups keep theirs). The arithmetic of every column is unchanged.
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .parallel import block_outputs, group_state, prepare_block, transition, ungroup_state, write_vectors

__all__ = ["chunk_form"]

BLOCK_ELEMENTS = 1 << 28  # elements of the per-column block tensors above which the columns run in groups


def _chunked(t: Optional[torch.Tensor], T_pad: int, C: int) -> Optional[torch.Tensor]:
    """``[B, H, T, *rest]`` -> ``[B*H*nc, C, *rest]``, zero-padded along T."""
    if t is None:
        return None
    B, H, T = t.shape[:3]
    rest = t.shape[3:]
    if T_pad != T:
        pad = [0, 0] * len(rest) + [0, T_pad - T]
        t = F.pad(t, pad)
    return t.reshape(B * H * (T_pad // C), C, *rest)


def chunk_form(
    q: torch.Tensor,
    xs: torch.Tensor,
    ys: torch.Tensor,
    eta_slots: torch.Tensor,
    kappa_slots: Optional[torch.Tensor],
    log_a: torch.Tensor,
    S0: torch.Tensor,
    *,
    read_after: bool,
    chunk_size: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs as in ``parallel.parallel_form`` (head-first). Returns ``o``
    ``[B, H, T, V]`` and ``S_T`` ``[B, H, K, V]``."""
    form = partial(_chunk_form, read_after=read_after, chunk_size=chunk_size)
    cols = _column_group(q, xs, log_a, regression=kappa_slots is not None, chunk_size=chunk_size)
    if cols is None:
        return form(q, xs, ys, eta_slots, kappa_slots, log_a, S0)
    parts = []
    for c in range(0, log_a.shape[-1], cols):
        j = slice(c, c + cols)
        args = (q, xs, ys[..., j], eta_slots[..., j], None if kappa_slots is None else kappa_slots[..., j],
                log_a[..., j], S0[..., j])
        parts.append(checkpoint(form, *args, use_reentrant=False) if _recomputable() else form(*args))
    return torch.cat([o for o, _ in parts], -1), torch.cat([s for _, s in parts], -1)


def _recomputable() -> bool:
    """Whether a column group's intermediates can be recomputed in the backward: autograd records
    the call, and saved-tensor hooks (through which ``checkpoint`` drops and recomputes them) are
    allowed. ``torch.func.grad``, ``vjp`` and ``jacrev`` disallow those hooks; there the groups keep
    their intermediates, as one call of all columns would."""
    if not torch.is_grad_enabled():
        return False
    hooks_enabled = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return hooks_enabled is None or hooks_enabled()


def _column_group(q: torch.Tensor, xs: torch.Tensor, log_a: torch.Tensor, *, regression: bool,
                  chunk_size: int) -> Optional[int]:
    """Columns per group for a per-column rule whose block tensors (scores ``[C, C W]``,
    history coupling ``[C W, K]`` and, for regression, transition ``[K, K]`` per chunk and
    column) would exceed ``BLOCK_ELEMENTS``; ``None`` to run all columns at once."""
    B, H, T, K = q.shape
    Vd, W = log_a.shape[-1], xs.shape[3]
    if Vd == 1:
        return None
    C = max(1, min(chunk_size, T))
    per_column = B * H * -(-T // C) * (C * C * W + C * W * K + (K * K if regression else 0))
    if per_column == 0:  # no rows or no heads: nothing to hold
        return None
    cols = max(1, BLOCK_ELEMENTS // per_column)
    return None if cols >= Vd else cols


def _chunk_form(q, xs, ys, eta_slots, kappa_slots, log_a, S0, *, read_after: bool, chunk_size: int):
    B, H, T, K = q.shape
    C = max(1, min(chunk_size, T))
    nc = -(-T // C)
    T_pad = nc * C
    blk = prepare_block(*(_chunked(t, T_pad, C) for t in (q, xs, ys, eta_slots, kappa_slots, log_a)), read_after=read_after)
    Vd = blk.U.shape[1]

    # Phase 2: every chunk is an affine map S -> G S + b of its entry state
    # (computed for all chunks at once); only the chain of maps is sequential.
    G, b = transition(blk)
    G = G.reshape(B * H, nc, *G.shape[1:]).unbind(1)
    b = b.reshape(B * H, nc, *b.shape[1:]).unbind(1)
    S = group_state(S0.flatten(0, 1), Vd)  # [BH, Vd, K, Vg]
    entries = []
    for i in range(nc):
        entries.append(S)
        S = (G[i] @ S if G[i].shape[-1] > 1 else G[i] * S) + b[i]

    # Phase 3: outputs of every chunk from its entry state, all chunks at once.
    S_in = ungroup_state(torch.stack(entries, 1).flatten(0, 1))
    o = block_outputs(blk, S_in, write_vectors(blk, S_in))
    V = ys.shape[-1]
    o = o.reshape(B, H, T_pad, V)[:, :, :T]
    return o, ungroup_state(S).reshape(B, H, K, V)
