"""Exact continuation through FalconState, the one-token decode step and packed
variable-length sequences."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import FORMS, RULE_NAMES, SLIDING, random_inputs, reference_falcon, rel_err

from falcon_fwa import FalconState, falcon_attention, falcon_step
from falcon_fwa.ops.state import TENSOR_FIELDS

TOL = 1e-10


def _segment(inp, a, b):
    return {name: t[:, a:b] for name, t in inp.items()}


def _random_cuts(T, n_segments, seed):
    rng = random.Random(seed)
    return sorted(rng.sample(range(1, T), n_segments - 1))


def _chained(inp, cuts, **options):
    bounds = [0, *cuts, inp["q"].shape[1]]
    outs, state = [], None
    for a, b in zip(bounds, bounds[1:]):
        o, state = falcon_attention(**_segment(inp, a, b), initial_state=state, output_final_state=True, **options)
        outs.append(o)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_continuation(rule, form):
    inp = random_inputs(rule, B=2, T=31, seed=41, lam_range=(0.0, 3.0))
    options = dict(rule=rule, window=4, form=form, chunk_size=4)
    full, full_state = falcon_attention(**inp, output_final_state=True, **options)
    # several random splits, including segments of length 1 and shorter than the window
    for trial, cuts in enumerate([_random_cuts(31, 5, trial) for trial in range(3)] + [[1, 2, 3], [30]]):
        out, state = _chained(inp, cuts, **options)
        assert rel_err(out, full) <= TOL, f"cuts {cuts}"
        assert rel_err(state.S, full_state.S) <= TOL
        # what the next segment continues from: the last key (the next pair's x) and the window's tail
        assert torch.equal(state.last_key, full_state.last_key) and torch.equal(state.last_key, inp["k"][:, -1])
        if rule in SLIDING:
            assert torch.equal(state.tail_valid, full_state.tail_valid)
            for name in ("tail_x", "tail_y"):
                assert torch.equal(getattr(state, name), getattr(full_state, name)), name


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize(
    "options",
    [dict(shift=False), dict(read="before"), dict(scale_ridge=True), dict()],
    ids=["no_shift", "read_before", "scale_ridge", "log_gate"],
)
def test_continuation_switches(rule, options):
    inp = random_inputs(rule, B=1, T=23, seed=42, with_gate=not options)
    for form in FORMS:
        opts = dict(rule=rule, window=3, form=form, chunk_size=4, **options)
        full, _ = falcon_attention(**inp, **opts)
        out, _ = _chained(inp, _random_cuts(23, 4, 7), **opts)
        assert rel_err(out, full) <= TOL, form


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_continuation_across_forms(rule):
    """A state made by one form continues exactly in another."""
    inp = random_inputs(rule, B=1, T=20, seed=43)
    full, _ = falcon_attention(**inp, rule=rule, window=3, form="recurrent")
    first, state = falcon_attention(**_segment(inp, 0, 9), rule=rule, window=3, form="chunk", chunk_size=4,
                                    output_final_state=True)
    second, _ = falcon_attention(**_segment(inp, 9, 20), rule=rule, window=3, form="parallel", initial_state=state)
    assert rel_err(torch.cat([first, second], 1), full) <= TOL


@pytest.mark.parametrize("rule", SLIDING)
def test_poisoned_empty_tail_slots_do_not_leak(rule):
    # A first segment of one step leaves a tail of window-1 slots that hold no pair.
    inp = random_inputs(rule, B=1, T=12, seed=44)
    _, state = falcon_attention(**_segment(inp, 0, 1), rule=rule, window=4, output_final_state=True)
    assert not state.tail_valid.any()
    clean, _ = falcon_attention(**_segment(inp, 1, 12), rule=rule, window=4, initial_state=state)
    poisoned = FalconState(rule=state.rule, window=state.window, shift=state.shift, S=state.S,
                           last_key=state.last_key, tail_x=torch.full_like(state.tail_x, float("nan")),
                           tail_y=torch.full_like(state.tail_y, float("nan")), tail_valid=state.tail_valid)
    for form in FORMS:
        o, _ = falcon_attention(**_segment(inp, 1, 12), rule=rule, window=4, form=form, chunk_size=4,
                                initial_state=poisoned)
        assert torch.isfinite(o).all() and rel_err(o, clean) <= TOL


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_step_equals_recurrent(rule):
    inp = random_inputs(rule, B=2, T=12, seed=45, with_gate=True)
    options = dict(rule=rule, window=3, read="before" if rule == "2" else "after")
    full, full_state = falcon_attention(**inp, form="recurrent", output_final_state=True, **options)
    state, sizes = None, set()
    for t in range(12):
        tok = {name: x[:, t] for name, x in inp.items()}
        o_t, state = falcon_step(**tok, state=state, **options)
        assert o_t.shape == full[:, t].shape
        assert rel_err(o_t, full[:, t]) <= 1e-13
        # O(1): the state does not grow with the number of tokens seen
        sizes.add(tuple((name, tuple(x.shape)) for name, x in vars(state).items() if torch.is_tensor(x)))
    assert len(sizes) == 1
    assert rel_err(state.S, full_state.S) <= 1e-13


def test_step_after_prefill():
    inp = random_inputs("3", B=1, T=15, seed=46)
    full, _ = falcon_attention(**inp, rule="3", window=4, form="recurrent")
    _, state = falcon_attention(**_segment(inp, 0, 10), rule="3", window=4, form="chunk", chunk_size=4,
                                output_final_state=True)
    for t in range(10, 15):
        o_t, state = falcon_step(**{n: x[:, t] for n, x in inp.items()}, state=state, rule="3", window=4)
        assert rel_err(o_t, full[:, t]) <= TOL


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", ["1", "3A", "2"])
def test_varlen_equals_separate_runs(rule, form):
    lengths = [5, 1, 9, 4]
    inp = random_inputs(rule, B=1, T=sum(lengths), seed=47, with_gate=True)
    cu = torch.tensor([0, 5, 6, 15, 19])
    options = dict(rule=rule, window=3, form=form, chunk_size=4)
    # fresh sequences
    packed, packed_state = falcon_attention(**inp, cu_seqlens=cu, output_final_state=True, **options)
    states = []
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, st = falcon_attention(**_segment(inp, a, b), output_final_state=True, **options)
        assert rel_err(packed[:, a:b], o) <= TOL
        states.append(st)
    assert rel_err(packed_state.S, FalconState.cat(states).S) <= TOL
    # continued sequences, one initial state per sequence
    more = random_inputs(rule, B=1, T=sum(lengths), seed=48, with_gate=True)
    packed2, _ = falcon_attention(**more, cu_seqlens=cu, initial_state=packed_state, **options)
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        o, _ = falcon_attention(**_segment(more, a, b), initial_state=states[n], **options)
        assert rel_err(packed2[:, a:b], o) <= TOL


def test_state_helpers():
    inp = random_inputs("3A", B=3, T=10, seed=49)
    _, st = falcon_attention(**inp, rule="3A", window=3, output_final_state=True)
    idx = torch.tensor([2, 0])
    sel = st.index_select(idx)
    assert torch.equal(sel.S, st.S[idx]) and torch.equal(sel.tail_x, st.tail_x[idx])
    assert torch.equal(sel.tail_valid, st.tail_valid[idx]) and torch.equal(sel.last_key, st.last_key[idx])
    both = FalconState.cat([sel, st])
    assert both.batch_size == 5 and torch.equal(both.S[2:], st.S)
    # continuing the selected rows equals continuing those rows of the batch
    more = random_inputs("3A", B=3, T=6, seed=50)
    o_all, _ = falcon_attention(**more, rule="3A", window=3, initial_state=st)
    o_sel, _ = falcon_attention(**{n: x[idx] for n, x in more.items()}, rule="3A", window=3, initial_state=sel)
    assert rel_err(o_sel, o_all[idx]) <= TOL


def test_detach_cuts_the_graph():
    inp = random_inputs("1", B=1, T=6, seed=51)
    k = inp["k"].clone().requires_grad_()
    _, st = falcon_attention(inp["q"], k, inp["v"], inp["beta"], inp["lam"], rule="1", output_final_state=True)
    assert st.S.requires_grad and st.last_key.requires_grad
    d = st.detach()
    assert not d.S.requires_grad and not d.last_key.requires_grad


@pytest.mark.parametrize("rule", ["1", "2A", "3"])
def test_split_is_the_inverse_of_cat_and_each_part_continues_its_rows(rule):
    """``split`` gives consecutive rows; continuing each part equals continuing those rows of the whole batch,
    and ``cat`` of the parts is the state back, field by field."""
    opts = dict(rule=rule, window=3, eps_attn=1e-3 if rule.endswith("A") else None)
    inp = random_inputs(rule, B=5, T=7, seed=61)
    _, st = falcon_attention(**inp, **opts, output_final_state=True)
    more = random_inputs(rule, B=5, T=5, seed=62)
    o_all, _ = falcon_attention(**more, **opts, initial_state=st)
    for sizes, bounds in ((2, [0, 2, 4, 5]), ([1, 0, 4], [0, 1, 1, 5])):
        parts = st.split(sizes)
        assert [p.batch_size for p in parts] == [b - a for a, b in zip(bounds[:-1], bounds[1:])]
        _assert_same_state(FalconState.cat(parts), st, tol=0.0)
        for part, a, b in zip(parts, bounds[:-1], bounds[1:]):
            if b > a:
                o, _ = falcon_attention(**{n: x[a:b] for n, x in more.items()}, **opts, initial_state=part)
                assert rel_err(o, o_all[a:b]) <= TOL, (sizes, a)
    for bad in (0, [2, 2], [6, -1], 2.5, True):
        with pytest.raises(ValueError, match="sizes"):
            st.split(bad)


def test_clone_shares_no_memory_and_to_keeps_the_mask_boolean():
    inp = random_inputs("3A", B=2, T=6, seed=63)
    _, st = falcon_attention(**inp, rule="3A", window=3, eps_attn=1e-3, output_final_state=True)
    snap = st.clone()
    _assert_same_state(snap, st, tol=0.0)
    for field in TENSOR_FIELDS:
        t = getattr(st, field)
        if t is not None:
            before = getattr(snap, field).clone()
            t.zero_() if t.dtype != torch.bool else t.fill_(False)
            assert torch.equal(getattr(snap, field), before), field
    low = snap.to(dtype=torch.float32)
    assert low.S.dtype == low.last_key.dtype == low.tail_x.dtype == low.z.dtype == torch.float32
    assert low.tail_valid.dtype == torch.bool and torch.equal(low.tail_valid, snap.tail_valid)
    assert torch.equal(low.S, snap.S.float()) and (low.rule, low.window, low.shift) == ("3A", 3, True)
    back = low.to("cpu", torch.float64)
    assert back.S.dtype == torch.float64 and back.S.device.type == "cpu"
    for bad in (torch.int64, "float32"):
        with pytest.raises(TypeError, match="dtype"):
            snap.to(dtype=bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rule", ["1A", "1", "3"])
def test_a_host_state_moved_to_the_gpu_continues_on_the_kernels(rule):
    """A state built on the host in float64, moved with ``to("cuda", float32)``, continues on the Triton kernels as
    the float64 state continues on the host (within float32's tolerance)."""
    pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
    inp = random_inputs(rule, B=2, T=70, H=2, K=16, V=16, seed=66)
    _, st = falcon_attention(**inp, rule=rule, window=4, output_final_state=True)
    more = random_inputs(rule, B=2, T=45, H=2, K=16, V=16, seed=67)
    ref, ref_st = falcon_attention(**more, rule=rule, window=4, initial_state=st, output_final_state=True)
    gpu = st.to("cuda", torch.float32)
    assert gpu.S.is_cuda and gpu.S.dtype == torch.float32
    o, out_st = falcon_attention(**{n: x.to("cuda", torch.float32) for n, x in more.items()}, rule=rule, window=4,
                                 initial_state=gpu, output_final_state=True, backend="triton")
    assert rel_err(o.double().cpu(), ref) <= 1e-4
    assert rel_err(out_st.to("cpu", torch.float64).S, ref_st.S) <= 1e-4


def test_requires_grad_sees_every_tensor_field():
    """``requires_grad`` is True when any of S, last_key, the tail's pairs or z needs a gradient, not only S."""
    S = torch.zeros(1, 2, 3, 4, dtype=torch.float64)
    assert not FalconState.fresh(S, rule="3A", window=3, z=torch.zeros(1, 2, 3)).requires_grad
    assert FalconState.fresh(S, rule="1A", z=torch.zeros(1, 2, 3, requires_grad=True)).requires_grad
    for field, shape in (("last_key", (1, 2, 3)), ("tail_x", (1, 2, 2, 3)), ("tail_y", (1, 2, 2, 4))):
        st = FalconState.fresh(S, rule="3", window=3)
        setattr(st, field, torch.zeros(shape, dtype=torch.float64, requires_grad=True))
        assert st.requires_grad, field
        assert not st.detach().requires_grad, field


@pytest.mark.parametrize("rule", SLIDING)
def test_fresh_state_of_a_window_of_one(rule):
    """A sliding rule with ``window=1`` keeps no tail: ``fresh`` makes a state of window 1 that such a call takes,
    and its outputs and final state are the float64 loop's from S_init with a window of one pair."""
    S0 = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    st = FalconState.fresh(S0, rule=rule, window=1)
    assert st.window == 1 and st.tail_x is None and st.tail_y is None and st.tail_valid is None
    inp = random_inputs(rule, B=2, T=9, seed=10, lam_range=(0.0, 2.0))
    for form in FORMS:
        o, final = falcon_attention(**inp, rule=rule, window=1, form=form, chunk_size=4, initial_state=st,
                                    output_final_state=True)
        ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, window=1, initial_S=S0)
        assert rel_err(o, ref_o) <= TOL and rel_err(final.S, ref_S) <= TOL, form
        assert final.window == 1 and final.tail_x is None, form


