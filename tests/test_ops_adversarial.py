"""The op at the edges of its shapes and options, against the float64 reference loop: sequences of one
and two steps, one key or value feature, a window of one or longer than the sequence, chunk sizes that
do not divide ``T``, and option combinations the other tests leave out (``eps = 0`` with zero keys,
``beta`` at 0 and 2, the clamp at a floor of 0.5, hard resets, ``normalize=False`` with
``scale_ridge``, unshifted pairs read before the write). Each case runs every form, continued from
the state at every cut, decoded token by token from there, and packed in short sequences; the
gradients go through the carried state."""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from conftest import FORMS, RULE_NAMES, random_inputs, reference_falcon, rel_err

from falcon_fwa import falcon_attention, falcon_step

TOL = 1e-10

# shape (B, T, H, K, V), window, chunk_size, random_inputs' regime, op options, hard resets (g = -inf) and
# beta = 0 (no write, no shrinkage) at these steps
CASES = {
    "one_step": dict(shape=(1, 1, 1, 1, 1), window=4, chunk=64, inputs={}, options={}, resets=(), silent=()),
    "two_steps_unshifted_read_before": dict(shape=(2, 2, 1, 2, 3), window=4, chunk=1, inputs={},
                                            options=dict(shift=False, read="before"), resets=(), silent=()),
    "window_past_the_end_unnormalized_scaled": dict(
        shape=(1, 5, 2, 3, 1), window=8, chunk=3, inputs=dict(with_gate=True),
        options=dict(normalize=False, scale_ridge=True), resets=(2,), silent=()),
    "window_one_eps_zero_zero_keys": dict(shape=(1, 7, 1, 1, 2), window=1, chunk=4,
                                          inputs=dict(zero_key_rows=0.5, lam_range=(0.0, 0.0)),
                                          options=dict(eps=0.0), resets=(), silent=()),
    "beta_two_clamped_at_half": dict(shape=(1, 6, 1, 2, 2), window=3, chunk=4,
                                     inputs=dict(beta_range=(2.0, 2.0), lam_range=(20.0, 50.0), with_gate=True),
                                     options=dict(decay_floor=0.5, read="before", scale_ridge=True), resets=(0, 4),
                                     silent=()),
    "beta_zero_and_resets": dict(shape=(2, 6, 1, 3, 2), window=2, chunk=4, inputs=dict(with_gate=True),
                                 options=dict(shift=False), resets=(3,), silent=(1, 2, 5)),
}


def _case(rule, name, seed):
    c = CASES[name]
    B, T, H, K, V = c["shape"]
    inp = random_inputs(rule, B=B, T=T, H=H, K=K, V=V, seed=seed, **c["inputs"])
    if c["resets"]:
        gate = inp.get("log_gate", torch.zeros(B, T, H, dtype=torch.float64)).clone()
        gate[:, list(c["resets"])] = -math.inf
        inp["log_gate"] = gate
    if c["silent"]:
        inp["beta"] = inp["beta"].clone()
        inp["beta"][:, list(c["silent"])] = 0.0
    return inp, dict(rule=rule, window=c["window"], **c["options"]), c["chunk"]


def _piece(inp, a, b):
    return {n: t[:, a:b] for n, t in inp.items()}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_every_form_cut_and_decoding_step_against_the_reference(rule, case):
    inp, opts, chunk = _case(rule, case, seed=91)
    ref_o, ref_S, _ = reference_falcon(**inp, **opts)
    T = inp["q"].shape[1]
    for form in FORMS:
        o, st = falcon_attention(**inp, form=form, chunk_size=chunk, output_final_state=True, **opts)
        assert rel_err(o, ref_o) <= TOL and rel_err(st.S, ref_S) <= TOL, form
    for cut, form in zip(range(1, T), itertools.cycle(FORMS)):
        o1, st = falcon_attention(**_piece(inp, 0, cut), form=form, chunk_size=chunk, output_final_state=True, **opts)
        for then in FORMS:  # the rest of the sequence in one call, from the state at the cut
            o2, end = falcon_attention(**_piece(inp, cut, T), form=then, chunk_size=chunk, initial_state=st,
                                       output_final_state=True, **opts)
            assert rel_err(torch.cat([o1, o2], 1), ref_o) <= TOL, (cut, form, then)
            assert rel_err(end.S, ref_S) <= TOL, (cut, form, then)
        for t in range(cut, T):  # and token by token
            o_t, st = falcon_step(**{n: x[:, t] for n, x in inp.items()}, state=st, **opts)
            assert rel_err(o_t, ref_o[:, t]) <= TOL, (cut, form, t)
        assert rel_err(st.S, ref_S) <= TOL, (cut, form)
    state = None
    for t in range(T):  # from a fresh sequence
        o_t, state = falcon_step(**{n: x[:, t] for n, x in inp.items()}, state=state, **opts)
        assert rel_err(o_t, ref_o[:, t]) <= TOL, t
    assert rel_err(state.S, ref_S) <= TOL


