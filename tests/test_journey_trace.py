"""docs/ops.md's "The learner, step by step", "The normalized read" and "Precision", checked against a float64
learner written here from the paper's equations alone: the ridge NLMS step of Eqs. 3.3-3.4, its per-column
(4.7, 4.9) and windowed (4.14, 4.18) forms, the positive-decay clamp of Eq. 4.20 and the normalizer of C.1."""
from __future__ import annotations

import math

import pytest
import torch

from falcon_fwa import FalconState, falcon_attention, falcon_step, falcon_trace

RULES = ("1", "2", "3", "1A", "2A", "3A")
PER_COLUMN, SLIDING, REGRESSION = {"2", "2A"}, {"3", "3A"}, {"1", "2", "3"}


def paper_learner(k, v, beta, lam, *, rule, window=4, eps=1e-6, decay_floor=1e-3, shift=True, normalize=True,
                  log_gate=None, scale_ridge=False, S0=None):
    """One head at a time, one step at a time, in float64. Pairs ``(x_t, y_t) = (k_{t-1}, v_t)`` (or ``(k_t, v_t)``
    unshifted), the sentinel ``x_1 = 0`` taking no step; the window ``I_t`` holds the last ``window`` real pairs;
    ``E_t`` is ``||x_t||^2``, ``lambda_max(X^T X) / B_t`` (rule 3) or the window's mean energy (3A); the ridge
    ``lambda_t = lam_t`` (times ``E_t`` with ``scale_ridge``); ``eta_t = beta_t / (E_t + lambda_t + eps)`` (0 where
    that is 0; ``beta_t`` unnormalized); ``alpha_t = min(eta_t lambda_t, 1 - floor)``, ``gamma_t = 1 - alpha_t``;
    ``S' = exp(g_t) S_{t-1}``, ``p_t = S'^T x_t``; ``S_t = gamma_t S' + X^T (eta_t / B_t (Y - X S'))`` for the
    regression rules, ``... Y`` for the inner-product ones (per value column for 2 and 2A)."""
    k, v, beta, lam = (t.double() for t in (k, v, beta, lam))
    B, T, H, _ = k.shape
    V = v.shape[-1]
    step_shape = (B, T, H, V) if rule in PER_COLUMN else (B, T, H)
    out = dict(eta=torch.zeros(step_shape, dtype=torch.float64), gamma=torch.ones(step_shape, dtype=torch.float64),
               clamped=torch.zeros(step_shape, dtype=torch.bool),
               prediction=torch.zeros(B, T, H, V, dtype=torch.float64),
               valid=torch.ones(B, T, dtype=torch.bool), S=torch.zeros(B, H, k.shape[-1], V, dtype=torch.float64))
    width = window if rule in SLIDING else 1
    for b in range(B):
        for h in range(H):
            S = torch.zeros(k.shape[-1], V, dtype=torch.float64) if S0 is None else S0[b, h].double().clone()
            pairs = []
            for t in range(T):
                if log_gate is not None:
                    S = math.exp(float(log_gate[b, t, h])) * S
                if shift and t == 0:
                    out["valid"][b, t] = False
                    continue
                x, y = (k[b, t - 1, h] if shift else k[b, t, h]), v[b, t, h]
                out["prediction"][b, t, h] = S.T @ x
                pairs = (pairs + [(x, y)])[-width:]
                X, Y = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
                if rule == "3":
                    E = float(torch.linalg.eigvalsh(X @ X.T).max()) / len(pairs)
                elif rule == "3A":
                    E = float((X * X).sum()) / len(pairs)
                else:
                    E = float(x @ x)
                ridge = float(lam[b, t, h]) * (E if scale_ridge else 1.0)
                gain = beta[b, t, h]
                denom = E + ridge + eps
                eta = (gain / denom if denom != 0 else torch.zeros_like(gain)) if normalize else gain.clone()
                gamma = 1 - torch.clamp(eta * ridge, max=1 - decay_floor)
                out["eta"][b, t, h], out["gamma"][b, t, h] = eta, gamma
                out["clamped"][b, t, h] = eta * ridge >= 1 - decay_floor
                target = Y - X @ S if rule in REGRESSION else Y
                S = S * gamma.reshape(-1) + X.T @ (target * eta.reshape(-1) / len(pairs))
            out["S"][b, h] = S
    return out


