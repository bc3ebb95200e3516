"""The language model of every mixer as a researcher comparing them uses it: the whole ``FalconForCausalLM`` of
each baseline against a float64 language model written here from the baselines' publications (embedding, Pre-Norm
blocks of the mixer and a SwiGLU MLP, final RMSNorm, tied head over the muP width multiplier), run whole and
continued through its cache; and a Transformer config that names a switch only the recurrent mixers read is
refused by the field's name instead of being saved with a model that ignores it."""
import math

import pytest
import torch
import torch.nn.functional as F

from falcon_fwa.models import FalconConfig, FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


# --- the Transformer's config ------------------------------------------------------------------------------------
# Switches of the recurrent mixers, each at a value other than the Transformer's own (softmax attention over RoPE
# queries and keys, scaled by head_dim ** -0.5, reads none of them).
RECURRENT_ONLY = [("rule", "3A"), ("shift", True), ("normalize", True), ("read", "before"), ("gate", "sigmoid"),
                  ("log_gate", "fixed"), ("lambda_scale", 1.0), ("qk_norm", "rmsnorm"), ("v_norm", True),
                  ("feature_map", "elu1"), ("query_scale", 1.0), ("use_short_conv", True), ("output_gate", True),
                  ("use_d_skip", True), ("norm_before_gate", False)]


@pytest.mark.parametrize("field,value", RECURRENT_ONLY, ids=[f for f, _ in RECURRENT_ONLY])
def test_a_transformer_config_refuses_a_switch_of_the_recurrent_mixers_by_name(field, value):
    """``FalconConfig(mixer="transformer", qk_norm="rmsnorm")`` would otherwise build the plain RoPE Transformer
    and save ``qk_norm: rmsnorm`` in its config.json; set on a built config, the model refuses it the same way."""
    with pytest.raises(ValueError, match=f"config field '{field}'"):
        get_preset("tiny-transformer", **{field: value})
    config = get_preset("tiny-transformer")
    setattr(config, field, value)
    with pytest.raises(ValueError, match=f"config field '{field}'"):
        config.validate_fields()
    # the Transformer's own values, given explicitly, are taken (a saved config lists them all)
    own = get_preset("tiny-transformer")
    again = FalconConfig(**{k: v for k, v in own.to_dict().items() if k not in ("transformers_version",)})
    assert again.query_scale == 16 ** -0.5 and again.qk_norm == "none" and not again.use_short_conv
    # the scale of heads of 12, however it was rounded when saved (12 ** -0.5 or 1 / sqrt(12))
    for scale in (12 ** -0.5, 1 / math.sqrt(12)):
        assert FalconConfig(mixer="transformer", hidden_size=24, num_heads=2, query_scale=scale).query_scale == scale



def test_a_hugging_face_config_attribute_given_to_a_preset_is_named_as_such():
    """``return_dict`` and ``output_hidden_states`` are Hugging Face's config attributes, not fields a preset
    overrides: the error says so and where they go (not "did you mean 'num_hidden_layers'?"), and set there they
    act as transformers documents (the tuple of the fields that are not None; embeddings, blocks, final norm)."""
    with pytest.raises(ValueError) as err:
        get_preset("tiny-retnet", return_dict=False, output_hidden_states=True)
    message = str(err.value)
    assert "did you mean" not in message and message.endswith(" for preset 'tiny-retnet'")
    for name in ("output_hidden_states", "return_dict"):
        assert f"'{name}' (an attribute of Hugging Face's PretrainedConfig: set it on the built config, " \
               f"config.{name} = ...)" in message
    with pytest.raises(ValueError, match=r"'return_dict' \(an attribute .*\), 'rul' \(did you mean 'rule'\?\)"):
        get_preset("tiny-retnet", rul="1", return_dict=False)  # each name with its own note
    for method in ("to_dict", "update"):  # methods of the config, not attributes to set on it
        with pytest.raises(ValueError) as err:
            get_preset("tiny-retnet", **{method: 1})
        assert f"'{method}'" in str(err.value) and "PretrainedConfig" not in str(err.value)
        assert f"config.{method} =" not in str(err.value)
    built = get_preset("tiny-retnet")
    with pytest.raises(AttributeError):  # a property of the config read from return_dict: nothing to set
        built.use_return_dict = False
    built.num_labels = 3  # a property with a setter: set on the built config, as advised
    assert len(built.id2label) == 3
    for name, advised in (("use_return_dict", False), ("num_labels", True)):
        with pytest.raises(ValueError) as err:
            get_preset("tiny-retnet", **{name: 1})
        assert f"'{name}'" in str(err.value) and (f"config.{name} = ..." in str(err.value)) == advised, name
    config = get_preset("tiny-retnet")
    config.return_dict, config.output_hidden_states = False, True
    out = FalconForCausalLM(config).eval()(torch.randint(0, 64, (2, 5)), use_cache=False)
    assert isinstance(out, tuple) and len(out) == 2 and len(out[1]) == config.num_hidden_layers + 1


