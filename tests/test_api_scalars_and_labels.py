"""The op's scalar options taken as numbers (numpy's scalars too, as ``FalconConfig`` takes them), and the
refusals that name the argument for everything else."""
import math

import numpy as np
import pytest
import torch

from falcon_fwa.ops.api import falcon_attention, falcon_step
from falcon_fwa.ops.rules import get_rule
from falcon_fwa.ops.state import FalconState
from falcon_fwa.ops.trace import falcon_trace
from falcon_fwa.ops.validate import check_chunk_size, check_number, check_options, check_positive_int

B, T, H, K, V = 2, 9, 2, 4, 3


def _inputs(rule: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=torch.float64)
    beta_shape = (B, T, H, V) if get_rule(rule).per_column else (B, T, H)
    beta = torch.rand(*beta_shape, generator=g, dtype=torch.float64)
    lam = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    return q, k, v, beta, lam


# values a float32 or float16 holds exactly, so the numpy scalar and the Python number are the same value
PYTHON = dict(window=3, chunk_size=4, eps=0.25, decay_floor=0.125, segments=2)
NUMPY = dict(window=np.int64(3), chunk_size=np.int32(4), eps=np.float32(0.25), decay_floor=np.float16(0.125),
             segments=np.int64(2))


@pytest.mark.parametrize("rule", ["1", "2A", "3", "3A"])
@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
def test_falcon_attention_takes_numpy_scalars_as_the_python_numbers(rule, form):
    q, k, v, beta, lam = _inputs(rule)
    o_py, s_py = falcon_attention(q, k, v, beta, lam, rule=rule, form=form, output_final_state=True, **PYTHON)
    o_np, s_np = falcon_attention(q, k, v, beta, lam, rule=rule, form=form, output_final_state=True, **NUMPY)
    assert torch.equal(o_py, o_np)
    assert torch.equal(s_py.S, s_np.S)
    assert s_np.window == s_py.window
    # a state made with numpy's window continues a call made with Python's
    o2, _ = falcon_attention(q, k, v, beta, lam, rule=rule, form=form, initial_state=s_np, **PYTHON)
    o2_ref, _ = falcon_attention(q, k, v, beta, lam, rule=rule, form=form, initial_state=s_py, **PYTHON)
    assert torch.equal(o2, o2_ref)


@pytest.mark.parametrize("rule", ["1", "3A"])
def test_falcon_step_and_trace_take_numpy_scalars(rule):
    q, k, v, beta, lam = _inputs(rule, seed=1)
    step_py = {n: PYTHON[n] for n in ("window", "eps", "decay_floor")}
    step_np = {n: NUMPY[n] for n in ("window", "eps", "decay_floor")}
    o_py, s_py = falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], rule=rule, **step_py)
    o_np, s_np = falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], rule=rule, **step_np)
    assert torch.equal(o_py, o_np) and torch.equal(s_py.S, s_np.S)
    # the step is the recurrent form's first step
    o_seq, _ = falcon_attention(q[:, :1], k[:, :1], v[:, :1], beta[:, :1], lam[:, :1], rule=rule, form="recurrent",
                                **step_py)
    torch.testing.assert_close(o_np, o_seq[:, 0], rtol=1e-12, atol=1e-12)
    trace_py = falcon_trace(k, v, beta, lam, rule=rule, chunk_size=4, **step_py)
    trace_np = falcon_trace(k, v, beta, lam, rule=rule, chunk_size=np.int64(4), **step_np)
    for field in ("eta", "gamma", "clamped", "prediction", "valid"):
        assert torch.equal(getattr(trace_py, field), getattr(trace_np, field)), field
    fresh = FalconState.fresh(torch.zeros(B, H, K, V, dtype=torch.float64), rule=rule, window=np.int64(3))
    assert fresh.window == (3 if get_rule(rule).sliding else 1) and type(fresh.window) is int
    assert type(s_np.window) is int  # the state a call returns holds the Python number too


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_the_normalized_read_takes_eps_attn_as_a_numpy_scalar(form):
    q, k, v, beta, lam = (t.abs() if t.dim() == 4 else t for t in _inputs("1A", seed=2))
    want, _ = falcon_attention(q, k, v, beta, lam, rule="1A", form=form, eps_attn=0.5)
    got, _ = falcon_attention(q, k, v, beta, lam, rule="1A", form=form, eps_attn=np.float32(0.5))
    assert torch.equal(want, got)
    o_py, _ = falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], rule="1A", eps_attn=0.5)
    o_np, _ = falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], rule="1A", eps_attn=np.float16(0.5))
    assert torch.equal(o_py, o_np)
    with pytest.raises(ValueError, match="eps_attn must be a finite number >= 0"):
        falcon_attention(q, k, v, beta, lam, rule="1A", form=form, eps_attn=np.float32("nan"))


