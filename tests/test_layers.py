"""Token mixers against textbook definitions: short convolution, RoPE attention, the
baselines' recurrences, the Falcon gates, packing and cached continuation."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from falcon_fwa.layers import (CausalSelfAttention, FalconAttention, LayerCache, Packing, ShortConv, apply_rope,
                               cu_seqlens_from_lengths, repad, unpad)
from falcon_fwa.models import FalconConfig, FalconForCausalLM, get_preset


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


def _dense(x):
    return Packing.dense(x.shape[0], x.shape[1], None, x.device)


def _packed(lengths, rows=None, offsets=None):
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    rows = torch.arange(len(lengths)) if rows is None else rows
    return Packing.from_cu_seqlens(cu, rows, offsets)


# ----------------------------------------------------------------------------- short conv
def _conv_reference(x, w):
    """y_t = SiLU(sum_i w_i x_{t-i}), zeros before the start; x [T, C], w [C, W] (w[:, -1] hits x_t)."""
    T, C = x.shape
    W = w.shape[1]
    y = torch.zeros_like(x)
    for t in range(T):
        for i in range(W):
            if t - i >= 0:
                y[t] += w[:, W - 1 - i] * x[t - i]
    return F.silu(y)


def test_short_conv_matches_reference_packed_and_continued():
    torch.manual_seed(0)
    conv = ShortConv(5, kernel_size=4).double()
    w = conv.weight[:, 0].detach()
    lengths = [6, 1, 9, 2]
    xs = [torch.randn(n, 5, dtype=torch.float64) for n in lengths]
    packed, buf = conv(torch.cat(xs)[None], _packed(lengths))
    refs = [_conv_reference(x, w) for x in xs]
    assert torch.allclose(packed[0], torch.cat(refs), atol=1e-13, rtol=0)
    # the carried buffer holds the last W-1 inputs of each sequence (zeros before its start)
    for n, x in enumerate(xs):
        want = torch.cat([torch.zeros(3, 5, dtype=x.dtype), x])[-3:]
        assert torch.equal(buf[n], want)
    # dense continuation from the buffer equals the full sequence
    x = torch.randn(2, 11, 5, dtype=torch.float64)
    full, _ = conv(x, _dense(x))
    a, buf_a = conv(x[:, :4], _dense(x[:, :4]))
    b, _ = conv(x[:, 4:], _dense(x[:, 4:]), buf_a)
    assert torch.allclose(torch.cat([a, b], 1), full, atol=1e-14, rtol=0)
    # packed continuation: sequence n continues cache row rows[n]
    rows = torch.tensor([1, 0])
    y, _ = conv(torch.cat([x[1, 4:9], x[0, 4:]])[None], _packed([5, 7], rows=rows), buf_a)
    assert torch.allclose(y[0, :5], full[1, 4:9], atol=1e-14, rtol=0)
    assert torch.allclose(y[0, 5:], full[0, 4:], atol=1e-14, rtol=0)


def test_short_conv_refuses_zero_time_steps_naming_x():
    conv = ShortConv(5, kernel_size=4)
    for buffer in (None, torch.zeros(2, 3, 5)):
        with pytest.raises(ValueError, match=re.escape("x must have at least one time step (T >= 1), got shape "
                                                       "(2, 0, 5)")):
            conv(torch.zeros(2, 0, 5), buffer=buffer)
    y, buf = conv(torch.zeros(2, 1, 5))  # one step still runs
    assert y.shape == (2, 1, 5) and buf.shape == (2, 3, 5)


def test_short_conv_under_compile_is_the_shifted_sum_of_the_reference():
    """Inside a ``torch.compile`` graph the convolution is written as shifted products (no
    convolution in the traced graphs); dense and packed, its outputs are the textbook convolution's
    and its weight gradients the eager module's."""
    torch.manual_seed(0)
    conv = ShortConv(5, kernel_size=4).double()
    w = conv.weight[:, 0].detach()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(conv, backend=record)
    lengths = [6, 1, 9, 2]
    xs = [torch.randn(n, 5, dtype=torch.float64) for n in lengths]
    dense = torch.randn(2, 11, 5, dtype=torch.float64)
    cases = [(torch.cat(xs)[None], _packed(lengths), torch.cat([_conv_reference(x, w) for x in xs])[None]),
             (dense, _dense(dense), torch.stack([_conv_reference(x, w) for x in dense]))]
    for x, packing, ref in cases:
        grads = []
        for module in (conv, compiled):
            conv.weight.grad = None
            y, _ = module(x, packing)
            assert torch.allclose(y, ref, atol=1e-13, rtol=0)
            y.square().sum().backward()
            grads.append(conv.weight.grad.clone())
        assert torch.allclose(grads[1], grads[0], atol=1e-12, rtol=1e-12)
    assert graphs and not any("conv" in str(node.target) for gm in graphs for node in gm.graph.nodes)


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
def test_short_conv_shifted_sum_equals_the_convolution_on_bf16_inputs(kernel_size):
    """Mixed precision (a float32 kernel, bfloat16 activations): the compiled form's shifted sum
    gives the eager convolution's outputs bit for bit (both round the kernel to bfloat16)."""
    torch.manual_seed(0)
    conv = ShortConv(64, kernel_size=kernel_size)
    ext = torch.randn(2, 40, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(conv._shifted_sum(ext), conv._conv(ext))


def test_unpad_repad_roundtrip():
    x = torch.arange(2 * 5 * 3, dtype=torch.float64).view(2, 5, 3)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    packed, index, cu, rows = unpad(x, mask)
    assert cu.tolist() == [0, 3, 7] and rows.tolist() == [0, 1]
    assert torch.equal(packed[0], torch.cat([x[0, 2:], x[1, :4]]))
    back = repad(packed, index, 2, 5)
    assert torch.equal(back * mask[..., None], x * mask[..., None])


# ----------------------------------------------------------------------------- RoPE attention
def test_packed_attention_costs_each_sequence_alone(monkeypatch):
    """Packed rows (cu_seqlens) attend within each sequence without a [N_tok, N_tok] mask: no
    attention call sees more keys than the longest sequence, and the output is unchanged."""
    from falcon_fwa.layers import attention as attention_module
    from falcon_fwa.models import FalconForCausalLM, get_preset

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-transformer")).double().eval()
    seqs = [torch.randint(0, 64, (n,)) for n in (7, 3, 12, 5)]
    cu = torch.tensor([0, 7, 10, 22, 27])
    with torch.no_grad():
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in seqs])
    sdpa, keys = F.scaled_dot_product_attention, []

    def recording(q, k, v, *args, **kwargs):
        keys.append(k.shape[-2])
        return sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        packed = model(torch.cat(seqs)[None], cu_seqlens=cu, use_cache=False).logits[0]
    assert keys and max(keys) <= 12, keys
    assert float((packed - alone).abs().max()) <= 1e-10
    # above the limit of calls per row: one masked call over the row, the same result
    monkeypatch.setattr(attention_module, "MAX_CALLS_PER_ROW", 3)
    keys.clear()
    with torch.no_grad():
        masked = model(torch.cat(seqs)[None], cu_seqlens=cu, use_cache=False).logits[0]
    assert keys and min(keys) == 27, keys
    assert float((masked - alone).abs().max()) <= 1e-10


