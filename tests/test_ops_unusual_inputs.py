"""Legitimate but unusual calls of the public op, each against the float64 recurrent form.

Strided and broadcast views, aliased arguments, gradients of only some inputs, ``torch.func``
transforms, ``inference_mode`` and deterministic algorithms, degenerate sizes, and decoding steps
from a state that was cast, moved, cloned or detached between the steps.
"""
from __future__ import annotations

import pytest
import torch
import torch.func as tfunc

import falcon_fwa.ops.chunk as chunk_module
from falcon_fwa import falcon_attention, falcon_step, falcon_trace
from falcon_fwa.ops.validate import trusted_values

RULES = ["1", "2", "3", "1A", "2A", "3A"]
PER_COLUMN = {"2", "2A"}
FORMS = ["recurrent", "parallel", "chunk"]


def _inputs(rule, B=2, T=9, H=2, K=4, V=5, seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    q, k, v = randn(B, T, H, K), randn(B, T, H, K), randn(B, T, H, V)
    beta = 2 * torch.sigmoid(randn(B, T, H, V) if rule in PER_COLUMN else randn(B, T, H))
    lam = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    log_gate = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    return q, k, v, beta, lam, log_gate


def _reference(rule, q, k, v, beta, lam, log_gate=None, **options):
    """The recurrent PyTorch form on contiguous float64 copies of the inputs."""
    plain = [None if t is None else t.detach().to(torch.float64).contiguous() for t in (q, k, v, beta, lam, log_gate)]
    return falcon_attention(*plain[:5], log_gate=plain[5], rule=rule, form="recurrent", backend="torch",
                            output_final_state=True, **options)


def _weights(o):
    """Fixed, non-symmetric weights for a scalar loss of the output."""
    return torch.cos(torch.arange(o.numel(), dtype=o.dtype)).reshape(o.shape)


def _reference_gradients(rule, inputs, **options):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    o, _ = falcon_attention(*leaves[:5], log_gate=leaves[5], rule=rule, form="recurrent", backend="torch", **options)
    return torch.autograd.grad((o * _weights(o)).sum(), leaves)


def _close(a, b, rtol=1e-10):
    err = (a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-300)
    assert err <= rtol, f"relative error {err:.3g}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULES)
def test_strided_broadcast_and_aliased_inputs(rule, form):
    q, k, v, beta, lam, log_gate = _inputs(rule)
    B, T, H, V = v.shape
    # views whose memory is laid out otherwise: a transposed copy, a stepped slice, stride-0 broadcasts
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)
    spread = torch.zeros(B, 2 * T, H, 2 * V, dtype=v.dtype)
    spread[:, ::2, :, ::2] = v
    v_s = spread[:, ::2, :, ::2]
    beta_b = beta[:, :1].expand_as(beta)
    lam_b = lam[:1, :, :1].expand_as(lam)
    gate_b = log_gate[:, :, :1].expand_as(log_gate)
    assert not (q_t.is_contiguous() or v_s.is_contiguous() or beta_b.is_contiguous() or lam_b.is_contiguous())
    want, want_state = _reference(rule, q, k, v, beta_b, lam_b, gate_b, window=3)
    o, state = falcon_attention(q_t, k, v_s, beta_b, lam_b, log_gate=gate_b, rule=rule, window=3, form=form,
                                chunk_size=4, backend="torch", output_final_state=True)
    _close(o, want)
    _close(state.S, want_state.S)
    # one tensor passed as queries, keys and values (K == V)
    x = torch.randn(B, T, H, V, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    want, _ = _reference(rule, x, x.clone(), x.clone(), beta, lam, window=3)
    _close(falcon_attention(x, x, x, beta, lam, rule=rule, window=3, form=form, chunk_size=4, backend="torch")[0],
           want)


@pytest.mark.parametrize("form", ["parallel", "chunk"])
@pytest.mark.parametrize("rule", RULES)
def test_gradients_of_views_and_of_single_inputs(rule, form):
    inputs = _inputs(rule)
    want = _reference_gradients(rule, inputs, window=3)
    q, k, v, beta, lam, log_gate = inputs
    # the gradient of a stride-0 broadcast reaches its source summed over the broadcast axis
    lam_src = lam[:, :, :1].clone().requires_grad_()
    v_src = v.transpose(1, 3).contiguous().requires_grad_()
    o, _ = falcon_attention(q, k, v_src.transpose(1, 3), beta, lam_src.expand_as(lam), log_gate=log_gate, rule=rule,
                            window=3, form=form, chunk_size=4, backend="torch")
    g_lam, g_v = torch.autograd.grad((o * _weights(o)).sum(), (lam_src, v_src))
    ref = _reference_gradients(rule, (q, k, v, beta, lam[:, :, :1].expand_as(lam), log_gate), window=3)
    _close(g_lam, ref[4].sum(-1, keepdim=True), 1e-9)
    _close(g_v.transpose(1, 3), ref[2], 1e-9)
    # only one input asks for a gradient
    for i in range(6):
        args = [t.detach().clone().requires_grad_(j == i) for j, t in enumerate(inputs)]
        o, _ = falcon_attention(*args[:5], log_gate=args[5], rule=rule, window=3, form=form, chunk_size=4,
                                backend="torch")
        (g,) = torch.autograd.grad((o * _weights(o)).sum(), args[i])
        _close(g, want[i], 1e-9)


@pytest.mark.parametrize("rule", RULES)
def test_func_grad_and_vjp_are_the_autograd_gradients(rule):
    inputs = _inputs(rule)
    want = _reference_gradients(rule, inputs, window=3)

    def loss(*args):
        o, _ = falcon_attention(*args[:5], log_gate=args[5], rule=rule, window=3, chunk_size=4, backend="torch")
        return (o * _weights(o)).sum()

    for got, ref in zip(tfunc.grad(loss, argnums=tuple(range(6)))(*inputs), want):
        _close(got, ref, 1e-9)
    q, k, v, beta, lam, log_gate = inputs
    o, pullback = tfunc.vjp(lambda v: falcon_attention(q, k, v, beta, lam, log_gate=log_gate, rule=rule, window=3,
                                                        form="parallel", backend="torch")[0], v)
    _close(pullback(_weights(o))[0], want[2], 1e-9)


@pytest.mark.parametrize("rule", ["2", "2A"])
def test_func_grad_of_the_per_column_rules_in_column_groups(rule, monkeypatch):
    """Past ``BLOCK_ELEMENTS`` the per-column chunk form runs its columns in groups that the backward
    recomputes; under ``torch.func.grad`` (which takes no saved-tensor hooks) it still gives the
    gradients, as at a size where the columns run at once."""
    monkeypatch.setattr(chunk_module, "BLOCK_ELEMENTS", 200)  # a few columns per group
    inputs = _inputs(rule, V=7)
    want = _reference_gradients(rule, inputs)

    def loss(*args):
        o, _ = falcon_attention(*args[:5], log_gate=args[5], rule=rule, chunk_size=4, backend="torch")
        return (o * _weights(o)).sum()

    for got, ref in zip(tfunc.grad(loss, argnums=tuple(range(6)))(*inputs), want):
        _close(got, ref, 1e-9)
    # and plain autograd, which recomputes the groups in the backward, the same
    leaves = [t.clone().requires_grad_() for t in inputs]
    for got, ref in zip(torch.autograd.grad(loss(*leaves), leaves), want):
        _close(got, ref, 1e-9)


@pytest.mark.parametrize("rule", RULES)
def test_vmap_over_an_extra_leading_axis_with_trusted_values(rule):
    first, second = _inputs(rule, seed=2), _inputs(rule, seed=3)
    stacked = [torch.stack(pair) for pair in zip(first, second)]
    batched = tfunc.vmap(lambda q, k, v, b, l, g: falcon_attention(q, k, v, b, l, log_gate=g, rule=rule, window=3,
                                                                   chunk_size=4, backend="torch")[0])
    # the value checks read lam and log_gate on the host, which vmap cannot batch: refused by name
    with pytest.raises(RuntimeError, match=r"^lam cannot be checked under torch.func.vmap .*trusted_values\(\)"):
        batched(*stacked)
    with trusted_values():
        out = batched(*stacked)
    for row, inputs in zip(out, (first, second)):
        _close(row, _reference(rule, *inputs, window=3)[0])


def test_per_sample_gradients_of_lam_name_the_check_then_match_one_sample_at_a_time():
    """``vmap(grad(f))`` over ``lam`` (per-sample gradients): inside the vmap the flag is wrapped by grad's
    transform, and the refusal still names ``lam`` and the way out; within ``trusted_values()`` each sample's
    gradient is that of its own call."""
    q, k, v, beta, lam, _ = _inputs("1", seed=4)
    lams = torch.stack([lam, lam.flip(1)])

    def loss(l):
        o, _ = falcon_attention(q, k, v, beta, l, rule="1", chunk_size=4, backend="torch")
        return (o * _weights(o)).sum()

    per_sample = tfunc.vmap(tfunc.grad(loss))
    with pytest.raises(RuntimeError, match=r"^lam cannot be checked under torch.func.vmap .*trusted_values\(\)"):
        per_sample(lams)
    with trusted_values():
        got = per_sample(lams)
    for row, l in zip(got, lams):  # each sample alone, by plain autograd
        leaf = l.clone().requires_grad_()
        _close(row, torch.autograd.grad(loss(leaf), leaf)[0], 1e-9)


def test_a_host_read_that_fails_outside_vmap_keeps_its_own_error(monkeypatch):
    """Only vmap's failure becomes the named refusal: another RuntimeError of the host read passes unchanged."""
    from falcon_fwa.ops import validate

    class Unreadable(torch.Tensor):
        def __bool__(self):
            raise RuntimeError("the device is gone")

    flag = torch.tensor(True).as_subclass(Unreadable)
    with pytest.raises(RuntimeError, match="^the device is gone$"):
        validate._check_values(flag, "lam must be finite")


@pytest.mark.parametrize("rule", RULES)
def test_inference_mode_no_grad_and_deterministic_algorithms(rule):
    inputs = _inputs(rule)
    want, want_state = _reference(rule, *inputs[:5], inputs[5], window=3)
    with torch.inference_mode():
        o, state = falcon_attention(*inputs[:5], log_gate=inputs[5], rule=rule, window=3, chunk_size=4,
                                    backend="torch", output_final_state=True)
    _close(o, want)
    _close(state.S, want_state.S)
    leaves = [t.clone().requires_grad_() for t in inputs]
    with torch.no_grad():
        o, _ = falcon_attention(*leaves[:5], log_gate=leaves[5], rule=rule, window=3, form="parallel",
                                backend="torch")
    assert not o.requires_grad
    _close(o, want)
    grads = _reference_gradients(rule, inputs, window=3)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        o, _ = falcon_attention(*leaves[:5], log_gate=leaves[5], rule=rule, window=3, chunk_size=4, backend="torch")
        got = torch.autograd.grad((o * _weights(o)).sum(), leaves)
    finally:
        torch.use_deterministic_algorithms(was)
    _close(o, want)
    for g, ref in zip(got, grads):
        _close(g, ref, 1e-9)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("sizes", [(1, 1, 1, 1, 1, 64), (1, 7, 1, 1, 1, 3), (1, 5, 1, 3, 1, 100), (2, 11, 1, 1, 3, 4)],
                         ids=["T1-K1-V1", "K1-V1-ragged", "V1-chunk-over-T", "K1-odd"])
@pytest.mark.parametrize("shift", [True, False])
def test_degenerate_sizes(rule, sizes, shift):
    B, T, H, K, V, chunk = sizes
    inputs = _inputs(rule, B=B, T=T, H=H, K=K, V=V, seed=T + K)
    want, want_state = _reference(rule, *inputs[:5], inputs[5], window=3, shift=shift)
    for form in ("parallel", "chunk"):
        o, state = falcon_attention(*inputs[:5], log_gate=inputs[5], rule=rule, window=3, form=form, shift=shift,
                                    chunk_size=chunk, backend="torch", output_final_state=True)
        _close(o, want)
        _close(state.S, want_state.S)


@pytest.mark.parametrize("rule", RULES)
def test_steps_from_a_state_cast_moved_cloned_and_detached(rule):
    inputs = _inputs(rule, T=10)
    want, want_state = _reference(rule, *inputs[:5], inputs[5], window=3)
    o, state = falcon_attention(*(t[:, :4].float() for t in inputs[:5]), log_gate=inputs[5][:, :4].float(),
                                rule=rule, window=3, chunk_size=3, backend="torch", output_final_state=True)
    outs = [o.double()]
    moves = [lambda s: s.to(torch.float64), lambda s: s.to(device="cpu"), lambda s: s.clone(),
             lambda s: s.detach(), lambda s: s.to(dtype=torch.float32), lambda s: s.index_select([0, 1])]
    for t, move in zip(range(4, 10), moves):
        state = move(state)
        o, state = falcon_step(*(x[:, t].float() for x in inputs[:5]), log_gate=inputs[5][:, t].float(),
                               state=state, rule=rule, window=3, backend="torch")
        outs.append(o[:, None].double())
    _close(torch.cat(outs, 1), want, 2e-6)
    _close(state.S, want_state.S, 2e-6)
    assert state.S.dtype == torch.float32
    assert state.tail_valid is None or state.tail_valid.dtype == torch.bool


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULES)
def test_a_state_and_inputs_made_under_inference_mode_take_gradients(rule, form):
    """A state returned under ``inference_mode`` (a cache made while serving), and any input made there,
    passed unchanged to a call that records gradients: autograd cannot save such a tensor for the backward,
    so the call works on a copy. Outputs, final state and the gradients of q, k, v are those of the same call
    from a normal copy of the state, and those of the float64 recurrent form."""
    inputs = _inputs(rule, T=12)
    head, tail = [t[:, :5] for t in inputs], [t[:, 5:] for t in inputs]
    with torch.inference_mode():
        _, state = falcon_attention(*head[:5], log_gate=head[5], rule=rule, window=3, chunk_size=4, backend="torch",
                                    output_final_state=True)
        made_there = [t.clone() for t in tail]
    assert state.S.is_inference() and all(t.is_inference() for t in made_there)
    normal = state.clone()
    assert not normal.S.is_inference()
    ref_leaves = [t.clone().requires_grad_() for t in tail[:3]]
    ref_o, ref_state = falcon_attention(*ref_leaves, *tail[3:5], log_gate=tail[5], rule=rule, window=3,
                                        form="recurrent", backend="torch", initial_state=normal,
                                        output_final_state=True)
    ref_grads = torch.autograd.grad((ref_o * _weights(ref_o)).sum() + ref_state.S.sum(), ref_leaves)

    def call(args, initial_state, segments=1):
        leaves = [t.clone().requires_grad_() if i < 3 and not t.is_inference() else t for i, t in enumerate(args)]
        o, final = falcon_attention(*leaves[:5], log_gate=leaves[5], rule=rule, window=3, form=form, chunk_size=2,
                                    backend="torch", initial_state=initial_state, output_final_state=True,
                                    segments=segments)
        wrt = [t for t in leaves[:3] if t.requires_grad]
        return o, final, torch.autograd.grad((o * _weights(o)).sum() + final.S.sum(), wrt)

    want_o, want_state, want_grads = call(tail, normal)
    _close(want_o, ref_o)
    _close(want_state.S, ref_state.S)
    for g, ref in zip(want_grads, ref_grads):
        _close(g, ref, 1e-9)
    for segments in (1, 2):
        o, final, grads = call(tail, state, segments)  # the state itself, as it came out of inference_mode
        _close(o, want_o)
        _close(final.S, want_state.S)
        for g, ref in zip(grads, want_grads):
            _close(g, ref, 1e-9)
    for i in range(6):  # one input at a time made under inference_mode; the others of q, k, v take gradients
        args = list(tail)
        args[i] = made_there[i]
        o, final, grads = call(args, state)
        _close(o, want_o)
        _close(final.S, want_state.S)
        for g, ref in zip(grads, [r for j, r in enumerate(want_grads) if j != i]):
            _close(g, ref, 1e-9)
    assert state.S.is_inference()  # the caller's state is left as it was


