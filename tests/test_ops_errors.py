"""Bad input raises a clear error that names the argument at fault."""
from __future__ import annotations

import pytest
import torch
from conftest import random_inputs, rel_err

from falcon_fwa import falcon_attention, falcon_step


def _inp(rule="1A", **kw):
    return random_inputs(rule, B=2, T=6, H=2, K=3, V=4, seed=81, **kw)


def _call(inp, **options):
    return falcon_attention(**inp, **options)


BAD_SHAPES = {
    "q_3d": ("q", lambda i: i["q"][0], "1A", r"\bq\b"),
    "k_other_T": ("k", lambda i: i["k"][:, :5], "1A", r"\bk\b"),
    "k_other_K": ("k", lambda i: i["k"][..., :2], "1A", r"\bk\b"),
    "v_other_B": ("v", lambda i: i["v"][:1], "1A", r"\bv\b"),
    "v_other_H": ("v", lambda i: i["v"][:, :, :1], "1A", r"\bv\b"),
    "v_3d": ("v", lambda i: i["v"][..., 0], "1A", r"\bv\b"),
    "beta_per_column_for_rule1": ("beta", lambda i: i["beta"][..., None].expand(2, 6, 2, 4), "1", r"\bbeta\b"),
    "beta_scalar_for_rule2": ("beta", lambda i: i["beta"][..., 0], "2", r"\bbeta\b"),
    "beta_other_T": ("beta", lambda i: i["beta"][:, :3], "3A", r"\bbeta\b"),
    "beta_broadcastable": ("beta", lambda i: i["beta"][:1], "1A", r"\bbeta\b"),
    "lam_other_H": ("lam", lambda i: i["lam"][:, :, :1], "1A", r"\blam\b"),
    "lam_with_V": ("lam", lambda i: i["lam"][..., None].expand(2, 6, 2, 4), "2A", r"\blam\b"),
    "log_gate_shape": ("log_gate", lambda i: i["lam"][:, :, :1] * 0, "1", r"\blog_gate\b"),
}


@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_bad_shapes(case):
    name, make, rule, pattern = BAD_SHAPES[case]
    inp = _inp(rule)
    inp[name] = make(inp)
    with pytest.raises(ValueError, match=pattern):
        _call(inp, rule=rule)


@pytest.mark.parametrize(
    "option,value,pattern",
    [
        ("rule", "4", r"\brule\b"),
        ("rule", "1B", r"\brule\b"),
        ("form", "scan", r"\bform\b"),
        ("window", 0, r"\bwindow\b"),
        ("window", -2, r"\bwindow\b"),
        ("window", 2.5, r"\bwindow\b"),
        ("chunk_size", 0, r"\bchunk_size\b"),
        ("eps", -1e-6, r"\beps\b"),
        ("decay_floor", 0.0, r"\bdecay_floor\b"),
        ("decay_floor", 1.0, r"\bdecay_floor\b"),
        ("decay_floor", -0.5, r"\bdecay_floor\b"),
        ("decay_floor", None, r"\bdecay_floor\b"),
        ("decay_floor", float("nan"), r"\bdecay_floor\b"),
        ("eps", "1e-6", r"\beps\b"),
        ("eps", float("nan"), r"\beps\b"),
        ("eps", float("inf"), r"\beps\b"),
        ("read", "during", r"\bread\b"),
    ],
)
def test_bad_options(option, value, pattern):
    with pytest.raises(ValueError, match=pattern):
        _call(_inp("3A"), **{"rule": "3A", option: value})


@pytest.mark.parametrize("bad", [-1e-3, float("nan"), float("inf")])
@pytest.mark.parametrize("form", ["recurrent", "chunk"])
def test_lam_negative_nan_or_infinite(bad, form):
    inp = _inp()
    inp["lam"][1, 3, 0] = bad
    with pytest.raises(ValueError, match=r"\blam\b"):
        _call(inp, form=form)
    with pytest.raises(ValueError, match=r"\blam\b"):  # the decoding step checks the same
        falcon_step(*(inp[n][:, 3] for n in ("q", "k", "v", "beta", "lam")))


@pytest.mark.parametrize("bad", [0.1, float("nan"), float("inf")])
def test_log_gate_positive_or_nan(bad):
    inp = _inp(with_gate=True)
    inp["log_gate"][0, 2, 1] = bad
    with pytest.raises(ValueError, match=r"\blog_gate\b"):
        _call(inp)