def test_the_checks_return_python_numbers():
    spec = get_rule("3")
    window, eps, decay_floor = check_options(spec, window=np.int16(5), eps=np.float32(0.5),
                                             decay_floor=np.float64(0.25), read="after")
    assert (window, eps, decay_floor) == (5, 0.5, 0.25)
    assert type(window) is int and type(eps) is float and type(decay_floor) is float
    assert type(check_chunk_size(np.uint8(7))) is int and check_chunk_size(np.uint8(7)) == 7
    assert type(check_positive_int("segments", np.int64(3))) is int
    assert type(check_number("eps", 1, 0, math.inf)) is float  # an int is a number, returned as a float


BAD = [
    ("window", np.array([3, 3]), r"^window must be an integer >= 1 for the sliding rule 3, got array"),
    ("window", np.array(3), r"^window must be an integer >= 1 for the sliding rule 3, got array"),
    ("window", "3", r"^window must be an integer >= 1 for the sliding rule 3, got '3'"),
    ("window", True, r"^window must be an integer >= 1 for the sliding rule 3, got True"),
    ("window", np.bool_(True), r"^window must be an integer >= 1 for the sliding rule 3, got np.True_"),
    ("window", np.float32(3.0), r"^window must be an integer >= 1 for the sliding rule 3, got 3.0"),
    ("window", np.int64(0), r"^window must be an integer >= 1 for the sliding rule 3, got 0"),
    ("chunk_size", np.array([4, 4]), r"^chunk_size must be an integer >= 1, got array"),
    ("chunk_size", "4", r"^chunk_size must be an integer >= 1, got '4'"),
    ("chunk_size", np.bool_(True), r"^chunk_size must be an integer >= 1, got np.True_"),
    ("chunk_size", np.float64(4.0), r"^chunk_size must be an integer >= 1, got 4.0"),
    ("chunk_size", np.int64(-2), r"^chunk_size must be an integer >= 1, got -2"),
    ("segments", np.array([2, 2]), r"^segments must be an integer >= 1, got array"),
    ("segments", True, r"^segments must be an integer >= 1, got True"),
    ("segments", np.float32(2), r"^segments must be an integer >= 1, got 2.0"),
    ("eps", np.array([0.1, 0.2]), r"^eps must be a number, got array"),
    ("eps", "0.1", r"^eps must be a number, got '0.1'"),
    ("eps", True, r"^eps must be a number, got True"),
    ("eps", np.bool_(False), r"^eps must be a number, got np.False_"),
    ("eps", np.float32("nan"), r"^eps must lie in \[0, inf\), got nan"),
    ("eps", np.float32("inf"), r"^eps must lie in \[0, inf\), got inf"),
    ("eps", np.float32(-0.5), r"^eps must lie in \[0, inf\), got -0.5"),
    ("decay_floor", np.array([0.5, 0.5]), r"^decay_floor must be a number, got array"),
    ("decay_floor", np.float64("nan"), r"^decay_floor must lie in \(0, 1\), got nan"),
    ("decay_floor", np.float32(1.0), r"^decay_floor must lie in \(0, 1\), got 1.0"),
    ("decay_floor", np.True_, r"^decay_floor must be a number, got np.True_"),
]


@pytest.mark.parametrize("name,value,message", BAD, ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_falcon_attention_refuses_what_is_no_such_number_by_name(name, value, message):
    q, k, v, beta, lam = _inputs("3")
    with pytest.raises(ValueError, match=message):
        falcon_attention(q, k, v, beta, lam, rule="3", form="chunk", **{**PYTHON, name: value})


@pytest.mark.parametrize("name,value,message", [b for b in BAD if b[0] in ("window", "eps", "decay_floor")],
                         ids=[f"{n}={v!r}" for n, v, _ in BAD if n in ("window", "eps", "decay_floor")])
def test_falcon_step_and_trace_refuse_by_name(name, value, message):
    q, k, v, beta, lam = _inputs("3")
    options = {n: PYTHON[n] for n in ("window", "eps", "decay_floor")}
    with pytest.raises(ValueError, match=message):
        falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], rule="3", **{**options, name: value})
    with pytest.raises(ValueError, match=message):
        falcon_trace(k, v, beta, lam, rule="3", **{**options, name: value})