@pytest.mark.parametrize("rule", RULES)
def test_steps_from_a_state_made_under_inference_mode_take_gradients(rule):
    """``falcon_step`` from a state (and with gains) made under ``inference_mode``, with gradients recorded:
    the step and the gradients of q, k, v are those from a normal copy, and those of the float64 recurrent form."""
    inputs = _inputs(rule, T=6)
    with torch.inference_mode():
        _, state = falcon_attention(*(t[:, :5] for t in inputs[:5]), log_gate=inputs[5][:, :5], rule=rule,
                                    window=3, backend="torch", output_final_state=True)
        beta, lam = inputs[3][:, 5].clone(), inputs[4][:, 5].clone()
    ref_leaves = [t[:, 5:].clone().requires_grad_() for t in inputs[:3]]
    ref_o, _ = falcon_attention(*ref_leaves, inputs[3][:, 5:], inputs[4][:, 5:], log_gate=inputs[5][:, 5:], rule=rule,
                                window=3, form="recurrent", backend="torch", initial_state=state.clone())
    ref_grads = torch.autograd.grad((ref_o[:, 0] * _weights(ref_o[:, 0])).sum(), ref_leaves)
    leaves = [t[:, 5].clone().requires_grad_() for t in inputs[:3]]
    o, _ = falcon_step(*leaves, beta, lam, log_gate=inputs[5][:, 5], state=state, rule=rule, window=3,
                       backend="torch")
    _close(o, ref_o[:, 0])
    for g, ref in zip(torch.autograd.grad((o * _weights(o)).sum(), leaves), ref_grads):
        _close(g, ref[:, 0], 1e-9)


