"""Properties of RoPE attention, the token layouts, the norms, the fla glue of the baselines and the graphed
decoding step that the other layer tests leave open, each against a reference written here: RoPE's angles at
long positions in float32 against the float64 rotation, the attention calls at exactly ``MAX_CALLS_PER_ROW``
sequences, ``Packing``'s documented counts, the l2 feature norm's ``eps`` under the root, RMSNorm's default and
refused ``eps``, which recurrence each set of op switches names, ``fla_backend.run`` on stand-ins of fla's three
kernels (float64 loops of the recurrences fla documents, its ``scale=None`` meaning ``K^-1/2``) against the
library's own op, and ``GraphedDecoder``'s recording on the CPU stand-ins of ``test_serve_graphs``: the warm-up on
a copy, the cache put back after a failed capture, a cache tensor whose shape a step changes refused."""
import math
import sys
import types

import pytest
import torch

from falcon_fwa.layers import (CausalSelfAttention, LayerCache, Packing, RMSNorm, apply_rope, cu_seqlens_from_lengths,
                               fla_backend)
from falcon_fwa.layers import attention as attention_module
from falcon_fwa.layers.norms import normalize_features
from falcon_fwa.models import get_preset
from falcon_fwa.ops import FalconState, falcon_attention
from falcon_fwa.serve import graphs
from falcon_fwa.serve.graphs import GraphedDecoder
from test_serve_graphs import _cache_tensors, _model, cpu_graphs  # noqa: F401 (a fixture)

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


