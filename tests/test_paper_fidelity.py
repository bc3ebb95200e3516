"""The paper's named models as the presets build them: each Falcon variant of Tables 1-3 is the rule, QK
normalization and context gates its label names and computes the paper's recurrence (the float64 loop of
``conftest.reference_falcon``), and its whole layer, decoded and differentiated, is ``_paper_layer``; the
124M / 130M presets hold the parameters their layer formulas count; the gates start at the memory horizons
``layers/gates.py`` states; the recipe spends the paper's token budget."""
import os

import pytest
import torch

from conftest import reference_falcon
from falcon_fwa.layers import FalconAttention, LayerCache, Packing
from falcon_fwa.models import count_parameters, get_preset
from falcon_fwa.train.config import load_config
from falcon_fwa.train.schedule import lr_at

pytestmark = pytest.mark.usefixtures("one_thread")

# Table 1 (and Falcon-1.3 of the earlier tables): preset -> (rule, QK normalization, write gain)
VARIANTS = {
    "falcon-1a.1-130m": ("1A", "l2", "ctx-beta"),      # QK-l2-norm, ctx-beta-ctx-lambda
    "falcon-1a.2-130m": ("1A", "l2", "ctx-eta"),       # QK-l2-norm, ctx-eta-ctx-lambda
    "falcon-1a.3-130m": ("1A", "rmsnorm", "ctx-eta"),  # QK-RMSNorm, ctx-eta-ctx-lambda
    "falcon-3a.3-130m": ("3A", "rmsnorm", "ctx-eta"),  # QK-RMSNorm, ctx-eta-ctx-lambda
    "falcon-1.3-130m": ("1", "rmsnorm", "ctx-eta"),    # the regression rule, QK-RMSNorm
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, chunk_size=4)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_paper_variant_is_its_labels_configuration(name):
    """Section 5: the scaled formulation with next-latent pairs (``x_1 = 0``), read after write, the normalized
    step and the context ridge (ctx-lambda), QK-RMSNorm or QK-l2, short convolutions on the projections, the
    denominator-free read, no value norm; the 3A model slides a window of 4 pairs."""
    cfg = get_preset(name)
    rule, qk_norm, gate = VARIANTS[name]
    assert (cfg.mixer, cfg.rule, cfg.qk_norm, cfg.gate) == ("falcon", rule, qk_norm, gate)
    assert (cfg.shift, cfg.read, cfg.normalize, cfg.log_gate) == (True, "after", True, "none")
    assert cfg.lambda_scale > 0 and cfg.eps_attn is None and not cfg.v_norm
    assert cfg.use_short_conv and cfg.feature_map == "identity"
    if rule == "3A":
        assert cfg.window == 4


def _layer_inputs(name, seed, **fields):
    torch.manual_seed(seed)
    cfg = get_preset(name, **SMALL, **fields)
    layer = FalconAttention(cfg).double()
    return cfg, layer