# ----------------------------------------------------------------------------- a new sequence from given fast weights
def _fresh(rule, S0, window=4, **kw):
    return FalconState.fresh(S0, rule=rule, window=window, **kw)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_fresh_state_first_step_writes_nothing_and_keeps_S(rule):
    """The paper's boundary sentinel on a carried S_init (Section 3, Appendix C.5): x_1 = 0 and eta_1 = 0,
    so the first step neither writes nor shrinks S, however large beta and lam are; only the gate decays it.
    Without ``normalize`` too (``eta_t = beta_t`` elsewhere): a sentinel gain of beta would shrink S by 1 - beta lam."""
    inp = random_inputs(rule, B=2, T=1, seed=5, beta_range=(1.0, 1.9), lam_range=(50.0, 90.0), with_gate=True)
    S0 = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for form in FORMS:
        for normalize in (True, False):
            lam = inp["lam"] if normalize else inp["lam"] / 100  # beta lam in (0.5, 1.7): gamma_1 < 1 if it counted
            o, state = falcon_attention(**dict(inp, lam=lam), rule=rule, form=form, initial_state=_fresh(rule, S0),
                                        output_final_state=True, normalize=normalize)
            S1 = torch.exp(inp["log_gate"][:, 0])[:, :, None, None] * S0
            assert rel_err(state.S, S1) <= TOL, (form, normalize)
            assert rel_err(o[:, 0], torch.einsum("bhkv,bhk->bhv", S1, inp["q"][:, 0])) <= TOL, (form, normalize)
            assert torch.equal(state.last_key, inp["k"][:, 0])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_fresh_state_matches_the_papers_loop_from_S_init(rule, form):
    """Every output and the final state against the float64 loop of conftest started at S_init."""
    S0 = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    for options, gate in ((dict(), True), (dict(read="before", scale_ridge=True), False)):
        inp = random_inputs(rule, B=2, T=19, seed=8, lam_range=(0.0, 3.0), with_gate=gate)
        o, state = falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=4,
                                    initial_state=_fresh(rule, S0, window=3), output_final_state=True, **options)
        ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, window=3, initial_S=S0, **options)
        assert rel_err(o, ref_o) <= TOL and rel_err(state.S, ref_S) <= TOL, options
        # the same sequence from S = 0 is the fresh start of initial_state=None
        o_zero, _ = falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=4,
                                     initial_state=_fresh(rule, torch.zeros_like(S0), window=3), **options)
        assert rel_err(o_zero, falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=4,
                                                **options)[0]) <= TOL


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_fresh_state_in_segments_steps_and_packed_rows(rule):
    """The start from S_init continues like any other: in segments, token by token with falcon_step, and per
    sequence of a packed batch."""
    S0 = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    inp = random_inputs(rule, B=2, T=13, seed=10, with_gate=True)
    full, full_state = falcon_attention(**inp, rule=rule, initial_state=_fresh(rule, S0), output_final_state=True)
    pieces, _ = falcon_attention(**inp, rule=rule, initial_state=_fresh(rule, S0), segments=3)
    assert rel_err(pieces, full) <= TOL
    state, outs = _fresh(rule, S0), []
    for t in range(13):
        o, state = falcon_step(*(inp[n][:, t] for n in ("q", "k", "v", "beta", "lam")), state=state, rule=rule,
                               log_gate=inp["log_gate"][:, t])
        outs.append(o)
    assert rel_err(torch.stack(outs, 1), full) <= TOL and rel_err(state.S, full_state.S) <= TOL
    packed = {n: t.reshape(1, 26, *t.shape[2:]) for n, t in inp.items()}
    o, _ = falcon_attention(**packed, rule=rule, initial_state=_fresh(rule, S0), cu_seqlens=torch.tensor([0, 13, 26]))
    assert rel_err(o.reshape(full.shape), full) <= TOL