def test_trusted_values_skip_only_the_value_checks_and_only_inside():
    """Inside ``ops.validate.trusted_values()`` a NaN ``lam`` and a NaN ``log_gate`` are not refused: the NaN
    reaches the output of the rows it is in (row 1), the other row equals the run without it; the shapes
    are still checked; after the block (also one left by an exception) the values are checked again."""
    from falcon_fwa.ops.validate import trusted_values
    inp = _inp(with_gate=True)
    clean, _ = _call(inp)
    inp["lam"][1, 3, 0] = float("nan")
    inp["log_gate"][1, 5, 1] = float("nan")
    with trusted_values():
        o, _ = _call(inp)
        with pytest.raises(ValueError, match=r"\bbeta\b"):
            _call(dict(inp, beta=inp["beta"][:, :-1]))
    assert bool(o[1].isnan().any()) and torch.equal(o[0], clean[0])
    with pytest.raises(RuntimeError, match="stop"):
        with trusted_values():
            raise RuntimeError("stop")
    with pytest.raises(ValueError, match=r"\blam\b"):
        _call(inp)


def test_log_gate_minus_infinity_is_a_reset():
    """g_t = -inf (exp(g_t) = 0) empties the state before step t: the output equals a fresh run
    on steps t.. whose first pair is still the carried key x_t = k_{t-1}."""
    inp = _inp(with_gate=True)
    inp["log_gate"][:, 3] = -float("inf")
    o, _ = _call(inp, rule="1A")
    assert torch.isfinite(o).all()
    rest = {n: inp[n][:, 3:] for n in ("q", "k", "v", "beta", "lam", "log_gate")}
    rest["log_gate"] = rest["log_gate"].clone()
    rest["log_gate"][:, 0] = 0.0
    from falcon_fwa.ops.state import FalconState
    B, H, K, V = 2, 2, 3, 4
    empty = FalconState(rule="1A", window=1, shift=True, S=torch.zeros(B, H, K, V, dtype=inp["v"].dtype),
                        last_key=inp["k"][:, 2])
    o_rest, _ = _call(rest, rule="1A", initial_state=empty)
    assert rel_err(o[:, 3:], o_rest) <= 1e-13  # float64: nothing of steps 1-2 leaks through (was atol 1e-5)


@pytest.mark.parametrize("switch", ["shift", "normalize", "scale_ridge", "output_final_state"])
def test_switches_must_be_booleans(switch):
    """A string such as "False" is truthy: refused rather than read as True."""
    with pytest.raises(TypeError, match=rf"\b{switch}\b"):
        _call(_inp(), **{switch: "False"})
    if switch != "output_final_state":
        inp = _inp()
        with pytest.raises(TypeError, match=rf"\b{switch}\b"):
            falcon_step(*(inp[n][:, 0] for n in ("q", "k", "v", "beta", "lam")), **{switch: "False"})


@pytest.mark.parametrize("make,error", [
    (lambda n: [0, 2, n], TypeError),
    (lambda n: torch.tensor([[0, 2, n]]), ValueError),
    (lambda n: torch.tensor([0.0, 2.7, n]), TypeError),
])
def test_cu_seqlens_must_be_a_1d_integer_tensor(make, error):
    inp = {n: t[:1] for n, t in _inp().items()}
    with pytest.raises(error, match=r"\bcu_seqlens\b"):
        _call(inp, cu_seqlens=make(6))


def test_non_float_and_non_tensor_inputs():
    inp = _inp()
    inp["q"] = inp["q"].long()
    with pytest.raises(TypeError, match=r"\bq\b"):
        _call(inp)
    inp = _inp()
    inp["beta"] = 0.5
    with pytest.raises(TypeError, match=r"\bbeta\b"):
        _call(inp)


def _state(rule="3A", window=3, shift=True, B=2, H=2, K=3, V=4):
    inp = random_inputs(rule, B=B, T=5, H=H, K=K, V=V, seed=82)
    return falcon_attention(**inp, rule=rule, window=window, shift=shift, output_final_state=True)[1]


@pytest.mark.parametrize(
    "make_state,rule,window,shift,pattern",
    [
        (lambda: _state("3A"), "1A", 3, True, r"initial_state.*rule"),
        (lambda: _state("1"), "2", 3, True, r"initial_state.*rule"),
        (lambda: _state("3A", window=2), "3A", 3, True, r"initial_state.*window"),
        (lambda: _state("3A", shift=False), "3A", 3, True, r"initial_state.*shift"),
        (lambda: _state("3A", B=1), "3A", 3, True, r"initial_state\.S"),
        (lambda: _state("3A", K=2), "3A", 3, True, r"initial_state\.S"),
        (lambda: _state("3A", V=5), "3A", 3, True, r"initial_state\.S"),
        (lambda: "not a state", "3A", 3, True, r"initial_state"),
    ],
    ids=["rule3A_into_1A", "rule1_into_2", "window", "shift", "batch", "key_dim", "value_dim", "type"],
)
def test_bad_initial_state(make_state, rule, window, shift, pattern):
    state = make_state()
    with pytest.raises((ValueError, TypeError), match=pattern):
        _call(_inp(rule), rule=rule, window=window, shift=shift, initial_state=state)