def test_rope_is_a_rotation_with_relative_scores():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(p, s):
        return (apply_rope(q, torch.tensor([[p]]), 100.0) * apply_rope(k, torch.tensor([[s]]), 100.0)).sum()

    assert torch.allclose(apply_rope(q, torch.tensor([[7]]), 100.0).norm(), q.norm(), atol=1e-14)
    assert torch.allclose(score(9, 4), score(5, 0), atol=1e-13)
    assert torch.allclose(score(3, 3), (q * k).sum(), atol=1e-13)
    # against complex multiplication by e^{i p theta^{-2j/d}} on (x_j, x_{j+d/2})
    p = 5
    z = torch.complex(q[..., :4], q[..., 4:]) * torch.exp(1j * p * 100.0 ** (-torch.arange(4) * 2.0 / 8))
    assert torch.allclose(apply_rope(q, torch.tensor([[p]]), 100.0), torch.cat([z.real, z.imag], -1), atol=1e-14)


def _attention_reference(layer, h):
    """softmax((R q)(R k)^T / sqrt(d) + causal) v per head, written out."""
    T = h.shape[1]
    H, d = layer.num_heads, layer.head_dim
    pos = torch.arange(T)[None]
    q = apply_rope(layer.q_proj(h).view(1, T, H, d), pos, layer.rope_theta)[0]
    k = apply_rope(layer.k_proj(h).view(1, T, H, d), pos, layer.rope_theta)[0]
    v = layer.v_proj(h).view(T, H, d)
    s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hts,shd->thd", s.softmax(-1), v)
    return layer.o_proj(o.reshape(1, T, H * d))


