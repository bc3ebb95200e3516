"""The baseline mixers as built by the models, against float64 references of the whole layer written from
each baseline's own publication, on the layer's own weights.

* DeltaNet (Yang et al. 2024): ``q, k, v = SiLU(conv(W u))``, ``q, k`` l2-normalized, ``beta = sigmoid(.)``,
  ``S_t = S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, ``o_t = S_t q_t / sqrt(d_k)``, per-head
  RMSNorm, ``W_o``.
* Gated DeltaNet (Yang et al. 2024b): the same with ``S_t = S_{t-1} alpha_t (I - beta_t k_t k_t^T) + ...``,
  ``alpha_t = exp(-exp(A_log) softplus(W_a u + dt_bias))``, and the output ``RMSNorm(o) * SiLU(W_g u)``.
* Mamba-2 (Dao & Gu 2024): ``x, B, C = SiLU(conv(W u))``, ``dt = softplus(W_dt u + dt_bias)``,
  ``A = -exp(A_log)``, ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``,
  ``W_o RMSNorm(y * SiLU(z))`` (the gate before the norm), one B, C and norm group per head.
* RetNet (Sun et al. 2023): ``S_n = gamma_h S_{n-1} + k_n^T v_n`` with ``gamma_h = 1 - 2^{-5-h}``,
  ``o_n = q_n S_n / sqrt(d_k)``, the per-head norm, ``W_o (SiLU(W_G u) * norm(o))``.
* Transformer: ``softmax(q k^T / sqrt(d) + causal mask) v`` with RoPE written as the rotation of the
  complex numbers ``x_i + i x_{i + d/2}`` by ``pos theta^{-2i/d}``.

The references share no code with the library: plain loops over time, the papers' ``d_v x d_k`` state
layout, the convolution written tap by tap. The choices of ``models/presets.py`` where the scaffold departs
from a publication (no convolution bias, a per-head offset on the sigmoid gains, RetNet's RMSNorm with a gain
in place of its GroupNorm, no xPos) are the references' too; each layer's parameter names are checked to
be exactly those the reference uses, so no weight goes unread. Each layer is compared on a whole sequence
(the chunk form, crossing chunk boundaries; the recurrent and parallel forms) and decoded with a cache:
a prefill, then one token at a time; its backward, in dense rows and packed sequences, is autograd through the
reference, for every weight and the input.
"""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from falcon_fwa.layers import CausalSelfAttention, FalconAttention, LayerCache, Packing, fla_backend
from falcon_fwa.models import get_preset

H, DK, DV = 3, 8, 6  # heads, key and value widths per head (d_k != d_v: a swapped head split fails)
B, T, PREFILL = 2, 11, 5
TOL = dict(rtol=1e-10, atol=1e-12)  # float64 rounding over 11 steps
TRITON_TOL = 1e-4  # float32 kernels with exact products (about 1e-6 seen on the CPU's float32 path)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


# ----------------------------------------------------------------------------- shared pieces of the references
def _w(layer, name):
    """The layer's weight ``name`` itself: autograd through a reference reaches the layer's parameters."""
    return dict(layer.named_parameters())[name]


def _lin(u, w):
    return torch.einsum("btd,od->bto", u, w)


def _conv_silu(x, kernel):
    """Causal depthwise convolution, then SiLU: ``y_t = SiLU(sum_i kernel[:, W-1-i] x_{t-i})``, zero before
    the start; ``x`` ``[B, T, C]``, ``kernel`` ``[C, 1, W]`` (its last tap weights the current token)."""
    W = kernel.shape[-1]
    y = torch.zeros_like(x)
    for t in range(x.shape[1]):
        for i in range(min(W, t + 1)):
            y[:, t] += kernel[:, 0, W - 1 - i] * x[:, t - i]
    return F.silu(y)


def _split(x, d):
    return x.reshape(*x.shape[:-1], -1, d)  # [B, T, H * d] -> [B, T, H, d]: head h owns columns h*d ... h*d+d-1


