"""``falcon_trace`` against the float64 loop reference (conftest): the step sizes, carries, the
decay clamp and the memory's own prediction of each new pair, fresh and continued."""
import pytest
import torch

from conftest import RULE_NAMES, random_inputs, reference_falcon
from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter

from falcon_fwa import falcon_attention, falcon_trace

KERNELS_RUN = prepare_interpreter()  # CUDA, or Triton's interpreter on the CPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _close(a, b):
    return torch.allclose(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("options", [dict(), dict(with_gate=True), dict(scale_ridge=True, lam=0.8),
                                     dict(shift=False, normalize=False, lam=0.3)],
                         ids=["plain", "gated", "scale_ridge", "unshifted"])
def test_trace_is_the_reference_learner(rule, options):
    options = dict(options)
    inp = random_inputs(rule, T=19, lam_range=(0.0, 3.0), with_gate=options.pop("with_gate", False), seed=3)
    if "lam" in options:  # unshifted and unnormalized steps: keep eta * lam near the clamp only sometimes
        inp["lam"] = inp["lam"] * options.pop("lam") / 3.0
    q = inp.pop("q")
    _, _, ref = reference_falcon(q, **inp, rule=rule, window=3, **options)
    trace = falcon_trace(**inp, rule=rule, window=3, chunk_size=8, **options)
    assert _close(trace.eta, ref["eta"]) and _close(trace.gamma, ref["gamma"])
    assert torch.equal(trace.clamped, ref["clamped"])
    assert torch.equal(trace.valid, ref["valid"])
    assert _close(trace.prediction, ref["prediction"])
    valid = ref["valid"]
    residual = inp["v"] - ref["prediction"]
    assert _close(trace.residual[valid], residual[valid]) and trace.residual[~valid].isnan().all()
    assert _close(trace.loss[valid], 0.5 * residual.square().sum(-1)[valid]) and trace.loss[~valid].isnan().all()


def test_the_clamp_is_found_where_it_holds():
    inp = random_inputs("1", T=40, lam_range=(0.0, 3.0), seed=5)
    q = inp.pop("q")
    _, _, ref = reference_falcon(q, **inp, rule="1")
    assert ref["clamped"].any() and not ref["clamped"].all()  # the inputs put some steps on each side
    trace = falcon_trace(**inp, rule="1")
    assert torch.equal(trace.clamped, ref["clamped"])
    held = trace.gamma[trace.clamped]
    assert torch.allclose(held, torch.full_like(held, 1e-3), rtol=1e-9, atol=0)


def test_a_carry_just_above_the_floor_is_not_clamped():
    """With a large decay_floor, some unclamped steps have gamma_t within 0.1% of it: only the steps
    the clamp sets are reported as clamped."""
    inp = random_inputs("1", T=40, lam_range=(0.0, 3.0), seed=6)
    q = inp.pop("q")
    _, _, ref = reference_falcon(q, **inp, rule="1", decay_floor=0.5)
    near = ~ref["clamped"] & (ref["gamma"] <= 0.5 * 1.001)
    assert near.any()  # the inputs put a step there
    trace = falcon_trace(**inp, rule="1", decay_floor=0.5)
    assert torch.equal(trace.clamped, ref["clamped"])


@pytest.mark.parametrize("rule", ["1", "3", "3A", "2"])
@pytest.mark.parametrize("options", [dict(), dict(shift=False, scale_ridge=True, decay_floor=0.2)],
                         ids=["shifted", "unshifted"])
def test_a_continued_trace_equals_one_trace(rule, options):
    """Tracing a sequence in two segments, the second from the first one's state (its last key and
    window tail: with ``shift=False`` the tail alone, whose pairs enter the window statistic), gives
    the trace of the whole sequence."""
    inp = random_inputs(rule, T=23, lam_range=(0.0, 3.0), with_gate=True, seed=7)
    q = inp.pop("q")
    whole = falcon_trace(**inp, rule=rule, window=3, **options)
    first = {name: t[:, :10] for name, t in inp.items()}
    rest = {name: t[:, 10:] for name, t in inp.items()}
    _, state = falcon_attention(q[:, :10], **first, rule=rule, window=3, output_final_state=True, **options)
    parts = [falcon_trace(**first, rule=rule, window=3, **options),
             falcon_trace(**rest, rule=rule, window=3, initial_state=state, **options)]
    for name in ("eta", "gamma", "prediction", "residual", "loss"):
        joined = torch.cat([getattr(p, name) for p in parts], dim=1)
        assert torch.allclose(joined, getattr(whole, name), rtol=1e-9, atol=1e-12, equal_nan=True), name
    for name in ("clamped", "valid"):
        assert torch.equal(torch.cat([getattr(p, name) for p in parts], 1), getattr(whole, name)), name
    assert whole.clamped[:, 10:].any()  # the clamp holds on some continued steps
    assert parts[1].valid.all()  # the continued segment's first pair is the carried key's (or, unshifted, its own)


def test_trace_names_a_bad_argument():
    inp = random_inputs("1A", T=5)
    inp.pop("q")
    with pytest.raises(TypeError, match="lam must be a torch.Tensor"):
        falcon_trace(inp["k"], inp["v"], inp["beta"], None)
    with pytest.raises(ValueError, match="decay_floor"):
        falcon_trace(**inp, decay_floor=0.0)
    k = inp.pop("k")  # the keys are its first tensor: errors about them name k, not q
    with pytest.raises(TypeError, match=r"^k must be a torch.Tensor"):
        falcon_trace(k.tolist(), **inp)
    with pytest.raises(TypeError, match=r"^k must be a floating-point tensor"):
        falcon_trace(k.long(), **inp)
    with pytest.raises(ValueError, match=r"^k must have shape"):
        falcon_trace(k[0], **inp)
    with pytest.raises(TypeError, match=r"\bshift\b"):
        falcon_trace(k, **inp, shift="False")


def test_a_refusal_of_the_kernels_names_the_traced_argument(monkeypatch):
    """With ``backend="triton"`` the trace calls the op with ``q`` = the write features and every input in
    the compute dtype; the kernels' refusals of a dtype or a device name the trace's own argument (``lam``
    in float64, ``k`` off CUDA), not a ``q`` it does not take."""
    pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
    from falcon_fwa.ops.triton import api as triton_api

    inp = random_inputs("1A", T=6, K=16, V=16, dtype=torch.float32)
    inp.pop("q")
    with pytest.raises(NotImplementedError, match=r"^lam\.dtype=torch\.float64 is not supported"):
        falcon_trace(**dict(inp, lam=inp["lam"].double()), backend="triton")
    monkeypatch.setattr(triton_api, "_interpreting", lambda: False)  # kernels built for a GPU: CPU tensors refused
    with pytest.raises(NotImplementedError, match=r"CUDA tensors are needed by the Triton kernels, and k is on cpu"):
        falcon_trace(**inp, backend="triton")


@pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_trace_on_the_kernels_is_the_float64_trace(rule):
    """With ``backend="triton"`` (fp32 inputs; on a CPU through Triton's interpreter) the predictions
    come from the chunk kernels, which raise rather than fall back: they and the step sizes equal the
    float64 trace within fp32 rounding. Window 4 is one the rule-3 kernels take (``SLOT_COUNTS``; 3 is
    not), and spans the chunk boundaries of the 40 steps in chunks of 16."""
    pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
    inp = random_inputs(rule, T=40, K=16, V=16, with_gate=True, seed=11)
    inp.pop("q")
    ref = falcon_trace(**inp, rule=rule, window=4)
    trace = falcon_trace(**{n: t.float().to(DEVICE) for n, t in inp.items()}, rule=rule, window=4, chunk_size=16,
                         backend="triton")
    scale = ref.prediction.abs().max()
    assert (trace.prediction.cpu().double() - ref.prediction).abs().max() <= 1e-4 * scale
    assert torch.allclose(trace.eta.cpu().double(), ref.eta, rtol=1e-5, atol=1e-7)
    assert torch.equal(trace.valid.cpu(), ref.valid)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rule", ["1", "2A", "3"])
def test_a_half_precision_trace_is_the_float32_trace(rule, dtype):
    """bfloat16 and float16 inputs are traced in float32, the compute dtype the trace reports: the
    predictions (and so the residuals and losses) are not rounded to the inputs' dtype on the way,
    and equal the float64 trace of the same values within float32 rounding (the inputs' rounding,
    2^-8 for bfloat16, would be 1e-3 here)."""
    inp = random_inputs(rule, T=17, with_gate=True, seed=12, dtype=dtype)
    inp.pop("q")
    trace = falcon_trace(**inp, rule=rule, window=3)
    ref = falcon_trace(**{n: t.double() for n, t in inp.items()}, rule=rule, window=3)
    assert trace.prediction.dtype == trace.loss.dtype == torch.float32
    scale = ref.prediction.abs().max()
    assert (trace.prediction.double() - ref.prediction).abs().max() <= 1e-5 * scale
    valid = ref.valid
    assert torch.allclose(trace.loss[valid].double(), ref.loss[valid], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("shift", [True, False])
def test_a_trace_from_given_fast_weights_is_the_reference_learner(rule, shift):
    """From ``FalconState.fresh(S_init)`` (the paper's ``S_init``, a new sequence: still the sentinel
    with ``shift=True``, an empty window) the trace is the loop reference's from that ``S_0``, gated."""
    from falcon_fwa import FalconState

    inp = random_inputs(rule, T=9, lam_range=(0.0, 3.0), with_gate=True, seed=13)
    q = inp.pop("q")
    S0 = torch.randn(2, 2, 5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, _, ref = reference_falcon(q, **inp, rule=rule, window=3, shift=shift, initial_S=S0)
    state = FalconState.fresh(S0, rule=rule, window=3, shift=shift)
    trace = falcon_trace(**inp, rule=rule, window=3, shift=shift, initial_state=state)
    assert _close(trace.eta, ref["eta"]) and _close(trace.gamma, ref["gamma"])
    assert torch.equal(trace.clamped, ref["clamped"]) and torch.equal(trace.valid, ref["valid"])
    assert _close(trace.prediction, ref["prediction"])
    fresh = falcon_trace(**inp, rule=rule, window=3, shift=shift)  # from S_0 = 0: S_init shows at step 2
    assert ((trace.prediction - fresh.prediction)[:, 1].abs().flatten(1).amax(-1) > 1e-2).all()


@pytest.mark.parametrize("rule", ["3", "3A"])
@pytest.mark.parametrize("window", [1, 2, 12])
def test_a_sliding_trace_at_any_window_is_the_reference_learner(rule, window):
    """Windows of one pair, two, and longer than the sequence (every pair so far)."""
    inp = random_inputs(rule, T=10, lam_range=(0.0, 3.0), seed=14)
    q = inp.pop("q")
    _, _, ref = reference_falcon(q, **inp, rule=rule, window=window)
    trace = falcon_trace(**inp, rule=rule, window=window, chunk_size=4)
    assert _close(trace.eta, ref["eta"]) and _close(trace.gamma, ref["gamma"])
    assert torch.equal(trace.clamped, ref["clamped"]) and _close(trace.prediction, ref["prediction"])


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_zero_keys_without_a_stabilizer_take_no_step(rule):
    """``eps=0``, ``lam=0`` and zero key rows: where the denominator is exactly 0, ``eta_t = 0`` (no NaN),
    as in the reference (Eq. 3.4's convention)."""
    inp = random_inputs(rule, T=15, lam_range=(0.0, 0.0), zero_key_rows=0.4, seed=15)
    q = inp.pop("q")
    _, _, ref = reference_falcon(q, **inp, rule=rule, eps=0.0, window=2)
    trace = falcon_trace(**inp, rule=rule, eps=0.0, window=2)
    no_step = ref["eta"] == 0
    zero = trace.valid[..., None] & (no_step if no_step.dim() == 3 else no_step.all(-1))  # zero features written
    assert zero.any() and not trace.eta.isnan().any()
    assert _close(trace.eta, ref["eta"]) and _close(trace.prediction, ref["prediction"])


@pytest.mark.parametrize("rule", ["1", "2", "1A", "2A", "3A"])
@pytest.mark.parametrize("shift", [True, False])
def test_the_op_reads_the_step_the_trace_reports(rule, shift):
    """The recurrent form's read-after-write at the queries ``x_t`` is one step of the traced learner:
    ``S_t^T x_t = gamma_t p_t + eta_t ||x_t||^2 r_t`` for rules 1 and 2 (per column), ``... y_t`` for 1A
    and 2A, and ``gamma_t p_t + eta_t / B_t sum_{j in I_t} (x_j . x_t) y_j`` for 3A: the trace's eta,
    gamma and prediction are those of the op's own state, at every step up to the last (S_T)."""
    W = 3
    inp = random_inputs(rule, T=12, lam_range=(0.0, 3.0), with_gate=True, seed=16)
    inp.pop("q")
    k, v = inp["k"], inp["v"]
    x = torch.cat([torch.zeros_like(k[:, :1]), k[:, :-1]], 1) if shift else k
    o, _ = falcon_attention(x, **inp, rule=rule, window=W, shift=shift, form="recurrent")
    tr = falcon_trace(**inp, rule=rule, window=W, shift=shift)
    eta, gamma = (t if t.dim() == 4 else t[..., None] for t in (tr.eta, tr.gamma))
    if rule in ("1", "2"):
        write = (x * x).sum(-1, keepdim=True) * tr.residual.nan_to_num()
    elif rule in ("1A", "2A"):
        write = (x * x).sum(-1, keepdim=True) * v
    else:
        write = torch.zeros_like(v)
        first = 1 if shift else 0  # the sentinel is no pair of any window
        for t in range(first, k.shape[1]):
            js = range(max(first, t - W + 1), t + 1)
            write[:, t] = sum((x[:, j] * x[:, t]).sum(-1, keepdim=True) * v[:, j] for j in js) / len(js)
    assert _close(o, gamma * tr.prediction + eta * write)