@pytest.mark.parametrize("rule", RULES)
def test_func_transforms_of_segments_are_the_autograd_gradients(rule):
    """``segments > 1`` under ``torch.func.grad``, ``vjp`` and ``jvp`` (which take no ``autograd.Function``
    without ``setup_context``): the pieces run one after the other under the transform, and the gradients of
    the inputs and of the initial state are those of the float64 recurrent form by ``torch.autograd.grad``."""
    from dataclasses import replace
    inputs = _inputs(rule, T=15)
    _, start = _reference(rule, *(t[:, :3] for t in inputs[:5]), inputs[5][:, :3], window=3)
    tail = [t[:, 3:] for t in inputs]

    def loss(form, segments, S, *args):
        o, final = falcon_attention(*args[:5], log_gate=args[5], rule=rule, window=3, form=form, chunk_size=3,
                                    backend="torch", initial_state=replace(start, S=S), output_final_state=True,
                                    segments=segments)
        return (o * _weights(o)).sum() + (final.S * torch.sin(final.S)).sum()

    leaves = [t.clone().requires_grad_() for t in (start.S, *tail)]
    want = torch.autograd.grad(loss("recurrent", 1, *leaves), leaves)
    for form in ("chunk", "parallel"):
        got = tfunc.grad(lambda *a: loss(form, 3, *a), argnums=tuple(range(7)))(start.S, *tail)
        for g, ref in zip(got, want):
            _close(g, ref, 1e-9)
    value, pullback = tfunc.vjp(lambda v: loss("chunk", 4, start.S, *tail[:2], v, *tail[3:]), tail[2])
    _close(value, loss("recurrent", 1, start.S, *tail))
    _close(pullback(torch.ones((), dtype=value.dtype))[0], want[3], 1e-9)
    direction = torch.cos(torch.arange(tail[0].numel(), dtype=torch.float64)).reshape(tail[0].shape)
    _, slope = tfunc.jvp(lambda q: loss("chunk", 2, start.S, q, *tail[1:]), (tail[0],), (direction,))
    _close(slope, (want[1] * direction).sum(), 1e-9)