def _rms(x, gain, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * gain


def _l2(x, eps):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _sizes(layer, u):
    """Batch, heads, key and value widths per head."""
    return u.shape[0], layer.num_heads, layer.head_k_dim, layer.head_v_dim


def _conv_proj(layer, u, name, proj, d):
    return _split(_conv_silu(_lin(u, _w(layer, f"{proj}.weight")), _w(layer, f"convs.{name}.weight")), d)


# ----------------------------------------------------------------------------- the published layers
def _deltanet(layer, u, gated):
    """DeltaNet / Gated DeltaNet on ``u`` ``[B, T, D]`` -> ``[B, T, D]``, one token at a time."""
    eps, (Bn, H, DK, DV) = layer.norm_eps, _sizes(layer, u)
    q = _l2(_conv_proj(layer, u, "q", "q_proj", DK), eps) / math.sqrt(DK)
    k = _l2(_conv_proj(layer, u, "k", "k_proj", DK), eps)
    v = _conv_proj(layer, u, "v", "v_proj", DV)
    beta = torch.sigmoid(_lin(u, _w(layer, "gates.gain_proj.weight")) + _w(layer, "gates.gain_bias"))  # [B, T, H]
    if gated:
        a = _lin(u, _w(layer, "gates.decay_proj.weight")) + _w(layer, "gates.decay_bias")
        alpha = torch.exp(-torch.exp(_w(layer, "gates.A_log")) * F.softplus(a))
    else:
        alpha = torch.ones_like(beta)
    S = u.new_zeros(Bn, H, DV, DK)
    eye = torch.eye(DK, dtype=u.dtype)
    outs = []
    for t in range(u.shape[1]):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        transition = alpha[:, t, :, None, None] * (eye - bt * kt[..., :, None] * kt[..., None, :])
        S = S @ transition + bt * vt[..., :, None] * kt[..., None, :]
        outs.append((S @ q[:, t, ..., None])[..., 0])
    o = torch.stack(outs, 1)  # [B, T, H, DV]
    if gated:
        o = _rms(o, _w(layer, "o_norm.weight"), eps) * F.silu(_split(_lin(u, _w(layer, "g_proj.weight")), DV))
    else:
        o = _rms(o, _w(layer, "o_norm.weight"), eps)
    return _lin(o.flatten(2), _w(layer, "o_proj.weight"))


def _mamba2(layer, u):
    """Mamba-2's SSD layer in its own names: ``z`` (g_proj), ``x`` (v_proj), ``B`` (k_proj), ``C`` (q_proj),
    ``dt`` (gates.gain_proj, offset ``dt_bias`` = gates.gain_bias)."""
    eps, (Bn, H, DK, DV) = layer.norm_eps, _sizes(layer, u)
    x = _conv_proj(layer, u, "v", "v_proj", DV)
    Bm = _conv_proj(layer, u, "k", "k_proj", DK)
    Cm = _conv_proj(layer, u, "q", "q_proj", DK)
    z = _split(_lin(u, _w(layer, "g_proj.weight")), DV)
    dt = F.softplus(_lin(u, _w(layer, "gates.gain_proj.weight")) + _w(layer, "gates.gain_bias"))  # [B, T, H]
    A = -torch.exp(_w(layer, "gates.A_log"))
    D = _w(layer, "D")
    h = u.new_zeros(Bn, H, DV, DK)  # [P, N] per head
    ys = []
    for t in range(u.shape[1]):
        dA = torch.exp(dt[:, t] * A)[..., None, None]
        h = dA * h + dt[:, t, :, None, None] * x[:, t, ..., :, None] * Bm[:, t, ..., None, :]
        ys.append((h @ Cm[:, t, ..., None])[..., 0] + D[:, None] * x[:, t])
    y = torch.stack(ys, 1)
    y = _rms(y * F.silu(z), _w(layer, "o_norm.weight"), eps)
    return _lin(y.flatten(2), _w(layer, "o_proj.weight"))


def _retnet(layer, u):
    """Multi-scale retention, recurrent form (Sun et al. 2023, Eq. 6 and Section 2.2) without xPos."""
    eps, (Bn, H, DK, DV) = layer.norm_eps, _sizes(layer, u)
    q = _split(_lin(u, _w(layer, "q_proj.weight")), DK)
    k = _split(_lin(u, _w(layer, "k_proj.weight")), DK) / math.sqrt(DK)
    v = _split(_lin(u, _w(layer, "v_proj.weight")), DV)
    gamma = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(H)], dtype=u.dtype)
    S = u.new_zeros(Bn, H, DK, DV)
    outs = []
    for n in range(u.shape[1]):
        S = gamma[:, None, None] * S + k[:, n, ..., :, None] * v[:, n, ..., None, :]
        outs.append((q[:, n, ..., None, :] @ S)[..., 0, :])
    Y = _rms(torch.stack(outs, 1), _w(layer, "o_norm.weight"), eps)
    gate = F.silu(_split(_lin(u, _w(layer, "g_proj.weight")), DV))
    return _lin((gate * Y).flatten(2), _w(layer, "o_proj.weight"))


