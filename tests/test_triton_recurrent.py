"""The fused recurrent kernel (segments and decoding steps, all six rules) against float64 references.

References: the literal loop of the paper's rules in ``conftest.reference_falcon`` (fresh
sequences; it shares no code with the op), and ``falcon_attention(form="recurrent")`` /
``falcon_step`` in float64 for what it does not cover (continued states, packed sequences,
the normalized read). Runs on the CPU through Triton's interpreter without CUDA, on the GPU
with it."""
from __future__ import annotations


import pytest
import torch

from conftest import RULE_NAMES, reference_falcon
from kernel_checks import in_this_process, kernel_inputs, needs_cuda, rel_norm

pytestmark = in_this_process
pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take

from falcon_fwa import FalconState, falcon_attention, falcon_step  # noqa: E402
from falcon_fwa.ops.triton import falcon_recurrent_triton, falcon_step_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
OP = ("q", "k", "v", "beta", "lam")
# (shift, read, gate, normalize, scale_ridge)
SWITCHES = [(True, "after", True, True, False), (False, "before", False, False, False),
            (True, "before", True, True, True)]


def _state(leaves, rule, window, shift):
    if leaves.get("S0") is None:
        return None
    W = window if rule in ("3", "3A") else 1
    return FalconState(rule=rule, window=W, shift=shift, S=leaves["S0"], last_key=leaves["last_key"] if shift else None,
                       tail_x=leaves.get("tail_x"), tail_y=leaves.get("tail_y"), tail_valid=leaves.get("tail_valid"))


def _run(op, leaves, *, rule, window, shift, dtype=None, **switches):
    t = {n: None if x is None else (x.to(DEVICE, dtype) if dtype is not None and x.is_floating_point()
                                     else x.to(DEVICE)) for n, x in leaves.items()}
    return op(*(t[n] for n in OP), rule=rule, window=window, shift=shift, log_gate=t.get("log_gate"),
              initial_state=_state(t, rule, window, shift), output_final_state=True, **switches)


def _fused(leaves, **kw):
    return _run(falcon_recurrent_triton, leaves, dtype=torch.float32, **kw)


def _reference(leaves, **kw):
    return _run(falcon_attention, leaves, dtype=torch.float64, form="recurrent", backend="torch", **kw)


def _assert_states_equal(ours, ref, tol):
    assert rel_norm(ours.S, ref.S) < tol
    if ref.last_key is not None:
        assert torch.allclose(ours.last_key.double().cpu(), ref.last_key.double().cpu(), atol=tol)
    if ref.tail_x is not None:
        assert torch.equal(ours.tail_valid.cpu(), ref.tail_valid.cpu())
        m = ref.tail_valid.cpu()[:, None, :, None]  # what empty slots hold is not part of the state
        for a, b in ((ours.tail_x, ref.tail_x), (ours.tail_y, ref.tail_y)):
            assert torch.allclose(torch.where(m, a.double().cpu(), 0.0), torch.where(m, b.double().cpu(), 0.0),
                                  atol=tol)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("shift,read,gate,normalize,scale_ridge", SWITCHES)