@pytest.mark.parametrize("rule", ["1", "2A", "3"])
def test_fresh_state_gradient_reaches_S_init(rule):
    """A learned S_init: the gradient of the outputs with respect to it, by finite differences."""
    inp = random_inputs(rule, B=1, T=6, H=1, K=3, V=2, seed=11, with_gate=True)
    S0 = torch.randn(1, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    for form in ("recurrent", "chunk"):
        torch.autograd.gradcheck(
            lambda S: falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=4,
                                       initial_state=_fresh(rule, S, window=3))[0], (S0,))


def test_fresh_state_checks_its_S():
    with pytest.raises(ValueError, match=r"S must be a tensor of shape \[B, H, K, V\], got \(2, 5, 4\)"):
        FalconState.fresh(torch.zeros(2, 5, 4), rule="1A")
    state = FalconState.fresh(torch.zeros(1, 2, 5, 4), rule="3A", window=4)
    assert state.window == 4 and state.tail_x.shape == (1, 2, 3, 5) and not state.tail_valid.any()
    assert FalconState.fresh(torch.zeros(1, 2, 5, 4), rule="1", window=4).window == 1
    # z, the normalized read's state, exists for the inner-product rules only (a call would name eps_attn)
    with pytest.raises(ValueError, match="z is the read normalizer of the inner-product rules.*rule '3' is a regr"):
        FalconState.fresh(torch.zeros(1, 2, 5, 4), rule="3", z=torch.zeros(1, 2, 5))
    assert FalconState.fresh(torch.zeros(1, 2, 5, 4), rule="3A", z=torch.zeros(1, 2, 5)).z.shape == (1, 2, 5)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_an_unshifted_fresh_state_writes_its_first_pair(rule):
    """``FalconState.fresh(S, shift=False)``: an unshifted sequence has no sentinel, so step 1 writes
    ``(k_1, v_1)`` into ``S_init`` and its ridge shrinks it, as the float64 loop started at ``S_init`` does."""
    S0 = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(13))
    inp = random_inputs(rule, B=2, T=7, seed=14, lam_range=(0.5, 2.0))
    ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, window=3, shift=False, initial_S=S0)
    for form in FORMS:
        o, state = falcon_attention(**inp, rule=rule, window=3, shift=False, form=form, chunk_size=4,
                                    initial_state=_fresh(rule, S0, window=3, shift=False), output_final_state=True)
        assert rel_err(o, ref_o) <= TOL and rel_err(state.S, ref_S) <= TOL, form
    _, first = falcon_attention(**_segment(inp, 0, 1), rule=rule, window=3, shift=False, output_final_state=True,
                                initial_state=_fresh(rule, S0, window=3, shift=False))
    assert rel_err(first.S, reference_falcon(**_segment(inp, 0, 1), rule=rule, window=3, shift=False,
                                             initial_S=S0)[1]) <= TOL
    assert rel_err(first.S, S0) > 0.01  # written and shrunk, unlike the shifted start's sentinel