_REFERENCES = {
    "deltanet": (lambda layer, u: _deltanet(layer, u, gated=False),
                 {"q_proj", "k_proj", "v_proj", "convs.q", "convs.k", "convs.v", "gates.gain_proj", "gates.gain_bias",
                  "o_norm", "o_proj"}),
    "gated_deltanet": (lambda layer, u: _deltanet(layer, u, gated=True),
                       {"q_proj", "k_proj", "v_proj", "convs.q", "convs.k", "convs.v", "gates.gain_proj",
                        "gates.gain_bias", "gates.decay_proj", "gates.decay_bias", "gates.A_log", "g_proj", "o_norm",
                        "o_proj"}),
    "mamba2": (_mamba2, {"q_proj", "k_proj", "v_proj", "convs.q", "convs.k", "convs.v", "gates.gain_proj",
                         "gates.gain_bias", "gates.A_log", "D", "g_proj", "o_norm", "o_proj"}),
    "retnet": (_retnet, {"q_proj", "k_proj", "v_proj", "g_proj", "o_norm", "o_proj"}),
}


def _recurrent_layer(mixer, heads=H, dk=DK, dv=DV, **fields):
    """The mixer's layer at the test sizes, in float64, every weight drawn away from its starting value (gains
    of the norm, offsets, ``A_log`` and ``D`` included) so that each enters the comparison."""
    torch.manual_seed(0)
    sizes = dict(num_heads=heads, head_k_dim=dk, head_v_dim=dv, chunk_size=4, conv_size=3)
    cfg = get_preset(f"tiny-{mixer}", **{**sizes, **fields})
    layer = FalconAttention(cfg).double()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("proj.weight"):
                p.normal_(0.0, 0.4)
            elif name.endswith(("bias", "A_log")):
                p.uniform_(-1.5, 0.5)
            elif name == "D" or name.endswith("o_norm.weight"):
                p.uniform_(0.5, 1.5)
    return layer


def _decode(layer, u, prefill, packing_of):
    """The layer run with a cache: the first ``prefill`` tokens in one call, then one token per call."""
    cache, outs = LayerCache(), []
    with torch.no_grad():
        outs.append(layer(u[:, :prefill], packing_of(prefill, 0), cache))
        for t in range(prefill, u.shape[1]):
            outs.append(layer(u[:, t:t + 1], packing_of(1, t), cache))
    return torch.cat(outs, 1)


def _dense(length, offset, batch=B, device="cpu"):
    return Packing.dense(batch, length, torch.full((batch,), offset), device)


@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("mixer", sorted(_REFERENCES))
def test_recurrent_baseline_layer_is_its_published_definition(mixer, form):
    layer = _recurrent_layer(mixer, form=form)
    reference, weights = _REFERENCES[mixer]
    assert {n.rsplit(".", 1)[0] if n.endswith(".weight") else n for n, _ in layer.named_parameters()} == weights
    u = torch.randn(B, T, layer.q_proj.in_features, dtype=torch.float64)
    with torch.no_grad():
        want = reference(layer, u)
        got = layer(u, _dense(T, 0))
    torch.testing.assert_close(got, want, **TOL)
    assert float(want.abs().amax()) > 0.1  # the comparison is not between two near-zero outputs