@pytest.mark.parametrize("options", [dict(), dict(shift=False, read="before"), dict(scale_ridge=True, normalize=False)],
                         ids=["default", "unshifted_read_before", "scaled_unnormalized"])
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_packed_sequences_shorter_than_the_window_continue_their_states(rule, options):
    """Packed sequences of 1, 2 and 3 steps (window 4), each continuing its row of a state that a
    two-step prefill returned, equal the reference over prefill and sequence as one sequence; the
    final state's rows continue each sequence again."""
    lengths = [1, 2, 3, 1, 2]
    N = len(lengths)
    cu = torch.tensor([0, *itertools.accumulate(lengths)])
    opts = dict(rule=rule, window=4, **options)
    pre = random_inputs(rule, B=N, T=2, H=2, K=3, V=2, seed=92, with_gate=True)
    packed = random_inputs(rule, B=1, T=sum(lengths), H=2, K=3, V=2, seed=93, with_gate=True)
    after = random_inputs(rule, B=N, T=2, H=2, K=3, V=2, seed=94, with_gate=True)
    for form in FORMS:
        _, st = falcon_attention(**pre, form=form, output_final_state=True, **opts)
        o, st = falcon_attention(**packed, form=form, chunk_size=2, cu_seqlens=cu, initial_state=st,
                                 output_final_state=True, **opts)
        o2, _ = falcon_attention(**after, form=form, chunk_size=2, initial_state=st, **opts)
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            whole = {name: torch.cat([pre[name][n:n + 1], packed[name][:, a:b], after[name][n:n + 1]], 1)
                     for name in pre}
            ref_o, _, _ = reference_falcon(**whole, **opts)
            assert rel_err(o[:, a:b], ref_o[:, 2:2 + b - a]) <= TOL, (form, n)
            assert rel_err(o2[n:n + 1], ref_o[:, 2 + b - a:]) <= TOL, (form, n)


STATE_FIELDS = ("S", "last_key", "tail_x", "tail_y")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_gradcheck_through_the_carried_state(rule, form):
    """Finite differences (float64 gradcheck) of a continued call: its inputs and the tensors of the
    state it continues (S, last key, sliding tail) to its outputs and every tensor of the state it
    returns. Then the gradients of a run split at every cut equal the whole run's."""
    opts = dict(rule=rule, window=3, form=form, chunk_size=2)
    small = dict(B=1, H=1, K=2, V=2, beta_range=(0.3, 0.9), lam_range=(0.05, 0.5), with_gate=True)
    _, start = falcon_attention(**random_inputs(rule, T=2, seed=95, **small), output_final_state=True, **opts)
    inp = random_inputs(rule, T=4, seed=96, **small)
    fields = [f for f in STATE_FIELDS if getattr(start, f) is not None]
    names = list(inp)

    def run(*tensors):
        state = dataclasses.replace(start, **dict(zip(fields, tensors[len(names):])))
        o, end = falcon_attention(**dict(zip(names, tensors)), initial_state=state, output_final_state=True, **opts)
        return (o, *(getattr(end, f) for f in fields))

    leaves = tuple(t.clone().requires_grad_() for t in [*inp.values(), *(getattr(start, f) for f in fields)])
    assert torch.autograd.gradcheck(run, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)

    cot = torch.randn(inp["v"].shape, generator=torch.Generator().manual_seed(97), dtype=torch.float64)
    state = dataclasses.replace(start, **dict(zip(fields, leaves[len(names):])))

    def grads(cuts):
        outs, st = [], state
        for a, b in zip([0, *cuts], [*cuts, 4]):
            o, st = falcon_attention(**dict(zip(names, (t[:, a:b] for t in leaves))), initial_state=st,
                                     output_final_state=True, **opts)
            outs.append(o)
        loss = (torch.cat(outs, 1) * cot).sum() + sum((getattr(st, f) ** 2).sum() for f in fields)
        return torch.autograd.grad(loss, leaves)

    whole = grads([])
    for cuts in ([1], [2], [3], [1, 2, 3]):
        for got, want in zip(grads(cuts), whole):
            assert rel_err(got, want) <= 1e-10, cuts