# ----------------------------------------------------------------------------- what a decoder does with the state
def _steps(inp, state, a, b, **options):
    """Tokens ``a .. b-1`` of ``inp`` through ``falcon_step`` from ``state``: the outputs ``[B, b-a, H, V]`` and
    the last state."""
    outs = []
    for t in range(a, b):
        o, state = falcon_step(**{n: x[:, t] for n, x in inp.items()}, state=state, **options)
        outs.append(o)
    return torch.stack(outs, 1), state


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_steps_from_any_cut_equal_the_float64_loop_under_every_switch(rule):
    """falcon_step continuing a state cut by falcon_attention at any step (1, inside the window, the last) gives
    the float64 loop's outputs and final state, with zero keys, windows of 1 to 5 and the options not covered
    above (eps=0, a high decay_floor, a gate with scale_ridge)."""
    inp = random_inputs(rule, B=2, T=9, seed=71, lam_range=(0.0, 3.0), zero_key_rows=0.2, with_gate=True)
    for window, options in ((1, dict(eps=0.0)), (2, dict(decay_floor=0.4)), (5, dict(scale_ridge=True)),
                            (3, dict(shift=False, normalize=False, eps=0.0))):
        opts = dict(rule=rule, window=window, **options)
        ref_o, ref_S, _ = reference_falcon(**inp, **opts)
        for cut in (1, 3, 8):
            _, state = falcon_attention(**_segment(inp, 0, cut), form="chunk", chunk_size=2, output_final_state=True,
                                        **opts)
            o, state = _steps(inp, state, cut, 9, **opts)
            assert rel_err(o, ref_o[:, cut:]) <= TOL and rel_err(state.S, ref_S) <= TOL, (opts, cut)


