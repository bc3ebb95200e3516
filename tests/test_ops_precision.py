"""Low precision: float32 / bfloat16 inputs, and long-context stability of the
chunk form (chunk-local log-space decays) against a float64 recurrent run."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import FORMS, RULE_NAMES, SLIDING, random_inputs, rel_err

from falcon_fwa import falcon_attention

T_LONG = 16384
FP32_TINY = torch.finfo(torch.float32).smallest_normal * 2.0 ** -23  # smallest subnormal


def _log_gamma_non_sliding(inp, decay_floor, eps=1e-6):
    """log carry of the rules 1 / 1A / 2 / 2A (float64), shift=True."""
    x = torch.cat([torch.zeros_like(inp["k"][:, :1]), inp["k"][:, :-1]], dim=1)
    E = (x.double() ** 2).sum(-1)
    lam = inp["lam"].double()
    beta = inp["beta"].double()
    if beta.dim() == 4:
        E, lam = E[..., None], lam[..., None]
    eta = beta / (E + lam + eps)
    eta[:, 0] = 0.0
    alpha_raw = eta * lam
    return torch.log1p(-alpha_raw.clamp(max=1 - decay_floor)), alpha_raw > 1 - decay_floor


LONG_REGIMES = {
    # strong decay: the clamp is active on most tokens, gamma = decay_floor there
    "clamp": dict(beta_range=(1.3, 1.9), lam_range=(3.0, 30.0), decay_floor=0.02),
    # long memory (gamma ~ 0.99) whose product over the sequence still underflows
    "long_memory": dict(beta_range=(0.2, 0.6), lam_range=(0.01, 0.03), decay_floor=1e-3),
}


LONG_CASES = [(rule, "clamp") for rule in RULE_NAMES] + [("1", "long_memory"), ("1A", "long_memory")]


@pytest.mark.parametrize("rule,regime", LONG_CASES)
def test_long_context_fp32_bf16(rule, regime):
    cfg = dict(LONG_REGIMES[regime])
    decay_floor = cfg.pop("decay_floor")
    # inputs that bf16 holds exactly (and so float32): the float64 recurrence on them is the reference of both
    inp = {n: t.bfloat16().double() for n, t in random_inputs(rule, B=1, T=T_LONG, H=1, K=2, V=2, seed=71,
                                                                **cfg).items()}
    if rule not in SLIDING:
        log_gamma, clamped = _log_gamma_non_sliding(inp, decay_floor)
        if regime == "clamp":
            assert clamped.double().mean() > 0.8
        # the global product of the decays underflows float32 (and so would any
        # unrenormalized cumulative decay)
        assert log_gamma.sum(1).max() < torch.log(torch.tensor(FP32_TINY, dtype=torch.float64))
        assert torch.prod(torch.exp(log_gamma).float(), dim=1).max() == 0
    options = dict(rule=rule, window=3, decay_floor=decay_floor, form="chunk", chunk_size=64)
    ref, _ = falcon_attention(**inp, **dict(options, form="recurrent"))
    o32, _ = falcon_attention(**{n: t.float() for n, t in inp.items()}, **options)
    assert o32.dtype == torch.float32 and torch.isfinite(o32).all()
    assert rel_err(o32, ref) <= 2e-6  # float32 accumulation over 16384 steps
    o16, _ = falcon_attention(**{n: t.bfloat16() for n, t in inp.items()}, **options)
    assert o16.dtype == torch.bfloat16 and torch.isfinite(o16).all()
    # float32 accumulation inside: within the rounding of the output to bfloat16 (2^-8 of the largest)
    assert rel_err(o16, ref) <= 2 ** -8 + 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_low_precision_inputs(rule, form, dtype):
    inp = random_inputs(rule, B=1, T=20, seed=72, with_gate=True)
    low = {n: t.to(dtype) for n, t in inp.items()}
    ref, _ = falcon_attention(**{n: t.double() for n, t in low.items()}, rule=rule, window=3, form="recurrent")
    o, st = falcon_attention(**low, rule=rule, window=3, form=form, chunk_size=8, output_final_state=True)
    assert o.dtype == dtype and o.shape == ref.shape
    assert st.S.dtype == torch.float32  # the state is accumulated in float32
    # against float64 on the rounded inputs: float32 accumulation, and for bf16 the one rounding of the output
    # (half a bf16 step, 2^-8 of the largest output); a state or products kept in bf16 would be off by several steps
    tol = 2e-6 if dtype == torch.float32 else 2 ** -8 + 2e-6
    assert rel_err(o, ref) <= tol
    # a low-precision state continues a sequence: the continued outputs are the last steps of
    # the float64 recurrence over the whole (rounded) sequence
    more = {n: t.to(dtype) for n, t in random_inputs(rule, B=1, T=5, seed=73, with_gate=True).items()}
    o2, _ = falcon_attention(**more, rule=rule, window=3, form=form, initial_state=st)
    whole = {n: torch.cat([low[n], more[n]], dim=1).double() for n in low}
    ref_whole, _ = falcon_attention(**whole, rule=rule, window=3, form="recurrent")
    assert o2.dtype == dtype and o2.shape == ref_whole[:, 20:].shape
    assert rel_err(o2, ref_whole[:, 20:]) <= tol


@pytest.mark.parametrize("rule", ["1", "2A"])
def test_low_precision_gradients(rule):
    inp = random_inputs(rule, B=1, T=20, seed=74)
    """Each precision's gradients against float64 autograd on the same (rounded) inputs and loss: float32 to its
    accumulation error, bf16 to the rounding of the output in the loss and of each gradient (2^-8 apiece)."""
    grads = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in inp.items()}
        o, _ = falcon_attention(**leaves, rule=rule, form="chunk", chunk_size=8)
        (o.float() ** 2).sum().backward()
        for n, t in leaves.items():
            assert t.grad.dtype == dtype and torch.isfinite(t.grad).all()
        grads[dtype] = leaves
    rounded = {n: t.bfloat16().double().requires_grad_() for n, t in inp.items()}
    o, _ = falcon_attention(**rounded, rule=rule, form="chunk", chunk_size=8)
    (o.bfloat16().double() ** 2).sum().backward()
    for n in inp:
        assert rel_err(grads[torch.float32][n].grad, grads[torch.float64][n].grad) <= 4e-6, n
        assert rel_err(grads[torch.bfloat16][n].grad, rounded[n].grad) <= 2 ** -7, n


@pytest.mark.parametrize("rule", ["1", "1A", "2A"])
def test_float32_forms_keep_long_memory_after_many_resets(rule):
    """Hard resets (``log_gate = -inf``, floored at -104 per step) on the first half, then a long memory
    (``g = -3e-3``): the log prefix of the decays reaches 5e4, where a float32 prefix rounds the small decays of
    the second half away (the parallel form was off by 4e-3, one chunk of 256 by 2e-4). In float32, every form
    and chunk size agrees with the float64 recurrent form to 2e-6."""
    T = 1024
    inp = random_inputs(rule, B=1, T=T, H=1, K=8, V=8, seed=21, lam_range=(0.0, 0.0))
    inp["log_gate"] = torch.full((1, T, 1), -3e-3, dtype=torch.float64)
    inp["log_gate"][:, : T // 2] = float("-inf")
    ref, ref_state = falcon_attention(**inp, rule=rule, form="recurrent", output_final_state=True)
    low = {n: t.float() for n, t in inp.items()}
    for form, chunk_size in (("parallel", 64), ("chunk", 256), ("chunk", 64)):
        o, state = falcon_attention(**low, rule=rule, form=form, chunk_size=chunk_size, output_final_state=True)
        assert rel_err(o, ref) <= 2e-6 and rel_err(state.S, ref_state.S) <= 2e-6, (form, chunk_size)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_float32_state_carried_over_many_segments_does_not_drift(rule):
    """A long memory (``g`` down to -1e-3, carries near 1), resets at a few steps (``g = -inf``) and keys whose
    norms span 1e-3 to 1e3, a tenth of them zero, run in float32 as 64 calls of 40 steps, each continuing the state
    the last one returned (cut inside chunks of 16), in every form: against the float64 recurrence over the whole
    sequence, the outputs and the final state are within three times the error of one float32 call of the chunk
    form (itself within float32 accumulation). Rounding in the carried state compounds no more across calls than
    within one."""
    n_calls, L = 64, 40
    T = n_calls * L
    inp = random_inputs(rule, B=1, T=T, H=2, K=4, V=4, seed=75, lam_range=(0.0, 0.05), zero_key_rows=0.1)
    g = torch.Generator().manual_seed(76)
    inp["k"] = inp["k"] * 10.0 ** (6 * torch.rand(1, T, 2, 1, generator=g, dtype=torch.float64) - 3)
    gate = -1e-3 * torch.rand(1, T, 2, generator=g, dtype=torch.float64)
    gate[:, torch.randperm(T, generator=g)[:8]] = -math.inf
    inp["log_gate"] = gate
    opts = dict(rule=rule, window=3, chunk_size=16)
    ref, ref_state = falcon_attention(**inp, form="recurrent", output_final_state=True, **opts)
    low = {n: t.float() for n, t in inp.items()}
    one, one_state = falcon_attention(**low, form="chunk", output_final_state=True, **opts)
    one_err = max(rel_err(one, ref), rel_err(one_state.S, ref_state.S))
    assert one_err <= 1e-6
    for form in FORMS:
        outs, state = [], None
        for i in range(n_calls):
            o, state = falcon_attention(**{n: t[:, i * L:(i + 1) * L] for n, t in low.items()}, form=form,
                                        initial_state=state, output_final_state=True, **opts)
            outs.append(o)
        o = torch.cat(outs, 1)
        err = (rel_err(o, ref), rel_err(state.S, ref_state.S))
        assert max(err) <= 3 * one_err, (form, err, one_err)
