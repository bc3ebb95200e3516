"""The fused pairs-and-step-sizes kernels of rules 1, 1A, 2 and 2A (``ops.triton.step_sizes``)
against the equations written out in float64: ``x_t = k_{t-1}`` (``x_0`` = the carried
last key, or the invalid sentinel 0), ``E = ||x||^2``, ``eta = beta / (E + lambda + eps)``,
``log a = log1p(-min(eta lambda, 1 - decay_floor)) + g``; values and every gradient,
including the gradient ``x`` receives downstream."""
from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, PoisonedEmpty, in_this_process

from falcon_fwa.ops.triton.step_sizes import feature_step_sizes, shifted_step_sizes

pytestmark = in_this_process


def _reference(k, first, beta, lam, gate, *, eps, decay_floor, scale_ridge):
    """``beta`` ``[B, T, H]`` or, per value column (rules 2, 2A), ``[B, T, H, V]``."""
    B, T, H, K = k.shape
    head = first[:, None] if first is not None else torch.zeros_like(k[:, :1])
    x = torch.cat([head, k[:, :-1]], 1)
    valid = torch.ones(B, T, H, dtype=torch.bool)
    if first is None:
        valid[:, 0] = False
    E = (x * x).sum(-1)
    lam_eff = lam * E if scale_ridge else lam
    if beta.dim() == 4:  # the row quantities, broadcast over the value columns
        valid, E, lam_eff, gate = valid[..., None], E[..., None], lam_eff[..., None], \
            None if gate is None else gate[..., None]
    eta = torch.where(valid, beta / (E + lam_eff + eps), torch.zeros_like(beta))
    alpha = torch.clamp(eta * lam_eff, max=1 - decay_floor)
    log_a = torch.log1p(-alpha) + (0 if gate is None else gate)
    return x, eta, log_a


@pytest.mark.parametrize("T,carry,gate,scale_ridge,V", [(9, False, True, False, None), (9, True, False, True, None),
                                                        (1, True, True, False, None), (1, False, False, False, None),
                                                        (9, False, True, False, 40), (9, True, False, True, 24),
                                                        (1, True, True, False, 40)])
def test_shifted_step_sizes_match_the_equations(T, carry, gate, scale_ridge, V):
    # V: the per-column rules' beta [B, T, H, V] (V = 40 spans two value blocks, the second partial)
    g = torch.Generator().manual_seed(T + 2 * carry)
    B, H, K = 2, 3, 20  # K below the key block: the masked columns
    cols = () if V is None else (V,)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64) / 3
    first = torch.randn(B, H, K, generator=g, dtype=torch.float64) / 3 if carry else None
    beta = 0.2 + torch.rand(B, T, H, *cols, generator=g, dtype=torch.float64)
    lam = 2.0 * torch.rand(B, T, H, generator=g, dtype=torch.float64)  # large: the clamp is reached
    log_gate = -0.3 * torch.rand(B, T, H, generator=g, dtype=torch.float64) if gate else None
    w = [torch.randn(B, T, H, *d, generator=g, dtype=torch.float64) for d in ((K,), cols, cols)]
    opts = dict(eps=1e-6, decay_floor=0.05, scale_ridge=scale_ridge)

    leaves64 = [t.clone().requires_grad_() for t in (k, first, beta, lam, log_gate) if t is not None]
    it = iter(leaves64)
    ins64 = [next(it) if t is not None else None for t in (k, first, beta, lam, log_gate)]
    ref = _reference(*ins64, **opts)
    sum((r * wi).sum() for r, wi in zip(ref, w)).backward()

    leaves = [t.float().to(DEVICE).requires_grad_() for t in (k, first, beta, lam, log_gate) if t is not None]
    it = iter(leaves)
    ins = [next(it) if t is not None else None for t in (k, first, beta, lam, log_gate)]
    out = shifted_step_sizes(*ins, normalize=True, **opts)
    sum((o * wi.float().to(DEVICE)).sum() for o, wi in zip(out, w)).backward()

    assert (not carry) == bool((out[1][:, 0] == 0).all())  # the sentinel's pair writes nothing
    eta_scale = out[3]
    if V is None:
        assert eta_scale is None
    else:  # the row factor of the per-column gains: eta = beta * scale to the bit, 1 / (E + lambda + eps)
        want_scale = ref[1][..., 0] / ins64[2][..., 0]
        assert torch.allclose(eta_scale.double().cpu(), want_scale.detach(), rtol=1e-6, atol=0)
        formed = torch.where(eta_scale[..., None] != 0, ins[2].detach() * eta_scale[..., None], 0.0)
        assert torch.equal(out[1], formed)
    for name, got, want in zip(("x", "eta", "log_a"), out, ref):
        assert torch.allclose(got.double().cpu(), want.detach(), rtol=1e-5, atol=1e-6), name
    for a, b in zip(leaves, leaves64):
        assert torch.allclose(a.grad.double().cpu(), b.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("T,carry,gate,scale_ridge", [(9, False, True, False), (9, True, False, True)])
def test_scalar_step_sizes_over_several_key_blocks(monkeypatch, T, carry, gate, scale_ridge):
    # a key block of 16 for K = 20: the kernels loop over two blocks (the second partial) and read
    # the features again for the shifted copy and the gradient, instead of keeping one tile
    from falcon_fwa.ops.triton import step_sizes
    for name in ("step_fwd", "step_bwd"):
        monkeypatch.setitem(step_sizes.LAUNCH, name, dict(step_sizes.LAUNCH[name], BK=16))
    test_shifted_step_sizes_match_the_equations(T, carry, gate, scale_ridge, None)


def test_unshifted_step_sizes_without_a_validity_mask_take_every_pair():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(1, 5, 2, 16, generator=g) / 3).to(DEVICE)
    beta, lam = (torch.rand(1, 5, 2, generator=g).to(DEVICE) for _ in range(2))
    opts = dict(eps=1e-6, decay_floor=1e-3, normalize=True, scale_ridge=False)
    eta_all, la_all, no_scale = feature_step_sizes(x, None, beta, lam, None, **opts)
    eta_m, la_m, _ = feature_step_sizes(x, torch.ones(1, 5, dtype=torch.bool, device=DEVICE), beta, lam, None, **opts)
    assert no_scale is None  # a scalar beta: eta is the row's own
    assert torch.equal(eta_all, eta_m) and torch.equal(la_all, la_m)
    want = beta / ((x * x).sum(-1) + lam + 1e-6)
    assert torch.allclose(eta_all, want, rtol=1e-6)