def test_the_state_owns_its_last_key_when_the_caller_reuses_its_buffers():
    """A decoder that copies each token into the same input tensors (static buffers, as for CUDA graphs) gets the
    sequence's outputs: the state keeps k_t, not a view of the k buffer that the next token overwrites (x_{t+1}
    would silently be k_{t+1}). The same for a segment's last key when the caller refills its k."""
    inp = random_inputs("3", B=2, T=7, seed=72, with_gate=True)
    full, _ = falcon_attention(**inp, rule="3", window=3, form="recurrent")
    buffers = {n: torch.empty_like(x[:, 0]) for n, x in inp.items()}
    state, outs = None, []
    for t in range(7):
        for n, buf in buffers.items():
            buf.copy_(inp[n][:, t])
        o, state = falcon_step(**buffers, state=state, rule="3", window=3)
        outs.append(o.clone())
    assert rel_err(torch.stack(outs, 1), full) <= TOL
    for form in FORMS:
        segment = {n: x[:, :4].clone() for n, x in inp.items()}
        o1, state = falcon_attention(**segment, rule="3", window=3, form=form, output_final_state=True)
        for n, x in segment.items():  # the caller's buffers take the next segment
            x[:, :3].copy_(inp[n][:, 4:])
        o2, _ = falcon_attention(**{n: x[:, :3] for n, x in segment.items()}, rule="3", window=3, form=form,
                                 initial_state=state)
        assert rel_err(torch.cat([o1, o2], 1), full) <= TOL, form