def test_fused_segment_matches_the_papers_loop(rule, shift, read, gate, normalize, scale_ridge):
    # a fresh segment: every output and the final state against the literal float64 loop
    B, T, H, K, V, W = 2, 7, 2, 20, 24, 3  # ragged head dims; a window that is not a power of two
    leaves = kernel_inputs(B, T, H, K, V, torch.float64, seed=1, rule=rule, gate=gate)
    sw = dict(read=read, normalize=normalize, scale_ridge=scale_ridge)
    o, final = _fused(leaves, rule=rule, window=W, shift=shift, **sw)
    ref_o, ref_S, _ = reference_falcon(*(leaves[n] for n in OP), rule=rule, window=W, shift=shift,
                                       log_gate=leaves["log_gate"], **sw)
    assert o.dtype == torch.float32
    assert rel_norm(o.cpu(), ref_o) < 1e-5
    assert rel_norm(final.S.cpu(), ref_S) < 1e-5


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("window", [2, 4])
def test_fused_segments_continue_exactly(rule, window):
    # from a carried state (matrix, last key, a tail with an empty slot) over two segments, against
    # the float64 recurrent form over the whole sequence
    B, T, H, K, V = 2, 9, 2, 16, 12
    leaves = kernel_inputs(B, T, H, K, V, torch.float64, seed=2, rule=rule, window=window, state=True,
                           empty_slot=float("nan"))  # the empty slot's garbage must not reach anything
    first = {n: (x[:, :4] if n in OP + ("log_gate",) else x) for n, x in leaves.items()}
    o1, mid = _fused(first, rule=rule, window=window, shift=True)
    second = {n: x[:, 4:] for n, x in leaves.items() if n in OP + ("log_gate",)}
    second.update(S0=mid.S, last_key=mid.last_key, tail_x=mid.tail_x, tail_y=mid.tail_y, tail_valid=mid.tail_valid)
    o2, final = _fused(second, rule=rule, window=window, shift=True)
    ref_o, ref = _reference(leaves, rule=rule, window=window, shift=True)
    assert rel_norm(torch.cat([o1, o2], 1), ref_o) < 1e-5
    _assert_states_equal(final, ref, 1e-5)


@pytest.mark.parametrize("rule", ["1A", "2", "3", "3A"])
def test_fused_packed_sequences(rule):
    # cu_seqlens: three sequences of 3, 4 and 1 tokens, each from its own carried state
    H, K, V, W = 2, 16, 16, 4
    leaves = kernel_inputs(1, 8, H, K, V, torch.float64, seed=3, rule=rule, window=W, state=True, N=3)
    cu = torch.tensor([0, 3, 7, 8], dtype=torch.int32)
    o, final = _fused(leaves, rule=rule, window=W, shift=True, cu_seqlens=cu.to(DEVICE))
    ref_o, ref = _reference(leaves, rule=rule, window=W, shift=True, cu_seqlens=cu)
    assert rel_norm(o, ref_o) < 1e-5
    _assert_states_equal(final, ref, 1e-5)


def _decode(step, seq, T, **options):
    state, outs = None, []
    for t in range(T):
        a = {n: None if x is None else x[:, t] for n, x in seq.items()}
        o, state = step(a["q"], a["k"], a["v"], a["beta"], a["lam"], log_gate=a["log_gate"], state=state, **options)
        outs.append(o)
    return torch.stack(outs, 1), state


def _sequence(rule, B, T, H, K, V, dtype, seed, gate):
    leaves = kernel_inputs(B, T, H, K, V, torch.float64, seed=seed, rule=rule, gate=gate)
    return {n: None if leaves[n] is None else leaves[n].to(DEVICE, dtype) for n in OP + ("log_gate",)}


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("shift,read,gate,normalize,scale_ridge", SWITCHES)
def test_step_matches_reference(rule, shift, read, gate, normalize, scale_ridge):
    # token by token from a fresh state: the window fills through the carried tail
    B, T, H, K, V = 2, 6, 2, 16, 20
    options = dict(rule=rule, window=3, shift=shift, read=read, normalize=normalize, scale_ridge=scale_ridge)
    ours = _decode(falcon_step_triton, _sequence(rule, B, T, H, K, V, torch.float32, 0, gate), T, **options)
    ref = _decode(falcon_step, _sequence(rule, B, T, H, K, V, torch.float64, 0, gate), T, backend="torch", **options)
    assert rel_norm(ours[0], ref[0]) < 1e-5
    _assert_states_equal(ours[1], ref[1], 1e-5)


