"""The normalized read ``o_t = S_t^T q_t / (z_t^T q_t + eps_attn)`` (``eps_attn``, Eq. 2.3 and
Appendix C.1) against textbook normalized linear attention and the float64 loop reference."""
from __future__ import annotations

import pytest
import torch
from conftest import FORMS, random_inputs, reference_falcon, rel_err
from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter

from falcon_fwa import FalconState, falcon_attention, falcon_step

KERNELS_RUN = prepare_interpreter()
INNER = ("1A", "2A", "3A")


def _positive(inp):
    """Nonnegative features (the setting in which the normalized read is safe, Appendix C.2)."""
    return dict(inp, q=inp["q"].abs() + 0.05, k=inp["k"].abs())


def _textbook(q, x, v, eps):
    """Causal normalized linear attention, one output at a time: sum_s (q_t . x_s) v_s / (sum_s q_t . x_s + eps)."""
    o = torch.zeros_like(v)
    for t in range(q.shape[1]):
        a = torch.einsum("bhk,bshk->bsh", q[:, t], x[:, :t + 1])
        o[:, t] = torch.einsum("bsh,bshv->bhv", a, v[:, :t + 1]) / (a.sum(1)[..., None] + eps)
    return o


def _normalized_reference(inp, rule, eps_attn, **kw):
    """The loop reference's read divided by the same reference run on values of one (``z`` is ``S``
    written with unit values; for 2A one ``z`` per value column, sharing that column's gains)."""
    o, S, _ = reference_falcon(**inp, rule=rule, **kw)
    den, z, _ = reference_falcon(**dict(inp, v=torch.ones_like(inp["v"])), rule=rule, **kw)
    return o / (den + eps_attn), S, z


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shift", [False, True])
def test_additive_case_is_normalized_linear_attention(form, shift):
    """eta = 1, lambda = 0: the read is textbook causal normalized linear attention, with the keys
    shifted by one step (and the sentinel x_1 = 0) under read-after-write."""
    inp = _positive(random_inputs("1A", T=29, K=6, V=5))
    q, k, v = inp["q"], inp["k"], inp["v"]
    ones, zeros = torch.ones_like(inp["lam"]), torch.zeros_like(inp["lam"])
    o, _ = falcon_attention(q, k, v, ones, zeros, rule="1A", shift=shift, normalize=False, form=form, chunk_size=8,
                            eps_attn=1e-3)
    x = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], 1) if shift else k
    ref = _textbook(q, x, v, 1e-3)
    assert rel_err(o, ref) < 1e-12
    if shift:  # the first step reads an empty memory: 0 / (0 + eps)
        assert torch.equal(o[:, 0], torch.zeros_like(o[:, 0]))


def test_rule_1a_normalizer_follows_the_papers_recurrence():
    """Appendix C.1 by hand: z_t = gamma_t exp(g_t) z_{t-1} + eta_t x_t, with eta and gamma (clamped)
    taken from the loop reference, and o_t = (S_t^T q_t) / (z_t^T q_t + eps_attn)."""
    inp = _positive(random_inputs("1A", T=31, with_gate=True, lam_range=(0.0, 4.0), seed=3))
    o_plain, _, rec = reference_falcon(**inp, rule="1A")
    assert rec["clamped_fraction"] > 0  # the clamp takes part
    k, q = inp["k"], inp["q"]
    x = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], 1)
    z = torch.zeros_like(k[:, 0])
    den = torch.zeros_like(inp["lam"])
    for t in range(k.shape[1]):
        z = (rec["gamma"][:, t] * inp["log_gate"][:, t].exp())[..., None] * z + rec["eta"][:, t, :, None] * x[:, t]
        den[:, t] = (z * q[:, t]).sum(-1)
    o, st = falcon_attention(**inp, rule="1A", eps_attn=0.01, output_final_state=True)
    assert rel_err(o, o_plain / (den[..., None] + 0.01)) < 1e-12
    assert rel_err(st.z, z) < 1e-12


@pytest.mark.parametrize("rule", INNER)
@pytest.mark.parametrize("form", FORMS)
def test_forms_match_the_reference(rule, form):
    inp = _positive(random_inputs(rule, T=33, with_gate=True, seed=1))
    ref, S_ref, z_ref = _normalized_reference(inp, rule, 0.05, window=3)
    o, st = falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=8, eps_attn=0.05,
                             output_final_state=True)
    assert rel_err(o, ref) < 1e-11
    assert rel_err(st.S, S_ref) < 1e-11
    # the normalizer state: [B, H, K], or one column per value column for 2A (every column of z_ref is z for 1A/3A)
    assert rel_err(st.z, z_ref if rule == "2A" else z_ref[..., 0]) < 1e-11
    assert st.z.shape == ((2, 2, 5, 4) if rule == "2A" else (2, 2, 5))