def _state_fields(state):
    return {f: getattr(state, f) for f in ("S", "last_key", "tail_x", "tail_y", "tail_valid", "z")}


def _assert_same_state(a, b, tol=TOL):
    for name, x in _state_fields(a).items():
        y = getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.shape == y.shape and x.dtype == y.dtype, name
            assert torch.equal(x, y) if x.dtype == torch.bool else rel_err(x, y) <= tol, name


@pytest.mark.parametrize("rule", ["1", "2A", "3", "3A"])
def test_packed_states_are_the_per_sequence_states_field_by_field(rule):
    """The state of a packed call (fresh, then continued) is FalconState.cat of the separate calls' states in
    every field (S, last key, window tail, z of the normalized read); its rows continue by falcon_step as the
    separate states do, and index_select of a row is that row's state."""
    cu = torch.tensor([0, 4, 5, 11, 13])
    spans = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for eps_attn in (None, 0.5) if rule.endswith("A") else (None,):
        inp = random_inputs(rule, B=1, T=13, seed=73, with_gate=True)
        inp["q"], inp["k"] = inp["q"].abs(), inp["k"].abs()
        options = dict(rule=rule, window=3, eps_attn=eps_attn)
        _, packed = falcon_attention(**inp, cu_seqlens=cu, output_final_state=True, **options)
        states = [falcon_attention(**_segment(inp, a, b), output_final_state=True, **options)[1] for a, b in spans]
        _assert_same_state(packed, FalconState.cat(states))
        more = random_inputs(rule, B=1, T=13, seed=74, with_gate=True)
        more["q"], more["k"] = more["q"].abs(), more["k"].abs()
        _, packed2 = falcon_attention(**more, cu_seqlens=cu, initial_state=packed, output_final_state=True, **options)
        states2 = [falcon_attention(**_segment(more, a, b), initial_state=st, output_final_state=True, **options)[1]
                   for (a, b), st in zip(spans, states)]
        _assert_same_state(packed2, FalconState.cat(states2))
        token = random_inputs(rule, B=4, T=2, seed=75, with_gate=True)
        token["q"], token["k"] = token["q"].abs(), token["k"].abs()
        o, after = _steps(token, packed2, 0, 2, **options)
        for n, st in enumerate(states2):
            _assert_same_state(packed2.index_select(torch.tensor([n])), st)
            o_n, after_n = _steps({name: x[n:n + 1] for name, x in token.items()}, st, 0, 2, **options)
            assert rel_err(o[n:n + 1], o_n) <= TOL
            _assert_same_state(after.index_select(torch.tensor([n])), after_n)