@pytest.mark.parametrize("prefill", [PREFILL, 1])
@pytest.mark.parametrize("mixer", sorted(_REFERENCES))
def test_recurrent_baseline_decodes_its_published_definition(mixer, prefill):
    """A prefill, then ``falcon_step`` one token at a time (state and convolution buffers carried)."""
    layer = _recurrent_layer(mixer)
    u = torch.randn(B, T, layer.q_proj.in_features, dtype=torch.float64)
    with torch.no_grad():
        want = _REFERENCES[mixer][0](layer, u)
    torch.testing.assert_close(_decode(layer, u, prefill, _dense), want, **TOL)


def _gradients(run, layer, u):
    """Autograd of ``<run(layer, u), w>`` (``w`` a fixed random cotangent) with respect to every weight of the
    layer and to ``u``, by name (``"input"``); each gradient is required to exist."""
    layer.zero_grad()
    u = u.clone().requires_grad_(True)
    out = run(layer, u)
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(7))
    (out * w).sum().backward()
    missing = [n for n, p in layer.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reaches {missing}"
    return {**{n: p.grad.clone() for n, p in layer.named_parameters()}, "input": u.grad}


@pytest.mark.parametrize("form", ["chunk", "recurrent", "parallel"])
@pytest.mark.parametrize("mixer", sorted(_REFERENCES))
def test_recurrent_baseline_gradients_are_those_of_its_published_definition(mixer, form):
    """The backward of the layer, dense rows and two sequences of 11 and 6 tokens packed in one row (each crossing
    chunk boundaries), equals autograd through the reference run on each sequence alone, for every weight (the
    convolution kernels, gate offsets, ``A_log``, ``D``, the norm's gains) and the input."""
    layer = _recurrent_layer(mixer, form=form)
    reference = _REFERENCES[mixer][0]
    u = torch.randn(B, T, layer.q_proj.in_features, dtype=torch.float64)
    got = _gradients(lambda m, x: m(x, _dense(T, 0)), layer, u)
    want = _gradients(reference, layer, u)
    assert set(got) == set(want) and all(float(g.abs().amax()) > 1e-3 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
    n = 6
    seqs = torch.cat([u[0], u[1, :n]])[None]
    packing = Packing.from_cu_seqlens(torch.tensor([0, T, T + n]), torch.arange(2), None)
    got = _gradients(lambda m, x: m(x, packing), layer, seqs)
    want = _gradients(lambda m, x: torch.cat([reference(m, x[:, :T]), reference(m, x[:, T:])], 1), layer, seqs)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def _cuda_errors(mixer, dtype, **fields):
    """The layer on the GPU in ``dtype`` (150 tokens whole; 140, then 10 decoded one at a time) against the
    float64 reference on the same rounded weights and inputs: the two errors relative to the largest output."""
    layer = _recurrent_layer(mixer, heads=2, dk=32, dv=64, hidden_size=64, chunk_size=64, **fields)
    reference = copy.deepcopy(layer.to(dtype)).double()
    layer.cuda()
    u = torch.randn(B, 150, 64, dtype=torch.float64).to(dtype)
    with torch.no_grad():
        want = _REFERENCES[mixer][0](reference, u.double())
        whole = layer(u.cuda(), _dense(150, 0, device="cuda"))
    decoded = _decode(layer, u.cuda(), 140, lambda n, t: _dense(n, t, device="cuda"))
    return [float((got.double().cpu() - want).abs().amax() / want.abs().amax()) for got in (whole, decoded)]


# fla 0.6.0's chunk_delta_rule on Hopper with Triton 3.6 is 0.6 off at keys 32 and values 64 (only there: 6.2e-3 at
# 64 and 64); the thirty-eighth GPU run of benchmarks/results/h200_tests.md records it. Not strict: a fixed fla passes.
_FLA_DELTA_RULE = pytest.mark.xfail(strict=False, reason="fla 0.6.0 chunk_delta_rule at dk=32, dv=64 on Hopper")


@pytest.mark.skipif(not fla_backend.available(), reason="needs CUDA and flash-linear-attention")
@pytest.mark.parametrize("mixer", [pytest.param(m, marks=_FLA_DELTA_RULE) if m == "deltanet" else m
                                   for m in sorted(_REFERENCES)])
def test_fla_backend_layer_is_its_published_definition(mixer):
    """``backend="fla"`` in bfloat16 (fla's chunk kernels, then ``falcon_step`` from the state they return):
    below 3e-2, ``test_models_fla``'s bf16 tolerance; a wrong scale, decay sign or layout is off by order one."""
    assert max(_cuda_errors(mixer, torch.bfloat16, backend="fla")) < 3e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mixer", sorted(_REFERENCES))
def test_triton_backend_layer_is_its_published_definition(mixer):
    """``backend="triton"`` in float32: the library's kernels for the chunks and the decoding steps, their dots
    in exact float32 (``torch.get_float32_matmul_precision() == "highest"``, not TF32)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        assert max(_cuda_errors(mixer, torch.float32, backend="triton")) < TRITON_TOL
    finally:
        torch.set_float32_matmul_precision(before)


# ----------------------------------------------------------------------------- the Transformer
def _rope_complex(x, positions, theta):
    """RoFormer's rotation: the pairs ``(x_i, x_{i + d/2})`` as complex numbers times ``exp(i pos theta^{-2i/d})``."""
    d = x.shape[-1]
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    freq = theta ** (-2.0 * torch.arange(d // 2, dtype=torch.float64) / d)
    z = z * torch.polar(torch.ones_like(freq), positions[:, :, None, None].double() * freq)
    return torch.cat([z.real, z.imag], -1)


def _transformer(layer, u, theta):
    d = DK
    q = _rope_complex(_split(_lin(u, _w(layer, "q_proj.weight")), d), torch.arange(T).expand(B, T), theta)
    k = _rope_complex(_split(_lin(u, _w(layer, "k_proj.weight")), d), torch.arange(T).expand(B, T), theta)
    v = _split(_lin(u, _w(layer, "v_proj.weight")), d)
    o = torch.zeros_like(v)
    for t in range(T):
        scores = torch.einsum("bhd,bshd->bhs", q[:, t], k[:, :t + 1]) / math.sqrt(d)
        o[:, t] = torch.einsum("bhs,bshd->bhd", scores.softmax(-1), v[:, :t + 1])
    return _lin(o.flatten(2), _w(layer, "o_proj.weight"))


def test_transformer_layer_is_rope_softmax_attention_whole_and_decoded():
    torch.manual_seed(0)
    theta = 500.0  # a small base: the rotation differs across the 11 positions in every pair
    layer = CausalSelfAttention(get_preset("tiny-transformer", hidden_size=H * DK, num_heads=H,
                                           rope_theta=theta)).double()
    assert {n for n, _ in layer.named_parameters()} == {f"{p}_proj.weight" for p in "qkvo"}
    u = torch.randn(B, T, H * DK, dtype=torch.float64)
    with torch.no_grad():
        want = _transformer(layer, u, theta)
        torch.testing.assert_close(layer(u, _dense(T, 0)), want, **TOL)
    torch.testing.assert_close(_decode(layer, u, PREFILL, _dense), want, **TOL)


def test_transformer_gradients_are_those_of_rope_softmax_attention():
    """The backward of the attention layer equals autograd through the written-out reference, for the four
    projections and the input."""
    torch.manual_seed(0)
    theta = 500.0
    layer = CausalSelfAttention(get_preset("tiny-transformer", hidden_size=H * DK, num_heads=H,
                                           rope_theta=theta)).double()
    u = torch.randn(B, T, H * DK, dtype=torch.float64)
    got = _gradients(lambda m, x: m(x, _dense(T, 0)), layer, u)
    want = _gradients(lambda m, x: _transformer(m, x, theta), layer, u)
    assert set(got) == {"input", *(f"{p}_proj.weight" for p in "qkvo")} == set(want)
    for name in want:
        assert float(want[name].abs().amax()) > 1e-3
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