def test_attention_dense_packed_cached_equal_reference():
    torch.manual_seed(0)
    layer = CausalSelfAttention(get_preset("tiny-transformer")).double()
    hs = [torch.randn(1, n, 32, dtype=torch.float64) for n in (5, 8)]
    refs = [_attention_reference(layer, h) for h in hs]
    assert torch.allclose(layer(hs[1], _dense(hs[1])), refs[1], atol=1e-13)
    packed = layer(torch.cat(hs, 1), _packed([5, 8]))
    assert torch.allclose(packed, torch.cat(refs, 1), atol=1e-13)
    cache, outs = LayerCache(), []
    for t in range(8):  # token by token with a KV cache
        outs.append(layer(hs[1][:, t:t + 1], Packing.dense(1, 1, torch.tensor([t]), "cpu"), cache))
    assert torch.allclose(torch.cat(outs, 1), refs[1], atol=1e-13)


# ----------------------------------------------------------------------------- recurrent cores
def _core_inputs(layer, h):
    q, k, v = layer._project(h, _dense(h), None)
    beta, lam, log_gate = layer.gates(h)
    return q, k, v, beta, lam, log_gate


def _textbook(kind, q, k, v, beta, log_gate):
    """Textbook recurrences, one token at a time, per head; inputs [T, H, .]."""
    T, H, K = q.shape
    S = torch.zeros(H, K, v.shape[-1], dtype=q.dtype)
    out = []
    for t in range(T):
        if log_gate is not None:
            S = torch.exp(log_gate[t])[:, None, None] * S
        kt, vt, bt = k[t], v[t], beta[t]
        if kind == "delta":  # S += beta k (v - S^T k)^T
            pred = torch.einsum("hkv,hk->hv", S, kt)
            S = S + bt[:, None, None] * torch.einsum("hk,hv->hkv", kt, vt - pred)
        else:  # S += beta k v^T
            S = S + bt[:, None, None] * torch.einsum("hk,hv->hkv", kt, vt)
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out)


@pytest.mark.parametrize("mixer,kind", [("deltanet", "delta"), ("gated_deltanet", "delta"),
                                        ("mamba2", "linear"), ("retnet", "linear")])
def test_baseline_cores_equal_textbook_recurrences(mixer, kind):
    torch.manual_seed(0)
    layer = FalconAttention(get_preset(f"tiny-{mixer}")).double()
    h = torch.randn(1, 13, 32, dtype=torch.float64)
    q, k, v, beta, lam, log_gate = _core_inputs(layer, h)
    o = layer._core(q, k, v, beta, lam, log_gate, _dense(h), None)
    ref = _textbook(kind, q[0], k[0], v[0], beta[0], None if log_gate is None else log_gate[0])
    assert torch.allclose(o[0], ref, atol=1e-12, rtol=0)
    if mixer == "retnet":  # fixed multi-scale decay gamma_h = 1 - 2^{-5-h}
        want = 1 - 2.0 ** (-5.0 - torch.arange(2, dtype=torch.float64))
        assert torch.allclose(log_gate.exp(), want.expand_as(log_gate), rtol=1e-15, atol=0)  # every token's
    if mixer == "mamba2":  # g_t = -dt_t exp(A_log), beta = dt = softplus(.) > 0
        assert torch.allclose(log_gate, -beta * layer.gates.A_log.exp(), rtol=1e-15, atol=0)
        assert bool((beta > 0).all())
    if mixer in ("deltanet", "gated_deltanet"):
        assert torch.allclose(k.norm(dim=-1), torch.ones((), dtype=k.dtype), atol=1e-5)  # l2 keys
        assert bool(((beta > 0) & (beta < 1)).all())