def test_cat_and_index_select_name_what_they_refuse():
    """FalconState.cat refuses states of another head count, key or value width, or window tail naming the
    field and the state (torch.cat's 'Sizes of tensors must match' named neither); index_select takes a list of
    rows as a tensor of them and refuses a mask or float rows naming index."""
    def fresh(H=2, K=5, V=4, rule="3A", window=3):
        return FalconState.fresh(torch.zeros(1, H, K, V), rule=rule, window=window)

    for other, field in ((fresh(H=3), "S"), (fresh(K=6), "S"), (fresh(V=3), "S")):
        with pytest.raises(ValueError, match=rf"states\[1\]\.{field} has shape .* states\[0\]\.{field} has shape"):
            FalconState.cat([fresh(), other])
    odd = fresh()
    odd.tail_x = torch.zeros(1, 2, 3, 5)  # a tail of another window than the state says
    with pytest.raises(ValueError, match=r"states\[2\]\.tail_x has shape \(1, 2, 3, 5\), states\[0\]\.tail_x has "
                                         r"shape \(1, 2, 2, 5\)"):
        FalconState.cat([fresh(), fresh(), odd])
    with pytest.raises(ValueError, match=r"states\[1\]\.window is 4, states\[0\]\.window is 3"):
        FalconState.cat([fresh(), fresh(window=4)])
    _, st = falcon_attention(**random_inputs("3A", B=3, T=5, seed=76), rule="3A", window=3, output_final_state=True)
    _assert_same_state(st.index_select([2, 0, 2]), st.index_select(torch.tensor([2, 0, 2])))
    assert torch.equal(st.index_select((1,)).S, st.S[1:2])
    for bad in (torch.tensor([True, False, True]), torch.tensor([0.0, 1.0]), "01", [0.5]):
        with pytest.raises(TypeError, match="index must be"):
            st.index_select(bad)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_gradients_through_the_state_across_segments(rule):
    """Truncated backpropagation through time: a state passed on undetached (to falcon_attention or to
    falcon_step) gives every input, S_init and z_init the gradients of one call over the whole sequence; a
    detached one gives the first segment's inputs (and S_init, z_init) the gradients of that segment's own
    outputs, and the second's those of a call from a constant state."""
    base = random_inputs(rule, B=1, T=8, K=3, V=2, seed=77, with_gate=True, lam_range=(0.1, 1.0))
    base["q"], base["k"] = base["q"].abs(), base["k"].abs()
    eps_attn = 0.3 if rule.endswith("A") else None
    g = torch.Generator().manual_seed(78)
    cot = torch.randn(base["v"].shape, generator=g, dtype=torch.float64)
    S0 = torch.randn(1, 2, 3, 2, generator=g, dtype=torch.float64)
    z0 = torch.rand(1, 2, 3, *((2,) if rule == "2A" else ()), generator=g, dtype=torch.float64)
    options = dict(rule=rule, window=3, eps_attn=eps_attn)

    def grads(a, b, state, *, cut=None, detach=False, step=False):
        """d/d(inputs a..b-1, then the leaves of ``state``) of the outputs' loss plus sum(S_T), the sequence cut
        once at ``cut``."""
        leaves = {n: t[:, a:b].clone().requires_grad_() for n, t in base.items()}
        init = [t.clone().requires_grad_() for t in state]
        st = None if not init else FalconState.fresh(init[0], rule=rule, window=3, z=init[1] if eps_attn else None)
        cut = b - a if cut is None else cut
        o, st = falcon_attention(**_segment(leaves, 0, cut), initial_state=st, output_final_state=True,
                                 form="chunk", chunk_size=3, **options)
        if detach:
            st = st.detach()
        if cut < b - a:
            o2, st = (_steps(leaves, st, cut, b - a, **options) if step else
                      falcon_attention(**_segment(leaves, cut, b - a), initial_state=st, output_final_state=True,
                                       **options))
            o = torch.cat([o, o2], 1)
        loss = (o * cot[:, a:b]).sum() + st.S.sum()
        return torch.autograd.grad(loss, [*leaves.values(), *init])

    inits = (S0, z0) if eps_attn else (S0,)
    whole = grads(0, 8, inits)
    assert all(x.abs().max() > 0 for x in whole)
    for cut, step in ((3, False), (1, True), (5, True)):
        for got, want in zip(grads(0, 8, inits, cut=cut, step=step), whole):
            assert rel_err(got, want) <= TOL, (cut, step)
    # detached at step 3: the first segment's own loss (its outputs), and the rest from the state as a constant
    first = grads(0, 3, inits)
    _, mid = falcon_attention(**_segment(base, 0, 3), initial_state=FalconState.fresh(S0, rule=rule, window=3,
                              z=z0 if eps_attn else None), output_final_state=True, **options)
    leaves = {n: t[:, 3:].clone().requires_grad_() for n, t in base.items()}
    o, st = falcon_attention(**leaves, initial_state=mid, output_final_state=True, **options)
    second = torch.autograd.grad((o * cot[:, 3:]).sum() + st.S.sum(), list(leaves.values()))
    detached = grads(0, 8, inits, cut=3, detach=True)
    for i, name in enumerate(base):
        assert rel_err(detached[i][:, 3:], second[i]) <= TOL, name
    # the first segment: its own outputs (its loss without sum(S_3), which the detach cut off)
    leaves = {n: t[:, :3].clone().requires_grad_() for n, t in base.items()}
    init = [t.clone().requires_grad_() for t in inits]
    o, _ = falcon_attention(**leaves, initial_state=FalconState.fresh(init[0], rule=rule, window=3,
                            z=init[1] if eps_attn else None), **options)
    own = torch.autograd.grad((o * cot[:, :3]).sum(), [*leaves.values(), *init])
    for i, name in enumerate([*base, "S_init", "z_init"][:len(own)]):
        got = detached[i][:, :3] if name in base else detached[i]
        assert rel_err(got, own[i]) <= TOL, name
    assert rel_err(detached[len(base)], first[len(base)]) > 1e-3  # without the detach, S_init's gradient differs


