"""The recurrent mixer layer against a float64 reference written from the paper, from its own weights:
projections, short convolution, feature map, QK normalization, gates, the recurrence of every rule
(sentinel, window, ridge, clamp, gate, read), the output norm; in dense rows, packed sequences, cached
continuation and bf16, and the errors of bad arguments."""
import math

import pytest
import torch
import torch.nn.functional as F

from falcon_fwa.layers import (ContextGates, FalconAttention, LayerCache, Packing, RMSNorm, ShortConv,
                               cu_seqlens_from_lengths, repad, unpad)
from falcon_fwa.models import get_preset

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, one torch thread


def _dense(x, offsets=None):
    return Packing.dense(x.shape[0], x.shape[1], None if offsets is None else torch.tensor(offsets), x.device)


def _packed(lengths, rows=None, offsets=None):
    cu = cu_seqlens_from_lengths(torch.tensor(lengths))
    rows = torch.arange(len(lengths)) if rows is None else torch.tensor(rows)
    return Packing.from_cu_seqlens(cu, rows, None if offsets is None else torch.tensor(offsets))


# ----------------------------------------------------------------------------- the reference, float64
def _sigmoid(z):
    return 1.0 / (1.0 + torch.exp(-z))


def _softplus(z):
    return torch.log1p(torch.exp(z))


PHI = {"identity": lambda u: u, "silu": lambda u: u * _sigmoid(u), "relu": lambda u: torch.where(u > 0, u, 0 * u),
       "elu1": lambda u: torch.where(u > 0, u + 1.0, torch.exp(u))}