@pytest.mark.parametrize("rule", ["1A", "2A", "3A"])
def test_fused_normalized_read(rule):
    # eps_attn: the normalizer z is the kernel's own recurrence on values of one (steps and a segment)
    B, T, H, K, V = 2, 5, 2, 16, 8
    seq = _sequence(rule, B, T, H, K, V, torch.float64, 4, True)
    seq["q"], seq["k"] = seq["q"].abs(), seq["k"].abs()  # nonnegative features: a positive denominator
    f32 = {n: None if x is None else x.float() for n, x in seq.items()}
    options = dict(rule=rule, window=2, eps_attn=1e-3)
    ours = _decode(falcon_step, f32, T, backend="triton", **options)
    ref = _decode(falcon_step, seq, T, backend="torch", **options)
    assert rel_norm(ours[0], ref[0]) < 1e-5
    assert rel_norm(ours[1].z, ref[1].z) < 1e-5
    o, _ = falcon_attention(*(f32[n] for n in OP), log_gate=f32["log_gate"], form="recurrent", backend="triton",
                            **options)
    assert rel_norm(o, ref[0]) < 1e-5


@pytest.mark.parametrize("rule", ["1", "3A"])
def test_fused_hard_reset_gate(rule):
    # a gate of -inf empties the memory before that step's write, as in the recurrent form
    B, T, H, K, V = 1, 6, 2, 16, 16
    leaves = kernel_inputs(B, T, H, K, V, torch.float64, seed=5, rule=rule)
    leaves["log_gate"][:, 3] = float("-inf")
    o, final = _fused(leaves, rule=rule, window=2, shift=True)
    ref_o, ref = _reference(leaves, rule=rule, window=2, shift=True)
    assert torch.isfinite(o).all()
    assert rel_norm(o, ref_o) < 1e-5
    assert rel_norm(final.S, ref.S) < 1e-5


def test_fused_refuses_what_it_does_not_cover():
    q = torch.randn(1, 2, 1, 16, device=DEVICE)
    b = torch.rand(1, 2, 1, device=DEVICE)
    with pytest.raises(NotImplementedError, match="gradients"):
        falcon_recurrent_triton(q.clone().requires_grad_(), q, q, b, b)
    with pytest.raises(NotImplementedError, match="window=17"):
        falcon_recurrent_triton(q, q, q, b, b, rule="3A", window=17)
    with pytest.raises(NotImplementedError, match="float64"):
        falcon_recurrent_triton(q.double(), q, q, b, b)
    with pytest.raises(ValueError, match="form='parallel'"):
        falcon_attention(q, q, q, b, b, form="parallel", backend="triton")
    with pytest.raises(ValueError, match=r"\bbeta\b"):  # the op's own checks come first
        falcon_attention(q, q, q, b[..., None].expand(-1, -1, -1, 16), b, form="recurrent", backend="triton")
    # without gradients the forward of a model that requires them runs (torch.no_grad)
    with torch.no_grad():
        o, _ = falcon_recurrent_triton(q.clone().requires_grad_(), q, q, b, b)
    assert o.shape == q.shape


def test_fused_refuses_gradients_of_the_state_and_a_normalizer_state():
    # a state that requires a gradient (a learned S0, or one carried through) needs the PyTorch forms or the chunk
    # kernels: the fused kernel refuses it instead of returning a result cut from the graph
    seq = _sequence("1", 1, 2, 2, 16, 8, torch.float32, 9, False)
    a = {n: None if x is None else x[:, 0] for n, x in seq.items()}
    state = FalconState(rule="1", window=1, shift=True, S=torch.randn(1, 2, 16, 8, device=DEVICE, requires_grad=True),
                        last_key=torch.randn(1, 2, 16, device=DEVICE))
    with pytest.raises(NotImplementedError, match="state"):
        falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], state=state, rule="1", backend="triton")
    with pytest.raises(NotImplementedError, match="state"):
        falcon_attention(*(seq[n] for n in OP), rule="1", initial_state=state, form="recurrent", backend="triton")
    o, new = falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], state=state, rule="1", backend="torch")
    assert o.requires_grad and new.S.requires_grad
    with torch.no_grad():  # without gradients it runs
        falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], state=state, rule="1", backend="triton")
    z_state = FalconState(rule="1A", window=1, shift=True, S=state.S.detach(), last_key=state.last_key,
                          z=torch.zeros(1, 2, 16, device=DEVICE))
    with pytest.raises(ValueError, match="normalizer z"):
        falcon_step_triton(a["q"], a["k"], a["v"], a["beta"], a["lam"], state=z_state, rule="1A")