def test_func_grad_of_segments_over_packed_sequences():
    """The packed pieces (groups of whole sequences) under ``torch.func.grad``: the gradients of one
    packed call without pieces, by ``torch.autograd.grad``, and those of each sequence on its own."""
    q, k, v, beta, lam, log_gate = (t[:1] for t in _inputs("3", T=13))
    cu = torch.tensor([0, 4, 9, 13])

    def loss(segments, *args):
        o, _ = falcon_attention(*args[:5], log_gate=args[5], rule="3", window=3, chunk_size=2, backend="torch",
                                cu_seqlens=cu, segments=segments)
        return (o * _weights(o)).sum()

    args = (q, k, v, beta, lam, log_gate)
    got = tfunc.grad(lambda *a: loss(3, *a), argnums=tuple(range(6)))(*args)
    leaves = [t.clone().requires_grad_() for t in args]
    want = torch.autograd.grad(loss(1, *leaves), leaves)
    for g, ref in zip(got, want):
        _close(g, ref, 1e-9)
    weights = _weights(v)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):  # each sequence alone, by the recurrent form
        parts = [t[:, a:b].clone().requires_grad_() for t in args]
        o, _ = falcon_attention(*parts[:5], log_gate=parts[5], rule="3", window=3, form="recurrent", backend="torch")
        ref = torch.autograd.grad((o * weights[:, a:b]).sum(), parts)
        for g, r in zip(got, ref):
            _close(g[:, a:b], r, 1e-9)