def test_bad_cu_seqlens():
    inp = random_inputs("1A", B=1, T=6, seed=83)
    with pytest.raises(ValueError, match=r"cu_seqlens"):
        _call(inp, cu_seqlens=torch.tensor([0, 4, 3, 6]))
    with pytest.raises(ValueError, match=r"cu_seqlens"):
        _call(inp, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"\bq\b"):
        _call(_inp(), cu_seqlens=torch.tensor([0, 3, 6]))


def test_step_checks_its_inputs():
    inp = {n: t[:, 0] for n, t in _inp("2").items()}
    with pytest.raises(ValueError, match=r"\bbeta\b"):
        falcon_step(inp["q"], inp["k"], inp["v"], inp["beta"][..., 0], inp["lam"], state=None, rule="2")
    _, st = falcon_step(**inp, state=None, rule="2")
    with pytest.raises(ValueError, match=r"\bstate\b.*rule"):
        falcon_step(**{n: t for n, t in inp.items() if n != "beta"}, beta=inp["beta"][..., 0], state=st, rule="1")


@pytest.mark.parametrize("option,value", [("read", "bogus"), ("window", 0), ("eps", -1.0), ("decay_floor", 1.0)])
def test_step_checks_its_options_even_unvalidated(option, value):
    """``validate=False`` skips the checks that wait on the tensors' values, not the host-only options:
    an unknown ``read`` would otherwise run as "before" on one backend and raise on another."""
    inp = {n: t[:, 0] for n, t in _inp("3").items()}
    with pytest.raises(ValueError, match=rf"\b{option}\b"):
        falcon_step(**inp, rule="3", validate=False, **{option: value})


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_falcon_step_names_a_tensor_with_a_time_axis(name):
    inp = {n: t[:, 0] for n, t in _inp("1A").items() if t is not None}
    inp[name] = inp[name][:, None]  # [B, 1, H, D]: a sequence of one token instead of one token
    want = r"\[B, H, V\]" if name == "v" else r"\[B, H, K\]"
    with pytest.raises(ValueError, match=rf"^{name} must have shape {want}"):
        falcon_step(**inp, state=None)


def test_window_is_checked_for_the_sliding_rules_only():
    inp = _inp("1A")
    o, _ = _call(inp, rule="1A", window=0)  # no window in rule 1A: ignored, as documented
    assert torch.equal(o, _call(inp, rule="1A", window=4)[0])
    with pytest.raises(ValueError, match=r"\bwindow\b.*3A"):
        _call(_inp("3A"), rule="3A", window=0)


@pytest.mark.parametrize("rule,name,bad,want", [
    ("1A", "beta", lambda t: t[..., None].expand(-1, -1, 4), r"^beta must have shape \[B, H\] for rule 1A = \(2, 2\)"),
    ("2", "beta", lambda t: t[..., 0], r"^beta must have shape \[B, H, V\] for the per-column rule 2 = \(2, 2, 4\)"),
    ("1A", "lam", lambda t: t[:, :1], r"^lam must have shape \[B, H\] = \(2, 2\)"),
    ("1A", "k", lambda t: t[..., :2], r"^k must have shape \[B, H, K\] like q = \(2, 2, 3\)"),
])
def test_falcon_step_shape_errors_speak_of_one_token(rule, name, bad, want):
    inp = {n: t[:, 0] for n, t in _inp(rule).items() if t is not None}
    inp[name] = bad(inp[name])
    with pytest.raises(ValueError, match=want):
        falcon_step(**inp, state=None, rule=rule)


def test_bad_initial_state_with_cu_seqlens():
    inp = random_inputs("1A", B=1, T=6, seed=84)
    with pytest.raises(TypeError, match=r"^initial_state must be a FalconState"):
        _call(inp, cu_seqlens=torch.tensor([0, 2, 6]), initial_state="not a state")


@pytest.mark.parametrize("name,value", [("q", "list"), ("k", None), ("beta", 0.5), ("lam", None), ("log_gate", -0.1),
                                        ("log_gate", "list")])