# --- every baseline's whole model against a language model written here ------------------------------------------
BASELINES = ["transformer", "deltanet", "gated_deltanet", "mamba2", "retnet"]
D, HEADS, DK, DV, VOCAB = 24, 2, 8, 6, 40  # d_k != d_v (and != D / H): a swapped head split fails
EPS = 1e-6  # rms_norm_eps, also the l2 norm's
THETA = 300.0  # a small RoPE base: every pair turns noticeably over a dozen positions
M = 2.0  # the muP width multiplier, D / mup_base_width


class _Reads(dict):
    """The model's parameters by name, recording which the reference reads (each must be read)."""

    def __init__(self, items):
        super().__init__(items)
        self.read = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


def _rms(x, gain):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * gain


def _l2(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + EPS)


def _conv_silu(x, kernel):
    """Causal depthwise convolution of ``x`` ``[T, C]`` (zeros before the start), its last tap on the current
    token, then SiLU; ``kernel`` ``[C, 1, W]``."""
    W = kernel.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(W):
            s = t - (W - 1) + j
            if s >= 0:
                y[t] += kernel[:, 0, j] * x[s]
    return F.silu(y)


def _heads(x, d):
    return x.reshape(x.shape[0], -1, d)  # [T, H * d] -> [T, H, d]


