"""The recurrent, parallel and chunk forms compute the same function as the
literal float64 reference of every rule (relative error <= 1e-10)."""
from __future__ import annotations

import pytest
import torch
from conftest import FORMS, RULE_NAMES, SLIDING, random_inputs, reference_falcon, rel_err

from falcon_fwa import falcon_attention

TOL = 1e-10

# Input regimes; each is run for every rule and every form.
REGIMES = {
    "generic": dict(),
    "beta_near_0": dict(beta_range=(1e-4, 1e-2)),
    "beta_near_2": dict(beta_range=(1.9, 1.999)),
    "lam_zero": dict(lam_range=(0.0, 0.0)),
    "clamp_active": dict(beta_range=(1.2, 1.95), lam_range=(5.0, 50.0)),
    "zero_key_rows": dict(zero_key_rows=0.35),
}


def _run_all_forms(inp, rule, **options):
    outs = {}
    for form in FORMS:
        o, st = falcon_attention(inp["q"], inp["k"], inp["v"], inp["beta"], inp["lam"], rule=rule, form=form,
                                 log_gate=inp.get("log_gate"), output_final_state=True, **options)
        outs[form] = (o, st.S)
    return outs


def _assert_matches_reference(inp, rule, *, chunk_size, **options):
    ref_o, ref_S, info = reference_falcon(inp["q"], inp["k"], inp["v"], inp["beta"], inp["lam"], rule=rule,
                                          log_gate=inp.get("log_gate"), **options)
    for form, (o, S) in _run_all_forms(inp, rule, chunk_size=chunk_size, **options).items():
        assert o.dtype == torch.float64
        assert rel_err(o, ref_o) <= TOL, f"{form}: outputs differ by {rel_err(o, ref_o):.2e}"
        assert rel_err(S, ref_S) <= TOL, f"{form}: final state differs by {rel_err(S, ref_S):.2e}"
    return info


@pytest.mark.parametrize("regime", list(REGIMES))
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_forms_match_reference(rule, regime):
    # T = 37 is not a multiple of chunk_size = 8 (a padded last chunk).
    inp = random_inputs(rule, seed=10 * RULE_NAMES.index(rule) + list(REGIMES).index(regime), **REGIMES[regime])
    info = _assert_matches_reference(inp, rule, window=3, chunk_size=8)
    if regime == "clamp_active":
        assert info["clamped_fraction"] > 0.8, info
    elif regime in ("beta_near_0", "lam_zero"):
        assert info["clamped_fraction"] == 0.0, info


@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("rule", SLIDING)
def test_sliding_windows(rule, window):
    inp = random_inputs(rule, B=1, T=29, seed=10 + window, zero_key_rows=0.1)
    _assert_matches_reference(inp, rule, window=window, chunk_size=7)


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 64])
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_chunk_sizes(rule, chunk_size):
    # chunk sizes below, around and above T = 21
    inp = random_inputs(rule, B=1, T=21, H=1, seed=3)
    ref_o, _, _ = reference_falcon(**inp, rule=rule, window=3)
    o, _ = falcon_attention(**inp, rule=rule, window=3, form="chunk", chunk_size=chunk_size)
    assert rel_err(o, ref_o) <= TOL


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize(
    "options",
    [
        dict(shift=False),
        dict(read="before"),
        dict(normalize=False),
        dict(scale_ridge=True),
        dict(eps=0.0),
        dict(decay_floor=0.3),
    ],
    ids=["no_shift", "read_before", "no_normalize", "scale_ridge", "eps0", "floor0.3"],
)
def test_switches_match_reference(rule, options):
    lam_range = (0.0, 3.0) if "decay_floor" in options else (0.0, 1.0)
    beta_range = (0.05, 0.9) if "normalize" in options else (0.05, 1.95)
    inp = random_inputs(rule, B=1, T=23, seed=7, lam_range=lam_range, beta_range=beta_range)
    _assert_matches_reference(inp, rule, window=3, chunk_size=6, **options)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_log_gate_matches_reference(rule):
    inp = random_inputs(rule, B=1, T=23, seed=8, with_gate=True)
    _assert_matches_reference(inp, rule, window=3, chunk_size=6)