@pytest.mark.parametrize("form", ["recurrent", "parallel", "chunk"])
def test_non_tensor_arguments_are_named(name, value, form):
    """A missing or non-tensor argument raises a TypeError naming it, on every form and on the
    one-token step, before any other check or computation touches it."""
    inp = _inp("1A", with_gate=True)
    inp[name] = inp[name].tolist() if value == "list" else value
    with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor"):
        _call(inp, rule="1A", form=form)
    tok = {n: t[:, 0] if torch.is_tensor(t) else t for n, t in inp.items()}
    with pytest.raises(TypeError, match=rf"^{name} must be a torch.Tensor"):
        falcon_step(**tok, state=None, rule="1A")


@pytest.mark.parametrize("name", ["v", "beta", "lam", "log_gate"])
def test_segments_check_the_whole_call_before_cutting_it(name):
    """With ``segments > 1`` a tensor longer in time than ``q`` is refused, by the whole call's shapes,
    as without segments (the pieces would cut it to ``q``'s length and drop its last steps)."""
    inp = _inp("1A", with_gate=True)
    longer = torch.cat([inp[name], inp[name][:, :2]], dim=1)
    inp[name] = longer
    for segments in (1, 2):
        with pytest.raises(ValueError, match=rf"^{name} must have shape .*\(2, 6, 2"):
            _call(inp, rule="1A", segments=segments, chunk_size=2)


def test_falcon_state_cat_refuses_states_of_another_configuration():
    from falcon_fwa import FalconState

    inp = _inp("1A")
    states = {rule: _call(_inp(rule), rule=rule, output_final_state=True)[1] for rule in ("1", "1A", "3")}
    with pytest.raises(ValueError, match=r"states\[1\]\.rule is '1A', states\[0\]\.rule is '1'"):
        FalconState.cat([states["1"], states["1A"]])
    with pytest.raises(ValueError, match=r"states\[1\]\.rule is '1'"):
        FalconState.cat([states["3"], states["1"]])
    with pytest.raises(ValueError, match="non-empty list"):
        FalconState.cat([])
    _, no_shift = _call(inp, rule="1A", shift=False, output_final_state=True)
    with pytest.raises(ValueError, match=r"states\[1\]\.shift is False"):
        FalconState.cat([states["1A"], no_shift])
    both = FalconState.cat([states["1A"], states["1A"]])
    assert both.batch_size == 4 and torch.equal(both.S[2:], states["1A"].S)


def test_a_state_in_another_dtype_kind_or_on_another_device_is_named():
    import dataclasses

    inp = _inp("1A")
    _, state = _call(inp, rule="1A", output_final_state=True)
    with pytest.raises(TypeError, match=r"initial_state\.S must be a floating-point tensor"):
        _call(inp, rule="1A", initial_state=dataclasses.replace(state, S=state.S.long()))
    elsewhere = dataclasses.replace(state, last_key=state.last_key.to("meta"))
    with pytest.raises(ValueError, match=r"initial_state\.last_key is on meta but the inputs are on cpu"):
        _call(inp, rule="1A", initial_state=elsewhere)
    step = {n: t[:, 0] for n, t in inp.items()}
    with pytest.raises(ValueError, match=r"^state\.last_key is on meta"):
        falcon_step(**step, rule="1A", state=elsewhere, validate=False)


def test_falcon_step_checks_the_state_with_validate_false():
    """The state's configuration is host-only: ``validate=False`` still refuses a state of another rule
    (it would continue the wrong recurrence silently) or window."""
    inp = _inp("1A")
    step = {n: t[:, 0] for n, t in inp.items()}
    _, state = _call(inp, rule="1A", output_final_state=True)
    with pytest.raises(ValueError, match=r"^state comes from rule '1A', not rule '1'"):
        falcon_step(**step, rule="1", state=state, validate=False)
    _, state3 = _call(_inp("3"), rule="3", window=4, output_final_state=True)
    with pytest.raises(ValueError, match=r"^state was made with window=4, not window=2"):
        falcon_step(**step, rule="3", window=2, state=state3, validate=False)


def test_falcon_state_fresh_checks_its_arguments():
    from falcon_fwa import FalconState

    S = torch.zeros(2, 2, 3, 4)
    with pytest.raises(ValueError, match=r"^window must be an integer >= 1 for the sliding rule 3, got 2.0"):
        FalconState.fresh(S, rule="3", window=2.0)
    with pytest.raises(TypeError, match=r"^shift must be True or False, got 'no'"):
        FalconState.fresh(S, rule="1", shift="no")
    with pytest.raises(TypeError, match=r"^S must be a floating-point tensor"):
        FalconState.fresh(S.long(), rule="1")
    with pytest.raises(ValueError, match=r"^rule"):
        FalconState.fresh(S, rule="4")


