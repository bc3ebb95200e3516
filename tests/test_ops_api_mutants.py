"""The public entries' documented defaults and argument checks, case by case: each default of
``falcon_attention`` and ``falcon_step`` against the float64 loop of ``conftest`` run with the documented
value, the boundaries of the ranges the checks accept (``lam = 0``, ``eps = 0``, a single-element ``lam``),
and the errors that name the argument at fault."""
from __future__ import annotations

import pytest
import torch
from conftest import random_inputs, reference_falcon, rel_err

from falcon_fwa import FalconState, falcon_attention, falcon_step

TOL = 1e-10


def _inp(rule="1A", **kw):
    kw = {"B": 2, "T": 9, "H": 2, "K": 3, "V": 4, "seed": 91, **kw}
    return random_inputs(rule, **kw)


def _steps(inp, **options):
    """``falcon_step`` over the sequence ``inp`` token by token: ``o`` ``[B, T, H, V]`` and the last state."""
    state, outs = None, []
    for t in range(inp["q"].shape[1]):
        o, state = falcon_step(**{n: x[:, t] for n, x in inp.items()}, state=state, **options)
        outs.append(o)
    return torch.stack(outs, 1), state


# ----------------------------------------------------------------------------- documented defaults
def _default_case(name):
    """Inputs on which the default ``name`` shows, the options the call passes, and the reference's
    options with the documented default spelled out."""
    if name == "rule":  # "1A": no correction term, unlike "1"
        return _inp("1A"), {}, {"rule": "1A"}
    if name == "window":  # 4 for the sliding rules: T = 9 fills windows of 3, 4 and 5 differently
        return _inp("3A"), {"rule": "3A"}, {"rule": "3A", "window": 4}
    if name == "decay_floor":  # 1e-3: a ridge so large that eta*lam passes 1 - decay_floor at every step
        return _inp("1A", lam_range=(50.0, 100.0), beta_range=(1.2, 1.9)), {}, {"rule": "1A", "decay_floor": 1e-3}
    if name == "eps":  # 1e-6: keys of norm ~1e-3 and lam = 0, so E_t + lam_t is of eps's order
        inp = _inp("1A", lam_range=(0.0, 0.0))
        inp["k"] = inp["k"] * 1e-3
        return inp, {}, {"rule": "1A", "eps": 1e-6}
    raise KeyError(name)


@pytest.mark.parametrize("name", ["rule", "window", "decay_floor", "eps"])
def test_the_entries_defaults_are_the_documented_ones(name):
    """``rule="1A"``, ``window=4``, ``decay_floor=1e-3`` and ``eps=1e-6`` when not given, on ``falcon_attention``
    and on ``falcon_step`` token by token: each call left at its defaults is the float64 loop run with the
    documented value, on inputs where another value would change the result."""
    inp, options, ref_options = _default_case(name)
    ref_o, ref_S, info = reference_falcon(**inp, **ref_options)
    if name == "decay_floor":
        assert bool(info["clamped"][:, 1:].all())  # the clamp, gamma = decay_floor, acts on every written step
    o, final = falcon_attention(**inp, **options, output_final_state=True)
    assert rel_err(o, ref_o) <= TOL and rel_err(final.S, ref_S) <= TOL
    o_step, state = _steps(inp, **options)
    assert rel_err(o_step, ref_o) <= TOL and rel_err(state.S, ref_S) <= TOL


def test_the_default_form_is_the_chunk_form_with_chunks_of_64(monkeypatch):
    """``form="chunk"`` and ``chunk_size=64`` when not given (``backend="torch"``, so the PyTorch forms run on any
    machine): the chunk form runs, with chunks of 64 steps, and its result is the float64 loop's."""
    import falcon_fwa.ops.api as api

    seen = []
    real_chunk = api.chunk_form

    def chunk_form(*args, **kw):
        seen.append(kw["chunk_size"])
        return real_chunk(*args, **kw)

    def other_form(*args, **kw):
        raise AssertionError("the default form is the chunk form")

    monkeypatch.setattr(api, "chunk_form", chunk_form)
    monkeypatch.setattr(api, "recurrent_form", other_form)
    monkeypatch.setattr(api, "parallel_form", other_form)
    inp = _inp("1", T=70, B=1, H=1)
    o, _ = falcon_attention(**inp, rule="1", backend="torch")
    assert seen == [64]
    assert rel_err(o, reference_falcon(**inp, rule="1")[0]) <= TOL