def test_auto_short_prompts_dispatch(monkeypatch):
    # backend="auto", form="chunk" where the chunk kernels serve (stood in for here, so that the choice is tested on
    # any machine): up to the rule's limits and without gradients of the inputs or the state, the fused kernel
    import falcon_fwa.ops.api as api
    import falcon_fwa.ops.triton as ops_triton
    fused, chunk = [], []
    real = ops_triton.falcon_recurrent_triton

    def spy(*args, **kwargs):
        fused.append(args[0].shape[1])
        return real(*args, **kwargs)

    def fake_chunk(q, k, v, beta, lam, **kwargs):
        chunk.append(q.shape[1])
        kwargs.pop("validate")
        return falcon_attention(q, k, v, beta, lam, form="chunk", backend="torch", **kwargs)

    monkeypatch.setattr(ops_triton, "falcon_recurrent_triton", spy)
    monkeypatch.setattr(ops_triton, "SHORT_PROMPT_LIMITS", {"3A": (8, 2 * 8 * 2)})
    monkeypatch.setattr(api, "_triton_chunk", lambda backend, q, rule: fake_chunk)
    leaves = kernel_inputs(2, 12, 2, 16, 16, torch.float32, seed=10, rule="3A", state=True, window=4)
    t = {n: None if x is None else x.to(DEVICE) for n, x in leaves.items()}
    cut = [t[n][:, :8] for n in OP]
    gate8 = t["log_gate"][:, :8]
    state = _state(t, "3A", 4, True)
    with torch.no_grad():
        short, _ = falcon_attention(*cut, rule="3A", log_gate=gate8, initial_state=state)
        falcon_attention(*(t[n] for n in OP), rule="3A", log_gate=t["log_gate"])  # 12 steps
        with pytest.raises(ValueError, match="chunk_size"):  # what the chunk form refuses, the fused path refuses
            falcon_attention(*cut, rule="3A", log_gate=gate8, chunk_size=0)
    falcon_attention(*cut, rule="3A", log_gate=gate8.clone().requires_grad_())  # an input needs a gradient
    grad_state = FalconState(**{**state.__dict__, "S": state.S.clone().requires_grad_()})
    falcon_attention(*cut, rule="3A", log_gate=gate8, initial_state=grad_state)  # the state needs one
    assert fused == [8] and chunk == [12, 8, 8]
    ref, _ = falcon_attention(*(x.double() for x in cut), rule="3A", log_gate=gate8.double(),
                              initial_state=_state({n: None if x is None or not x.is_floating_point() else x.double()
                                                    for n, x in t.items()} | {"tail_valid": t["tail_valid"]},
                                                   "3A", 4, True),
                              form="recurrent", backend="torch")
    assert rel_norm(short, ref) < 1e-5