def _inputs(rule, *, T=13, B=2, H=2, K=4, V=3, seed=0, positive=False):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    q = torch.randn(B, T, H, K, generator=g, dtype=torch.float64)
    if positive:  # nonnegative features, where the normalized read is safe (Appendix C.2)
        k, q = k.abs(), q.abs() + 0.05
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = 2 * torch.rand((B, T, H, V) if rule in PER_COLUMN else (B, T, H), generator=g, dtype=torch.float64)
    lam = 3 * torch.rand(B, T, H, generator=g, dtype=torch.float64)
    gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    return q, k, v, beta, lam, gate


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _check_trace(trace, ref, v):
    close = dict(rtol=1e-9, atol=1e-12)
    for name in ("eta", "gamma", "prediction"):
        assert torch.allclose(getattr(trace, name), ref[name], **close), name
    assert torch.equal(trace.clamped, ref["clamped"]) and torch.equal(trace.valid, ref["valid"])
    ok = ref["valid"]
    residual = v - ref["prediction"]
    assert torch.allclose(trace.residual[ok], residual[ok], **close) and trace.residual[~ok].isnan().all()
    assert torch.allclose(trace.loss[ok], 0.5 * residual.square().sum(-1)[ok], **close)
    assert trace.loss[~ok].isnan().all()


CASES = {
    "plain": dict(),
    "floor 0.4": dict(decay_floor=0.4),
    "scale_ridge": dict(scale_ridge=True, lam_scale=0.3),
    "unnormalized": dict(normalize=False, lam_scale=0.3),
    "unshifted, gated": dict(shift=False, gate=True),
    "hard resets": dict(gate="resets", window=2),
    "eps 0, zero keys and ridges": dict(eps=0.0, zeros=True),
    "window 1": dict(window=1, gate=True),
    "window 5, unshifted, scaled": dict(window=5, shift=False, scale_ridge=True, decay_floor=0.2, lam_scale=0.5),
}


@pytest.mark.parametrize("rule", RULES)
def test_every_traced_field_is_the_papers_learner(rule):
    """Each field ``falcon_trace`` reports (eta, gamma, clamped where ``eta_t lambda_t >= 1 - decay_floor``, the
    memory's prediction before the write, residual, loss, valid) is the paper's learner's, over the switches that
    shape the writes, on inputs where the clamp holds at some steps and not at others."""
    for name, case in CASES.items():
        case = dict(case)
        _, k, v, beta, lam, gate = _inputs(rule, seed=len(name))
        lam = lam * case.pop("lam_scale", 1.0)
        kind = case.pop("gate", None)
        if kind == "resets":
            gate = gate.clone()
            gate[:, 4] = -math.inf
            gate[1, 9] = -math.inf
        if case.pop("zeros", False):
            k = k.clone()
            k[:, 3:6] = 0
            lam = lam.clone()
            lam[:, 2:7] = 0
        kw = dict(rule=rule, log_gate=gate if kind else None, **{"window": 3, **case})
        ref = paper_learner(k, v, beta, lam, **kw)
        trace = falcon_trace(k, v, beta, lam, chunk_size=4, **kw)
        try:
            _check_trace(trace, ref, v)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        if name == "plain":
            assert ref["clamped"].any() and not ref["clamped"][ref["valid"]].all()


