"""Gradients: the parallel and chunk forms against autograd through the recurrent
form (float64, <= 1e-8), and finite differences (gradcheck) for every rule, also of the
recurrent form under each switch (scale_ridge, read="before", shift=False, normalize=False)."""
from __future__ import annotations

import pytest
import torch
from conftest import RULE_NAMES, SLIDING, random_inputs, reference_falcon, rel_err

from falcon_fwa import falcon_attention

NAMES = ("q", "k", "v", "beta", "lam", "log_gate")


def _grads(inp, form, cotangent, state_cotangent, **options):
    leaves = {n: t.clone().requires_grad_() for n, t in inp.items()}
    o, st = falcon_attention(**leaves, form=form, output_final_state=True, **options)
    loss = (o * cotangent).sum() + (st.S * state_cotangent).sum()
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("options", [dict(), dict(read="before", scale_ridge=True)], ids=["default", "rbw_scaled"])
def test_gradients_match_recurrent(rule, options):
    # the clamp is active on part of the tokens (lam up to 4)
    inp = random_inputs(rule, B=1, T=19, K=4, V=3, seed=61, lam_range=(0.0, 4.0), with_gate=True)
    assert 0.0 < reference_falcon(**inp, rule=rule, window=3, **options)[2]["clamped_fraction"] < 1.0
    g = torch.Generator().manual_seed(62)
    cot = torch.randn(inp["v"].shape, generator=g, dtype=torch.float64)
    cot_S = torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64)
    opts = dict(rule=rule, window=3, chunk_size=5, **options)
    ref = _grads(inp, "recurrent", cot, cot_S, **opts)
    for form in ("parallel", "chunk"):
        got = _grads(inp, form, cot, cot_S, **opts)
        for name in NAMES:
            assert ref[name].abs().max() > 0, name
            assert rel_err(got[name], ref[name]) <= 1e-8, f"{form} d{name}: {rel_err(got[name], ref[name]):.2e}"


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_gradients_through_initial_state(rule):
    """Gradients flow into the carried state (S, last key, sliding tail) identically."""
    first = random_inputs(rule, B=1, T=6, K=3, V=2, H=1, seed=63)
    second = random_inputs(rule, B=1, T=9, K=3, V=2, H=1, seed=64)
    grads = {}
    for form in ("recurrent", "parallel", "chunk"):
        k0 = first["k"].clone().requires_grad_()
        v0 = first["v"].clone().requires_grad_()
        _, st = falcon_attention(first["q"], k0, v0, first["beta"], first["lam"], rule=rule, window=3,
                                 form="recurrent", output_final_state=True)
        o, _ = falcon_attention(**second, rule=rule, window=3, form=form, chunk_size=4, initial_state=st)
        (o ** 2).sum().backward()
        grads[form] = (k0.grad, v0.grad)
    for form in ("parallel", "chunk"):
        for got, ref in zip(grads[form], grads["recurrent"]):
            assert ref.abs().max() > 0 and rel_err(got, ref) <= 1e-8


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_gradcheck(rule, form):
    # Tiny case away from non-smooth points: beta < 1 keeps eta*lam < 1 (the clamp
    # inactive), random keys (no repeated top eigenvalue in a window).
    inp = random_inputs(rule, B=1, T=5, H=1, K=3, V=2, seed=65, beta_range=(0.3, 0.9), lam_range=(0.05, 0.5),
                        with_gate=True)
    assert reference_falcon(**inp, rule=rule, window=2)[2]["clamped_fraction"] == 0.0
    names = list(inp)

    def f(*tensors):
        o, st = falcon_attention(*tensors[:5], log_gate=tensors[5], rule=rule, window=2, form=form, chunk_size=2,
                                 output_final_state=True)
        return o, st.S

    leaves = tuple(inp[n].clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


# The switches' gradients through the recurrent form, the definition (the other forms are compared with it
# above, and share its step-size code: only finite differences check that code's own gradient).
SWITCHES = {
    "scale_ridge": dict(scale_ridge=True),
    "read_before": dict(read="before"),
    "unshifted": dict(shift=False),
    "unnormalized": dict(normalize=False),
    "unnormalized_scaled": dict(normalize=False, scale_ridge=True),
    "all": dict(scale_ridge=True, read="before", shift=False),
}


def _window_energy(k, rule, window, shift):
    """``E_t`` ``[B, T, H]`` of the sliding rules, with loops: over the write features ``x_j``, ``j`` in
    ``I_t`` (``k_{j-1}``, from the second step with ``shift``; else ``k_j``), the top eigenvalue of the
    window Gram over ``B_t`` (rule 3) or the mean squared norm (3A); 0 where the window is empty."""
    B, T, H, _ = k.shape
    E = torch.zeros(B, T, H, dtype=k.dtype)
    for b in range(B):
        for h in range(H):
            for t in range(T):
                js = range(max(int(shift), t - window + 1), t + 1)
                if not js:
                    continue
                X = torch.stack([k[b, j - 1 if shift else j, h] for j in js])
                E[b, t, h] = (torch.linalg.eigvalsh(X @ X.T)[-1] if rule == "3" else (X * X).sum()) / len(js)
    return E


@pytest.mark.parametrize("switches", list(SWITCHES.values()), ids=list(SWITCHES))
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_gradcheck_of_the_switches(rule, switches):
    """Finite differences (float64 gradcheck) of the recurrent form under each switch, with a full
    sliding window (3 of 5 steps). With ``scale_ridge`` the sliding rules scale lambda by a detached
    ``E_t`` (Appendix C.6), which is no derivative: their key gradient is checked as that of the op
    with ``scale_ridge=False`` and the ridge ``lam * E_t`` of the unperturbed keys, itself gradchecked."""
    inp = random_inputs(rule, B=1, T=5, H=1, K=3, V=3, seed=66, beta_range=(0.3, 0.9), lam_range=(0.05, 0.5),
                        with_gate=True)
    opts = dict(rule=rule, window=3, **switches)
    ref_o, ref_S, info = reference_falcon(**inp, **opts)
    assert info["clamped_fraction"] == 0.0  # away from the clamp's kink
    o, st = falcon_attention(**inp, form="recurrent", output_final_state=True, **opts)
    assert rel_err(o, ref_o) <= 1e-10 and rel_err(st.S, ref_S) <= 1e-10  # the switches reach the op
    detached = rule in SLIDING and switches.get("scale_ridge", False)
    names = [n for n in inp if not (detached and n == "k")]

    def op(values, **overrides):
        args = {**inp, **values}
        o, st = falcon_attention(**args, form="recurrent", output_final_state=True, **{**opts, **overrides})
        return o, st.S

    def f(*tensors):
        return op(dict(zip(names, tensors)))

    leaves = tuple(inp[n].clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)
    if not detached:
        return
    ridge = inp["lam"] * _window_energy(inp["k"], rule, 3, switches.get("shift", True))

    def g(k):
        return op(dict(k=k, lam=ridge), scale_ridge=False)

    k = inp["k"].clone().requires_grad_()
    assert torch.autograd.gradcheck(g, (k,), eps=1e-6, atol=1e-7, rtol=1e-5)
    cot = torch.randn(inp["v"].shape, generator=torch.Generator().manual_seed(67), dtype=torch.float64)
    grads = []
    for fn in (lambda k: op(dict(k=k)), g):
        k = inp["k"].clone().requires_grad_()
        o, S = fn(k)
        assert rel_err(o, ref_o) <= 1e-10
        ((o * cot).sum() + S.sum()).backward()
        grads.append(k.grad)
    assert rel_err(grads[0], grads[1]) <= 1e-10


@pytest.mark.parametrize("form", ["recurrent", "chunk"])
@pytest.mark.parametrize("rule", ["1", "2", "1A", "2A"])
def test_gradients_at_a_vanishing_denominator(rule, form):
    """With eps = 0 and lam = 0 a zero write feature makes E_t + lambda_t + eps = 0, where eta_t = 0 (the step
    writes nothing, whatever beta_t and v_t are). The op is smooth in q, v and beta there: finite differences
    (gradcheck) agree with autograd, and the gradients of k and lam stay finite (beta / 0 never reaches them)."""
    inp = random_inputs(rule, B=1, T=6, H=1, K=2, V=2, seed=66, beta_range=(0.3, 0.9), lam_range=(0.0, 0.0))
    inp["k"][:, 1] = 0.0  # x_2 = k_1 = 0 and x_4 = k_3 = 0 (shifted pairs)
    inp["k"][:, 3] = 0.0
    opts = dict(rule=rule, chunk_size=4, eps=0.0)

    def f(q, v, beta):
        o, st = falcon_attention(q, inp["k"], v, beta, inp["lam"], form=form, output_final_state=True, **opts)
        return o, st.S

    leaves = tuple(inp[n].clone().requires_grad_() for n in ("q", "v", "beta"))
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)
    grads = _grads(inp, form, torch.ones_like(inp["v"]), torch.ones(1, 1, 2, 2, dtype=torch.float64), **opts)
    assert all(torch.isfinite(g).all() for g in grads.values()), {n: g for n, g in grads.items()}