def test_auto_step_takes_only_gpu_checked_rules(monkeypatch):
    # backend="auto" takes the fused step for STEP_RULES only; "triton" forces it for any rule
    import falcon_fwa.ops.triton as ops_triton
    seq = _sequence("3A", 1, 1, 2, 16, 16, torch.float32, 6, False)
    a = {n: None if x is None else x[:, 0] for n, x in seq.items()}
    calls = []
    real = ops_triton.falcon_step_triton

    def spy(*args, **kwargs):
        calls.append(kwargs["rule"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops_triton, "falcon_step_triton", spy)
    monkeypatch.setattr(ops_triton, "STEP_RULES", ("1A",))
    falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], state=None, rule="3A", backend="triton")
    assert calls == ["3A"]
    if CUDA:
        falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], state=None, rule="3A", backend="auto")
        assert calls == ["3A"]  # not in STEP_RULES: the PyTorch step
        falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], state=None, rule="1A", backend="auto")
        assert calls == ["3A", "1A"]


def test_fused_step_checks_its_inputs_like_the_torch_step():
    seq = _sequence("1A", 2, 1, 2, 16, 16, torch.float32, 5, True)
    a = {n: x[:, 0] for n, x in seq.items()}
    bad = dict(a, lam=-a["lam"])
    if not CUDA:  # on a GPU a bad value is a device-side assertion (test below); it would end this process's context
        with pytest.raises(ValueError, match=r"\blam\b"):
            falcon_step(bad["q"], bad["k"], bad["v"], bad["beta"], bad["lam"], log_gate=bad["log_gate"], state=None,
                        rule="1A", backend="triton")
    with pytest.raises(ValueError, match=r"\bbeta\b"):
        falcon_step(a["q"], a["k"], a["v"], a["beta"][..., None].expand(-1, -1, 16), a["lam"],
                    log_gate=a["log_gate"], state=None, rule="1A", backend="triton")
    _, state = falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], log_gate=a["log_gate"], state=None, rule="1",
                           backend="triton")
    with pytest.raises(ValueError, match=r"\bstate\b.*rule"):
        falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], log_gate=a["log_gate"], state=state, rule="1A",
                    backend="triton")
    # validate=False: the caller vouches for its inputs (the model's layers); the kernel runs unchecked
    o, _ = falcon_step(bad["q"], bad["k"], bad["v"], bad["beta"], bad["lam"], log_gate=bad["log_gate"], state=None,
                       rule="1A", backend="triton", validate=False)
    assert o.shape == a["v"].shape


@needs_cuda
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_fused_cuda_bf16_head_dim_128(rule):
    # bf16 inputs at the presets' head dims, decoding from a prompt run as one fused segment
    B, T, H, K, V, P = 4, 32, 6, 128, 128, 8
    seq = _sequence(rule, B, T, H, K, V, torch.bfloat16, 1, True)
    prompt = {n: None if x is None else x[:, :P] for n, x in seq.items()}
    o_p, state = falcon_attention(*(prompt[n] for n in OP), log_gate=prompt["log_gate"], rule=rule, form="recurrent",
                                  backend="triton", output_final_state=True)
    outs = [o_p]
    for t in range(P, T):
        a = {n: None if x is None else x[:, t] for n, x in seq.items()}
        o, state = falcon_step_triton(a["q"], a["k"], a["v"], a["beta"], a["lam"], log_gate=a["log_gate"],
                                      state=state, rule=rule)
        outs.append(o[:, None])
    ours = torch.cat(outs, 1)
    seq64 = {n: None if x is None else x.double() for n, x in seq.items()}
    ref_o, ref = falcon_attention(*(seq64[n] for n in OP), log_gate=seq64["log_gate"], rule=rule, form="recurrent",
                                  backend="torch", output_final_state=True)
    assert ours.dtype == torch.bfloat16
    assert rel_norm(ours, ref_o) < 1e-2
    assert rel_norm(state.S, ref.S) < 1e-3


@needs_cuda
@pytest.mark.parametrize("rule", RULE_NAMES)
def test_fused_segment_equals_the_chunk_kernels(rule):
    # the two kernels of the op agree on a prompt (fp32, exact products), state included
    B, T, H, K, V = 2, 100, 4, 64, 64
    leaves = kernel_inputs(B, T, H, K, V, torch.float32, seed=7, rule=rule, window=4, state=True)
    o, final = _run(falcon_recurrent_triton, leaves, rule=rule, window=4, shift=True)
    ref_o, ref = _run(falcon_attention, leaves, rule=rule, window=4, shift=True, backend="triton")
    assert rel_norm(o, ref_o) < 1e-4
    _assert_states_equal(final, ref, 1e-4)