def _conv(x, w):
    """``y_t = SiLU(sum_i w[:, W-1-i] x_{t-i})`` over one sequence ``x`` ``[T, C]``, zeros before its start."""
    W = w.shape[1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for i in range(min(W, t + 1)):
            y[t] += w[:, W - 1 - i] * x[t - i]
    return y * _sigmoid(y)


def _features(layer, cfg, h):
    """q, k ``[T, H, K]``, v ``[T, H, V]`` of one sequence ``h`` ``[T, D]``."""
    T, H = h.shape[0], cfg.num_heads
    x = {}
    for name, proj in (("q", layer.q_proj), ("k", layer.k_proj), ("v", layer.v_proj)):
        x[name] = h @ proj.weight.T
        if cfg.use_short_conv:
            x[name] = _conv(x[name], layer.convs[name].weight[:, 0])
    e = cfg.rms_norm_eps
    norm = {"rmsnorm": lambda u: u / torch.sqrt((u * u).sum(-1, keepdim=True) / u.shape[-1] + e),
            "l2": lambda u: u / torch.sqrt((u * u).sum(-1, keepdim=True) + e), "none": lambda u: u}[cfg.qk_norm]
    phi = PHI[cfg.feature_map]
    q = cfg.query_scale * norm(phi(x["q"].view(T, H, -1)))
    k = norm(phi(x["k"].view(T, H, -1)))
    v = x["v"].view(T, H, -1)
    if cfg.v_norm:
        v = v / torch.sqrt((v * v).mean(-1, keepdim=True) + e)
    return q, k, v


def _gates(gates, cfg, h):
    """beta ``[T, H, C]`` (C = 1, or V for rules 2/2A), lambda-bar ``[T, H]``, log decay ``[T, H]``."""
    T, H, ls = h.shape[0], cfg.num_heads, cfg.lambda_scale
    C = cfg.head_v_dim if cfg.rule in ("2", "2A") else 1
    lam = ls * _sigmoid(h @ gates.lam_proj.weight.T + gates.lam_bias) if ls > 0 else torch.zeros(T, H, dtype=F64)
    pre = None if cfg.gate == "one" else (h @ gates.gain_proj.weight.T + gates.gain_bias).view(T, H, C)
    beta = {"ctx-beta": lambda: 2 * _sigmoid(pre), "sigmoid": lambda: _sigmoid(pre), "dt": lambda: _softplus(pre),
            "ctx-eta": lambda: min(1.0, 2.0 / (1.0 + ls)) * _sigmoid(pre) * (1 + lam)[..., None],
            "one": lambda: torch.ones(T, H, C, dtype=F64)}[cfg.gate]()
    if cfg.log_gate == "data":
        g = -torch.exp(gates.A_log) * _softplus(h @ gates.decay_proj.weight.T + gates.decay_bias)
    elif cfg.log_gate == "dt":
        g = -torch.exp(gates.A_log) * beta.mean(-1)
    elif cfg.log_gate == "fixed":  # RetNet: gamma_h = 1 - 2^(-5-h)
        g = torch.tensor([math.log(1 - 2.0 ** (-5 - i)) for i in range(H)], dtype=F64).expand(T, H)
    else:
        g = torch.zeros(T, H, dtype=F64)
    return beta, lam, g


def _recurrence(cfg, q, k, v, beta, lam, g, clamp=True):
    """docs/ops.md "One step" (Eq. 3.3-3.4, 4.8-4.9, Appendix C.5-C.7) token by token, per head, on a fresh
    sequence: pair (x_t, y_t) = (k_{t-1}, v_t) with the sentinel x_1 = 0, eta_1 = 0 (shift) or (k_t, v_t);
    the window of the last B real pairs; E_t; lambda_t = lambda-bar_t E_t (normalize); eta_t = beta_t / (E_t +
    lambda_t + eps); gamma_t = 1 - min(eta_t lambda_t, 1 - decay_floor); S' = exp(g_t) S; the regression or
    inner-product write; the read after (S_t) or before (S_{t-1}); with eps_attn the normalized read."""
    T, H, K = q.shape
    rule = cfg.rule
    W = cfg.window if rule in ("3", "3A") else 1
    column = rule in ("2", "2A")
    out = torch.zeros(T, H, v.shape[-1], dtype=F64)
    for hd in range(H):
        S = torch.zeros(K, v.shape[-1], dtype=F64)
        z = torch.zeros(K, v.shape[-1] if column else 1, dtype=F64)  # normalizer: the rule on a column of ones
        pairs = []
        for t in range(T):
            if not cfg.shift:
                pairs.append((k[t, hd], v[t, hd]))
            elif t > 0:
                pairs.append((k[t - 1, hd], v[t, hd]))
            win = pairs[-W:] if (t > 0 or not cfg.shift) else []
            b = beta[t, hd] if column else beta[t, hd, :1]  # [C]
            S_before, z_before = S, z
            S, z = math.exp(g[t, hd]) * S, math.exp(g[t, hd]) * z
            if win:
                X, Y = torch.stack([p[0] for p in win]), torch.stack([p[1] for p in win])
                n = len(win)
                E = {"3": float(torch.linalg.eigvalsh(X @ X.T).max()) / n,
                     "3A": float((X * X).sum(-1).mean())}.get(rule, float(X[0] @ X[0]))
                lam_t = float(lam[t, hd]) * (E if cfg.normalize else 1.0)
                eta = b / (E + lam_t + cfg.eps) if cfg.normalize else b
                alpha = eta * lam_t
                gamma = 1 - (alpha.clamp(max=1 - cfg.decay_floor) if clamp else alpha)
                D = Y if rule.endswith("A") else Y - X @ S
                S = S * gamma + X.T @ (D * eta / n)
                z = z * gamma + X.sum(0)[:, None] * eta / n
            S_read, z_read = (S, z) if cfg.read == "after" else (S_before, z_before)
            o = S_read.T @ q[t, hd]
            if cfg.eps_attn is not None:
                o = o / (z_read.T @ q[t, hd] + cfg.eps_attn)
            out[t, hd] = o
    return out


def _reference(layer, cfg, h, clamp=True):
    """The layer's output ``[T, D]`` for one fresh sequence ``h`` ``[T, D]``, float64."""
    with torch.no_grad():
        q, k, v = _features(layer, cfg, h)
        beta, lam, g = _gates(layer.gates, cfg, h)
        o = _recurrence(cfg, q, k, v, beta, lam, g, clamp=clamp)
        if cfg.use_d_skip:
            o = o + layer.D[:, None] * v
        w, e = layer.o_norm.weight, cfg.rms_norm_eps

        def rms(u):
            return u / torch.sqrt((u * u).mean(-1, keepdim=True) + e) * w

        if cfg.output_gate:
            z = (h @ layer.g_proj.weight.T).view_as(o)
            gate = z * _sigmoid(z)
            o = rms(o) * gate if cfg.norm_before_gate else rms(o * gate)
        else:
            o = rms(o)
        return o.reshape(h.shape[0], -1) @ layer.o_proj.weight.T


def _layer(name, **fields):
    """A float64 layer with spread gate offsets, output-norm gains and skip (so every part matters)."""
    torch.manual_seed(0)
    cfg = get_preset(name, **fields)
    layer = FalconAttention(cfg).double()
    with torch.no_grad():
        for pname, p in layer.gates.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 1.0)
        layer.o_norm.weight.uniform_(0.5, 1.5)
        if layer.D is not None:
            layer.D.uniform_(0.5, 1.5)
    return cfg, layer