@pytest.mark.parametrize("gate", ["ctx-beta", "ctx-eta"])
def test_falcon_core_is_the_scaled_1A_recurrence(gate):
    """Falcon-1A: S_t = gamma_t S + eta_t x_t v_t^T with x_t = k_{t-1}, eta_t = beta_t/(E_t + lambda_t + eps),
    lambda_t = lambda-bar_t E_t; under ctx-eta, eta_t = eta-bar_t / E_t (up to eps)."""
    torch.manual_seed(0)
    cfg = get_preset("tiny-falcon", gate=gate, lambda_scale=0.5)
    layer = FalconAttention(cfg).double()
    with torch.no_grad():
        layer.gates.lam_bias.fill_(0.0)  # a sizeable ridge so the decay matters
    h = torch.randn(1, 11, 32, dtype=torch.float64)
    q, k, v, beta, lam, log_gate = _core_inputs(layer, h)
    o = layer._core(q, k, v, beta, lam, log_gate, _dense(h), None)
    q, k, v, beta, lam = q[0], k[0], v[0], beta[0], lam[0]
    S = torch.zeros(2, 16, 16, dtype=torch.float64)
    out = []
    for t in range(11):
        if t > 0:
            x = k[t - 1]
            E = (x * x).sum(-1)
            lam_t = lam[t] * E
            eta = beta[t] / (E + lam_t + cfg.eps)
            gamma = 1 - torch.clamp(eta * lam_t, max=1 - cfg.decay_floor)
            S = gamma[:, None, None] * S + eta[:, None, None] * torch.einsum("hk,hv->hkv", x, v[t])
            if gate == "ctx-eta":
                c = min(1.0, 2.0 / 1.5)
                eta_bar = beta[t] / (1 + lam[t])
                assert bool((eta_bar > 0).all()) and bool((eta_bar < c).all())
                assert torch.allclose(eta * E, eta_bar, rtol=1e-6)
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    assert torch.allclose(o[0], torch.stack(out), atol=1e-12, rtol=0)
    assert torch.allclose(k.pow(2).mean(-1), torch.ones((), dtype=k.dtype), atol=1e-3)  # QK-RMSNorm: ||k||^2 ~ d
    assert bool(((lam > 0) & (lam < 0.5)).all())
    lo, hi = (0.0, 2.0)
    assert bool(((beta > lo) & (beta < hi)).all())


def test_ctx_eta_gain_stays_admissible_for_a_large_ridge_scale():
    torch.manual_seed(0)
    layer = FalconAttention(get_preset("tiny-falcon", gate="ctx-eta", lambda_scale=9.0)).double()
    with torch.no_grad():
        layer.gates.lam_bias.fill_(20.0)
        layer.gates.gain_bias.fill_(20.0)  # saturate both sigmoids
    with torch.no_grad():
        beta, lam, _ = layer.gates(torch.randn(1, 6, 32, dtype=torch.float64))
    assert float(beta.max()) < 2.0 and float(beta.max()) > 1.99


@pytest.mark.parametrize("rule", ["1", "2A", "3"])
def test_falcon_layer_packed_and_cached_continuation(rule):
    """Packed sequences equal separate runs; a prefix then token-by-token steps equal the full run
    (state, last key, sliding tail and conv buffers all carried)."""
    torch.manual_seed(0)
    layer = FalconAttention(get_preset("tiny-falcon", rule=rule, window=3)).double()
    hs = [torch.randn(1, n, 32, dtype=torch.float64) for n in (7, 3, 10)]
    sep = [layer(h, _dense(h)) for h in hs]
    packed = layer(torch.cat(hs, 1), _packed([7, 3, 10]))
    assert torch.allclose(packed, torch.cat(sep, 1), atol=1e-12, rtol=0)
    cache = LayerCache()
    outs = [layer(hs[2][:, :4], _dense(hs[2][:, :4]), cache)]
    for t in range(4, 10):
        outs.append(layer(hs[2][:, t:t + 1], _dense(hs[2][:, t:t + 1]), cache))
    assert torch.allclose(torch.cat(outs, 1), sep[2], atol=1e-12, rtol=0)
    assert cache.state.S.shape == (1, 2, 16, 16)  # constant-size state
    assert cache.conv["k"].shape == (1, 2, 32)  # W-1 = 2 buffered inputs