@pytest.mark.parametrize("rule", ["1", "3", "3A"])
@pytest.mark.parametrize("cut", [1, 2])
def test_a_trace_continued_right_after_the_sentinel(rule, cut):
    """A segment of one step (the sentinel alone) or two passes on its last key and a window holding no or one
    real pair: the continued trace is the whole sequence's learner from there on."""
    _, k, v, beta, lam, gate = _inputs(rule, seed=40 + cut)
    kw = dict(rule=rule, window=3)
    ref = paper_learner(k, v, beta, lam, log_gate=gate, **kw)
    head = [t[:, :cut] for t in (k, k, v, beta, lam)]
    _, state = falcon_attention(*head, log_gate=gate[:, :cut], output_final_state=True, **kw)
    trace = falcon_trace(k[:, cut:], v[:, cut:], beta[:, cut:], lam[:, cut:], log_gate=gate[:, cut:],
                         initial_state=state, chunk_size=4, **kw)
    _check_trace(trace, {n: t[:, cut:] for n, t in ref.items() if n != "S"}, v[:, cut:])
    assert trace.valid.all()


@pytest.mark.parametrize("rule", ["1A", "2A", "3A"])
@pytest.mark.parametrize("shift", [True, False])
def test_a_normalized_read_from_given_memory_packed_and_stepped(rule, shift):
    """``o_t = S_t^T q_t / (z_t^T q_t + eps_attn)`` where ``z`` is the learner run on values of one (per column
    for 2A), from given fast weights ``S`` and normalizer ``z`` (``FalconState.fresh``), for three packed
    sequences (``cu_seqlens``) with gates and the clamp, and one token at a time with ``falcon_step``."""
    q, k, v, beta, lam, gate = _inputs(rule, B=1, T=16, seed=50, positive=True)
    lam = 10 * lam  # ridges up to 30: the clamp holds at some steps
    H, K, V, eps_attn = 2, 4, 3, 1e-2
    cu = torch.tensor([0, 5, 12, 16])
    g = torch.Generator().manual_seed(51)
    S0 = torch.randn(3, H, K, V, generator=g, dtype=torch.float64)
    z0 = torch.rand((3, H, K, V) if rule == "2A" else (3, H, K), generator=g, dtype=torch.float64)
    kw = dict(rule=rule, window=3, shift=shift)
    state = FalconState.fresh(S0, z=z0, **kw)
    o, final = falcon_attention(q, k, v, beta, lam, log_gate=gate, eps_attn=eps_attn, cu_seqlens=cu,
                                initial_state=state, output_final_state=True, chunk_size=4, **kw)
    clamped = False
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        zn = z0[n:n + 1] if rule == "2A" else z0[n:n + 1, ..., None].expand(1, H, K, V)
        for t in range(a, b):
            part = [x[:, a:t + 1] for x in (k, v, beta, lam, gate)]
            mem = paper_learner(*part[:4], log_gate=part[4], S0=S0[n:n + 1], **kw)
            norm = paper_learner(part[0], torch.ones_like(part[1]), *part[2:4], log_gate=part[4], S0=zn, **kw)
            want = (torch.einsum("hkv,hk->hv", mem["S"][0], q[0, t])
                    / (torch.einsum("hkv,hk->hv", norm["S"][0], q[0, t]) + eps_attn))
            assert torch.allclose(o[0, t], want, rtol=1e-9, atol=1e-12), (n, t)
            clamped = clamped or bool(mem["clamped"].any())
        z = final.z[n] if rule == "2A" else final.z[n][..., None].expand(H, K, V)
        assert torch.allclose(z, norm["S"][0], rtol=1e-9, atol=1e-12)
    assert clamped
    st = FalconState.fresh(S0[1:2], z=z0[1:2], **kw)
    for t in range(5, 12):
        o_t, st = falcon_step(q[:, t], k[:, t], v[:, t], beta[:, t], lam[:, t], state=st, log_gate=gate[:, t],
                              eps_attn=eps_attn, **kw)
        assert torch.allclose(o_t, o[:, t], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("rule", RULES)
def test_float16_and_mixed_inputs_compute_as_documented(rule):
    """float16 inputs compute in float32 and give float16 outputs in every form and ``falcon_step``: within one
    float16 rounding of the output (2^-11 of the largest) of the float64 learner on the same rounded inputs, the
    state in float32 to its accumulation error. A float64 input among float32 ones makes the computation float64
    (the state float64, the output in ``v``'s float32, to its one rounding)."""
    q, k, v, beta, lam, gate = _inputs(rule, B=1, T=12, seed=60, positive=True)
    half = [t.half() for t in (q, k, v, beta, lam, gate)]
    wide = [t.double() for t in half]
    kw = dict(rule=rule, window=3)
    ref = paper_learner(*wide[1:5], log_gate=wide[5], **kw)
    o_ref, _ = falcon_attention(*wide[:5], log_gate=wide[5], form="recurrent", **kw)
    # the read S_T^T q_T of the last step is the paper learner's, independent of the op
    assert torch.allclose(o_ref[:, -1], torch.einsum("bhkv,bhk->bhv", ref["S"], wide[0][:, -1]), rtol=1e-10)
    for form in ("recurrent", "parallel", "chunk"):
        o, st = falcon_attention(*half[:5], log_gate=half[5], form=form, chunk_size=4, output_final_state=True, **kw)
        assert o.dtype == torch.float16 and st.S.dtype == torch.float32, form
        assert _rel(o, o_ref) <= 2 ** -11 + 1e-6 and _rel(st.S, ref["S"]) <= 1e-6, form
    st = None
    for t in range(12):
        o_t, st = falcon_step(*(x[:, t] for x in half[:5]), state=st, log_gate=half[5][:, t], **kw)
    assert o_t.dtype == torch.float16 and st.S.dtype == torch.float32 and _rel(st.S, ref["S"]) <= 1e-6
    mixed = [t.float() for t in (q, k, v)] + [beta, lam.float()]  # beta alone in float64
    o, st = falcon_attention(*mixed, form="chunk", chunk_size=4, output_final_state=True, **kw)
    ref = paper_learner(*(t.double() for t in mixed[1:]), **kw)
    assert o.dtype == torch.float32 and st.S.dtype == torch.float64
    assert torch.allclose(st.S, ref["S"], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("rule", ["1", "2A", "3A"])
def test_the_clamp_at_every_step_under_deep_gates_stays_at_float32_accuracy(rule):
    """docs/ops.md (chunk-local log-space decays): with ``eta_t lambda_t > 1`` at every step (``gamma_t`` at the
    floor) and gates down to -20, the float32 chunk form stays within float32 accumulation (measured 5e-8 to
    6.4e-7) of the float64 recurrence on the same inputs, with nothing overflowing: the decay product over one chunk
    (below 1e-190) is far outside float32's range."""
    T, H, K, V = 2048, 2, 4, 4
    g = torch.Generator().manual_seed(70)
    q, k = (torch.randn(1, T, H, K, generator=g) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=g)
    beta = 1.5 + 0.4 * torch.rand((1, T, H, V) if rule in PER_COLUMN else (1, T, H), generator=g)
    lam = 1e3 * (1 + torch.rand(1, T, H, generator=g))
    gate = -20 * torch.rand(1, T, H, generator=g)
    inp = [t.double() for t in (q, k, v, beta, lam, gate)]
    # every real step clamps: eta lam = beta lam / (E + lam + eps) >= 1.5 / (1 + max ||k||^2 / min lam) > 1 - floor
    # (E_t, one key's energy or a window's mean, is at most the largest key's)
    assert 1.5 / (1 + (k.square().sum(-1).amax() + 1e-6) / lam.amin()) > 1
    kw = dict(rule=rule, window=3, decay_floor=1e-3)
    ref, _ = falcon_attention(*inp[:5], log_gate=inp[5], form="recurrent", **kw)
    o, _ = falcon_attention(q, k, v, beta, lam, log_gate=gate, form="chunk", chunk_size=64, **kw)
    assert o.dtype == torch.float32 and torch.isfinite(o).all()
    assert _rel(o, ref) <= 1e-6