def test_clamp_really_limits_the_decay():
    # With a tiny decay floor the clamp is what keeps gamma positive: without it
    # 1 - eta*lam would be negative here. gamma = decay_floor exactly.
    K = V = 1
    q = torch.ones(1, 3, 1, K, dtype=torch.float64)
    k = torch.ones(1, 3, 1, K, dtype=torch.float64)
    v = torch.full((1, 3, 1, V), 2.0, dtype=torch.float64)
    beta = torch.full((1, 3, 1), 1.9, dtype=torch.float64)
    lam = torch.full((1, 3, 1), 100.0, dtype=torch.float64)
    for form in FORMS:
        o, _ = falcon_attention(q, k, v, beta, lam, rule="1A", form=form, eps=0.0, decay_floor=0.25)
        eta = 1.9 / 101.0  # ||x||^2 = 1
        s2 = eta * 2.0
        s3 = 0.25 * s2 + eta * 2.0  # gamma = 1 - min(eta*lam, 0.75) = 0.25
        assert torch.allclose(o[0, :, 0, 0], torch.tensor([0.0, s2, s3], dtype=torch.float64), rtol=1e-13, atol=0)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_poisoned_future_does_not_leak(rule):
    """Causality: the recurrent form's outputs before t0 stay finite and unchanged
    when the inputs from step t0 on are NaN (lam and log_gate, whose values are checked,
    are garbage within their ranges). The parallel and chunk forms mix a chunk's steps in
    dense matrix products (where 0 * NaN = NaN), so for them the future is replaced by
    finite garbage instead, which must not change the past."""
    T, t0 = 26, 17
    inp = random_inputs(rule, B=1, T=T, seed=11, with_gate=True)
    garbage = random_inputs(rule, B=1, T=T, seed=12, with_gate=True, beta_range=(3.0, 9.0), lam_range=(0.0, 50.0))
    poisoned = {name: t.clone() for name, t in inp.items()}
    changed = {name: t.clone() for name, t in inp.items()}
    for name in inp:
        changed[name][:, t0:] = 10 * garbage[name][:, t0:]
        # lam and log_gate are checked (NaN refused): their future is garbage within range instead
        poisoned[name][:, t0:] = changed[name][:, t0:] if name in ("lam", "log_gate") else float("nan")
    clean, _ = falcon_attention(**inp, rule=rule, window=3, form="recurrent")
    o, _ = falcon_attention(**poisoned, rule=rule, window=3, form="recurrent")
    assert torch.isfinite(o[:, :t0]).all() and torch.isnan(o[:, t0 + 1:]).all()
    assert torch.equal(o[:, :t0], clean[:, :t0])
    for form in ("parallel", "chunk"):
        ref, _ = falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=8)
        o, _ = falcon_attention(**changed, rule=rule, window=3, form=form, chunk_size=8)
        assert rel_err(o[:, :t0], ref[:, :t0]) <= 1e-13
        assert rel_err(o[:, t0 + 1:], ref[:, t0 + 1:]) > 1e-3  # the future did change


