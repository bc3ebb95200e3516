"""The paper's named models as the presets build them: each Falcon variant of Tables 1-3 is the rule, QK
normalization and context gates its label names and computes the paper's recurrence (the float64 loop of
``conftest.reference_falcon``); the 124M / 130M presets hold the parameters their layer formulas count; the
gates start at the memory horizons ``layers/gates.py`` states; the recipe spends the paper's token budget."""
import os

import pytest
import torch

from conftest import reference_falcon
from falcon_fwa.layers import FalconAttention, Packing
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
    sentinel and the clamp; ``saturated`` drives the ridge and the gain so that the clamp holds every step."""
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
    if cfg.gate == "ctx-eta" and cfg.rule != "3A":  # the step in units of the inverse write energy (up to eps)
        E = k[:, :-1].pow(2).sum(-1)  # E_t = ||x_t||^2, x_t = k_{t-1}
        torch.testing.assert_close(info["eta"][:, 1:] * E, gain[:, 1:], rtol=1e-4, atol=0)


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