@pytest.mark.parametrize("rule", INNER)
def test_continuation_step_and_packing_are_exact(rule):
    """Two segments with the state carried, one token at a time with falcon_step, and packed
    sequences (cu_seqlens) all give the one-call result."""
    inp = _positive(random_inputs(rule, T=30, seed=2))
    kw = dict(rule=rule, window=3, eps_attn=0.02)
    full, st_full = falcon_attention(**inp, **kw, output_final_state=True)
    a = {n: t[:, :13] for n, t in inp.items()}
    b = {n: t[:, 13:] for n, t in inp.items()}
    o1, st = falcon_attention(**a, **kw, output_final_state=True)
    o2, st = falcon_attention(**b, **kw, initial_state=st, output_final_state=True)
    assert rel_err(torch.cat([o1, o2], 1), full) < 1e-12
    assert rel_err(st.z, st_full.z) < 1e-12 and rel_err(st.S, st_full.S) < 1e-12
    state, outs = None, []
    for t in range(30):
        o_t, state = falcon_step(*(inp[n][:, t] for n in ("q", "k", "v", "beta", "lam")), state=state, **kw)
        outs.append(o_t)
    assert rel_err(torch.stack(outs, 1), full) < 1e-12
    assert rel_err(state.z, st_full.z) < 1e-12
    packed = {n: t.reshape(1, -1, *t.shape[2:]) for n, t in inp.items()}
    o_p, st_p = falcon_attention(**packed, **kw, cu_seqlens=torch.tensor([0, 30, 60]), output_final_state=True)
    assert rel_err(o_p.reshape(full.shape), full) < 1e-12
    assert rel_err(st_p.z, st_full.z) < 1e-12


def test_gradients_match_finite_differences():
    inp = _positive(random_inputs("3A", B=1, T=11, H=1, K=3, V=2, with_gate=True, seed=4))
    names = ("q", "k", "v", "beta", "lam")
    args = [inp[n].clone().requires_grad_(True) for n in names]

    def fn(*xs):
        return falcon_attention(*xs, rule="3A", window=2, chunk_size=4, log_gate=inp["log_gate"], eps_attn=0.3)[0]

    assert torch.autograd.gradcheck(fn, args)


def test_state_kinds_do_not_mix_and_errors_name_the_argument():
    inp = _positive(random_inputs("1A", T=6))
    _, plain = falcon_attention(**inp, rule="1A", output_final_state=True)
    _, normed = falcon_attention(**inp, rule="1A", eps_attn=0.1, output_final_state=True)
    with pytest.raises(ValueError, match="initial_state has no read normalizer z"):
        falcon_attention(**inp, rule="1A", eps_attn=0.1, initial_state=plain)
    with pytest.raises(ValueError, match="initial_state carries the read normalizer z"):
        falcon_attention(**inp, rule="1A", initial_state=normed)
    step = {n: inp[n][:, 0] for n in ("q", "k", "v", "beta", "lam")}
    with pytest.raises(ValueError, match="state carries the read normalizer z"):
        falcon_step(**step, state=normed, rule="1A")
    bad = FalconState(rule="1A", window=1, shift=True, S=normed.S, last_key=normed.last_key, z=normed.z[:, :, :2])
    with pytest.raises(ValueError, match=r"initial_state\.z must have shape \[B, H, K\]"):
        falcon_attention(**inp, rule="1A", eps_attn=0.1, initial_state=bad)
    for eps in (-1.0, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="eps_attn must be a finite number >= 0"):
            falcon_attention(**inp, rule="1A", eps_attn=eps)
    with pytest.raises(ValueError, match="eps_attn .* applies to the inner-product rules"):
        falcon_attention(**random_inputs("1", T=6), rule="1", eps_attn=0.1)
    with pytest.raises(ValueError, match=r"v must have shape \[B, T, H, V\].*got \(2, 5, 2, 4\)"):
        falcon_attention(**dict(inp, v=inp["v"][:, :5]), rule="1A", eps_attn=0.1)
    assert normed.index_select(torch.tensor([1])).z.shape[0] == 1
    assert FalconState.cat([normed, normed]).z.shape[0] == 4 and not normed.detach().z.requires_grad


