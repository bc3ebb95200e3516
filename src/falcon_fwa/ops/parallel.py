"""Masked-parallel form of a block of steps, and the whole-sequence parallel form.

Unrolling the recurrence over a block of ``C`` steps that starts from ``S_0``.
Every step writes its window slots ``p = (t, m)`` (pair ``t - m``, step ``s_p = t``), so a block has
``C*W`` write slots. With the carry ``a_t = gamma_t * exp(g_t)`` and the block-local
log-prefixes ``u_t = sum_{r<=t} log a_r``, ``w_t = u_{t-1}`` (restarted at 0 in
every block)::

    S_t = exp(u_t) S_0 + sum_{p: s_p <= t} exp(u_t - u_{s_p}) x_p d_p^T

with write vectors ``d_p = eta_p y_p - kappa_p S_{s_p-1}^T x_p`` (``kappa_p = eta_p
exp(g_{s_p})`` for the regression rules, so that ``kappa_p S_{s_p-1}^T x_p = eta_p S'^T x_p``
with the gated ``S' = exp(g_{s_p}) S_{s_p-1}`` of ``recurrent.py``; 0 for the inner-product
rules). Substituting ``S_{s_p-1}`` gives a unit lower-triangular system (the WY / Gram form;
block-strictly lower for the sliding rule 3, the ParallelFlow solve)::

    d_p + kappa_p sum_{r: s_r < s_p} exp(w_{s_p} - u_{s_r}) (x_p . x_r) d_r
        = eta_p y_p - kappa_p exp(w_{s_p}) S_0^T x_p

solved once with the merged right-hand side ``[eta*Y | kappa*exp(w)*X]`` so that
``D = U - W S_0``. Outputs are decay-masked attention plus the decayed history::

    o_t = exp(u_t) S_0^T q_t + sum_{p: s_p <= t} exp(u_t - u_{s_p}) (q_t . x_p) d_p

(read-before-write uses ``w_t`` and ``s_p < t``). Only differences ``u_t - u_s``
with ``s <= t`` and prefixes ``u_t`` are exponentiated, all ``<= 0``: the
chunk-local log-space renormalization of Appendix C.6 in its closed form, in which
the rescaled step sizes ``eta/gamma`` and targets ``y/c_{t-1}`` only ever appear
multiplied by the decay that undoes them. Per-column rules (2, 2A) carry one decay
and one system per value column (``Vd = V`` groups sharing the Gram ``X X^T``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

__all__ = ["Block", "prepare_block", "write_vectors", "propagate", "transition", "block_outputs", "parallel_form", "group_state", "ungroup_state"]


@dataclass
class Block:
    """Intra-block quantities that do not depend on the incoming state."""

    X: torch.Tensor  # [N, CW, K] slot write features
    U: torch.Tensor  # [N, Vd, CW, Vg] state-independent part of the write vectors
    Wm: Optional[torch.Tensor]  # [N, Vd, CW, K] history coupling (regression rules)
    A: torch.Tensor  # [N, Vd, C, CW] decay-masked attention scores
    q: torch.Tensor  # [N, C, K]
    hist: torch.Tensor  # [N, Vd, C] decay of the incoming state at each read
    to_end: torch.Tensor  # [N, Vd, CW] decay from each slot's step to the block end
    decay_end: torch.Tensor  # [N, Vd] decay over the whole block


def _masked_exp(diff: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    # Fill before exp so that masked (positive) exponents never overflow or leak gradients.
    return torch.exp(diff.masked_fill(~keep, float("-inf")))


def prepare_block(
    q: torch.Tensor,
    xs: torch.Tensor,
    ys: torch.Tensor,
    eta: torch.Tensor,
    kappa: Optional[torch.Tensor],
    log_a: torch.Tensor,
    *,
    read_after: bool,
) -> Block:
    """``q`` ``[N, C, K]``, ``xs`` ``[N, C, W, K]``, ``ys`` ``[N, C, W, V]``, ``eta`` and
    ``kappa`` ``[N, C, W, Vd]`` (``kappa=None`` for the inner-product rules),
    ``log_a`` ``[N, C, Vd]``."""
    N, C, W, K = xs.shape
    V, Vd = ys.shape[-1], log_a.shape[-1]
    Vg = V // Vd
    CW = C * W
    X = xs.reshape(N, CW, K)
    Y = ys.reshape(N, CW, Vd, Vg).permute(0, 2, 1, 3)  # [N, Vd, CW, Vg]
    eta = eta.reshape(N, CW, Vd).transpose(1, 2)  # [N, Vd, CW]
    # The log prefix and every difference of it in float64, each cast to the compute dtype just before its exp:
    # after hard resets (g floored at -104) or clamped decays, |u| reaches 1e4-1e5 over a long block, where a
    # float32 prefix would round the small decays of the steps after them away.
    dt = log_a.dtype
    log_a = log_a.to(torch.float64)
    u = torch.cumsum(log_a.transpose(1, 2), dim=-1)  # [N, Vd, C]
    w = u - log_a.transpose(1, 2)
    step = torch.arange(CW, device=xs.device) // W  # the step of each slot
    u_s, w_s = u[..., step], w[..., step]

    if kappa is None:
        U, Wm = eta[..., None] * Y, None
    else:
        kappa = kappa.reshape(N, CW, Vd).transpose(1, 2)
        earlier = step[:, None] > step[None, :]
        L = kappa[..., None] * _masked_exp((w_s[..., :, None] - u_s[..., None, :]).to(dt), earlier) \
            * (X @ X.transpose(1, 2))[:, None]
        rhs = torch.cat([eta[..., None] * Y, (kappa * torch.exp(w_s.to(dt)))[..., None] * X[:, None].expand(N, Vd, CW, K)],
                        dim=-1)
        Z = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
        U, Wm = Z[..., :Vg], Z[..., Vg:]

    t = torch.arange(C, device=xs.device)
    seen = step[None, :] <= t[:, None] if read_after else step[None, :] < t[:, None]
    u_q = u if read_after else w
    A = _masked_exp((u_q[..., :, None] - u_s[..., None, :]).to(dt), seen) * (q @ X.transpose(1, 2))[:, None]
    return Block(X=X, U=U, Wm=Wm, A=A, q=q, hist=torch.exp(u_q.to(dt)),
                 to_end=torch.exp((u[..., -1:] - u_s).to(dt)), decay_end=torch.exp(u[..., -1].to(dt)))


def group_state(S: torch.Tensor, Vd: int) -> torch.Tensor:
    """``S`` ``[N, K, V]`` -> ``[N, Vd, K, V // Vd]``: the value columns in ``Vd`` groups that share a
    transition (``Vd = V`` for the per-column rules, ``1`` otherwise)."""
    N, K, V = S.shape
    return S.reshape(N, K, Vd, V // Vd).permute(0, 2, 1, 3)  # [N, Vd, K, Vg]


def ungroup_state(Sg: torch.Tensor) -> torch.Tensor:
    """The inverse of ``group_state``: ``[N, Vd, K, Vg]`` -> ``[N, K, Vd * Vg]``."""
    N, Vd, K, Vg = Sg.shape
    return Sg.permute(0, 2, 1, 3).reshape(N, K, Vd * Vg)


def write_vectors(blk: Block, S0: torch.Tensor) -> torch.Tensor:
    """Write vectors ``D = U - W S_0`` ``[N, Vd, CW, Vg]`` from the entry state ``S0`` ``[N, K, V]``."""
    return blk.U if blk.Wm is None else blk.U - blk.Wm @ group_state(S0, blk.U.shape[1])


def propagate(blk: Block, S0: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Write vectors ``D = U - W S_0`` and the block's exit state, from ``S0`` ``[N, K, V]``."""
    D = write_vectors(blk, S0)
    S0g = group_state(S0, D.shape[1])
    S_end = blk.decay_end[..., None, None] * S0g + blk.X.transpose(1, 2)[:, None] @ (blk.to_end[..., None] * D)
    return D, ungroup_state(S_end)


def transition(blk: Block) -> Tuple[torch.Tensor, torch.Tensor]:
    """The block as an affine map of its entry state, per value group:
    ``S_end = G S_0 + b`` with ``b = X^T diag(exp(u_C - u)) U`` ``[N, Vd, K, Vg]`` and
    ``G = exp(u_C) I - X^T diag(exp(u_C - u)) W`` ``[N, Vd, K, K]``; for the
    inner-product rules (no ``W``) ``G`` is the scalar decay, returned as ``[N, Vd, 1, 1]``."""
    Xt = blk.X.transpose(1, 2)[:, None]  # [N, 1, K, CW]
    b = Xt @ (blk.to_end[..., None] * blk.U)
    G = blk.decay_end[..., None, None]
    if blk.Wm is not None:
        K = blk.X.shape[-1]
        eye = torch.eye(K, dtype=G.dtype, device=G.device)
        G = G * eye - Xt @ (blk.to_end[..., None] * blk.Wm)
    return G, b


def block_outputs(blk: Block, S0: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """Outputs ``[N, C, V]``: decayed history plus masked attention over the block."""
    S0g = group_state(S0, D.shape[1])
    O = blk.hist[..., None] * (blk.q[:, None] @ S0g) + blk.A @ D  # [N, Vd, C, Vg]
    N, Vd, C, Vg = O.shape
    return O.permute(0, 2, 1, 3).reshape(N, C, Vd * Vg)


def _flat(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.flatten(0, 1)


def parallel_form(
    q: torch.Tensor,
    xs: torch.Tensor,
    ys: torch.Tensor,
    eta_slots: torch.Tensor,
    kappa_slots: Optional[torch.Tensor],
    log_a: torch.Tensor,
    S0: torch.Tensor,
    *,
    read_after: bool,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The whole sequence as one block (``O(T^2)``): inputs as in ``recurrent_form``
    (head-first, ``[B, H, T, ...]``) with ``kappa_slots`` and the total log carry
    ``log_a`` ``[B, H, T, Vd]``."""
    B, H, T, K = q.shape
    V = ys.shape[-1]
    blk = prepare_block(_flat(q), _flat(xs), _flat(ys), _flat(eta_slots), _flat(kappa_slots), _flat(log_a), read_after=read_after)
    S0 = S0.flatten(0, 1)
    D, S_end = propagate(blk, S0)
    o = block_outputs(blk, S0, D)
    return o.reshape(B, H, T, V), S_end.reshape(B, H, K, V)