# ----------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("kwargs,field", [
    (dict(rule="4B"), "rule"),
    (dict(hidden_size=30, num_heads=4), "num_heads"),
    (dict(rule="3A", window=0), "window"),
    (dict(rule="3", window=-2), "window"),
    (dict(mixer="lstm"), "mixer"),
    (dict(qk_norm="layernorm"), "qk_norm"),
    (dict(gate="ctx-gamma"), "gate"),
    (dict(gate="ctx-eta", normalize=False), "gate"),  # the normalized step needs the normalized update
    (dict(gate="sigmoid", log_gate="dt"), "log_gate"),  # Mamba-2's decay reads the step dt of gate="dt"
    (dict(lambda_scale=-1.0), "lambda_scale"),
    (dict(mixer="transformer", hidden_size=30, num_heads=4, head_k_dim=8, head_v_dim=8), "num_heads"),
    (dict(mixer="transformer", hidden_size=33, num_heads=3), "num_heads"),  # head dim 11: RoPE rotates pairs
    (dict(mixer="transformer", head_k_dim=8), "head_k_dim"),  # the Transformer's heads are hidden_size / num_heads
    (dict(rule="1", eps_attn=1e-3), "eps_attn"),
    (dict(mixer="transformer", eps_attn=1e-3), "eps_attn"),
    (dict(rule="1A", eps_attn=-1.0), "eps_attn"),
    (dict(rule="1A", eps_attn=True), "eps_attn"),
    (dict(rule="1A", eps_attn="0.1"), "eps_attn"),
    # positive features, but the first token reads the empty memory, 0 / (0 + eps_attn): shift=True (the
    # default), or read before the write
    (dict(rule="1A", eps_attn=0.0, feature_map="elu1"), "eps_attn"),
    (dict(rule="1A", shift=False, read="before", eps_attn=0.0, feature_map="elu1"), "eps_attn"),
    # relu features: 0 / 0 where a query shares no positive feature with z (5 in 256 sequences of 8 tokens of a
    # tiny layer); signed features: denominators of either sign
    (dict(rule="1A", shift=False, eps_attn=0.0, feature_map="relu"), "eps_attn"),
    (dict(rule="3A", shift=False, eps_attn=0.0, feature_map="identity"), "eps_attn"),
    (dict(rule="2A", shift=False, eps_attn=0.0, feature_map="silu"), "eps_attn"),
    (dict(rule="1A", shift=False, eps_attn=0.0, feature_map="elu1", query_scale=-1.0), "eps_attn"),
    # types: a fraction for an integer, text for a bool or a number, a bool for the window
    (dict(hidden_size=64.5), "hidden_size"),
    (dict(chunk_size=2.5), "chunk_size"),
    (dict(shift="False"), "shift"),
    (dict(use_short_conv="no"), "use_short_conv"),
    (dict(decay_floor="0.1"), "decay_floor"),
    (dict(rule="3", window=True), "window"),
    # values that would make every forward NaN, or fail later without the field's name
    (dict(lambda_scale=float("nan")), "lambda_scale"),
    (dict(query_scale=float("inf")), "query_scale"),
    (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
    (dict(eps=-1.0), "eps"),
    (dict(initializer_range=-1.0), "initializer_range"),
    (dict(mixer="transformer", rope_theta=0.0), "rope_theta"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps"),
    # the switches HF itself reads are typed too
    (dict(use_cache="no"), "use_cache"),
    (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    (dict(rule="3", window=2.5), "window"),
])
def test_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        FalconConfig(**{**dict(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1), **kwargs})


@pytest.mark.parametrize("name,stored", [("3a", "3A"), ("Falcon-1A", "1A"), (" 2 ", "2")])
def test_config_takes_a_rule_as_get_rule_does_and_stores_its_canonical_name(name, stored):
    assert FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, rule=name).rule == stored


def test_an_integral_float_is_an_integer_field():
    """64.0 (JSON's or a division's) is the integer 64, stored as an int."""
    cfg = FalconConfig(vocab_size=64.0, hidden_size=32, num_heads=2.0, num_hidden_layers=1)
    assert (cfg.vocab_size, cfg.num_heads) == (64, 2) and isinstance(cfg.num_heads, int)


def test_numpy_scalars_are_numbers_and_switches():
    """Values read from numpy (a sweep grid, np.load) are taken, stored as Python types."""
    import numpy as np

    cfg = FalconConfig(vocab_size=np.int64(64), hidden_size=32, num_heads=2, num_hidden_layers=1, rule="3",
                       window=np.int32(3), shift=np.bool_(False), eps=np.float32(1e-5))
    assert (cfg.vocab_size, cfg.window, cfg.shift) == (64, 3, False)
    assert type(cfg.vocab_size) is int and type(cfg.window) is int and type(cfg.shift) is bool


@pytest.mark.parametrize("field, value, message", [
    ("lambda_scale", float("nan"), "config field 'lambda_scale' must be a finite number, got nan"),
    ("lambda_scale", -0.5, "config field 'lambda_scale' must be >= 0, got -0.5"),
    ("shift", "False", "config field 'shift' must be true or false, got 'False'"),
    ("chunk_size", 2.5, "config field 'chunk_size' must be an integer, got 2.5"),
    ("query_scale", float("inf"), "config field 'query_scale' must be a finite number"),
    ("window", True, "config field 'window' must be an integer >= 1"),
])
def test_validate_fields_checks_fields_assigned_after_construction(field, value, message):
    cfg = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, rule="3")
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        cfg.validate_fields()