@pytest.mark.parametrize("rule", ["2", "3", "2A", "3A"])
def test_a_step_keeps_the_state_in_the_compute_dtype(rule):
    """As docs/ops.md says: bfloat16 and float16 steps keep every float field of the state (S, the last key, the
    window tail, z) in float32 and return v's dtype; float64 stays float64; a float64 state continued with
    float32 inputs goes on in float32, equal to the float32 run from that state rounded."""
    base = random_inputs(rule, B=2, T=3, seed=79, with_gate=True)
    base["q"], base["k"] = base["q"].abs(), base["k"].abs()
    for eps_attn in (None, 0.5) if rule.endswith("A") else (None,):
        options = dict(rule=rule, window=3, eps_attn=eps_attn, backend="torch")
        for dtype, state_dtype in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                   (torch.float32, torch.float32), (torch.float64, torch.float64)):
            o, state = _steps({n: x.to(dtype) for n, x in base.items()}, None, 0, 3, **options)
            assert o.dtype == dtype
            for name, x in _state_fields(state).items():
                if x is not None and name != "tail_valid":
                    assert x.dtype == state_dtype, (dtype, name)
        _, wide = _steps(base, None, 0, 2, **options)
        o, narrow = _steps({n: x.float() for n, x in base.items()}, wide, 2, 3, **options)
        rounded = FalconState(**{n: x.float() if torch.is_tensor(x) and x.is_floating_point() else x
                                 for n, x in vars(wide).items()})
        o_ref, ref = _steps({n: x.float() for n, x in base.items()}, rounded, 2, 3, **options)
        assert narrow.S.dtype == torch.float32 and torch.equal(o, o_ref) and torch.equal(narrow.S, ref.S)