# ----------------------------------------------------------------------------- FalconForCausalLM.forward
def _lm(seed: int = 0, **overrides):
    from falcon_fwa.models import FalconForCausalLM, get_preset
    torch.manual_seed(seed)
    return FalconForCausalLM(get_preset("tiny-falcon", **overrides)).to(torch.float64).eval()


def _cache_of(out):
    return getattr(out, "cache", None) if "cache" in out.__dataclass_fields__ else out.past_key_values


@pytest.mark.parametrize("bad", ["no", "False", 1, 0, 1.0, torch.tensor(True), np.int64(1)],
                         ids=repr)
def test_forward_refuses_a_use_cache_that_is_no_bool_by_name(bad):
    model = _lm()
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    with pytest.raises(TypeError, match=r"^use_cache must be True, False or None, got "):
        model(input_ids=ids, use_cache=bad)


def test_forward_use_cache_none_true_false_and_numpy_bools():
    """None follows the config (a cache in eval mode, none in training, True with a cache given); True and
    np.True_ return a cache that continues the sequence as the whole sequence's forward does; False and
    np.False_ return none."""
    model = _lm(seed=1)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(3))
    whole = model(input_ids=ids, use_cache=False)
    assert _cache_of(whole) is None
    assert _cache_of(model(input_ids=ids, use_cache=np.False_)) is None
    assert _cache_of(model(input_ids=ids)) is not None  # config.use_cache is True, eval mode
    model.train()
    assert _cache_of(model(input_ids=ids)) is None
    model.eval()
    for flag in (True, np.True_, None):
        first = model(input_ids=ids[:, :4], use_cache=True)
        rest = model(input_ids=ids[:, 4:], past_key_values=_cache_of(first), use_cache=flag)
        assert _cache_of(rest) is not None
        torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), whole.logits, rtol=1e-9, atol=1e-9)


def _reference_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean of ``-log softmax(logits[:, t])[labels[:, t + 1]]`` over the targets that are not -100, in float64."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1] - 1):
            target = int(labels[b, t + 1])
            if target == -100:
                continue
            row = logits[b, t].double()
            total = total + (row.exp().sum().log() - row[target])
            count += 1
    return total / count


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16])
def test_labels_in_the_vocabulary_and_the_ignore_index_score_as_cross_entropy(dtype):
    model = _lm(seed=2)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, V, (2, 6), generator=g)
    labels = ids.clone()
    labels[0, 2] = labels[1, 5] = -100
    labels[0, 4], labels[1, 1] = 0, V - 1  # the vocabulary's first and last ids
    out = model(input_ids=ids, labels=labels.to(dtype), use_cache=False)
    torch.testing.assert_close(out.loss, _reference_loss(out.logits, labels), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad", ["V", "V+7", -1, -5, -99, -101, -(2 ** 40)])
@pytest.mark.parametrize("where", [(0, 1), (1, 3)], ids=["second-column", "later"])
def test_labels_outside_the_vocabulary_are_refused_by_name_before_the_model_runs(bad, where):
    """A scored label neither -100 nor in [0, vocab) is a ValueError naming labels, the id and the vocabulary
    size, also beside -100s (the ignored ids are not taken for the smallest), and before the cache moves."""
    model = _lm(seed=2)
    V = model.config.vocab_size
    shown = value = {"V": V, "V+7": V + 7}.get(bad, bad)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(5))
    labels = ids.clone()
    labels[:, -1] = -100
    labels[where] = value
    cache = _cache_of(model(input_ids=ids[:, :2], use_cache=True))
    seen = cache.get_seq_length()
    with pytest.raises(ValueError, match=rf"^labels holds token id {shown}, outside the vocabulary \[0, {V}\)"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match=rf"^labels holds token id {shown}, outside the vocabulary \[0, {V}\)"):
        model(input_ids=ids[:, 2:], labels=labels[:, 2:] if where[1] >= 3 else labels[:, :4], past_key_values=cache)
    assert cache.get_seq_length() == seen