# ----------------------------------------------------------------------------- RoPE attention
def test_rope_keeps_float32_inputs_at_float32_accuracy_far_into_a_sequence():
    """The angles ``p theta^{-2i/d}`` are formed in float64 and only ``cos``/``sin`` rounded to the input's dtype:
    at positions near 10^5 a float32 angle is off by ``p * 2^-24 ~ 10^-2`` rad, far above float32's rounding of
    the rotated values. Reference: the complex rotation of ``(x_i, x_{i + d/2})`` in float64."""
    torch.manual_seed(0)
    d = 16
    x = torch.randn(1, 3, 2, d)
    pos = torch.tensor([[99_991, 123_457, 131_071]])
    freq = 10_000.0 ** (-torch.arange(d // 2, dtype=F64) * 2.0 / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2:].double())
    z = z * torch.exp(1j * pos.double()[..., None, None] * freq)
    want = torch.cat([z.real, z.imag], -1)
    got = apply_rope(x, pos, 10_000.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-6)


def test_exactly_max_calls_per_row_sequences_get_one_causal_call_each(monkeypatch):
    """"above ``MAX_CALLS_PER_ROW`` sequences ... one call with a block-diagonal causal mask": at the limit itself
    every sequence still has its own call (keys of its own length, no mask), with the same output."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(get_preset("tiny-transformer")).double()
    lengths = [4, 2, 5]
    h = torch.randn(1, sum(lengths), layer.q_proj.in_features, dtype=F64)
    packing = Packing.from_cu_seqlens(cu_seqlens_from_lengths(torch.tensor(lengths)), torch.arange(3), None)
    sdpa, calls = attention_module.F.scaled_dot_product_attention, []

    def recording(q, k, v, *args, **kwargs):
        calls.append((k.shape[-2], kwargs.get("attn_mask") is None))
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recording)
    monkeypatch.setattr(attention_module, "MAX_CALLS_PER_ROW", 3)
    with torch.no_grad():
        y = layer(h, packing)
        alone = torch.cat([layer(h[:, a:b], Packing.dense(1, b - a, None, "cpu"))
                           for a, b in ((0, 4), (4, 6), (6, 11))], 1)
    assert calls[:3] == [(4, True), (2, True), (5, True)], calls
    torch.testing.assert_close(y, alone, rtol=1e-12, atol=1e-12)


def test_a_step_without_gradients_leaves_the_buffers_an_earlier_step_saved_for_backward():
    """Frozen weights, gradients on the inputs of a prefill and one step, then a step whose input needs none: its
    new key does not require grad, but the cache's buffers do, and the earlier step's attention saved them, so
    the write goes into copies. The gradient of the first five outputs is that of one uncached pass over them."""
    torch.manual_seed(0)
    layer = CausalSelfAttention(get_preset("tiny-transformer")).double().requires_grad_(False)
    h = torch.randn(1, 6, layer.q_proj.in_features, dtype=F64)
    w = torch.randn(1, 5, layer.o_proj.out_features, dtype=F64)
    parts = [h[:, :4].clone().requires_grad_(), h[:, 4:5].clone().requires_grad_(), h[:, 5:6].clone()]
    cache, outs = LayerCache(), []
    for part, start in zip(parts, (0, 4, 5)):
        offsets = None if start == 0 else torch.tensor([start])
        outs.append(layer(part, Packing.dense(1, part.shape[1], offsets, "cpu"), cache))
    (torch.cat(outs[:2], 1) * w).sum().backward()
    whole = h[:, :5].clone().requires_grad_()
    (layer(whole, Packing.dense(1, 5, None, "cpu")) * w).sum().backward()
    torch.testing.assert_close(torch.cat([parts[0].grad, parts[1].grad], 1), whole.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        torch.testing.assert_close(outs[2], layer(h, Packing.dense(1, 6, None, "cpu"))[:, 5:], rtol=1e-10, atol=1e-12)


# ----------------------------------------------------------------------------- Packing
def test_packing_counts_dense_rows_and_packed_sequences():
    """``num_sequences``: the ``B`` dense rows (not their length), or the ``N`` sequences of ``cu_seqlens``
    ``[N + 1]``; ``packed`` tells the two layouts apart."""
    dense = Packing.dense(3, 5, torch.tensor([0, 2, 7]), "cpu")
    assert dense.num_sequences == 3 and not dense.packed
    assert dense.positions.tolist() == [[0, 1, 2, 3, 4], [2, 3, 4, 5, 6], [7, 8, 9, 10, 11]]
    packed = Packing.from_cu_seqlens(torch.tensor([0, 2, 3, 7]), torch.tensor([2, 0, 1]), torch.tensor([10, 20, 30]))
    assert packed.num_sequences == 3 and packed.packed
    # each token's index in its sequence plus the tokens its cache row (2, 0, 1) already holds
    assert packed.positions.tolist() == [[30, 31, 10, 20, 21, 22, 23]]
    assert packed.seq_ids.tolist() == [0, 0, 1, 2, 2, 2, 2] and packed.bounds == (0, 2, 3, 7)


# ----------------------------------------------------------------------------- norms
def test_l2_feature_norm_adds_eps_under_the_root_of_the_plain_sum():
    """``"l2"``: ``u / sqrt(||u||^2 + eps)``, ``eps`` once under the root (not scaled by the width, not added to
    the norm): a vector of squared norm ``eps`` comes out at ``1/sqrt(2)`` of unit length, the zero vector stays
    zero."""
    eps = 1e-2
    u = torch.zeros(2, 5, dtype=F64)
    u[0, 1] = math.sqrt(eps)  # ||u||^2 = eps
    y = normalize_features(u, "l2", eps)
    assert y[0, 1].item() == pytest.approx(math.sqrt(eps) / math.sqrt(2 * eps), rel=1e-14)
    assert torch.equal(y[1], torch.zeros(5, dtype=F64))
    v = torch.tensor([[3.0, 4.0]], dtype=F64)  # ||v||^2 = 25
    torch.testing.assert_close(normalize_features(v, "l2", 11.0), v / 6.0, rtol=1e-15, atol=0)


def test_rmsnorm_feature_norm_uses_the_given_eps():
    """``"rmsnorm"``: ``u / sqrt(||u||^2 / d + eps)`` with the caller's ``eps``: mean square 1 and ``eps = 3``
    halve the vector."""
    u = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=F64)
    torch.testing.assert_close(normalize_features(u, "rmsnorm", 3.0), u / 2.0, rtol=1e-15, atol=0)


def test_rmsnorm_defaults_to_eps_1e_6_and_uses_the_one_it_is_given():
    """The default ``eps = 1e-6`` and the layer's own ``eps`` both reach the formula: a constant row of mean square
    ``c^2`` comes out at ``c / sqrt(c^2 + eps)``, which tells ``1e-6`` from ``1e-5`` at ``c^2 = 1e-6``."""
    c = 1e-3
    x = torch.full((1, 4), c, dtype=F64)
    for norm, eps in ((RMSNorm(4).double(), 1e-6), (RMSNorm(4, eps=0.5).double(), 0.5)):
        assert norm.eps == eps
        with torch.no_grad():
            torch.testing.assert_close(norm(x), x / math.sqrt(c * c + eps), rtol=1e-12, atol=0)


@pytest.mark.parametrize("eps", [True, float("inf"), float("nan"), -1e-9, "1e-6"])
def test_rmsnorm_refuses_an_eps_that_is_not_a_finite_number_at_least_zero(eps):
    with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
        RMSNorm(4, eps=eps)


# ----------------------------------------------------------------------------- the fla backend's glue
@pytest.mark.parametrize("switches,want", [
    (dict(rule="1", log_gate="none"), "delta"),
    (dict(rule="1", log_gate="data"), "gated_delta"),
    (dict(rule="1A", log_gate="data"), "gated_linear"),
    (dict(rule="1A", log_gate="fixed"), "gated_linear"),
    (dict(rule="1A", log_gate="none"), "falcon"),  # plain linear attention: no fla kernel named for it
    (dict(rule="2A", log_gate="data"), "falcon"),
    (dict(rule="1", log_gate="none", shift=True), "falcon"),
    (dict(rule="1A", log_gate="data", normalize=True), "falcon"),
    (dict(rule="1", log_gate="data", has_ridge=True), "falcon"),
    (dict(rule="1A", log_gate="data", read="before"), "falcon"),
    (dict(rule="1", log_gate="none", normalized_read=True), "falcon"),
])
def test_classify_names_a_known_recurrence_only_for_its_exact_switches(switches, want):
    """The module docstring's three recurrences: unshifted, no step normalization, no ridge, the read after the
    write and no normalized read; rule 1 with or without a gate, rule 1A only with one. Anything else is
    ``"falcon"`` and refused by ``check_supported``."""
    args = dict(rule="1", shift=False, normalize=False, has_ridge=False, log_gate="none", read="after")
    got = fla_backend.classify(**{**args, **switches})
    assert got == want
    if want == "falcon":
        with pytest.raises(ValueError, match="'falcon' recurrence"):
            fla_backend.check_supported(got)
    else:
        fla_backend.check_supported(got)


def test_fla_is_available_only_with_both_the_package_and_cuda(monkeypatch):
    real = fla_backend.importlib.util.find_spec
    for has_fla in (False, True):
        for cuda in (False, True):
            def find_spec(name, *a, _h=has_fla):
                return (object() if _h else None) if name == "fla" else real(name, *a)

            monkeypatch.setattr(fla_backend.importlib.util, "find_spec", find_spec)
            monkeypatch.setattr(torch.cuda, "is_available", lambda _c=cuda: _c)
            assert fla_backend.available() is (has_fla and cuda)


def _fla_loop(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens, delta):
    """fla's recurrences in float64, its conventions: ``[B, T, H, .]`` inputs, state ``[N, H, K, V]``, one state per
    sequence of ``cu_seqlens`` (then ``B = 1``), ``scale=None`` meaning ``K^-1/2``; per step ``S <- exp(g) S``, then
    the delta write ``S += beta k (v - S^T k)^T`` or the plain ``S += k v^T``, and ``o = scale S^T q``."""
    K = q.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    spans = ([(b, 0, q.shape[1]) for b in range(q.shape[0])] if cu_seqlens is None else
             [(0, int(a), int(e)) for a, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    o = torch.zeros(*v.shape, dtype=F64)
    finals = []
    for n, (b, a, e) in enumerate(spans):
        S = (torch.zeros(q.shape[2], K, v.shape[-1], dtype=F64) if initial_state is None
             else initial_state[n].double().clone())
        for t in range(a, e):
            if g is not None:
                S = torch.exp(g[b, t].double())[:, None, None] * S
            kt, vt = k[b, t].double(), v[b, t].double()
            if delta:
                pred = torch.einsum("hkv,hk->hv", S, kt)
                S = S + beta[b, t].double()[:, None, None] * torch.einsum("hk,hv->hkv", kt, vt - pred)
            else:
                S = S + torch.einsum("hk,hv->hkv", kt, vt)
            o[b, t] = scale * torch.einsum("hkv,hk->hv", S, q[b, t].double())
        finals.append(S)
    return o.to(q.dtype), (torch.stack(finals).float() if output_final_state else None)


@pytest.fixture
def fake_fla(monkeypatch):
    """fla's three kernels as float64 loops, importable under fla's module names; records each call's arguments."""
    calls = []

    def chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        calls.append(dict(kernel="delta", initial_state=initial_state, cu_seqlens=cu_seqlens))
        return _fla_loop(q, k, v, beta, None, scale, initial_state, output_final_state, cu_seqlens, True)

    def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None):
        calls.append(dict(kernel="gated_delta", g=g, initial_state=initial_state, cu_seqlens=cu_seqlens))
        return _fla_loop(q, k, v, beta, g, scale, initial_state, output_final_state, cu_seqlens, True)

    def chunk_simple_gla(q, k, v, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None):
        calls.append(dict(kernel="gated_linear", g=g, initial_state=initial_state, cu_seqlens=cu_seqlens))
        return _fla_loop(q, k, v, None, g, scale, initial_state, output_final_state, cu_seqlens, False)

    modules = {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops")}
    for name, fn in (("delta_rule", chunk_delta_rule), ("gated_delta_rule", chunk_gated_delta_rule),
                     ("simple_gla", chunk_simple_gla)):
        mod = types.ModuleType(f"fla.ops.{name}")
        setattr(mod, fn.__name__, fn)
        setattr(modules["fla.ops"], name, mod)
        modules[mod.__name__] = mod
    modules["fla"].ops = modules["fla.ops"]
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


@pytest.mark.parametrize("kind", ["delta", "gated_delta", "gated_linear"])
def test_fla_run_is_the_library_op_on_the_same_inputs(kind, fake_fla):
    """``run`` hands fla ``scale=1`` (the layer scales its queries itself), ``beta`` as the delta step or folded into
    ``v`` for rule 1A, the log-gate, the state as float32 ``[B, H, K, V]`` and ``cu_seqlens`` as int64, and returns
    a ``FalconState`` that ``falcon_step`` continues: the output and final state are those of ``falcon_attention``
    with the same switches (rule 1/1A, unshifted, unnormalized, no ridge), dense from a state and packed."""
    torch.manual_seed(0)
    B, T, H, K, V = 2, 6, 2, 4, 3
    rule = "1A" if kind == "gated_linear" else "1"
    q, k = torch.randn(B, T, H, K, dtype=F64), torch.nn.functional.normalize(torch.randn(B, T, H, K, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, V, dtype=F64)
    beta = torch.rand(B, T, H, dtype=F64) * 0.8 + 0.1
    g = None if kind == "delta" else -torch.rand(B, T, H, dtype=F64)
    h0 = (torch.randn(B, H, K, V) * 0.5).double()
    opts = dict(rule=rule, shift=False, normalize=False, log_gate=g, form="recurrent")
    want_o, want_s = falcon_attention(q, k, v, beta, torch.zeros_like(beta), **opts,
                                      initial_state=FalconState(rule=rule, window=1, shift=False, S=h0),
                                      output_final_state=True)
    o, final = fla_backend.run(kind, q, k, v, beta, g, initial_state=FalconState(rule, 1, False, h0),
                               output_final_state=True, cu_seqlens=None, rule=rule, shift=False)
    assert fake_fla[-1]["kernel"] == kind and fake_fla[-1]["initial_state"].dtype == torch.float32
    assert g is None or fake_fla[-1]["g"].dtype == torch.float32
    torch.testing.assert_close(o, want_o, rtol=1e-6, atol=1e-6)  # the state crosses in float32
    assert (final.rule, final.window, final.shift) == (rule, 1, False)
    torch.testing.assert_close(final.S.double(), want_s.S, rtol=1e-5, atol=1e-5)
    # packed: three sequences in one row, each from a zero state, cu_seqlens handed over as int64
    cu = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    flat = [None if t is None else t[:1] for t in (q, k, v, beta, g)]
    want_o, _ = falcon_attention(*flat[:4], torch.zeros_like(flat[3]), **{**opts, "log_gate": flat[4]},
                                 cu_seqlens=cu.long())
    o, final = fla_backend.run(kind, *flat, initial_state=None, output_final_state=False, cu_seqlens=cu,
                               rule=rule, shift=False)
    assert fake_fla[-1]["cu_seqlens"].dtype == torch.int64 and final is None
    torch.testing.assert_close(o, want_o, rtol=1e-6, atol=1e-6)  # fla takes the log-gate in float32


# ---------------------------------------------------------------------- the graphed decoding step (CPU stand-ins)
def _prefilled(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values


def test_recording_warms_up_twice_on_a_copy_then_records_one_step_on_the_cache(cpu_graphs, monkeypatch):
    """"Recording runs two eager warm-up steps on a copy of the cache ... so ``cache`` itself only advances on
    ``step``": two passes on another cache object, then the recorded one on ``cache``, whose values the recording
    leaves as they were."""
    model = _model("falcon", {})
    cache = _prefilled(model, torch.randint(1, 256, (2, 4)))
    before = [t.clone() for t in _cache_tensors(cache)]
    seen_caches, forward = [], graphs.GraphedDecoder._forward
    monkeypatch.setattr(graphs.GraphedDecoder, "_forward",
                        lambda self, c: seen_caches.append(c is self.cache) or forward(self, c))
    with torch.inference_mode():
        GraphedDecoder(model, cache, 2)
    assert seen_caches == [False, False, True]
    assert all(torch.equal(a, b) for a, b in zip(_cache_tensors(cache), before)) and cache.num_positions == 4


def test_a_failed_recording_puts_back_the_caches_own_tensors_and_count(cpu_graphs, monkeypatch):
    """"its objects are put back as they were if recording fails": a capture that fails after the step ran leaves
    the cache with its row counts, states and buffers of before the recording, not the step's."""
    def fails_after_the_step(decoder):
        decoder._forward(decoder.cache)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.GraphedDecoder, "_step_in_place", fails_after_the_step)
    model = _model("falcon", {})
    cache = _prefilled(model, torch.randint(1, 256, (2, 4)))
    before = [t.clone() for t in _cache_tensors(cache)]
    with torch.inference_mode(), pytest.raises(RuntimeError, match="capturing"):
        GraphedDecoder(model, cache, 2)
    assert cache.seen.tolist() == [4, 4] and cache.num_positions == 4
    after = _cache_tensors(cache)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))


def test_a_step_that_changes_a_cache_tensors_shape_is_not_graphable(cpu_graphs, monkeypatch):
    """The recorded step copies each new cache tensor into the one it replaces; a new one of another shape (here
    the rows' token counts cut to one row) is refused by name rather than broadcast into the old."""
    model = _model("falcon", {})
    cache = _prefilled(model, torch.randint(1, 256, (2, 4)))
    forward = graphs.GraphedDecoder._forward

    def cutting(self, c):
        out = forward(self, c)
        if c is self.cache:  # the recorded step, not the warm-up on a copy
            c.seen = c.seen[:1].clone()
        return out

    monkeypatch.setattr(graphs.GraphedDecoder, "_forward", cutting)
    refused = pytest.raises(NotImplementedError, match=r"changed in a decoding step \(\(2,\) -> \(1,\)\)")
    with torch.inference_mode(), refused:
        GraphedDecoder(model, cache, 2)