CASES = {
    **{f"falcon-{r}": ("tiny-falcon", dict(rule=r, window=3)) for r in ("1", "2", "3", "1A", "2A", "3A")},
    "falcon-1A-rbw-l2-ctxbeta-gated-silu": ("tiny-falcon", dict(rule="1A", read="before", qk_norm="l2", gate="ctx-beta",
                                                                log_gate="data", feature_map="silu", conv_size=2)),
    "falcon-3-unshifted-rbw": ("tiny-falcon", dict(rule="3", window=2, shift=False, read="before", log_gate="data")),
    "falcon-2-raw-step-relu-skip": ("tiny-falcon", dict(rule="2", shift=False, normalize=False, gate="sigmoid",
                                                        lambda_scale=0.5, feature_map="relu", use_d_skip=True,
                                                        output_gate=False, v_norm=True)),
    "falcon-2A-normalized-read": ("tiny-falcon", dict(rule="2A", eps_attn=1e-3, feature_map="elu1",
                                                      use_short_conv=False, norm_before_gate=False)),
    "falcon-3A-normalized-read": ("tiny-falcon", dict(rule="3A", window=2, eps_attn=1e-3, feature_map="elu1",
                                                      use_short_conv=False, conv_size=1)),
    **{m: (f"tiny-{m}", {}) for m in ("deltanet", "gated_deltanet", "mamba2", "retnet")},
}


@pytest.mark.parametrize("case", list(CASES))
def test_layer_equals_the_float64_reference_in_rows_and_packed(case):
    """Dense rows and packed sequences (one of a single token) each equal the reference run on that sequence alone:
    every packed sequence restarts its short convolution, its pairs (the sentinel x_1 = 0) and its window."""
    cfg, layer = _layer(CASES[case][0], **CASES[case][1])
    torch.manual_seed(1)
    hs = [torch.randn(n, 32, dtype=F64) for n in (9, 9, 1, 6)]
    refs = [_reference(layer, cfg, h) for h in hs]
    with torch.no_grad():
        dense = layer(torch.stack(hs[:2]), _dense(torch.stack(hs[:2])))
        packed = layer(torch.cat(hs)[None], _packed([9, 9, 1, 6]))[0]
    torch.testing.assert_close(dense, torch.stack(refs[:2]), rtol=0, atol=1e-12)
    torch.testing.assert_close(packed, torch.cat(refs), rtol=0, atol=1e-12)
    assert float(torch.cat(refs).abs().max()) > 1e-2  # not a vacuous comparison