def test_a_preset_override_that_is_not_a_field_is_an_error():
    """A misspelt field would be kept by the config, unused, leaving the model as it was."""
    with pytest.raises(ValueError, match=r"unknown config field 'rul' \(did you mean 'rule'\?\)"):
        get_preset("tiny-falcon", rul="3")
    assert get_preset("tiny-falcon", rule="3").rule == "3"


@pytest.mark.parametrize("name,meant", [("decay_flor", "decay_floor"), ("num_attention_heads", "num_heads"),
                                        ("segment", "segments")])
def test_config_refuses_a_misspelt_or_foreign_field_name(name, meant):
    """FalconConfig(**kwargs) hands unknown names to PretrainedConfig, which would store them unused."""
    with pytest.raises(ValueError, match=rf"unknown config field '{name}' \(did you mean '{meant}'\?\)"):
        FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, **{name: 2})


def test_config_keeps_hugging_face_attributes_and_reloads(tmp_path):
    """What a saved config carries besides the fields (transformers_version, architectures, ...) and
    Hugging Face's own attributes still pass."""
    cfg = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, output_hidden_states=True,
                       architectures=["FalconForCausalLM"])
    cfg.save_pretrained(tmp_path)
    again = FalconConfig.from_pretrained(tmp_path)
    assert again.output_hidden_states and again.architectures == ["FalconForCausalLM"]
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("kwargs,name", [(dict(gate="bogus"), "gate"), (dict(log_gate="decay"), "log_gate"),
                                         (dict(lambda_scale=-1.0), "lambda_scale"),
                                         (dict(lambda_scale=float("inf")), "lambda_scale")])
def test_context_gates_refuse_an_unknown_kind_when_built(kwargs, name):
    """Built directly (not through a config), an unknown kind would otherwise run as another one
    ("none" for log_gate) or fail only in the forward."""
    from falcon_fwa.layers import ContextGates
    args = {**dict(gate="ctx-eta", log_gate="none", lambda_scale=1.0, per_column=False), **kwargs}
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        ContextGates(16, 2, 8, **args)


def test_triton_backend_field_needs_the_chunk_form():
    with pytest.raises(ValueError, match="config field 'backend' = 'triton' runs the chunk form"):
        FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, backend="triton", form="parallel")


def test_window_is_free_for_non_sliding_rules_and_fla_refuses_falcon():
    FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, rule="1A", window=0)
    # textbook normalized linear attention (positive features) reads its own first key: eps_attn = 0 is allowed
    FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, rule="1A", shift=False, eps_attn=0.0, feature_map="elu1")
    with pytest.raises(ValueError, match="backend"):
        FalconAttention(get_preset("tiny-falcon", backend="fla"))
    with pytest.raises(ValueError, match="backend"):  # RetNet's recurrence, but with the normalized read
        FalconAttention(get_preset("tiny-retnet", backend="fla", eps_attn=1e-3))