@needs_cuda
def test_auto_runs_short_prompts_without_gradients_on_the_fused_kernel(monkeypatch):
    # backend="auto", form="chunk": up to SHORT_PROMPT_LIMITS steps and no gradient, the fused kernel; else the
    # chunk kernels
    import falcon_fwa.ops.triton as ops_triton
    calls = []
    real = ops_triton.falcon_recurrent_triton

    def spy(*args, **kwargs):
        calls.append(args[0].shape[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(ops_triton, "falcon_recurrent_triton", spy)
    monkeypatch.setattr(ops_triton, "SHORT_PROMPT_LIMITS", {"3A": (8, 2 * 8 * 2), "2A": (8, 2 * 4 * 2)})
    leaves = kernel_inputs(2, 12, 2, 32, 32, torch.float32, seed=8, rule="3A")
    t = {n: None if x is None else x.to(DEVICE) for n, x in leaves.items()}
    args = [t[n] for n in OP]
    with torch.no_grad():
        short, _ = falcon_attention(*(a[:, :8] for a in args), rule="3A", log_gate=t["log_gate"][:, :8])
        falcon_attention(*args, rule="3A", log_gate=t["log_gate"])  # 12 steps: the chunk kernels
        falcon_attention(*(a[:, :8] for a in args), rule="1A", log_gate=t["log_gate"][:, :8])  # not in the table
        falcon_attention(*(a[:, :8] for a in args[:3]), args[3][:, :8, :, None].expand(-1, -1, -1, 32).contiguous(),
                         args[4][:, :8], rule="2A")  # more steps times rows times heads than 2A's limit
    q = args[0][:, :8].clone().requires_grad_()
    falcon_attention(q, *(a[:, :8] for a in args[1:]), rule="3A", log_gate=t["log_gate"][:, :8])  # gradients
    assert calls == [8]
    ref, _ = falcon_attention(*(a[:, :8].double() for a in args), rule="3A", log_gate=t["log_gate"][:, :8].double(),
                              form="recurrent", backend="torch")
    assert rel_norm(short, ref) < 1e-5


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_fused_new_sequence_from_given_fast_weights(rule):
    """``FalconState.fresh`` on the fused kernel and its decoding step: the first step is the sentinel
    (no write, no shrink of ``S0``), then as the float64 recurrent form and ``falcon_step``."""
    B, T, H, K, V, W = 2, 6, 2, 20, 24, 3
    leaves = kernel_inputs(B, T, H, K, V, torch.float64, seed=4, rule=rule, window=W, state=True, sentinel=True)
    leaves["lam"] = leaves["lam"] * 6.0  # a ridge that would shrink S0 at an ordinary first step
    o, final = _fused(leaves, rule=rule, window=W, shift=True)
    ref_o, ref_final = _reference(leaves, rule=rule, window=W, shift=True)
    assert rel_norm(o.cpu(), ref_o) < 1e-5
    _assert_states_equal(final, ref_final, 1e-5)
    state = FalconState.fresh(leaves["S0"].to(DEVICE, torch.float32), rule=rule, window=W)
    for t in range(T):
        step = {n: leaves[n][:, t].to(DEVICE, torch.float32) for n in OP}
        o_t, state = falcon_step_triton(*(step[n] for n in OP), state=state, rule=rule, window=W,
                                        log_gate=leaves["log_gate"][:, t].to(DEVICE, torch.float32))
        assert rel_norm(o_t.cpu(), ref_o[:, t]) < 1e-5, t
    _assert_states_equal(state, ref_final, 1e-5)