@pytest.mark.parametrize("bad", [-1, "V+7"])
def test_labels_the_loss_never_reads_are_not_checked(bad):
    """The first column's label (no logits before it), a pad's and the label after a pad are not scored: any
    value there gives the loss of -100 there, as before the range check existed."""
    model = _lm(seed=2)
    V = model.config.vocab_size
    value = V + 7 if bad == "V+7" else bad
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # row 1 left-padded by two
    labels = ids.clone()
    labels[0, 0] = labels[1, 0] = labels[1, 1] = labels[1, 2] = value  # first column, pads, the token after them
    plain = labels.clone()
    plain[0, 0] = plain[1, 0] = plain[1, 1] = plain[1, 2] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    want = model(input_ids=ids, attention_mask=mask, labels=plain, use_cache=False)
    assert torch.equal(out.loss, want.loss)
    torch.testing.assert_close(out.loss, _reference_loss(want.logits, plain), rtol=1e-10, atol=1e-12)


def test_labels_of_a_narrow_dtype_out_of_the_vocabulary_are_refused():
    model = _lm(seed=2)
    V = model.config.vocab_size
    ids = torch.randint(0, V, (1, 4), generator=torch.Generator().manual_seed(6))
    labels = ids.to(torch.uint8)
    labels[0, 2] = 200
    with pytest.raises(ValueError, match=rf"^labels holds token id 200, outside the vocabulary \[0, {V}\)"):
        model(input_ids=ids, labels=labels, use_cache=False)


@pytest.mark.parametrize("value,want", [
    (np.int64(3), 3), (np.uint8(200), 200), (np.int32(-4), -4), (7, 7),
    (np.float32(0.5), 0.5), (np.float16(0.125), 0.125), (np.float64(2.0), 2.0), (0.25, 0.25),
])
def test_plain_number_gives_the_python_number(value, want):
    from falcon_fwa.ops.validate import plain_number
    got = plain_number(value)
    assert got == want and type(got) is type(want)


@pytest.mark.parametrize("value", [True, np.bool_(False), "3", None, np.array([1, 2]), np.array(3), 1 + 2j])
def test_plain_number_leaves_what_is_no_real_number_to_the_checks(value):
    from falcon_fwa.ops.validate import plain_number
    assert plain_number(value) is value


def test_numpy_values_assigned_to_a_built_config_are_stored_as_python_numbers_and_save(tmp_path):
    from falcon_fwa import FalconConfig, FalconForCausalLM

    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, rule="3A", window=2)
    config.window, config.chunk_size, config.eps = np.int64(3), np.int32(8), np.float32(0.25)
    config.shift, config.lambda_scale = np.bool_(True), np.float64(0.5)
    torch.manual_seed(0)
    model = FalconForCausalLM(config).eval()  # checks the fields, as assigned
    assert (config.window, config.chunk_size, config.eps, config.shift, config.lambda_scale) == (3, 8, 0.25, True, 0.5)
    assert [type(getattr(config, f)) for f in ("window", "chunk_size", "eps", "shift", "lambda_scale")] == \
        [int, int, float, bool, float]
    model.save_pretrained(tmp_path)
    again = FalconForCausalLM.from_pretrained(tmp_path).eval()
    assert (again.config.window, again.config.chunk_size, again.config.eps) == (3, 8, 0.25)
    ids = torch.randint(0, 64, (2, 11))
    assert torch.equal(model(ids).logits, again(ids).logits)


def test_a_numpy_window_that_is_no_integer_is_still_refused_for_a_sliding_rule():
    from falcon_fwa import FalconConfig

    config = FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, rule="3A", window=2)
    config.window = np.float32(2.5)
    with pytest.raises(ValueError, match=r"config field 'window' must be an integer >= 1 for the sliding rule '3A'"):
        config.validate_fields()


@pytest.mark.parametrize("name,value,message", [("eps", 10 ** 400, r"^eps must lie in \[0, inf\), got 1000"),
                                                ("decay_floor", -10 ** 400, r"^decay_floor must lie in \(0, 1\), got -1000")],
                         ids=["eps", "decay_floor"])
def test_an_integer_past_floats_range_is_refused_by_name(name, value, message):
    q, k, v, beta, lam = _inputs("1")
    with pytest.raises(ValueError, match=message):
        falcon_attention(q, k, v, beta, lam, rule="1", **{name: value})