@pytest.mark.parametrize("rule", ["1", "2", "3", "1A", "2A", "3A"])
def test_the_positive_decay_clamp_holds_when_the_ridge_would_overshoot(rule):
    """ctx-beta gains near 2 and a ridge near lambda_scale = 4 ask for alpha_t = eta_t lambda_t near 1.5: the layer
    is the reference with gamma_t = max(1 - alpha_t, decay_floor) (Section 4.1), and not the unclamped one."""
    cfg, layer = _layer("tiny-falcon", rule=rule, window=2, gate="ctx-beta", lambda_scale=4.0, decay_floor=0.2)
    with torch.no_grad():
        layer.gates.lam_bias.fill_(3.0)
        layer.gates.gain_bias.fill_(2.0)
        h = torch.randn(8, 32, dtype=F64)
        y = layer(h[None], _dense(h[None]))[0]
        beta, lam, _ = _gates(layer.gates, cfg, h)
    assert float((beta[..., 0] * lam / (1 + lam)).min()) > 1 - cfg.decay_floor  # the clamp binds on every step
    torch.testing.assert_close(y, _reference(layer, cfg, h), rtol=0, atol=1e-12)
    assert float((y - _reference(layer, cfg, h, clamp=False)).abs().max()) > 1e-3


@pytest.mark.parametrize("case", ["falcon-1", "falcon-2", "falcon-3", "falcon-1A", "falcon-2A", "falcon-3A",
                                  "falcon-3-unshifted-rbw", "falcon-3A-normalized-read", "gated_deltanet", "mamba2"])
def test_cached_continuation_equals_the_reference(case):
    """A prefill of T tokens then one token at a time then a chunk of three equals the reference over all tokens
    (recurrent state, last key, sliding tail, normalizer and the short convolutions' buffers carried); packed
    calls continue the rows they name at their offsets, in any order, the first call included; then one dense
    step over rows of different lengths."""
    cfg, layer = _layer(CASES[case][0], **CASES[case][1])
    torch.manual_seed(2)
    hs = [torch.randn(n, 32, dtype=F64) for n in (12, 7, 9)]
    refs = [_reference(layer, cfg, h) for h in hs]
    with torch.no_grad():
        cache, h = LayerCache(), hs[0][None]
        outs = [layer(h[:, :4], _dense(h[:, :4]), cache)]
        outs += [layer(h[:, t:t + 1], _dense(h[:, t:t + 1], [t]), cache) for t in range(4, 9)]
        outs.append(layer(h[:, 9:], _dense(h[:, 9:], [9]), cache))
        torch.testing.assert_close(torch.cat(outs, 1)[0], refs[0], rtol=0, atol=1e-12)
        # packed: the first call fills rows 2, 0, 1 (sequence n -> row rows[n]); the second continues rows 1 and 2
        cache = LayerCache()
        a = layer(torch.cat([hs[2][:3], hs[0][:1], hs[1][:5]])[None], _packed([3, 1, 5], rows=[2, 0, 1]), cache)[0]
        b = layer(torch.cat([hs[1][5:6], hs[2][3:7]])[None], _packed([1, 4], rows=[1, 2], offsets=[1, 5, 3]), cache)[0]
        x = torch.stack([hs[0][1], hs[1][6], hs[2][7]])[:, None]
        s = layer(x, _dense(x, [1, 6, 7]), cache)[:, 0]
    got = [torch.cat([a[3:4], s[0:1]]), torch.cat([a[4:9], b[0:1], s[1:2]]), torch.cat([a[0:3], b[1:5], s[2:3]])]
    for n in range(3):
        torch.testing.assert_close(got[n], refs[n][:got[n].shape[0]], rtol=0, atol=1e-12)
    if cfg.use_short_conv:  # each row's buffer: its sequence's last W-1 projected inputs
        W1 = cfg.conv_size - 1
        for r, (seq, n) in enumerate([(hs[0], 2), (hs[1], 7), (hs[2], 8)]):
            want = (seq[:n] @ layer.k_proj.weight.T)[n - W1:]
            torch.testing.assert_close(cache.conv["k"][r], want, rtol=0, atol=1e-14)