@pytest.mark.parametrize("saturated", [False, True], ids=["spread", "clamped"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_paper_variant_computes_the_papers_recurrence(name, saturated):
    """From the layer's own projections: the gates are the documented functions of ``h`` (ctx-beta
    ``2 sigmoid``, ctx-eta ``sigmoid (1 + lambda-bar)``, the ridge ``lambda_scale sigmoid``), q and k carry the
    named normalization, and the output is the paper's recurrence with ``lambda_t = lambda-bar_t E_t``
    (Appendix C.1), Eq. (3.3)-(3.4) for rule 1, Section 4.3 for 1A and Eq. (4.18)-(4.20) for 3A, with the
    sentinel and the clamp; ``saturated`` drives the ridge and the gain so that the clamp holds every step. The
    gates mean what ``layers/gates.py`` says: under ctx-eta ``eta_t = eta-bar_t / E_t`` (``E_t`` the window's mean
    energy for 3A) and ``gamma_t = 1 - eta-bar_t lambda-bar_t``, under ctx-beta ``gamma_t = 1 - beta_t
    lambda-bar_t / (1 + lambda-bar_t)`` (both up to ``eps``, and at least ``decay_floor``)."""
    floor = 0.05 if saturated else 1e-3
    cfg, layer = _layer_inputs(name, 1, decay_floor=floor)
    gates = layer.gates
    with torch.no_grad():
        if saturated:
            gates.lam_bias.fill_(10.0)
            gates.gain_bias.fill_(10.0)
        else:
            gates.lam_bias.normal_(0.0, 1.0)
            gates.gain_bias.normal_(0.0, 1.0)
        h = torch.randn(2, 11, cfg.hidden_size, dtype=torch.float64)
        packing = Packing.dense(2, 11, None, h.device)
        q, k, v = layer._project(h, packing, None)
        beta, lam, log_gate = gates(h)
        o = layer._core(q, k, v, beta, lam, log_gate, packing, None)
        gain = torch.sigmoid(h @ gates.gain_proj.weight.T + gates.gain_bias)
        lam_bar = cfg.lambda_scale * torch.sigmoid(h @ gates.lam_proj.weight.T + gates.lam_bias)
    assert log_gate is None
    torch.testing.assert_close(lam, lam_bar, rtol=1e-13, atol=0)
    want_beta = 2.0 * gain if cfg.gate == "ctx-beta" else gain * (1.0 + lam_bar)
    torch.testing.assert_close(beta, want_beta, rtol=1e-13, atol=0)
    assert bool(((beta > 0) & (beta < 2)).all())  # the NLMS gain range of Eq. (3.4)
    d = cfg.head_k_dim
    for u in (q, k):  # query_scale is 1 for Falcon
        energy = u.pow(2).sum(-1)
        want = torch.ones_like(energy) if cfg.qk_norm == "l2" else torch.full_like(energy, float(d))
        torch.testing.assert_close(energy, want, rtol=1e-3, atol=0)  # ||u||^2 = 1 (l2) or d (RMSNorm), up to eps
    ref, _, info = reference_falcon(q, k, v, beta, lam, rule=cfg.rule, window=cfg.window, eps=cfg.eps,
                                    decay_floor=floor, shift=True, normalize=True, scale_ridge=True)
    torch.testing.assert_close(o, ref, rtol=0, atol=1e-12)
    assert info["clamped_fraction"] == (1.0 if saturated else 0.0)
    # E_t = ||x_t||^2 with x_t = k_{t-1}, or for 3A its mean over the window I_t of Algorithm 4
    energy = k.pow(2).sum(-1)
    W = cfg.window if cfg.rule == "3A" else 1
    E = torch.stack([energy[:, max(0, t - W):t].mean(1) for t in range(1, 11)], 1)
    if cfg.gate == "ctx-eta":  # the step in units of the inverse write energy, alpha = eta-bar lambda-bar (up to eps)
        torch.testing.assert_close(info["eta"][:, 1:] * E, gain[:, 1:], rtol=1e-4, atol=0)
        alpha = gain * lam_bar
    else:  # ctx-beta: alpha = beta lambda-bar E / (E (1 + lambda-bar) + eps)
        alpha = 2.0 * gain * lam_bar / (1.0 + lam_bar)
    want_gamma = torch.clamp(1.0 - alpha[:, 1:], min=floor)
    torch.testing.assert_close(info["gamma"][:, 1:], want_gamma, rtol=1e-4, atol=0)


def _paper_layer(layer, cfg, h):
    """One fresh sequence ``h`` ``[T, D]`` through the Falcon layer as the paper and the library's documented
    choices define it, float64 and differentiable, sharing no code with the library: ``SiLU`` of a causal
    depthwise convolution of each projection; QK-RMSNorm ``u / sqrt(||u||^2 / d + eps)`` or QK-l2
    ``u / sqrt(||u||^2 + eps)`` on q and k (Section 4.1); the gates ``beta = 2 sigmoid`` (ctx-beta) or the step
    ``eta = eta-bar / E`` with ``eta-bar = c sigmoid``, ``c = min(1, 2 / (1 + lambda_scale))`` (ctx-eta), and
    ``lambda-bar = lambda_scale sigmoid`` scaled to ``lambda = lambda-bar E`` (ctx-lambda, Appendix C.1; ``E``
    stop-gradient for the sliding rule, Appendix C.6); the pair ``(k_{t-1}, v_t)`` with the sentinel, the window
    ``I_t`` of Algorithm 4, ``eta = beta / (E + lambda + eps)``, ``alpha = min(eta lambda, 1 - decay_floor)``
    and the write of rule 1 (Eq. 3.3), 1A (Section 4.3) or 3A (Eq. 4.18-4.20), read after the write; then the
    per-head RMSNorm with its gain times ``SiLU(W_g h)`` and ``W_o``. Returns the output ``[T, D]`` and the
    fraction of writes the clamp bounds."""
    T, H, e = h.shape[0], cfg.num_heads, cfg.rms_norm_eps

    def conv_silu(x, w):  # y_t = sum_i w[:, W-1-i] x_{t-i}, zeros before the start
        W = w.shape[1]
        y = sum(w[:, W - 1 - i] * torch.cat([x.new_zeros(i, x.shape[1]), x])[:T] for i in range(W))
        return y * torch.sigmoid(y)

    q, k, v = (conv_silu(h @ getattr(layer, f"{n}_proj").weight.T, layer.convs[n].weight[:, 0]).view(T, H, -1)
               for n in "qkv")
    div = 1.0 if cfg.qk_norm == "l2" else q.shape[-1]
    q, k = (u / torch.sqrt((u * u).sum(-1, keepdim=True) / div + e) for u in (q, k))
    g = layer.gates
    s = torch.sigmoid(h @ g.gain_proj.weight.T + g.gain_bias)
    lam_bar = cfg.lambda_scale * torch.sigmoid(h @ g.lam_proj.weight.T + g.lam_bias)
    W = cfg.window if cfg.rule == "3A" else 1
    out, clamped, writes = [], 0, 0
    for hd in range(H):
        S, o = torch.zeros(k.shape[-1], v.shape[-1], dtype=h.dtype), []
        for t in range(T):
            if t > 0:  # t = 0 is the sentinel x_1 = 0, eta_1 = 0
                X = torch.stack([k[j - 1, hd] for j in range(max(1, t - W + 1), t + 1)])
                Y = torch.stack([v[j, hd] for j in range(max(1, t - W + 1), t + 1)])
                E = (X * X).sum(-1).mean()
                lam = lam_bar[t, hd] * (E.detach() if cfg.rule == "3A" else E)
                if cfg.gate == "ctx-beta":
                    eta = 2 * s[t, hd] / (E + lam + cfg.eps)
                else:  # eta-bar / E, up to eps: beta = eta-bar (1 + lambda-bar) over E + lambda + eps
                    eta = min(1.0, 2.0 / (1.0 + cfg.lambda_scale)) * s[t, hd] * (1 + lam_bar[t, hd]) / (
                        E + lam + cfg.eps)
                alpha = torch.clamp(eta * lam, max=1 - cfg.decay_floor)
                clamped, writes = clamped + int(eta * lam > 1 - cfg.decay_floor), writes + 1
                D = Y - X @ S if cfg.rule == "1" else Y
                S = (1 - alpha) * S + eta * X.T @ D / X.shape[0]
            o.append(S.T @ q[t, hd])
        out.append(torch.stack(o))
    o = torch.stack(out, 1)
    z = (h @ layer.g_proj.weight.T).view_as(o)
    o = o / torch.sqrt((o * o).mean(-1, keepdim=True) + e) * layer.o_norm.weight * z * torch.sigmoid(z)
    return o.reshape(T, -1) @ layer.o_proj.weight.T, clamped / writes


@pytest.mark.parametrize("name", list(VARIANTS))
def test_each_paper_variant_is_the_papers_layer_decoded_and_differentiated(name):
    """The whole layer of each paper variant (from its own weights, in two rows over chunks of 4) equals
    ``_paper_layer``, also as a prefill of 6 tokens then one token at a time, and its gradients in every weight
    and in ``h`` are those of autograd through ``_paper_layer`` (the clamp bounds some of the writes)."""
    cfg, layer = _layer_inputs(name, 7, decay_floor=0.5)
    with torch.no_grad():  # head 0 asks for alpha near 0.9 (clamped), head 1 for 0.1-0.2; gates vary by token
        layer.gates.lam_bias.copy_(torch.tensor([3.0, -1.0]))
        layer.gates.gain_bias.copy_(torch.tensor([3.0, 0.0]))
        layer.gates.lam_proj.weight.normal_(0.0, 0.2)
        layer.gates.gain_proj.weight.normal_(0.0, 0.2)
        layer.o_norm.weight.uniform_(0.5, 1.5)
    h = torch.randn(2, 10, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    refs = [_paper_layer(layer, cfg, h[b]) for b in range(2)]
    assert all(0.3 < frac < 0.7 for _, frac in refs)
    ref = torch.stack([r for r, _ in refs])
    y = layer(h, Packing.dense(2, 10, None, h.device))
    torch.testing.assert_close(y, ref, rtol=0, atol=1e-13)
    cot = torch.randn_like(y)
    params = dict(layer.named_parameters(), h=h)
    got = torch.autograd.grad((y * cot).sum(), list(params.values()))
    want = torch.autograd.grad((ref * cot).sum(), list(params.values()))
    for pname, a, b in zip(params, got, want):
        assert float(b.abs().max()) > 0, pname
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12 * float(b.abs().max()), msg=pname)
    with torch.no_grad():
        cache = LayerCache()
        outs = [layer(h[:, :6], Packing.dense(2, 6, None, h.device), cache)]
        outs += [layer(h[:, t:t + 1], Packing.dense(2, 1, torch.tensor([t, t]), h.device), cache) for t in range(6, 10)]
    torch.testing.assert_close(torch.cat(outs, 1), ref.detach(), rtol=0, atol=1e-13)


@pytest.mark.parametrize("gate,lo,hi", [("ctx-beta", 11.0, 1000.0), ("ctx-eta", 20.0, 2000.0)])
def test_gates_start_at_the_documented_memory_horizons(gate, lo, hi):
    """``layers/gates.py``: with the gain offsets at 0 and ``lambda-bar`` log-uniform in ``[1e-3, 1e-1]`` over the
    heads, ``1 / alpha = 1 / (eta lambda)`` starts from about 11 to 1000 tokens under ctx-beta and 20 to 2000
    under ctx-eta (here with the projections zeroed, so each gate is its offset, and ``E >> eps``)."""
    torch.manual_seed(0)
    layer = FalconAttention(get_preset("tiny-falcon", hidden_size=48, num_heads=6, gate=gate)).double()
    with torch.no_grad():
        layer.gates.gain_proj.weight.zero_()
        layer.gates.lam_proj.weight.zero_()
        beta, lam, _ = layer.gates(torch.randn(1, 1, 48, dtype=torch.float64))
    E = 1.0e6  # eta lambda = beta lambda-bar E / (E (1 + lambda-bar) + eps)
    horizon = 1.0 / (beta * lam * E / (E * (1.0 + lam) + 1e-6))[0, 0]
    assert float(horizon.max()) == pytest.approx(hi, rel=0.01)
    assert float(horizon.min()) == pytest.approx(lo, rel=0.01)


def _formula_count(name):
    """Parameters of a preset from its layer shapes: embedding (tied) + L blocks + final norm."""
    c = get_preset(name)
    d, H, L, m, taps = c.hidden_size, c.num_heads, c.num_hidden_layers, c.intermediate_size, c.conv_size
    kd, vd = H * c.head_k_dim, H * c.head_v_dim
    mlp, norms = 3 * d * m, 2 * d
    if c.mixer == "transformer":
        mixer = 4 * d * d
    else:
        mixer = d * (2 * kd + vd) + vd * d + c.head_v_dim  # q, k, v, o and the per-head output norm gain
        mixer += d * vd if c.output_gate else 0
        mixer += taps * (2 * kd + vd) if c.use_short_conv else 0
        mixer += (d * H + H) if c.gate != "one" else 0  # gain projection and offset
        mixer += (d * H + H) if c.lambda_scale > 0 else 0  # ridge projection and offset
        mixer += (d * H + H) if c.log_gate == "data" else 0  # decay projection and offset
        mixer += H if c.log_gate in ("data", "dt") else 0  # A_log
        mixer += H if c.use_d_skip else 0  # D
    return c.vocab_size * d + L * (mixer + mlp + norms) + d


@pytest.mark.parametrize("name,label", [("transformer-124m", 124), ("retnet-130m", 130), ("mamba2-130m", 130),
                                        ("deltanet-130m", 130), ("gated_deltanet-130m", 130)]
                         + [(n, 130) for n in VARIANTS])
def test_paper_presets_count_to_the_papers_sizes_by_their_layer_formulas(name, label):
    """Table 1's 124M Transformer (4 d^2 attention, SwiGLU 3 d m) and 130M recurrent models, counted from the
    layer shapes (tied embedding once) and by the built model; the Transformer is 124,029,696."""
    total = count_parameters(get_preset(name))["total"]
    assert total == _formula_count(name)
    assert round(total / 1e6) == label
    if name == "transformer-124m":
        assert total == 50304 * 768 + 12 * (4 * 768 ** 2 + 3 * 768 * 2064 + 2 * 768) + 768 == 124_029_696


def test_paper_recipe_spends_the_papers_budget():
    """Section 5.1 / Appendix B: 100,000 steps of 480 x 1,024 tokens (about 49.2B), on one 4-GPU node in whole
    accumulation steps; 2,000 warmup steps to the peak 1e-3, then the cosine."""
    for name in ["falcon-1.3-130m", "falcon-1a.3-130m", "transformer-124m"]:
        cfg = load_config(os.path.join(ROOT, "configs", "paper", f"{name}.yaml"))
        t, o = cfg.train, cfg.optim
        assert cfg.model.preset == name
        assert t.steps * t.global_batch * cfg.data.seq_len == 49_152_000_000
        assert t.global_batch % (4 * t.micro_batch) == 0
        kw = dict(lr=o.lr, warmup_steps=o.warmup_steps, total_steps=t.steps, min_lr_ratio=o.min_lr_ratio)
        assert lr_at(1999, **kw) == pytest.approx(1e-3, rel=1e-12)
        mid = 2000 + (t.steps - 2000) // 2  # halfway down the cosine: the middle of the peak and the floor
        assert lr_at(mid, **kw) == pytest.approx(1e-3 * (1 + o.min_lr_ratio) / 2, rel=1e-12)
        assert lr_at(t.steps - 1, **kw) == pytest.approx(1e-3 * o.min_lr_ratio, rel=1e-6)