@pytest.mark.parametrize("T", [1, 4])
def test_shifted_step_sizes_of_fp16_keys_carry_an_fp32_last_key(T, monkeypatch):
    # B > 1 and H > 1 rows (the row arithmetic of the shift), K = 80 over two key blocks (the
    # second one partial), fp16 keys and a carried last key in fp32: the features are the fp16
    # values, every gradient reaches its leaf in the leaf's dtype; T = 1 makes the first step
    # also the last (the whole key gradient is 0, the carried key takes the step's). Fresh
    # buffers start as NaN, so an element the kernels leave unwritten shows.
    g = torch.Generator().manual_seed(40 + T)
    B, H, K = 2, 3, 80
    k = (torch.randn(B, T, H, K, generator=g) / 4).half()
    first = (torch.randn(B, H, K, generator=g) / 4).half().float()  # fp32, its values exact in fp16
    beta, lam = 0.2 + torch.rand(B, T, H, generator=g), torch.rand(B, T, H, generator=g)
    w = [torch.randn(B, T, H, *d, generator=g, dtype=torch.float64) for d in ((K,), (), ())]
    opts = dict(eps=1e-6, decay_floor=1e-3, scale_ridge=False)

    leaves64 = [t.double().requires_grad_() for t in (k, first, beta, lam)]
    ref = _reference(*leaves64, None, **opts)
    sum((r * wi).sum() for r, wi in zip(ref, w)).backward()

    leaves = [t.to(DEVICE).requires_grad_() for t in (k, first, beta, lam)]
    with PoisonedEmpty(monkeypatch):
        out = shifted_step_sizes(*leaves, None, normalize=True, **opts)
        sum((o.double() * wi.to(DEVICE)).sum() for o, wi in zip(out, w)).backward()

    assert out[0].dtype == torch.float16 and torch.equal(out[0].double().cpu(), ref[0].detach())
    for name, got, want in zip(("eta", "log_a"), out[1:], ref[1:]):
        assert torch.allclose(got.double().cpu(), want.detach(), rtol=1e-5, atol=1e-7), name
    for a, b in zip(leaves, leaves64):
        assert a.grad.dtype == a.dtype
        assert torch.allclose(a.grad.double().cpu(), b.grad, rtol=2e-3, atol=2e-3)
    assert T > 1 or not leaves[0].grad.any()


def test_a_carried_key_of_the_wrong_shape_is_named():
    # without the op's argument checks (validate=False) the kernel would read past the carried key
    k = torch.zeros(2, 3, 1, 16, device=DEVICE)
    beta = lam = torch.ones(2, 3, 1, device=DEVICE)
    opts = dict(eps=1e-6, decay_floor=1e-3, normalize=True, scale_ridge=False)
    with pytest.raises(ValueError, match=r"first \(the carried last key\) must have shape \(2, 1, 16\)"):
        shifted_step_sizes(k, torch.zeros(1, 1, 16, device=DEVICE), beta, lam, None, **opts)
