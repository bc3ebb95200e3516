"""Exact continuation through FalconState, the one-token decode step and packed
variable-length sequences."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import FORMS, RULE_NAMES, SLIDING, random_inputs, reference_falcon, rel_err

from falcon_fwa import FalconState, falcon_attention, falcon_step

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


# ----------------------------------------------------------------------------- a new sequence from given fast weights
def _fresh(rule, S0, window=4, **kw):
    return FalconState.fresh(S0, rule=rule, window=window, **kw)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_fresh_state_first_step_writes_nothing_and_keeps_S(rule):
    """The paper's boundary sentinel on a carried S_init (Section 3, Appendix C.5): x_1 = 0 and eta_1 = 0,
    so the first step neither writes nor shrinks S, however large beta and lam are; only the gate decays it."""
    inp = random_inputs(rule, B=2, T=1, seed=5, beta_range=(1.0, 1.9), lam_range=(50.0, 90.0), with_gate=True)
    S0 = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    for form in FORMS:
        o, state = falcon_attention(**inp, rule=rule, form=form, initial_state=_fresh(rule, S0),
                                    output_final_state=True)
        S1 = torch.exp(inp["log_gate"][:, 0])[:, :, None, None] * S0
        assert rel_err(state.S, S1) <= TOL, form
        assert rel_err(o[:, 0], torch.einsum("bhkv,bhk->bhv", S1, inp["q"][:, 0])) <= TOL, form
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