def test_the_recurrent_kernel_path_refuses_a_bad_chunk_size_as_the_torch_path_does():
    inp = _inp("1A")
    for backend in ("torch", "triton"):
        with pytest.raises(ValueError, match=r"^chunk_size must be an integer >= 1, got 0"):
            _call(inp, rule="1A", form="recurrent", chunk_size=0, backend=backend)


def test_the_falcon_layer_names_a_hidden_state_of_the_wrong_width():
    from falcon_fwa.layers import FalconAttention
    from falcon_fwa.layers.packing import Packing
    from falcon_fwa.models import get_preset

    layer = FalconAttention(get_preset("tiny-falcon", hidden_size=32))
    for h in (torch.randn(2, 5, 16), torch.randn(5, 32)):
        with pytest.raises(ValueError, match=r"^h must have shape \[B, T, hidden_size=32\]"):
            layer(h, Packing.dense(2, 5, None, "cpu"))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
@pytest.mark.parametrize("how", ["plain", "eps_attn", "cu_seqlens"])
def test_a_log_gate_not_in_floating_point_is_named(dtype, how):
    """An integer log_gate is refused as falcon_step and falcon_trace refuse it (the gate's floor,
    a clamp, turned it into a float and the call ran), and a boolean one is named for its dtype
    (it was refused as a gate above 0)."""
    inp = _inp(with_gate=True)
    gate = inp["log_gate"] < -0.25
    inp["log_gate"] = gate if dtype == torch.bool else -gate.long()  # 0 or -1, a gate of exp(-1) as an integer
    options = dict(rule="1A")
    if how == "eps_attn":
        options["eps_attn"] = 0.5
    if how == "cu_seqlens":
        inp = {n: t[:1] for n, t in inp.items()}
        options["cu_seqlens"] = torch.tensor([0, 2, 6])
    with pytest.raises(TypeError, match=rf"^log_gate must be a floating-point tensor, got {dtype}"):
        _call(inp, **options)


@pytest.mark.parametrize("bad", ["int", "float", "meta"])
def test_a_sliding_tail_mask_of_another_dtype_or_device_is_named(bad):
    """tail_valid selects the window's carried pairs: a non-boolean mask or one on another device is
    named (masked_fill raised a RuntimeError naming no argument), by falcon_attention and by
    falcon_step, also with validate=False."""
    import dataclasses

    inp = _inp("3")
    _, state = _call(inp, rule="3", window=3, output_final_state=True)
    mask = {"int": state.tail_valid.long(), "float": state.tail_valid.double(),
            "meta": state.tail_valid.to("meta")}[bad]
    state = dataclasses.replace(state, tail_valid=mask)
    error, message = ((ValueError, r"tail_valid is on meta but the inputs are on cpu") if bad == "meta" else
                      (TypeError, rf"tail_valid must be a bool tensor, got {mask.dtype}"))
    with pytest.raises(error, match=rf"^initial_state\.{message}"):
        _call(inp, rule="3", window=3, initial_state=state)
    step = {n: t[:, 0] for n, t in inp.items()}
    for validate in (True, False):
        with pytest.raises(error, match=rf"^state\.{message}"):
            falcon_step(**step, rule="3", window=3, state=state, validate=validate)


@pytest.mark.parametrize("rule", ["1", "2", "3", "1A", "2A", "3A"])
def test_an_empty_key_or_value_axis_is_named(rule):
    """K = 0 or V = 0 is refused naming q or v on every form, the step and the trace (the chunk form
    of rules 1 and 3 failed on K = 0 and the parallel and chunk forms of rules 2 and 2A on V = 0
    with errors naming no argument, while the other forms returned zeros)."""
    from falcon_fwa import falcon_trace

    for name, K, V, message in (("q", 0, 2, r"^q must have at least one feature \(K >= 1\)"),
                                ("v", 2, 0, r"^v must have at least one value column \(V >= 1\)")):
        inp = random_inputs(rule, B=1, T=3, H=1, K=K, V=V, seed=84)
        for form in ("recurrent", "parallel", "chunk"):
            with pytest.raises(ValueError, match=message):
                _call(inp, rule=rule, form=form, output_final_state=True)
        with pytest.raises(ValueError, match=message):
            falcon_step(**{n: t[:, 0] for n, t in inp.items()}, rule=rule)
        with pytest.raises(ValueError, match=message.replace("^q", "^k")):  # falcon_trace's first tensor is k
            falcon_trace(inp["k"], inp["v"], inp["beta"], inp["lam"], rule=rule)