def _attention(p, u):
    """RoPE (pairs ``(x_i, x_{i + d/2})`` turned by ``t theta^{-2i/d}``) and causal softmax attention."""
    T, d = u.shape[0], D // HEADS

    def rope(x):
        out = x.clone()
        for t in range(T):
            for i in range(d // 2):
                a = t * THETA ** (-2.0 * i / d)
                c, s = math.cos(a), math.sin(a)
                out[t, :, i] = x[t, :, i] * c - x[t, :, i + d // 2] * s
                out[t, :, i + d // 2] = x[t, :, i + d // 2] * c + x[t, :, i] * s
        return out

    q, k = rope(_heads(u @ p["q_proj.weight"].T, d)), rope(_heads(u @ p["k_proj.weight"].T, d))
    v = _heads(u @ p["v_proj.weight"].T, d)
    o = torch.zeros_like(v)
    for t in range(T):
        for h in range(HEADS):
            w = torch.softmax(k[:t + 1, h] @ q[t, h] / math.sqrt(d), 0)
            o[t, h] = w @ v[:t + 1, h]
    return o.reshape(T, D) @ p["o_proj.weight"].T


def _recurrent(mixer, p, u):
    """DeltaNet, Gated DeltaNet, Mamba-2 (SSD) and RetNet on one sequence ``u`` ``[T, D]``, token by token, with
    the state ``S`` ``[d_v, d_k]`` of each head."""
    T = u.shape[0]
    lin = {n: u @ p[f"{n}_proj.weight"].T for n in "qkv"}
    if mixer == "retnet":
        q, k, v = _heads(lin["q"], DK), _heads(lin["k"], DK), _heads(lin["v"], DV)
    else:
        q, k, v = (_heads(_conv_silu(lin[n], p[f"convs.{n}.weight"]), d) for n, d in (("q", DK), ("k", DK), ("v", DV)))
    gain = None
    if mixer != "retnet":
        gain = u @ p["gates.gain_proj.weight"].T + p["gates.gain_bias"]  # [T, H]
    if mixer in ("deltanet", "gated_deltanet"):
        q, k, beta = _l2(q) / math.sqrt(DK), _l2(k), torch.sigmoid(gain)
    if mixer == "gated_deltanet":
        g = u @ p["gates.decay_proj.weight"].T + p["gates.decay_bias"]
        alpha = torch.exp(-torch.exp(p["gates.A_log"]) * F.softplus(g))
    if mixer == "mamba2":  # x = v, B = k, C = q
        dt = F.softplus(gain)
        A = -torch.exp(p["gates.A_log"])
    gamma = [1 - 2.0 ** (-5 - h) for h in range(HEADS)]
    o = torch.zeros(T, HEADS, DV, dtype=u.dtype)
    for h in range(HEADS):
        S = torch.zeros(DV, DK, dtype=u.dtype)
        for t in range(T):
            kt, vt = k[t, h], v[t, h]
            if mixer == "deltanet":
                S = S + beta[t, h] * torch.outer(vt - S @ kt, kt)
            elif mixer == "gated_deltanet":
                S = alpha[t, h] * S
                S = S + beta[t, h] * torch.outer(vt - S @ kt, kt)
            elif mixer == "mamba2":
                S = torch.exp(dt[t, h] * A[h]) * S + dt[t, h] * torch.outer(vt, kt)
            else:
                S = gamma[h] * S + torch.outer(vt, kt)
            o[t, h] = S @ q[t, h] / (math.sqrt(DK) if mixer == "retnet" else 1.0)
            if mixer == "mamba2":
                o[t, h] = o[t, h] + p["D"][h] * vt
    gain_norm = p["o_norm.weight"]
    if mixer == "deltanet":
        o = _rms(o, gain_norm)
    elif mixer == "mamba2":  # the gate before the norm
        o = _rms(o * F.silu(_heads(u @ p["g_proj.weight"].T, DV)), gain_norm)
    else:
        o = _rms(o, gain_norm) * F.silu(_heads(u @ p["g_proj.weight"].T, DV))
    return o.reshape(T, HEADS * DV) @ p["o_proj.weight"].T


def _reference_logits(model, ids):
    """``h = E[x]``; per block ``h += Mixer(RMSNorm(h))``, ``h += W_down(SiLU(W_gate x) * W_up x)`` with ``x =
    RMSNorm(h)``; ``logits = RMSNorm(h) E^T / m``; each row of ``ids`` ``[B, T]`` alone."""
    mixer = model.config.mixer
    params = _Reads(model.named_parameters())
    out = []
    for row in ids:
        h = params["model.embed_tokens.weight"][row]
        for i in range(model.config.num_hidden_layers):
            pre = f"model.layers.{i}."
            p = _Reads({n[len(pre) + len("mixer."):]: w for n, w in params.items() if n.startswith(pre + "mixer.")})
            u = _rms(h, params[pre + "mixer_norm.weight"])
            h = h + (_attention(p, u) if mixer == "transformer" else _recurrent(mixer, p, u))
            params.read |= {pre + "mixer." + n for n in p.read}
            x = _rms(h, params[pre + "mlp_norm.weight"])
            h = h + (F.silu(x @ params[pre + "mlp.gate_proj.weight"].T) * (x @ params[pre + "mlp.up_proj.weight"].T)) \
                @ params[pre + "mlp.down_proj.weight"].T
        out.append(_rms(h, params["model.norm.weight"]) @ params["model.embed_tokens.weight"].T / M)
    assert params.read == set(dict(model.named_parameters())), "a weight the reference does not read"
    return torch.stack(out)


def _baseline(mixer):
    """The mixer's tiny model in float64 (2 blocks, muP multiplier 2), every weight drawn away from its starting
    value: norm gains, gate offsets, ``A_log`` and ``D`` too."""
    torch.manual_seed(0)
    heads = {} if mixer == "transformer" else dict(head_k_dim=DK, head_v_dim=DV)
    config = get_preset(f"tiny-{mixer}", vocab_size=VOCAB, hidden_size=D, num_heads=HEADS, intermediate_size=20,
                        mup_base_width=12, rope_theta=THETA, chunk_size=4, conv_size=3, rms_norm_eps=EPS, **heads)
    model = FalconForCausalLM(config).double().eval()
    assert config.width_multiplier == M
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 1.0)
            elif name.endswith("proj.weight"):
                p.normal_(0.0, 0.8 / math.sqrt(p.shape[1]))
            elif name.endswith(("bias", "A_log")):
                p.uniform_(-1.5, 0.5)
            elif name.endswith((".D", "norm.weight")):
                p.uniform_(0.5, 1.5)
    return model


def _cache(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


@pytest.mark.parametrize("mixer", BASELINES)
def test_each_baseline_model_is_the_textbook_language_model_whole_and_continued(mixer):
    """The logits of 11 tokens in 2 rows: one forward; then a prompt of 5, the next 4 in one call and 2 single
    tokens through the cache (chunks of 4, so calls start inside chunks), each against the reference."""
    model = _baseline(mixer)
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _reference_logits(model, ids)
        assert float(want.std()) > 0.3  # logits that tell the tokens apart
        torch.testing.assert_close(model(ids, use_cache=False).logits, want, rtol=1e-10, atol=1e-10)
        cache, got = None, []
        for a, b in ((0, 5), (5, 9), (9, 10), (10, 11)):
            out = model(ids[:, a:b], past_key_values=cache, use_cache=True)
            cache = _cache(out)
            got.append(out.logits)
    torch.testing.assert_close(torch.cat(got, 1), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mixer", BASELINES)
def test_each_baseline_generates_the_greedy_continuation_of_the_textbook_model(mixer):
    """``generate()`` of a left-padded batch (prompts of 5 and 2 tokens; the prompt step, then one cached token at
    a time): in each row, every step's logits are the reference's last logits on that row's own tokens alone
    (``generate()`` hands them out rounded to float32), and the token picked is their argmax."""
    model = _baseline(mixer)
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 10) and len(out.logits) == 5
    for row, start in ((0, 0), (1, 3)):
        seq = prompt[row:row + 1, start:]
        for step in range(5):
            with torch.no_grad():
                last = _reference_logits(model, seq)[0, -1]
            torch.testing.assert_close(out.logits[step][row].double(), last, rtol=1e-6, atol=1e-6)
            top2 = last.topk(2).values
            assert float(top2[0] - top2[1]) > 1e-4  # no near-tie for rounding to break
            seq = torch.cat([seq, last.argmax().view(1, 1)], 1)
        assert torch.equal(out.sequences[row, 5:], seq[0, -5:]), row


def _gradients(model, logits_of):
    """The gradient of ``<logits_of(model), w>`` (``w`` a fixed random cotangent) for every weight, by name."""
    model.zero_grad()
    logits = logits_of(model)
    w = torch.randn(logits.shape, dtype=logits.dtype, generator=torch.Generator().manual_seed(5))
    (logits * w).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mixer", BASELINES)
def test_each_baseline_trains_whole_and_through_its_cache_with_the_textbook_gradients(mixer):
    """In training mode, the backward of one forward over 11 tokens, and of three calls continuing one cache (5
    tokens, 1, then 5: truncated at no point), equals autograd through the reference for every weight."""
    model = _baseline(mixer).train()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))

    def cached(m):
        cache, outs = None, []
        for a, b in ((0, 5), (5, 6), (6, 11)):
            out = m(ids[:, a:b], past_key_values=cache, use_cache=True)
            cache = _cache(out)
            outs.append(out.logits)
        return torch.cat(outs, 1)

    want = _gradients(model, lambda m: _reference_logits(m, ids))
    assert all(float(g.abs().amax()) > 1e-4 for g in want.values())  # every weight takes part
    for run in (lambda m: m(ids, use_cache=False).logits, cached):
        got = _gradients(model, run)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-10, msg=name)