@pytest.mark.parametrize("rule", RULES)
def test_meta_tensors_give_the_shapes_of_a_real_call(rule):
    """On the meta device (tensors with shapes and no values, for shape inference) the value checks have
    nothing to read and pass: every form, with pieces, gradients and a decoding step, returns what the same
    call on the CPU returns, shape for shape and dtype for dtype. Packed sequences, laid out from the values of
    ``cu_seqlens``, are refused by name."""
    cpu = [t.float() for t in _inputs(rule)]
    meta = [t.to("meta") for t in cpu]

    def call(args, form, segments):
        leaves = [t.clone().requires_grad_(i < 3) for i, t in enumerate(args)]
        o, state = falcon_attention(*leaves[:5], log_gate=leaves[5], rule=rule, window=3, form=form, chunk_size=2,
                                    backend="torch", output_final_state=True, segments=segments)
        grads = torch.autograd.grad((o * o).sum() + state.S.sum(), leaves[:3])
        o2, step = falcon_step(*(t[:, 0] for t in args[:5]), log_gate=args[5][:, 0], state=state, rule=rule,
                               window=3, backend="torch")
        tensors = [o, *grads, o2, *(getattr(s, f) for s in (state, step) for f in
                                    ("S", "last_key", "tail_x", "tail_y", "tail_valid"))]
        return [None if t is None else (tuple(t.shape), t.dtype, t.device.type) for t in tensors]

    for form in FORMS:
        for segments in (1, 3):
            got, want = call(meta, form, segments), call(cpu, form, segments)
            assert [None if g is None else g[:2] for g in got] == [None if w is None else w[:2] for w in want]
            assert {g[2] for g in got if g is not None} == {"meta"}
    with pytest.raises(ValueError, match="^cu_seqlens: .*meta device"):
        falcon_attention(*(t[:1] for t in meta[:5]), log_gate=meta[5][:1], rule=rule, window=3, backend="torch",
                         cu_seqlens=torch.tensor([0, 4, 9]))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULES)