def test_op_gets_the_projection_dtype_under_autocast(monkeypatch):
    """Under bf16 autocast the QK normalizations compute in float32 (``pow``/``rsqrt``); the op must get
    q, k, v back in the projections' bf16, or its GPU kernels would run float32 dot products."""
    import falcon_fwa.layers.falcon_attention as mod

    seen = {}
    real = mod.falcon_attention

    def spy(q, k, v, beta, lam, **kwargs):
        seen.update(q=q.dtype, k=k.dtype, v=v.dtype)
        return real(q, k, v, beta, lam, **kwargs)

    monkeypatch.setattr(mod, "falcon_attention", spy)
    # CUDA autocast runs pow/rsqrt in float32 (CPU autocast does not): make the norms return float32 here too.
    norm = mod.normalize_features
    monkeypatch.setattr(mod, "normalize_features", lambda u, kind, eps: norm(u, kind, eps).float())
    rms = mod.rms_normalize
    monkeypatch.setattr(mod, "rms_normalize", lambda u, eps: rms(u, eps).float())
    torch.manual_seed(0)
    layer = FalconAttention(get_preset("tiny-falcon", v_norm=True))
    h = torch.randn(2, 9, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(h, _dense(h))
    assert seen == {"q": torch.bfloat16, "k": torch.bfloat16, "v": torch.bfloat16}
    seen.clear()
    layer(h, _dense(h))  # no autocast: float32 throughout
    assert seen == {"q": torch.float32, "k": torch.float32, "v": torch.float32}


def test_rmsnorm_matches_the_textbook_formula():
    # y = x / sqrt(mean(x^2) + eps) * w * silu(gate), in float32 for bf16 inputs, returned in x's dtype
    from falcon_fwa.layers.norms import RMSNorm, normalize_features
    g = torch.Generator().manual_seed(0)
    x, gate = (torch.randn(2, 7, 48, generator=g, dtype=torch.float64) for _ in range(2))
    w = torch.rand(48, generator=g, dtype=torch.float64) + 0.5
    norm = RMSNorm(48, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.copy_(w)
    unit = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(norm(x), unit * w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(norm(x, gate), unit * w * gate * torch.sigmoid(gate), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(normalize_features(x, "rmsnorm", 1e-5), unit, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(normalize_features(x, "l2", 1e-5), x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-5),
                               rtol=1e-12, atol=1e-12)
    # bf16 in and out, float32 inside: the float64 formula on the rounded inputs (w as float32), rounded once to
    # bf16, is within half a bf16 step (2^-8 relative) plus float32's rounding; norm, weight and gate each rounded
    # to bf16 on the way would be off by up to several half-steps
    xb, gb = x.bfloat16(), gate.bfloat16()
    norm.float()
    wf = w.float().double()
    unit_b = xb.double() / torch.sqrt(xb.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    for y, want in ((norm(xb), unit_b * wf), (norm(xb, gb), unit_b * wf * F.silu(gb.double()))):
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), want, rtol=2 ** -8 + 1e-6, atol=0)


# ---- the gated output norm: Mamba-2 gates before the norm, the others after
def _layer_and_reference(name):
    torch.manual_seed(0)
    cfg = get_preset(name)
    layer = FalconAttention(cfg).double()
    with torch.no_grad():
        layer.o_norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    packing = Packing.dense(2, 6, None, h.device)
    with torch.no_grad():
        y = layer(h, packing)
        q, k, v = layer._project(h, packing, None)
        beta, lam, log_gate = layer.gates(h)
        o = layer._core(q, k, v, beta, lam, log_gate, packing, None)
        if layer.D is not None:
            o = o + layer.D[:, None] * v
        g = F.silu(layer.g_proj(h).view_as(o))
        w, eps = layer.o_norm.weight, layer.o_norm.eps
        gate_first = F.rms_norm(o * g, (o.shape[-1],), w, eps)
        norm_first = F.rms_norm(o, (o.shape[-1],), w, eps) * g
        ref = {"gate_first": layer.o_proj(gate_first.reshape(2, 6, -1)),
               "norm_first": layer.o_proj(norm_first.reshape(2, 6, -1))}
    return y, ref


def test_mamba2_gates_before_the_output_norm():
    y, ref = _layer_and_reference("tiny-mamba2")
    torch.testing.assert_close(y, ref["gate_first"])
    assert not torch.allclose(y, ref["norm_first"])


@pytest.mark.parametrize("name", ["tiny-gated_deltanet", "tiny-retnet", "tiny-falcon"])
def test_other_gated_mixers_normalize_before_the_gate(name):
    y, ref = _layer_and_reference(name)
    torch.testing.assert_close(y, ref["norm_first"])


# ---- the feature path and the gates' starting values, as the docstrings state them
def test_projection_is_the_documented_feature_path():
    """``q = query_scale * N(phi(SiLU(conv(W_q h))))``, ``k = N(phi(SiLU(conv(W_k h))))``, ``v = RMSNorm(SiLU(conv(
    W_v h)))`` with ``v_norm`` (no gain): here ``phi = elu + 1``, ``N`` the l2 norm ``u / sqrt(||u||^2 + eps)``."""
    torch.manual_seed(0)
    cfg = get_preset("tiny-falcon", feature_map="elu1", qk_norm="l2", query_scale=0.7, v_norm=True, conv_size=3)
    layer = FalconAttention(cfg).double()
    h = torch.randn(2, 7, 32, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = layer._project(h, _dense(h), None)
        eps = cfg.rms_norm_eps

        def conv(name, proj):
            x, w = proj(h), layer.convs[name].weight[:, 0]
            return torch.stack([_conv_reference(x[b], w) for b in range(2)]).view(2, 7, 2, 16)

        def l2(u):
            return u / torch.sqrt((u * u).sum(-1, keepdim=True) + eps)

        phi = lambda u: F.elu(u) + 1  # noqa: E731
        vc = conv("v", layer.v_proj)
        close = dict(rtol=1e-12, atol=1e-15)  # float64 rounding
        torch.testing.assert_close(q, 0.7 * l2(phi(conv("q", layer.q_proj))), **close)
        torch.testing.assert_close(k, l2(phi(conv("k", layer.k_proj))), **close)
        torch.testing.assert_close(v, vc / torch.sqrt(vc.pow(2).mean(-1, keepdim=True) + eps), **close)
    # query_scale left unset: 1 for Falcon and Mamba-2, head_k_dim ** -0.5 for the others
    for mixer, scale in [("falcon", 1.0), ("mamba2", 1.0), ("deltanet", 12 ** -0.5), ("gated_deltanet", 12 ** -0.5),
                         ("retnet", 12 ** -0.5)]:
        assert get_preset(f"tiny-{mixer}", head_k_dim=12).query_scale == pytest.approx(scale, rel=1e-15), mixer


@pytest.mark.parametrize("heads", [4, 1])
def test_gates_start_at_their_documented_values(heads):
    """In a built model: the ridge ``lambda-bar = lambda_scale sigmoid(b)`` log-uniform in ``[1e-3, 1e-1] *
    lambda_scale`` over the heads, Mamba-2's ``dt = softplus(b)`` and Gated DeltaNet's decay step log-uniform in
    ``[1e-3, 1e-1]``, ``exp(A_log)`` from 1 to 16, the other gain offsets 0, ``D`` 1 (one head: the geometric
    middle, 1e-2, and ``A = 1``)."""
    f64 = dict(dtype=torch.float64)
    spread = torch.logspace(-3, -1, heads, **f64) if heads > 1 else torch.tensor([1e-2], **f64)
    decay = torch.linspace(1, 16, heads, dtype=torch.float64)
    hidden = dict(hidden_size=8 * heads, num_heads=heads)

    def gates(name, **fields):
        torch.manual_seed(0)
        return FalconForCausalLM(get_preset(name, **hidden, **fields)).double().model.layers[1].mixer

    def close(a, b):
        torch.testing.assert_close(a.detach(), b, rtol=1e-6, atol=0)  # the offsets are stored in float32

    falcon = gates("tiny-falcon", lambda_scale=2.0).gates
    close(2.0 * torch.sigmoid(falcon.lam_bias), 2.0 * spread)
    close(falcon.gain_bias, torch.zeros(heads, dtype=torch.float64))
    mamba = gates("tiny-mamba2")
    close(F.softplus(mamba.gates.gain_bias), spread)
    close(mamba.gates.A_log.exp(), decay)
    close(mamba.D, torch.ones(heads, dtype=torch.float64))
    gdn = gates("tiny-gated_deltanet").gates
    close(F.softplus(gdn.decay_bias), spread)
    close(gdn.A_log.exp(), decay)
    close(gdn.gain_bias, torch.zeros(heads, dtype=torch.float64))


def test_gated_deltanet_decay_and_the_constant_gain():
    """``log_gate="data"``: ``g_t = -exp(A_log) softplus(w^T h_t + b)`` per head; ``gate="one"``: ``beta = 1``."""
    torch.manual_seed(0)
    layer = FalconAttention(get_preset("tiny-gated_deltanet")).double()
    gates = layer.gates
    with torch.no_grad():
        gates.A_log.uniform_(-1.0, 2.0)
        h = torch.randn(2, 5, 32, dtype=torch.float64)
        beta, lam, log_gate = gates(h)
        pre = h @ gates.decay_proj.weight.T + gates.decay_bias
        torch.testing.assert_close(log_gate, -gates.A_log.exp() * torch.log1p(pre.exp()), rtol=1e-13, atol=0)
        torch.testing.assert_close(beta, torch.sigmoid(h @ gates.gain_proj.weight.T + gates.gain_bias),
                                   rtol=1e-13, atol=0)
        assert not lam.any()
        one = FalconAttention(get_preset("tiny-falcon", gate="one", normalize=False)).double().gates
        beta, _, _ = one(h)
        assert beta.shape == (2, 5, 2) and bool((beta == 1).all())