@pytest.mark.parametrize("case", ["falcon-1", "falcon-3", "falcon-2A", "falcon-3A", "deltanet", "mamba2"])
def test_outputs_depend_on_no_later_token_and_no_other_sequence(case):
    """Perturbing the tokens after t leaves every output up to t bit for bit (the short convolution and the op
    are causal); perturbing one packed sequence leaves the others bit for bit."""
    cfg, layer = _layer(CASES[case][0], **CASES[case][1])
    torch.manual_seed(3)
    h = torch.randn(1, 14, 32, dtype=F64)
    with torch.no_grad():
        y = layer(h, _dense(h))
        for t in (0, 5, 12):
            h2 = h.clone()
            h2[:, t + 1:] += 3.0 * torch.randn_like(h2[:, t + 1:])
            y2 = layer(h2, _dense(h2))
            assert torch.equal(y2[:, :t + 1], y[:, :t + 1]), t
            assert bool(((y2[:, t + 1:] - y[:, t + 1:]).abs().amax(-1) > 0).all()), t
        lengths = [5, 4, 5]
        p = layer(h, _packed(lengths))
        h2 = h.clone()
        h2[:, 5:9] = torch.randn(1, 4, 32, dtype=F64)
        p2 = layer(h2, _packed(lengths))
    assert torch.equal(p2[:, :5], p[:, :5]) and torch.equal(p2[:, 9:], p[:, 9:])
    assert not torch.equal(p2[:, 5:9], p[:, 5:9])


def test_every_packed_sequence_starts_with_the_sentinel():
    """Under next-latent pairing with the read after the write, a fresh sequence's first state is S_1 = 0 (x_1 = 0,
    eta_1 = 0): the first output of every packed sequence is exactly 0, whatever came before it in the row."""
    cfg, layer = _layer("tiny-falcon", rule="3A", window=3)
    torch.manual_seed(4)
    h = torch.randn(1, 17, 32, dtype=F64)
    lengths = [6, 1, 3, 7]
    with torch.no_grad():
        y = layer(h, _packed(lengths))[0]
    starts = cu_seqlens_from_lengths(torch.tensor(lengths))[:-1]
    assert torch.equal(y[starts], torch.zeros(4, 32, dtype=F64))
    rest = torch.ones(17, dtype=torch.bool)
    rest[starts] = False
    assert bool((y[rest].abs().amax(-1) > 1e-6).all())


# ----------------------------------------------------------------------------- gates: ranges at saturation
@pytest.mark.parametrize("gate,per_column", [("ctx-beta", False), ("ctx-eta", False), ("ctx-eta", True),
                                             ("sigmoid", False), ("dt", True)])