def test_forward_mode_tangents_through_segments(rule, form):
    """Dual tensors of ``torch.autograd.forward_ad`` (a tangent for q and for the initial state) through
    ``segments > 1``: the output's tangent is the directional derivative that the reverse-mode gradients of the
    float64 recurrent form give, and the backward of the same call still gives those gradients."""
    import torch.autograd.forward_ad as fwAD
    from dataclasses import replace
    inputs = _inputs(rule, T=14)
    _, start = _reference(rule, *(t[:, :2] for t in inputs[:5]), inputs[5][:, :2], window=3)
    q, k, v, beta, lam, log_gate = (t[:, 2:] for t in inputs)
    dq = torch.sin(torch.arange(q.numel(), dtype=q.dtype)).reshape(q.shape)
    dS = torch.cos(torch.arange(start.S.numel(), dtype=q.dtype)).reshape(start.S.shape)
    leaves = [q.clone().requires_grad_(), start.S.clone().requires_grad_()]
    ref, _ = falcon_attention(leaves[0], k, v, beta, lam, log_gate=log_gate, rule=rule, window=3, form="recurrent",
                              backend="torch", initial_state=replace(start, S=leaves[1]))
    g_q, g_S = torch.autograd.grad((ref * _weights(ref)).sum(), leaves)
    q_leaf = q.clone().requires_grad_()
    with fwAD.dual_level():
        o, _ = falcon_attention(fwAD.make_dual(q_leaf, dq), k, v, beta, lam, log_gate=log_gate, rule=rule, window=3,
                                form=form, chunk_size=2, backend="torch", segments=3,
                                initial_state=replace(start, S=fwAD.make_dual(start.S, dS)))
        primal, tangent = fwAD.unpack_dual(o)
        _close(primal, ref)
        _close((tangent * _weights(ref)).sum(), (g_q * dq).sum() + (g_S * dS).sum(), 1e-9)
    (g,) = torch.autograd.grad((o * _weights(o)).sum(), q_leaf)
    _close(g, g_q, 1e-9)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULES)
