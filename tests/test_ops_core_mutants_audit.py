"""The positive-decay clamp of Eq. 4.20 where it holds the carry at the floor: at ``eta_t lambda_t = 1`` exactly
(``normalize=False``, ``beta = lam = 1``) the carry is ``gamma_t = decay_floor``, a constant, so the gradient is that
of the update with ``gamma_t`` held there (zero for ``lam``), finite in every form and rule; never the ``0 / 0`` of
``log1p(-1)``. That holds also where ``1 - decay_floor`` rounds to 1 in the compute dtype (a floor below its
epsilon, which ``log_carry`` accepts), so that the clamped fraction is 1 itself. Each case is checked against a
float64 loop of the update written here, differentiated by autograd.
"""
from __future__ import annotations

import pytest
import torch
from conftest import FORMS, rel_err

from falcon_fwa import falcon_attention

f64 = torch.float64
RULES = ("1", "2", "3", "1A", "2A", "3A")


def _loop_at_the_clamp(q, k, v, beta, *, rule, window, decay_floor):
    """``o`` ``[B, T, H, V]`` of the rule with ``eta_t = beta_t`` (``normalize=False``) and the carry held at
    ``gamma_t = decay_floor`` on every step that writes (``eta_t lambda_t >= 1 - decay_floor``), 1 at the
    sentinel: a float64 loop of the update of ``falcon_attention``'s table, differentiable in its inputs."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sliding, regression = rule in ("3", "3A"), rule in ("1", "2", "3")
    rows = []
    for b in range(B):
        heads = []
        for h in range(H):
            S = torch.zeros(K, V, dtype=f64)
            fifo, outs = [], []
            for t in range(T):
                if t > 0:  # t = 0 is the sentinel: x_1 = 0, eta_1 = 0, gamma_1 = 1
                    fifo = (fifo + [(k[b, t - 1, h], v[b, t, h])])[-(window if sliding else 1):]
                    eta = beta[b, t, h]  # a scalar, or [V] for the per-column rules
                    write = sum(torch.outer(x, (y - S.T @ x) if regression else y) for x, y in fifo) / len(fifo)
                    S = decay_floor * S + eta * write
                outs.append(S.T @ q[b, t, h])
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads, 1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype,decay_floor", [(f64, 1e-2), (f64, 1e-20), (torch.float32, 1e-8)],
                         ids=["float64", "float64-floor-below-eps", "float32-floor-below-eps"])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULES)
def test_gradient_where_the_decay_clamp_holds_the_carry_at_the_floor(rule, form, dtype, decay_floor):
    """``eta_t lambda_t = 1`` exactly, above ``1 - decay_floor``: ``gamma_t = decay_floor`` does not depend on
    ``lam`` or ``beta`` there, so ``d o / d lam = 0`` and the gradients of ``beta`` and ``v`` are those of the
    loop with the carry held at ``decay_floor``; all finite. ``1e-20`` is below float64's epsilon and ``1e-8``
    below float32's: ``1 - decay_floor`` is 1 there, and so is the clamped fraction."""
    g = torch.Generator().manual_seed(3)
    B, T, H, K, V = 1, 7, 2, 3, 2
    q, k, v = (torch.randn(B, T, H, d, generator=g, dtype=f64) for d in (K, K, V))
    w = torch.randn(B, T, H, V, generator=g, dtype=f64)
    bshape = (B, T, H, V) if rule in ("2", "2A") else (B, T, H)
    tol = 1e-10 if dtype == f64 else 1e-5

    beta, lam = (torch.ones(shape, dtype=dtype, requires_grad=True) for shape in (bshape, (B, T, H)))
    v1 = v.to(dtype).clone().requires_grad_(True)
    q, k = q.to(dtype), k.to(dtype)
    o, _ = falcon_attention(q, k, v1, beta, lam, rule=rule, window=3, form=form, chunk_size=3, normalize=False,
                            decay_floor=decay_floor, backend="torch")
    (o * w.to(dtype)).sum().backward()

    beta_r, v_r = torch.ones(bshape, dtype=f64, requires_grad=True), v.clone().requires_grad_(True)
    o_r = _loop_at_the_clamp(q.double(), k.double(), v_r, beta_r, rule=rule, window=3, decay_floor=decay_floor)
    (o_r * w).sum().backward()

    assert rel_err(o, o_r) < tol
    for got in (beta.grad, lam.grad, v1.grad):
        assert torch.isfinite(got).all()
    assert lam.grad.abs().max().item() == 0.0
    assert rel_err(beta.grad, beta_r.grad) < tol
    assert rel_err(v1.grad, v_r.grad) < tol