@pytest.mark.parametrize("cols_budget", [1, 3])
@pytest.mark.parametrize("rule", ["2", "2A"])
def test_chunk_form_in_column_groups(rule, cols_budget, monkeypatch):
    """Per-column rules run their value columns in groups (recomputed in the backward) when
    the block tensors would be large: outputs, final state and every gradient are those of
    the float64 reference and of the ungrouped chunk form. A budget of 1 element gives one
    column per group; 3 columns' worth gives groups of 3 and a last group of 1."""
    from falcon_fwa.ops import chunk

    inp = random_inputs(rule, B=2, T=21, seed=91, with_gate=True)
    B, T, H, K = inp["q"].shape
    per_column = B * H * -(-T // 8) * (8 * 8 + 8 * K + (K * K if rule == "2" else 0))
    ref_o, ref_S, _ = reference_falcon(inp["q"], inp["k"], inp["v"], inp["beta"], inp["lam"], rule=rule,
                                       log_gate=inp["log_gate"])
    widths, inner = [], chunk._chunk_form

    def spy(q, xs, ys, *args, **kwargs):
        widths.append(ys.shape[-1])
        return inner(q, xs, ys, *args, **kwargs)

    monkeypatch.setattr(chunk, "_chunk_form", spy)
    results = []
    for budget in (chunk.BLOCK_ELEMENTS, cols_budget * per_column):
        monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", budget)
        widths.clear()
        leaves = {n: t.detach().clone().requires_grad_() for n, t in inp.items() if t is not None}
        o, st = falcon_attention(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves["lam"], rule=rule,
                                 log_gate=leaves["log_gate"], form="chunk", chunk_size=8, output_final_state=True)
        assert rel_err(o, ref_o) <= TOL and rel_err(st.S, ref_S) <= TOL
        g = torch.Generator().manual_seed(3)
        ((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() + st.S.square().sum()).backward()
        results.append({n: t.grad for n, t in leaves.items()})
    V = inp["v"].shape[-1]
    groups = [cols_budget] * (V // cols_budget) + [V % cols_budget] * (V % cols_budget > 0)
    # each group once in the forward, and once more when the backward recomputes it
    assert widths[:len(groups)] == groups and sorted(widths[len(groups):]) == sorted(groups)
    for n in results[0]:
        assert rel_err(results[1][n], results[0][n]) <= TOL, n


@pytest.mark.parametrize("dtype,decay_floor", [(torch.float32, 1e-8), (torch.float64, 1e-17)])
def test_decay_floor_below_the_dtype_epsilon(dtype, decay_floor):
    # 1 - decay_floor rounds to 1 in the compute dtype; the clamp must still leave gamma = decay_floor > 0.
    # Step 3 writes nothing (x_3 = k_2 = 0) and only decays: eta*lam = 1.9*100/(100 + eps) clamps.
    q = torch.ones(1, 3, 1, 1, dtype=dtype)
    k = torch.tensor([1.0, 0.0, 0.0], dtype=dtype).view(1, 3, 1, 1)
    v = torch.full((1, 3, 1, 1), 2.0, dtype=dtype)
    beta = torch.full((1, 3, 1), 1.9, dtype=dtype)
    lam = torch.tensor([0.0, 0.0, 100.0], dtype=dtype).view(1, 3, 1)
    s2 = 1.9 / (1.0 + 1e-6) * 2.0
    want = torch.tensor([0.0, s2, decay_floor * s2], dtype=torch.float64)
    for form in FORMS:
        o, _ = falcon_attention(q, k, v, beta, lam, rule="1A", form=form, decay_floor=decay_floor, backend="torch")
        assert torch.isfinite(o).all(), form
        assert torch.allclose(o[0, :, 0, 0].double(), want, rtol=1e-5, atol=0), (form, o[0, :, 0, 0])


@pytest.mark.parametrize("rule", ["1", "1A", "2", "3"])
def test_hard_reset_gate(rule):
    """log_gate = -inf (exp(g) = 0: the state is reset) is a valid gate (g <= 0): every form
    gives the recurrence's finite outputs and gradients. A huge finite gate (-1e6) in float32
    does not cost the chunk-local differences their precision. The gradients are those of the
    recurrent form in float64 (autograd, itself checked against finite differences with the -inf
    gate): within 1e-10 in float64, and within float32 rounding (5e-5) for the float32 inputs."""
    inp = random_inputs(rule, B=1, T=12, H=1, K=3, V=2, seed=13, with_gate=True)
    for g, dtype, tol, grad_tol in ((float("-inf"), torch.float64, TOL, TOL), (-1e6, torch.float32, 1e-5, 5e-5)):
        x = {n: t.clone() for n, t in inp.items()}
        x["log_gate"][:, 5] = g
        x = {n: t.to(dtype) for n, t in x.items()}
        ref, _, _ = reference_falcon(**x, rule=rule, window=3)
        # float64 autograd of the recurrent form (the definition) at the same (rounded) values
        ref_grads = _squared_output_grads({n: t.double() for n, t in x.items()}, rule, "recurrent")
        assert all(t.abs().max() > 0 for n, t in ref_grads.items() if n != "log_gate")
        assert ref_grads["log_gate"][:, 5].abs().max() == 0  # d/dg exp(g) S = exp(g) S = 0 at the reset
        for form in FORMS:
            leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
            o, _ = falcon_attention(**leaves, rule=rule, window=3, form=form, chunk_size=8, backend="torch")
            assert torch.isfinite(o).all() and rel_err(o, ref) <= tol, (form, g, rel_err(o, ref))
            (o ** 2).sum().backward()
            for n, t in leaves.items():
                assert torch.isfinite(t.grad).all(), (form, g, n)
                assert rel_err(t.grad, ref_grads[n]) <= grad_tol, (form, g, n, rel_err(t.grad, ref_grads[n]))
    # the recurrent form's own gradient with the -inf gate, against finite differences
    x = {n: t.clone() for n, t in inp.items()}
    x["log_gate"][:, 5] = float("-inf")
    names = list(x)

    def f(*tensors):
        o, st = falcon_attention(**dict(zip(names, tensors)), rule=rule, window=3, form="recurrent",
                                 output_final_state=True, backend="torch")
        return o, st.S

    leaves = tuple(x[n].clone().requires_grad_() for n in names)
    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def _squared_output_grads(x, rule, form):
    """Gradients of ``sum(o ** 2)`` with respect to every input in ``x`` (window 3, chunks of 8)."""
    leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
    o, _ = falcon_attention(**leaves, rule=rule, window=3, form=form, chunk_size=8, backend="torch")
    (o ** 2).sum().backward()
    return {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_empty_batch_or_heads(rule):
    """No batch rows (or no heads) is a batch like any other: every form returns the empty
    output ``[B, T, H, V]`` and final state ``[B, H, K, V]``, and the rows beside it are
    unaffected (the non-empty part equals the float64 reference)."""
    inp = random_inputs(rule, B=2, T=9, H=2, K=3, V=4, seed=14)
    ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, window=3)
    for dim, name in ((0, "B"), (2, "H")):
        empty = {n: t.narrow(dim, 0, 0) for n, t in inp.items()}
        for form in FORMS:
            o, st = falcon_attention(**empty, rule=rule, window=3, form=form, chunk_size=4, output_final_state=True)
            want = list(inp["v"].shape)
            want[dim] = 0
            assert list(o.shape) == want, (name, form)
            assert list(st.S.shape) == ([0, 2, 3, 4] if name == "B" else [2, 0, 3, 4]), (name, form)
    for form in FORMS:
        o, st = falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=4, output_final_state=True)
        assert rel_err(o, ref_o) <= TOL and rel_err(st.S, ref_S) <= TOL


@pytest.mark.parametrize("rule", ["1", "1A", "2", "2A"])
def test_a_float32_reset_gate_clears_a_float64_state_exactly(rule):
    """A float32 ``log_gate`` of ``-inf`` with float64 inputs: the op computes in float64, where the
    reset leaves exactly nothing of the state before it (``exp`` of the floor is 0 in float64, not
    the 6e-46 of float32's floor). With zero values from the reset on, every later output is 0."""
    inp = random_inputs(rule, B=1, T=12, H=1, K=3, V=2, seed=17, with_gate=True)
    inp["log_gate"] = inp["log_gate"].float()
    inp["log_gate"][:, 5] = float("-inf")
    inp["v"][:, 5:] = 0.0
    assert inp["q"].dtype == torch.float64
    for form in FORMS:
        o, _ = falcon_attention(**inp, rule=rule, form=form, chunk_size=4, backend="torch")
        assert o.dtype == torch.float64 and o[:, :5].abs().max() > 0, form
        assert torch.equal(o[:, 5:], torch.zeros_like(o[:, 5:])), (form, o[:, 5:].abs().max())