def test_writing_into_the_initial_state_before_the_backward_never_changes_the_gradients(rule, form):
    """A caller that writes into the initial state's tensors between the forward and the backward (a buffer
    refilled in place): the backward either raises autograd's error for a saved tensor modified in place or
    gives the gradients of the values the forward ran on, never those of the new values; with ``segments``
    as in one call, whose backward runs its first piece again from that state."""
    inputs = _inputs(rule, T=11)
    _, start = _reference(rule, *(t[:, :3] for t in inputs[:5]), inputs[5][:, :3], window=3)
    tail = [t[:, 3:] for t in inputs]

    def forward(state, segments):
        leaves = [t.clone().requires_grad_(i < 3) for i, t in enumerate(tail)]
        o, _ = falcon_attention(*leaves[:5], log_gate=leaves[5], rule=rule, window=3, form=form, chunk_size=2,
                                backend="torch", initial_state=state, segments=segments)
        return leaves[:3], (o * _weights(o)).sum()

    want = _reference_gradients(rule, tail, window=3, initial_state=start)[:3]
    for segments in (1, 2):
        for field in ("S", "last_key", "tail_x", "tail_y"):
            if getattr(start, field) is None:
                continue
            state = start.clone()
            leaves, loss = forward(state, segments)
            with torch.no_grad():
                getattr(state, field).mul_(0.5).add_(0.25)
            try:
                got = torch.autograd.grad(loss, leaves)
            except RuntimeError as err:
                assert "modified by an inplace operation" in str(err)
                continue
            for g, ref in zip(got, want):
                _close(g, ref, 1e-9)