# ----------------------------------------------------------------------------- range boundaries
def _deltanet(q, k, v, beta):
    """DeltaNet by hand: ``S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T``, ``o_t = S_t^T q_t``."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, v.shape[-1], dtype=torch.float64)
            for t in range(T):
                x = k[b, t, h]
                S = S + beta[b, t, h] * torch.outer(x, v[b, t, h] - S.T @ x)
                o[b, t, h] = S.T @ q[b, t, h]
    return o


@pytest.mark.parametrize("form", ["recurrent", "parallel", "chunk"])
def test_a_ridge_of_zero_is_accepted_as_deltanet(form):
    """``lam >= 0`` admits ``lam = 0`` exactly: DeltaNet is rule "1" with ``shift=False, normalize=False, lam=0``
    (the docstring's special cases), on every form and on the one-token step."""
    inp = _inp("1", lam_range=(0.0, 0.0), beta_range=(0.1, 0.9))
    assert bool((inp["lam"] == 0).all())
    want = _deltanet(inp["q"], inp["k"], inp["v"], inp["beta"])
    o, _ = falcon_attention(**inp, rule="1", shift=False, normalize=False, form=form, chunk_size=4)
    assert rel_err(o, want) <= TOL
    o_step, _ = _steps(inp, rule="1", shift=False, normalize=False)
    assert rel_err(o_step, want) <= TOL


def test_a_single_negative_ridge_is_refused():
    """The ``lam`` check holds for a ``lam`` of one element (one row, one step, one head) too."""
    inp = _inp("1A", B=1, T=1, H=1)
    inp["lam"] = torch.full((1, 1, 1), -0.5, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^lam must be finite and >= 0"):
        falcon_attention(**inp)
    with pytest.raises(ValueError, match=r"^lam must be finite and >= 0"):
        falcon_step(**{n: x[:, 0] for n, x in inp.items()})


@pytest.mark.parametrize("switch", ["shift", "normalize", "scale_ridge", "output_final_state", "validate"])
@pytest.mark.parametrize("value", [1, 0])
def test_a_switch_given_as_an_integer_is_refused(switch, value):
    """The on/off arguments are ``bool``: an integer 1 or 0 raises a ``TypeError`` naming the switch."""
    inp = _inp("1A")
    if switch != "validate":
        with pytest.raises(TypeError, match=rf"^{switch} must be True or False, got {value}"):
            falcon_attention(**inp, **{switch: value})
    if switch != "output_final_state":
        with pytest.raises(TypeError, match=rf"^{switch} must be True or False, got {value}"):
            falcon_step(**{n: x[:, 0] for n, x in inp.items()}, **{switch: value})


def test_eps_of_zero_is_accepted():
    """``eps >= 0`` admits ``eps = 0`` (and ``inf`` is refused): the op and the step are then the float64 loop
    with no stabilizer in the denominator."""
    inp = _inp("1", lam_range=(0.5, 1.0))
    ref_o, _, _ = reference_falcon(**inp, rule="1", eps=0.0)
    assert rel_err(falcon_attention(**inp, rule="1", eps=0.0, chunk_size=4)[0], ref_o) <= TOL
    assert rel_err(_steps(inp, rule="1", eps=0.0)[0], ref_o) <= TOL
    with pytest.raises(ValueError, match=r"^eps must lie in \[0, inf\), got -1e-09"):
        falcon_attention(**inp, rule="1", eps=-1e-9)


@pytest.mark.parametrize("rule", ["3", "3A"])
def test_a_window_of_one_is_accepted_and_a_bool_window_refused(rule):
    """``window`` of a sliding rule is an integer ``>= 1``: one (each step's own pair alone) runs as the float64
    loop with that window; ``True`` is no integer window and is refused, naming ``window``."""
    inp = _inp(rule)
    ref_o, _, _ = reference_falcon(**inp, rule=rule, window=1)
    assert rel_err(falcon_attention(**inp, rule=rule, window=1, chunk_size=4)[0], ref_o) <= TOL
    assert rel_err(_steps(inp, rule=rule, window=1)[0], ref_o) <= TOL
    with pytest.raises(ValueError, match=rf"^window must be an integer >= 1 for the sliding rule {rule}, got True"):
        falcon_attention(**inp, rule=rule, window=True)
    with pytest.raises(ValueError, match=r"^window must be an integer >= 1"):
        falcon_step(**{n: x[:, 0] for n, x in inp.items()}, rule=rule, window=True)


@pytest.mark.parametrize("name", ["chunk_size", "segments"])
def test_a_bool_chunk_size_or_segments_is_refused(name):
    """``chunk_size`` and ``segments`` are integers ``>= 1``, and a bool is not one."""
    with pytest.raises(ValueError, match=rf"^{name} must be an integer >= 1, got True"):
        falcon_attention(**_inp("1A"), **{name: True})


def test_a_sequence_of_no_steps_is_refused():
    """``T >= 1``: an empty time axis is named as such."""
    inp = {n: x[:, :0] for n, x in _inp("1A").items()}
    for form in ("recurrent", "parallel", "chunk"):
        with pytest.raises(ValueError, match=r"^q must have at least one time step \(T >= 1\)"):
            falcon_attention(**inp, form=form)


def test_a_query_with_an_extra_axis_is_refused():
    """``q`` has exactly four axes ``[B, T, H, K]`` (three, ``[B, H, K]``, on the step): one more is named."""
    inp = _inp("1A")
    inp5 = dict(inp, q=inp["q"][..., None])
    with pytest.raises(ValueError, match=r"^q must have shape \[B, T, H, K\], got \(2, 9, 2, 3, 1\)"):
        falcon_attention(**inp5)
    step = {n: x[:, 0] for n, x in inp.items()}
    step["q"] = step["q"][..., None]
    with pytest.raises(ValueError, match=r"^q must have shape \[B, H, K\]"):
        falcon_step(**step)


@pytest.mark.parametrize("name", ["k", "v", "beta", "lam", "log_gate"])
def test_a_tensor_on_another_device_than_q_is_named(name):
    """Every tensor must be on ``q``'s device: one elsewhere (here the ``meta`` device, which any machine has)
    is named with both devices."""
    inp = _inp("1A", with_gate=True)
    inp[name] = inp[name].to("meta")
    with pytest.raises(ValueError, match=rf"^{name} is on meta but q is on cpu"):
        falcon_attention(**inp)
    with pytest.raises(ValueError, match=rf"^{name} is on meta but q is on cpu"):
        falcon_step(**{n: x[:, 0] for n, x in inp.items()})


# ----------------------------------------------------------------------------- states
def test_a_state_whose_last_key_has_another_shape_is_named():
    """A state's ``last_key`` is ``[B, H, K]``: one of another width is refused by both entries, naming the field,
    before it could be written as the next step's key."""
    inp = _inp("1A")
    _, st = falcon_attention(**inp, output_final_state=True)
    st.last_key = st.last_key[..., :2]
    with pytest.raises(ValueError, match=r"^initial_state\.last_key must have shape \[B, H, K\] = \(2, 2, 3\)"):
        falcon_attention(**inp, initial_state=st)
    with pytest.raises(ValueError, match=r"^state\.last_key must have shape \[B, H, K\] = \(2, 2, 3\)"):
        falcon_step(**{n: x[:, 0] for n, x in inp.items()}, state=st)


@pytest.mark.parametrize("rule", ["3", "3A"])
def test_a_window_of_two_needs_its_one_slot_tail(rule):
    """With ``window=2`` a sliding state carries a tail of ``window - 1 = 1`` slot: a state without it is refused
    (the earlier pair would be lost), and the state of a window-2 call continues it exactly."""
    inp = _inp(rule)
    first = {n: x[:, :4] for n, x in inp.items()}
    rest = {n: x[:, 4:] for n, x in inp.items()}
    _, st = falcon_attention(**first, rule=rule, window=2, output_final_state=True)
    assert st.tail_x.shape == (2, 2, 1, 3) and st.tail_valid.shape == (2, 1)
    o_rest, _ = falcon_attention(**rest, rule=rule, window=2, initial_state=st, chunk_size=4)
    ref_o, _, _ = reference_falcon(**inp, rule=rule, window=2)
    assert rel_err(o_rest, ref_o[:, 4:]) <= TOL
    bare = FalconState(rule=st.rule, window=2, shift=True, S=st.S, last_key=st.last_key)
    with pytest.raises(ValueError, match=r"^initial_state has no sliding-window tail"):
        falcon_attention(**rest, rule=rule, window=2, initial_state=bare)
    with pytest.raises(ValueError, match=r"^state has no sliding-window tail"):
        falcon_step(**{n: x[:, 0] for n, x in rest.items()}, rule=rule, window=2, state=bare)


@pytest.mark.parametrize("segments", [0, -1, True])
def test_segments_must_be_a_positive_integer(segments):
    with pytest.raises(ValueError, match=rf"^segments must be an integer >= 1, got {segments}"):
        falcon_attention(**_inp("1A"), segments=segments)


def test_two_segments_run_the_chunk_form_in_two_pieces(monkeypatch):
    """``segments=2`` runs the sequence in two pieces of whole chunks, each from the state the first returned
    (T = 16 in chunks of 4: two calls of the chunk form on 8 steps each), and the result is the float64 loop's."""
    import falcon_fwa.ops.api as api

    lengths = []
    real_chunk = api.chunk_form

    def chunk_form(qh, *args, **kw):
        lengths.append(qh.shape[2])  # qh is [B, H, T, K]
        return real_chunk(qh, *args, **kw)

    monkeypatch.setattr(api, "chunk_form", chunk_form)
    inp = _inp("1", T=16)
    o, final = falcon_attention(**inp, rule="1", chunk_size=4, segments=2, backend="torch", output_final_state=True)
    assert lengths == [8, 8]
    ref_o, ref_S, _ = reference_falcon(**inp, rule="1")
    assert rel_err(o, ref_o) <= TOL and rel_err(final.S, ref_S) <= TOL


def test_triton_refuses_the_parallel_form():
    """``backend="triton"`` runs the chunk or the recurrent form: the parallel form with it is refused, naming
    both, rather than run on PyTorch."""
    with pytest.raises(ValueError, match=r"backend='triton'.*form='parallel'"):
        falcon_attention(**_inp("1A"), backend="triton", form="parallel")


@pytest.mark.parametrize("form", ["parallel", "chunk"])
def test_a_finite_gate_far_below_the_floor_changes_no_value(form):
    """The floor put under ``log_gate`` changes no value of the recurrence: a gate of -60 (exp(-60) ~ 1e-26) at
    step 5 of a float64 call leaves no trace of the values before it, which are 1e6 times larger than those
    after, as in the float64 loop."""
    inp = _inp("1A", with_gate=True, T=10)
    inp["v"][:, :5] *= 1e6
    inp["log_gate"][:, 5] = -60.0
    ref_o, _, _ = reference_falcon(**inp, rule="1A")
    o, _ = falcon_attention(**inp, form=form, chunk_size=4)
    assert rel_err(o[:, 5:], ref_o[:, 5:]) <= TOL


@pytest.mark.parametrize("wide", ["q", "k", "v", "beta", "lam"])
def test_one_float64_input_makes_the_compute_dtype_float64(wide):
    """Mixed dtypes: the PyTorch forms compute in float64 when any input is float64 (the final state is in the
    compute dtype), and ``o`` is in ``v``'s dtype. Inputs of float32 values are exact in float64, so the result
    is the float64 loop's to float64 precision."""
    inp = {n: x.float() if n != wide else x for n, x in _inp("1A").items()}
    ref_o, ref_S, _ = reference_falcon(**inp, rule="1A")
    for form in ("recurrent", "chunk"):
        o, final = falcon_attention(**inp, form=form, backend="torch", chunk_size=4, output_final_state=True)
        assert final.S.dtype == torch.float64 and o.dtype == inp["v"].dtype
        assert rel_err(final.S, ref_S) <= TOL
        assert rel_err(o, ref_o) <= (TOL if wide == "v" else 1e-6)
    o_step, state = _steps(inp)
    assert state.S.dtype == torch.float64 and o_step.dtype == inp["v"].dtype
    assert rel_err(state.S, ref_S) <= TOL


# ----------------------------------------------------------------------------- packed sequences
def test_packed_final_state_keeps_each_sequences_own_last_key_and_continues_it():
    """With ``cu_seqlens`` the final state has one row per sequence, and its ``last_key`` is that sequence's last
    key (not the zero padding after a shorter one); continuing from it is the float64 loop of the whole."""
    inp = _inp("1A", B=1, T=9)
    cu = torch.tensor([0, 3, 9])
    _, final = falcon_attention(**inp, cu_seqlens=cu, output_final_state=True)
    assert final.S.shape[0] == 2
    assert torch.equal(final.last_key[0], inp["k"][0, 2]) and torch.equal(final.last_key[1], inp["k"][0, 8])
    more = _inp("1A", B=1, T=4, seed=92)
    packed_more = {n: torch.cat([x, x], 1) for n, x in more.items()}  # both sequences go on with the same 4 steps
    o, _ = falcon_attention(**packed_more, cu_seqlens=torch.tensor([0, 4, 8]), initial_state=final)
    for n, (a, b) in enumerate(((0, 3), (3, 9))):
        whole = {name: torch.cat([inp[name][:, a:b], more[name]], 1) for name in inp}
        ref_o, _, _ = reference_falcon(**whole, rule="1A")
        assert rel_err(o[:, 4 * n:4 * n + 4], ref_o[:, b - a:]) <= TOL, n


def test_a_packed_call_names_a_state_of_another_number_of_rows():
    inp = _inp("1A", B=1, T=9)
    st = FalconState.fresh(torch.zeros(3, 2, 3, 4, dtype=torch.float64), rule="1A")
    with pytest.raises(ValueError, match=r"^initial_state has 3 rows, but cu_seqlens holds 2 sequences"):
        falcon_attention(**inp, cu_seqlens=torch.tensor([0, 3, 9]), initial_state=st)


def test_step_with_validate_false_skips_the_value_checks():
    """``validate=False`` skips the tensors' values: a NaN ``lam`` in row 1 is not refused and reaches that row's
    output, and row 0 is the validated step's; with ``validate=True`` it is refused, naming ``lam``."""
    inp = {n: x[:, 0] for n, x in _inp("1A").items()}
    _, st = falcon_step(**inp)
    clean, _ = falcon_step(**inp, state=st)
    inp["lam"][1, 0] = float("nan")
    o, _ = falcon_step(**inp, state=st, validate=False)
    assert bool(o[1].isnan().any()) and torch.equal(o[0], clean[0])
    with pytest.raises(ValueError, match=r"^lam must be finite and >= 0"):
        falcon_step(**inp, state=st)


def test_the_steps_last_key_is_not_a_view_of_the_callers_key_buffer():
    """A decoder may refill one key buffer with each token: the state keeps ``k_t`` in a tensor of its own, so the
    tokens run through one refilled buffer are the float64 loop's (keys already in the compute dtype included)."""
    inp = _inp("1A")
    buffers = {n: torch.empty_like(x[:, 0]) for n, x in inp.items()}
    state, outs = None, []
    for t in range(inp["q"].shape[1]):
        for n, buf in buffers.items():
            buf.copy_(inp[n][:, t])
        o, state = falcon_step(**buffers, state=state)
        outs.append(o.clone())
    ref_o, ref_S, _ = reference_falcon(**inp, rule="1A")
    assert rel_err(torch.stack(outs, 1), ref_o) <= TOL and rel_err(state.S, ref_S) <= TOL


@pytest.mark.parametrize("options", [{}, {"validate": False}, {"eps_attn": 1e-6}, {"rule": "3A"}])
def test_a_step_state_that_is_no_falcon_state_is_named(options):
    """``state`` must be a :class:`FalconState` (or ``None``): anything else raises a ``TypeError`` naming ``state``
    before any field of it is read, with or without the value checks and the normalized read."""
    inp = {n: x[:, 0] for n, x in _inp(options.get("rule", "1A")).items()}
    for bad in ("state", {"S": torch.zeros(2, 2, 3, 4)}):
        with pytest.raises(TypeError, match=r"^state must be a FalconState, got"):
            falcon_step(**inp, state=bad, **options)