def test_gates_are_the_documented_functions_and_stay_in_range(gate, per_column):
    """beta: ctx-beta 2 sigmoid in (0, 2); ctx-eta c sigmoid (1 + lambda-bar), c = min(1, 2 / (1 + lambda_scale)),
    the normalized step eta-bar = beta / (1 + lambda-bar) in (0, c); sigmoid in (0, 1); dt softplus > 0; the
    ridge lambda-bar in (0, lambda_scale); log decays <= 0; here over pre-activations from -30 to 30."""
    torch.manual_seed(5)
    ls = 3.0
    gates = ContextGates(8, 2, 4, gate=gate, log_gate="dt" if gate == "dt" else "data", lambda_scale=ls,
                         per_column=per_column).double()
    cfg = type("Cfg", (), dict(num_heads=2, head_v_dim=4, lambda_scale=ls, gate=gate,
                               log_gate="dt" if gate == "dt" else "data", rule="2A" if per_column else "1A"))
    # h = s u: every projection's pre-activation runs linearly in s up to 25 from its offset (|offset| < 7), short
    # of where float64's sigmoid rounds to 1 (about 36.7)
    u = torch.randn(8, dtype=F64)
    reach = max(float((p.weight.detach() @ u).abs().max()) for p in gates.modules() if isinstance(p, torch.nn.Linear))
    h = torch.linspace(-25.0, 25.0, 41, dtype=F64)[:, None] * u / reach
    with torch.no_grad():
        beta, lam, g = gates(h[None])
        want_beta, want_lam, want_g = _gates(gates, cfg, h)
    torch.testing.assert_close(beta[0], want_beta if per_column else want_beta[..., 0], rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(lam[0], want_lam, rtol=1e-12, atol=0)
    torch.testing.assert_close(g[0], want_g, rtol=1e-12, atol=0)
    assert bool(((lam > 0) & (lam < ls)).all()) and bool((g <= 0).all())
    hi = {"ctx-beta": 2.0, "sigmoid": 1.0, "dt": math.inf, "ctx-eta": 2.0}[gate]
    assert bool(((beta > 0) & (beta < hi)).all())
    if gate == "ctx-eta":
        lam_b = lam[..., None] if per_column else lam
        eta_bar = beta / (1 + lam_b)
        assert bool((eta_bar < min(1.0, 2.0 / (1 + ls))).all())
        assert float(eta_bar.max()) > 0.49  # saturated: c = 0.5


def test_retnet_decays_are_fixed_per_head():
    gates = ContextGates(8, 6, 4, gate="one", log_gate="fixed", lambda_scale=0.0, per_column=False).double()
    beta, lam, g = gates(torch.randn(2, 3, 8, dtype=F64))
    want = torch.tensor([1 - 2.0 ** (-5 - h) for h in range(6)], dtype=F64)
    torch.testing.assert_close(g.exp(), want.expand(2, 3, 6), rtol=1e-15, atol=0)
    assert bool((beta == 1).all()) and not lam.any()


# ----------------------------------------------------------------------------- bf16
@pytest.mark.parametrize("case", ["falcon-1A", "falcon-3A", "falcon-1", "mamba2", "gated_deltanet"])
def test_bf16_layer_and_its_decoding_follow_the_reference(case):
    """bf16 weights and inputs: the full forward and a prefill followed by single steps stay within 3% of the
    largest output of the float64 reference on the same (bf16-rounded) weights; the op's state is float32."""
    cfg, layer = _layer(CASES[case][0], **CASES[case][1])
    layer = layer.bfloat16()
    ref_layer = FalconAttention(cfg).double()
    ref_layer.load_state_dict({k: v.double() for k, v in layer.state_dict().items()})
    torch.manual_seed(6)
    h = torch.randn(1, 24, 32).bfloat16()
    ref = _reference(ref_layer, cfg, h[0].double())
    with torch.no_grad():
        full = layer(h, _dense(h))[0]
        cache = LayerCache()
        outs = [layer(h[:, :10], _dense(h[:, :10]), cache)]
        outs += [layer(h[:, t:t + 1], _dense(h[:, t:t + 1], [t]), cache) for t in range(10, 24)]
    step = torch.cat(outs, 1)[0]
    scale = float(ref.abs().max())
    for y in (full, step):
        assert y.dtype == torch.bfloat16
        assert float((y.double() - ref).abs().max()) < 0.03 * scale
    assert cache.state.S.dtype == torch.float32


def test_gates_compute_in_float32_under_bf16_autocast():
    """Under bf16 autocast the gates' projections run in bf16 and their float32 offsets lift everything after
    them to float32 (layers/gates.py): beta, lambda-bar and the decay are float32 and equal the float64
    formulas on the bf16 projections within float32 rounding."""
    torch.manual_seed(7)
    for log_gate, gate in (("data", "ctx-eta"), ("dt", "dt")):
        gates = ContextGates(32, 2, 16, gate=gate, log_gate=log_gate, lambda_scale=1.0, per_column=False)
        h = torch.randn(1, 9, 32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            beta, lam, g = gates(h)
        assert (beta.dtype, lam.dtype, g.dtype) == (torch.float32,) * 3
        hb, d = h[0].bfloat16(), {}
        for name in ("gain_proj", "lam_proj") + (("decay_proj",) if log_gate == "data" else ()):
            d[name] = F.linear(hb, getattr(gates, name).weight.bfloat16()).double()  # autocast's bf16 projection
        lam_ref = _sigmoid(d["lam_proj"] + gates.lam_bias.double())
        pre = d["gain_proj"] + gates.gain_bias.double()
        beta_ref = _sigmoid(pre) * (1 + lam_ref) if gate == "ctx-eta" else _softplus(pre)
        a = torch.exp(gates.A_log.double())
        g_ref = -a * (_softplus(d["decay_proj"] + gates.decay_bias.double()) if log_gate == "data" else beta_ref)
        for got, want in ((beta, beta_ref), (lam, lam_ref), (g, g_ref)):
            torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- errors name the argument
@pytest.mark.parametrize("build,match", [
    (lambda: ShortConv(8, kernel_size=0), "kernel_size must be an integer >= 1"),
    (lambda: ShortConv(8, kernel_size=2.5), "kernel_size must be an integer >= 1"),
    (lambda: ShortConv(8, kernel_size=True), "kernel_size must be an integer >= 1"),
    (lambda: ShortConv(0), "channels must be an integer >= 1"),
    (lambda: ContextGates(16, 0, 8, gate="one", log_gate="none", lambda_scale=0.0, per_column=False), "num_heads"),
    (lambda: ContextGates(0, 2, 8, gate="one", log_gate="none", lambda_scale=0.0, per_column=False), "hidden_size"),
    (lambda: ContextGates(16, 2, 0, gate="one", log_gate="none", lambda_scale=0.0, per_column=True), "head_v_dim"),
    (lambda: RMSNorm(8, eps=-1.0), "eps must be a finite number >= 0"),
    (lambda: RMSNorm(8, eps=float("nan")), "eps must be a finite number >= 0"),
    (lambda: RMSNorm(0), "dim must be an integer >= 1"),
], ids=["conv-0", "conv-2.5", "conv-True", "channels-0", "heads-0", "hidden-0", "v-dim-0", "eps-neg", "eps-nan",
        "dim-0"])
def test_bad_sizes_are_refused_naming_the_argument(build, match):
    with pytest.raises(ValueError, match=f"^{match}"):
        build()


def test_bad_inputs_are_refused_naming_the_argument():
    """A short-convolution buffer of another width or row count, a mask of another shape, a packed layout given
    dense rows or another token count, and a cache of other rows: each a ValueError naming the argument (a
    buffer one short used to give fewer outputs than inputs; a short mask read the wrong tokens)."""
    conv = ShortConv(8, kernel_size=4)
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"^buffer must have shape \[rows, kernel_size - 1 = 3, channels = 8\]"):
        conv(x, _dense(x), torch.zeros(2, 2, 8))
    with pytest.raises(ValueError, match="^buffer must have one row per row of x"):
        conv(x[:, :1], _dense(x[:, :1]), torch.zeros(3, 3, 8))
    with pytest.raises(ValueError, match=r"^x must have shape \[B, T, channels=8\]"):
        conv(x[..., :6], _dense(x))
    with pytest.raises(ValueError, match=r"^mask must have shape \[B, T\]"):
        unpad(x, torch.ones(2, 4))
    _, layer = _layer("tiny-falcon")
    h = torch.randn(2, 5, 32, dtype=F64)
    with pytest.raises(ValueError, match=r"^h must have shape \[1, 5, hidden_size\] for packed"):
        layer(h, _packed([3, 2]))
    with pytest.raises(ValueError, match=r"^h must have shape \[1, 6, hidden_size\] for packed"):
        layer(h[:1], _packed([3, 3]))
    cache = LayerCache()
    with torch.no_grad():
        layer(h, _dense(h), cache)
    h3 = torch.randn(3, 1, 32, dtype=F64)
    with pytest.raises(ValueError, match="^cache holds 2 rows, h has 3"):
        layer(h3, _dense(h3), cache)


def test_unpad_skips_empty_rows_and_repads():
    x = torch.arange(3 * 4 * 2, dtype=F64).view(3, 4, 2)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    packed, index, cu, rows = unpad(x, mask)
    assert cu.tolist() == [0, 2, 6] and rows.tolist() == [0, 2]
    assert torch.equal(packed[0], torch.cat([x[0, 1:3], x[2]]))
    assert torch.equal(repad(packed, index, 3, 4), x * mask[..., None])