@pytest.mark.parametrize("rule", RULES)
def test_traces_of_a_state_and_gains_made_under_inference_mode_take_gradients(rule):
    """``falcon_trace`` from a state, and with ``beta``, ``lam`` and ``log_gate``, made under ``inference_mode``, with
    gradients recorded for ``k`` and ``v``: the trace and its gradients are those of normal copies."""
    inputs = _inputs(rule, T=11)
    with torch.inference_mode():
        _, state = falcon_attention(*(t[:, :4] for t in inputs[:5]), log_gate=inputs[5][:, :4], rule=rule, window=3,
                                    backend="torch", output_final_state=True)
        gains = [t[:, 4:].clone() for t in inputs[3:]]

    def trace(initial_state, beta, lam, log_gate):
        k, v = (t[:, 4:].clone().requires_grad_() for t in inputs[1:3])
        tr = falcon_trace(k, v, beta, lam, log_gate=log_gate, rule=rule, window=3, chunk_size=3, backend="torch",
                          initial_state=initial_state)
        weights = _weights(tr.prediction)
        loss = (tr.prediction * weights).sum() + (tr.eta * torch.cos(tr.eta)).sum()
        return tr, torch.autograd.grad(loss, (k, v))

    want, want_grads = trace(state.clone(), *(t.clone() for t in gains))
    got, grads = trace(state, *gains)
    for field in ("eta", "gamma", "prediction", "loss"):
        _close(getattr(got, field).nan_to_num(), getattr(want, field).nan_to_num())
    for g, ref in zip(grads, want_grads):
        _close(g, ref, 1e-9)


def test_only_tensors_made_under_inference_mode_and_only_where_gradients_are_recorded_are_copied():
    """The copies the op makes of tensors made under ``inference_mode`` (``ops.api._outside_inference``): outside
    that mode with gradients on, each such tensor (an input, a state field) is copied and every other tensor passes
    as the same object; with gradients off, and inside ``inference_mode`` even with ``enable_grad`` (where nothing
    is recorded), nothing is copied, so an ordinary call or a serving one costs no copy."""
    from falcon_fwa.ops.api import _outside_inference

    q, k, v, beta, lam, log_gate = _inputs("3")
    _, plain_state = falcon_attention(q, k, v, beta, lam, log_gate=log_gate, rule="3", window=3, backend="torch",
                                      output_final_state=True)
    with torch.inference_mode():
        made_there = q.clone()
        _, state = falcon_attention(q, k, v, beta, lam, log_gate=log_gate, rule="3", window=3, backend="torch",
                                    output_final_state=True)
    fields = [f for f in ("S", "last_key", "tail_x", "tail_y", "tail_valid", "z") if getattr(state, f) is not None]
    assert len(fields) >= 4 and all(getattr(state, f).is_inference() for f in fields)
    tensors = (made_there, k, v, beta, lam, None)

    (got, got_state) = _outside_inference(tensors, state)  # gradients on, outside inference_mode
    assert not got[0].is_inference() and got[0] is not made_there and torch.equal(got[0], made_there)
    assert all(a is b for a, b in zip(got[1:], tensors[1:]))
    for f in fields:
        assert not getattr(got_state, f).is_inference() and torch.equal(getattr(got_state, f), getattr(state, f))
    assert _outside_inference((q, k), plain_state)[1] is plain_state
    assert all(a is b for a, b in zip(_outside_inference((q, k), None)[0], (q, k)))

    def unchanged():
        got, got_state = _outside_inference(tensors, state)
        return got_state is state and all(a is b for a, b in zip(got, tensors))

    with torch.no_grad():
        assert unchanged()
    with torch.inference_mode(), torch.enable_grad():
        assert torch.is_grad_enabled() and unchanged()