def _large_denominator_inputs(rule, B=1, T=40, H=1, K=16, V=4):
    """Linear attention (eta = beta, lambda = 0) whose denominator z_t^T q_t passes float16's largest
    value, 65504, within a few steps, while the read, an average of the values, stays near 3."""
    g = torch.Generator().manual_seed(11)
    q, k = (0.5 + torch.rand(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = 3 + torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta = torch.full((B, T, H, V) if rule == "2A" else (B, T, H), 300.0, dtype=torch.float64)
    return dict(q=q, k=k, v=v, beta=beta, lam=torch.zeros(B, T, H, dtype=torch.float64))


@pytest.mark.parametrize("rule", INNER)
def test_float16_read_does_not_overflow(rule):
    """Numerator and denominator each pass float16's range long before their ratio does; float16
    inputs give the float64 read to float16 precision (not inf or NaN), sequence and step alike."""
    inp = _large_denominator_inputs(rule)
    kw = dict(rule=rule, window=3, shift=False, normalize=False, eps_attn=1e-3)
    ref, _ = falcon_attention(**inp, **kw)
    half = {n: t.half() for n, t in inp.items()}
    o, st = falcon_attention(**half, **kw, backend="torch", output_final_state=True)
    assert o.dtype == torch.float16 and rel_err(o, ref) < 5e-3
    state, outs = None, []
    for t in range(inp["q"].shape[1]):
        o_t, state = falcon_step(*(half[n][:, t] for n in ("q", "k", "v", "beta", "lam")), state=state,
                                 backend="torch", **kw)
        outs.append(o_t)
    assert torch.stack(outs, 1).dtype == torch.float16 and rel_err(torch.stack(outs, 1), ref) < 5e-3


def test_state_errors_name_the_callers_value_width():
    """A state of another batch size or window tail is reported with the caller's V, not the
    extended width of the values of ones."""
    inp = _positive(random_inputs("3A", T=6))
    _, st = falcon_attention(**inp, rule="3A", window=3, eps_attn=0.1, output_final_state=True)
    one = {n: t[:1] for n, t in inp.items()}
    with pytest.raises(ValueError, match=r"initial_state\.S must have shape \[B, H, K, V\] = \(1, 2, 5, 4\), "
                                         r"got \(2, 2, 5, 4\)"):
        falcon_attention(**one, rule="3A", window=3, eps_attn=0.1, initial_state=st)
    with pytest.raises(ValueError, match=r"state\.S must have shape \[B, H, K, V\] = \(1, 2, 5, 4\)"):
        falcon_step(*(one[n][:, 0] for n in ("q", "k", "v", "beta", "lam")), state=st, rule="3A", window=3,
                    eps_attn=0.1)
    bad = FalconState(**{**st.__dict__, "tail_y": st.tail_y[..., :2]})
    with pytest.raises(ValueError, match=r"tail_y must have shape .* = \(2, 2, 2, 4\), got \(2, 2, 2, 2\)"):
        falcon_attention(**inp, rule="3A", window=3, eps_attn=0.1, initial_state=bad)


def test_detach_cuts_z_from_the_graph():
    inp = {n: t.requires_grad_(True) for n, t in _positive(random_inputs("1A", T=6)).items()}
    _, st = falcon_attention(**inp, rule="1A", eps_attn=0.1, output_final_state=True)
    assert st.z.requires_grad and not st.detach().z.requires_grad


@pytest.mark.parametrize("rule", INNER)
def test_trace_continues_a_normalized_read_state(rule):
    """falcon_trace from the state of a call with eps_attn: the learner's S is that of the
    denominator-free call, so the trace is the same as from that call's state."""
    from falcon_fwa import falcon_trace

    inp = _positive(random_inputs(rule, T=12, seed=8))
    a = {n: t[:, :5] for n, t in inp.items()}
    _, plain = falcon_attention(**a, rule=rule, window=3, output_final_state=True)
    _, normed = falcon_attention(**a, rule=rule, window=3, eps_attn=0.1, output_final_state=True)
    rest = [inp[n][:, 5:] for n in ("k", "v", "beta", "lam")]
    want = falcon_trace(*rest, rule=rule, window=3, initial_state=plain)
    got = falcon_trace(*rest, rule=rule, window=3, initial_state=normed)
    assert torch.allclose(got.loss, want.loss, rtol=1e-12) and torch.equal(got.eta, want.eta)


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("rule", INNER)
def test_kernels_float16_read_does_not_overflow(rule):
    """The chunk kernels (the interpreter on a CPU) with float16 inputs whose numerator and
    denominator pass float16's range: the read stays finite and equal to the float64 one."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    inp = _large_denominator_inputs(rule, T=20)
    kw = dict(rule=rule, window=2, shift=False, normalize=False, eps_attn=1e-3, chunk_size=16)
    ref, _ = falcon_attention(**inp, **kw, backend="torch")
    o, _ = falcon_attention(**{n: t.half().to(dev) for n, t in inp.items()}, **kw, backend="triton")
    assert o.dtype == torch.float16 and rel_err(o.cpu(), ref) < 5e-3


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("rule", INNER)
def test_kernels_take_the_normalized_read(rule):
    """The Triton chunk kernels (the interpreter on a CPU) give the PyTorch forms' normalized read
    and state, with a continued segment."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    inp = {n: t.float().to(dev) for n, t in _positive(random_inputs(rule, T=21, K=16, V=16, seed=5)).items()}
    kw = dict(rule=rule, window=2, chunk_size=16, eps_attn=0.05, output_final_state=True)
    ref, st_ref = falcon_attention(**{n: t.double() for n, t in inp.items()}, **kw, backend="torch")
    a = {n: t[:, :9] for n, t in inp.items()}
    b = {n: t[:, 9:] for n, t in inp.items()}
    o1, st = falcon_attention(**a, **kw, backend="triton")
    o2, st = falcon_attention(**b, **kw, initial_state=st, backend="triton")
    assert rel_err(torch.cat([o1, o2], 1), ref) < 1e-4
    assert rel_err(st.z, st_ref.z) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels and the fused step are checked on a GPU")
@pytest.mark.parametrize("rule", INNER)
def test_gpu_bf16_chunk_and_fused_step(rule):
    """On a GPU: bf16 inputs through the chunk kernels (the value rows extended by z's columns and padded
    to a multiple of 16) and one token at a time through falcon_step (the fused step kernel for 1A)
    against float64."""
    inp = _positive(random_inputs(rule, B=2, T=150, H=4, K=64, V=64, seed=6))
    kw = dict(rule=rule, window=4, eps_attn=0.05)
    ref, st_ref = falcon_attention(**inp, **kw, output_final_state=True)
    dev = {n: t.cuda() for n, t in inp.items()}
    o, st = falcon_attention(**{n: t.bfloat16() for n, t in dev.items()}, **kw, output_final_state=True)
    assert rel_err(o.cpu(), ref) < 1e-2 and rel_err(st.z.cpu(), st_ref.z) < 1e-2
    state, outs = None, []
    for t in range(150):
        o_t, state = falcon_step(*(dev[n][:, t].float() for n in ("q", "k", "v", "beta", "lam")), state=state, **kw)
        outs.append(o_t)
    assert rel_err(torch.stack(outs, 1).cpu(), ref) < 1e-4 and rel_err(state.z.cpu(), st_ref.z) < 1e-4


@pytest.mark.parametrize("rule", INNER)
def test_the_empty_memory_is_read_at_the_steps_the_docs_name(rule):
    """docs/ops.md: a fresh sequence reads the empty memory, ``0 / (0 + eps_attn)``, at its first step with
    ``shift=True`` (the sentinel writes nothing) or ``read="before"``, and at its first two with both (step 2
    reads ``S_1``): NaN at ``eps_attn = 0``, exactly 0 above it, and finite from the first written state on."""
    inp = _positive(random_inputs(rule, T=6, seed=91))
    for shift, read, empty in ((False, "after", 0), (True, "after", 1), (False, "before", 1), (True, "before", 2)):
        for form in FORMS:
            kw = dict(rule=rule, shift=shift, read=read, form=form, chunk_size=4)
            o, _ = falcon_attention(**inp, eps_attn=0.0, **kw)
            assert o[:, :empty].isnan().all() and o[:, empty:].isfinite().all(), (shift, read, form)
            o, _ = falcon_attention(**inp, eps_attn=0.1, **kw)
            assert torch.equal(o[:, :empty], torch.zeros_like(o[:, :empty])) and o[:, empty:].abs().amin() > 0


def test_a_bfloat16_read_divides_in_float32():
    """Hand-computed: one step of linear attention (1A, unshifted, eta = 1, lambda = 0) with q = k = v = 1 reads
    S_1^T q = 1 over z_1^T q = 1, so o = 1 / (1 + eps_attn). With eps_attn = 0.003, 1.003 is 1 in bfloat16: a
    division in bfloat16 would give 1.0, while 1 / 1.003 = 0.99701 rounds to bfloat16's 0.99609375 (= 1 - 2^-8)."""
    one = torch.ones(1, 1, 1, 1, dtype=torch.bfloat16)
    beta, lam = torch.ones(1, 1, 1, dtype=torch.bfloat16), torch.zeros(1, 1, 1, dtype=torch.bfloat16)
    want = torch.tensor(1 / 1.003, dtype=torch.float64).to(torch.bfloat16)
    assert want.item() == 1 - 2 ** -8
    for form in FORMS:
        o, _ = falcon_attention(one, one, one, beta, lam, rule="1A", shift=False, normalize=False, form=form,
                                eps_attn=0.003, backend="torch")
        assert o.dtype == torch.bfloat16 and o.item() == want.item(), form
    o, _ = falcon_step(one[:, 0], one[:, 0], one[:, 0], beta[:, 0], lam[:, 0], rule="1A", shift=False,
                       normalize=False, eps_attn=0.003, backend="torch")
    assert o.item() == want.item()
