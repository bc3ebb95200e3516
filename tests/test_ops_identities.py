"""Identities between the rules, the known baselines against their textbook
recurrences, and tiny cases worked out by hand."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import FORMS, random_inputs, rel_err

from falcon_fwa import falcon_attention

TOL = 1e-10
f64 = torch.float64


def _t(rows):
    """[[...] per step] -> [1, T, 1, D] float64."""
    return torch.tensor(rows, dtype=f64)[None, :, None, :]


def _s(vals):
    """[... per step] -> [1, T, 1] float64."""
    return torch.tensor(vals, dtype=f64)[None, :, None]


# ---------------------------------------------------------------- rule identities


@pytest.mark.parametrize("form", FORMS)
def test_rule3_window1_is_rule1(form):
    inp = random_inputs("3", seed=21)
    o3, s3 = falcon_attention(**inp, rule="3", window=1, form=form, chunk_size=8, output_final_state=True)
    o1, s1 = falcon_attention(**inp, rule="1", form=form, chunk_size=8, output_final_state=True)
    # the identity holds for t >= 2; at t = 1 both rules take the boundary sentinel
    assert rel_err(o3[:, 1:], o1[:, 1:]) <= TOL and rel_err(s3.S, s1.S) <= TOL
    assert torch.equal(o3[:, 0], o1[:, 0])


@pytest.mark.parametrize("form", FORMS)
def test_rule3A_window1_is_rule1A(form):
    inp = random_inputs("3A", seed=22)
    o3, _ = falcon_attention(**inp, rule="3A", window=1, form=form, chunk_size=8)
    o1, _ = falcon_attention(**inp, rule="1A", form=form, chunk_size=8)
    assert rel_err(o3, o1) <= TOL


@pytest.mark.parametrize("pair", [("2", "1"), ("2A", "1A")])
@pytest.mark.parametrize("form", FORMS)
def test_tied_per_column_beta_is_scalar_rule(form, pair):
    per_col, scalar = pair
    inp = random_inputs(scalar, seed=23, lam_range=(0.0, 3.0))  # clamp partly active
    V = inp["v"].shape[-1]
    tied = inp["beta"][..., None].expand(*inp["beta"].shape, V).contiguous()
    o2, s2 = falcon_attention(inp["q"], inp["k"], inp["v"], tied, inp["lam"], rule=per_col, form=form,
                              chunk_size=8, output_final_state=True)
    o1, s1 = falcon_attention(inp["q"], inp["k"], inp["v"], inp["beta"], inp["lam"], rule=scalar, form=form,
                              chunk_size=8, output_final_state=True)
    assert rel_err(o2, o1) <= TOL and rel_err(s2.S, s1.S) <= TOL


# ---------------------------------------------------------------- baselines


def _baseline(rule, q, k, v, beta, form, log_gate=None):
    return falcon_attention(q, k, v, beta, torch.zeros_like(q[..., 0]), rule=rule, form=form, chunk_size=8,
                            shift=False, normalize=False, log_gate=log_gate)[0]


def _textbook_delta_net(q, k, v, beta, log_gate=None):
    """(Gated) DeltaNet: S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t."""
    B, T, H, K = q.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=f64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, v.shape[-1], dtype=f64)
            for t in range(T):
                kt, bt = k[b, t, h], beta[b, t, h]
                a = 1.0 if log_gate is None else math.exp(log_gate[b, t, h])
                S = a * (torch.eye(K, dtype=f64) - bt * torch.outer(kt, kt)) @ S + bt * torch.outer(kt, v[b, t, h])
                o[b, t, h] = S.T @ q[b, t, h]
    return o


@pytest.mark.parametrize("form", FORMS)
def test_delta_net(form):
    inp = random_inputs("1", seed=31, beta_range=(0.0, 1.0))
    ref = _textbook_delta_net(inp["q"], inp["k"], inp["v"], inp["beta"])
    assert rel_err(_baseline("1", inp["q"], inp["k"], inp["v"], inp["beta"], form), ref) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_gated_delta_net(form):
    inp = random_inputs("1", seed=32, beta_range=(0.0, 1.0), with_gate=True)
    ref = _textbook_delta_net(inp["q"], inp["k"], inp["v"], inp["beta"], inp["log_gate"])
    out = _baseline("1", inp["q"], inp["k"], inp["v"], inp["beta"], form, log_gate=inp["log_gate"])
    assert rel_err(out, ref) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_linear_attention(form):
    """Causal linear attention without normalizer: o_t = sum_{s <= t} (q_t . k_s) v_s."""
    inp = random_inputs("1A", seed=33)
    q, k, v = inp["q"], inp["k"], inp["v"]
    T = q.shape[1]
    scores = torch.einsum("bthk,bshk->bhts", q, k) * torch.tril(torch.ones(T, T, dtype=f64))
    ref = torch.einsum("bhts,bshv->bthv", scores, v)
    assert rel_err(_baseline("1A", q, k, v, torch.ones_like(inp["beta"]), form), ref) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_mamba2_ssd(form):
    """Mamba-2's SSD in its quadratic (attention) form with scalar decay per head:
    y_t = sum_{s <= t} exp(sum_{r=s+1}^{t} dt_r A) (C_t . B_s) dt_s x_s."""
    inp = random_inputs("1A", seed=34)
    C, Bm, x = inp["q"], inp["k"], inp["v"]
    dt = 0.05 + torch.rand(inp["beta"].shape, generator=torch.Generator().manual_seed(1), dtype=f64)
    A = -torch.exp(torch.tensor([0.3, -1.2], dtype=f64))  # per head, A = -exp(A_log)
    a = dt * A  # [B, T, H], log decays
    cum = torch.cumsum(a, dim=1)
    T = C.shape[1]
    seg = cum[:, :, None, :] - cum[:, None, :, :]  # [B, t, s, H] = sum_{r=s+1}^t a_r
    mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, :, :, None]
    L = torch.where(mask, torch.exp(seg.masked_fill(~mask, 0.0)), torch.zeros_like(seg))
    ref = torch.einsum("btsh,bthk,bshk,bsh,bshv->bthv", L, C, Bm, dt, x)
    assert rel_err(_baseline("1A", C, Bm, x, dt, form, log_gate=a), ref) <= TOL


@pytest.mark.parametrize("form", FORMS)
def test_retention(form):
    """RetNet / Lightning attention: o_t = sum_{s <= t} gamma_h^{t-s} (q_t . k_s) v_s."""
    inp = random_inputs("1A", seed=35)
    q, k, v = inp["q"], inp["k"], inp["v"]
    B, T, H, _ = q.shape
    gammas = torch.tensor([0.9, 0.6], dtype=f64)
    tt = torch.arange(T)
    dist = (tt[:, None] - tt[None, :]).to(f64)
    decay = torch.where(dist >= 0, gammas[:, None, None] ** dist.clamp(min=0), torch.zeros(()))  # [H, t, s]
    ref = torch.einsum("hts,bthk,bshk,bshv->bthv", decay, q, k, v)
    log_gate = torch.log(gammas).expand(B, T, H).contiguous()
    assert rel_err(_baseline("1A", q, k, v, torch.ones_like(inp["beta"]), form, log_gate=log_gate), ref) <= TOL


# ---------------------------------------------------------------- by hand


HAND_1D = dict(q=_t([[1.0], [1.0], [1.0]]), k=_t([[1.0], [2.0], [0.5]]), v=_t([[1.0], [3.0], [-1.0]]),
               beta=_s([1.0, 0.5, 1.0]), lam=_s([0.0, 1.0, 0.5]))


@pytest.mark.parametrize("form", FORMS)
def test_hand_rule1(form):
    # t=1: sentinel, S_1 = 0.
    # t=2: x=k_1=1, y=3, E=1, lam=1: eta = 0.5/(1+1) = 1/4, gamma = 1 - 1/4 = 3/4,
    #      r = 3 - 0 = 3, S_2 = 3/4*0 + 1/4*1*3 = 3/4.
    # t=3: x=k_2=2, y=-1, E=4, lam=1/2: eta = 1/4.5 = 2/9, gamma = 1 - 1/9 = 8/9,
    #      r = -1 - 3/4*2 = -5/2, S_3 = 8/9*3/4 + 2/9*2*(-5/2) = 2/3 - 10/9 = -4/9.
    o, st = falcon_attention(**HAND_1D, rule="1", form=form, eps=0.0, chunk_size=2, output_final_state=True)
    want = torch.tensor([0.0, 3 / 4, -4 / 9], dtype=f64)
    assert torch.allclose(o[0, :, 0, 0], want, rtol=1e-14, atol=1e-15)
    assert torch.allclose(st.S[0, 0, 0, 0], want[-1], rtol=1e-14)


@pytest.mark.parametrize("form", FORMS)
def test_hand_rule1A(form):
    # t=2: eta = 1/4, gamma = 3/4, S_2 = 1/4*1*3 = 3/4.
    # t=3: eta = 2/9, gamma = 8/9, S_3 = 8/9*3/4 + 2/9*2*(-1) = 2/3 - 4/9 = 2/9.
    # read before write: o_t = S_{t-1} q_t = [0, 0, 3/4].
    o, _ = falcon_attention(**HAND_1D, rule="1A", form=form, eps=0.0, chunk_size=2)
    assert torch.allclose(o[0, :, 0, 0], torch.tensor([0.0, 3 / 4, 2 / 9], dtype=f64), rtol=1e-14, atol=1e-15)
    o, _ = falcon_attention(**HAND_1D, rule="1A", form=form, eps=0.0, chunk_size=2, read="before")
    assert torch.allclose(o[0, :, 0, 0], torch.tensor([0.0, 0.0, 3 / 4], dtype=f64), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("form", FORMS)
def test_hand_rule2(form):
    # shift=False (no sentinel), K=1, V=2, lam=0, eps=0: eta_c = beta_c / k^2.
    # t=1: k=1, eta=(1, 1/2), S_1 = (1*1, 1/2*2) = (1, 1).
    # t=2: k=1, y=(3, 4), residual (3-1, 4-1) = (2, 3), S_2 = (1 + 1*2, 1 + 1/2*3) = (3, 5/2).
    q, k = _t([[1.0], [1.0]]), _t([[1.0], [1.0]])
    v = _t([[1.0, 2.0], [3.0, 4.0]])
    beta = torch.tensor([[1.0, 0.5], [1.0, 0.5]], dtype=f64)[None, :, None, :]
    o, _ = falcon_attention(q, k, v, beta, _s([0.0, 0.0]), rule="2", form=form, eps=0.0, shift=False, chunk_size=1)
    assert torch.allclose(o[0, :, 0], torch.tensor([[1.0, 1.0], [3.0, 2.5]], dtype=f64), rtol=1e-14)


HAND_2D = dict(q=_t([[1.0, 1.0]] * 3), k=_t([[1.0, 0.0], [0.0, 2.0], [5.0, 5.0]]), v=_t([[9.0], [1.0], [1.0]]),
               beta=_s([1.0, 1.0, 1.0]), lam=_s([0.0, 0.0, 0.0]))


@pytest.mark.parametrize("form", FORMS)
def test_hand_rule3(form):
    # window 2. t=2: I={2}, x_2=(1,0), mu = 1, eta = 1, S_2 = x_2 (1 - 0) = (1, 0).
    # t=3: I={2,3}, x_3=(0,2): window Gram [[1,0],[0,4]], lambda_max = 4, mu = 4/2 = 2,
    #      eta = 1/2; residuals at S_2: r_2 = 1 - 1 = 0, r_3 = 1 - 0 = 1;
    #      S_3 = S_2 + (eta/B_t) (x_2 r_2 + x_3 r_3) = (1,0) + 1/4 (0,2) = (1, 1/2).
    # o = S^T (1,1): [0, 1, 3/2].
    o, _ = falcon_attention(**HAND_2D, rule="3", window=2, form=form, eps=0.0, chunk_size=2)
    assert torch.allclose(o[0, :, 0, 0], torch.tensor([0.0, 1.0, 1.5], dtype=f64), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("form", FORMS)
def test_hand_rule3A(form):
    # window 2. t=2: Ebar = 1, eta = 1, S_2 = x_2 y_2 = (1, 0).
    # t=3: Ebar = (1 + 4)/2 = 5/2, eta = 2/5, S_3 = S_2 + eta/2 (x_2 + x_3) = (1,0) + 1/5 (1,2) = (6/5, 2/5).
    # o = [0, 1, 8/5].
    o, _ = falcon_attention(**HAND_2D, rule="3A", window=2, form=form, eps=0.0, chunk_size=2)
    assert torch.allclose(o[0, :, 0, 0], torch.tensor([0.0, 1.0, 1.6], dtype=f64), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("form", FORMS)
def test_hand_scale_ridge(form):
    # rule 1A, lam-bar = 1, so lambda_t = ||x_t||^2: t=2: x=1, lambda=1, eta = 0.5/(1+1) = 1/4,
    # gamma = 3/4, S_2 = 3/4; t=3: x=2, lambda = 4, eta = 1/(4+4) = 1/8, alpha = 1/2,
    # S_3 = 1/2*3/4 + 1/8*2*(-1) = 3/8 - 1/4 = 1/8.
    inp = dict(HAND_1D, lam=_s([1.0, 1.0, 1.0]))
    o, _ = falcon_attention(**inp, rule="1A", form=form, eps=0.0, scale_ridge=True, chunk_size=2)
    assert torch.allclose(o[0, :, 0, 0], torch.tensor([0.0, 0.75, 0.125], dtype=f64), rtol=1e-14, atol=1e-15)


def test_top_eigenvalue_sliced_matches_closed_form():
    # 2x2 symmetric [[a, b], [b, c]]: lambda_max = (a + c)/2 + sqrt(((a - c)/2)^2 + b^2). Slicing the
    # batch (as done on CUDA, whose batched eigensolver fails on very large batches) must not change it.
    from falcon_fwa.ops.step_sizes import top_eigenvalue

    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(3, 5, 7, generator=g, dtype=f64) for _ in range(3))
    gram = torch.stack([torch.stack([a, b], -1), torch.stack([b, c], -1)], -2)  # [3, 5, 7, 2, 2]
    expected = (a + c) / 2 + torch.sqrt(((a - c) / 2) ** 2 + b ** 2)
    for batch in (1, 4, 16384):
        top = top_eigenvalue(gram, batch=batch)
        assert top.shape == (3, 5, 7)
        assert torch.allclose(top, expected, rtol=1e-12, atol=1e-12)
    assert top_eigenvalue(gram[:0]).shape == (0, 5, 7)
    with pytest.raises(ValueError, match="batch"):
        top_eigenvalue(gram, batch=0)


def test_top_eigenvalue_by_squaring_closed_form_and_bound():
    # PSD 2x2 Grams: the closed form above; random W x W Grams, including nearly equal top
    # eigenvalues (the slow case of power methods): within the documented bound
    # W max_r (1 - r) r^p (p = 2m + 2, m = 2^squarings) of float64 eigvalsh; a zero matrix gives 0;
    # a float32 Gram whose trace overflows (no entry does) is still right; the gradient is v v^T.
    from falcon_fwa.ops.step_sizes import top_eigenvalue_by_squaring

    g = torch.Generator().manual_seed(1)
    x = torch.randn(200, 2, 3, generator=g, dtype=f64)
    gram = x @ x.transpose(-1, -2)
    a, b, c = gram[:, 0, 0], gram[:, 0, 1], gram[:, 1, 1]
    expected = (a + c) / 2 + torch.sqrt(((a - c) / 2) ** 2 + b ** 2)
    assert torch.allclose(top_eigenvalue_by_squaring(gram), expected, rtol=1e-12, atol=0)
    for W in (3, 4, 8):
        q, _ = torch.linalg.qr(torch.randn(300, W, W, generator=g, dtype=f64))
        lam = torch.rand(300, W, generator=g, dtype=f64)
        lam[:150, 1] = lam[:150, 0] * (1 - 1e-6 * torch.rand(150, generator=g, dtype=f64))  # near ties
        gram = q @ torch.diag_embed(lam) @ q.transpose(-1, -2)
        exact = torch.linalg.eigvalsh(gram)[..., -1]
        for squarings in (4, 20):
            p = 2 * 2 ** squarings + 2
            bound = W / (p + 1) * (p / (p + 1)) ** p  # = W max_r (1 - r) r^p
            got = top_eigenvalue_by_squaring(gram, squarings=squarings)
            assert ((exact - got) / exact).max() <= bound + 1e-13
            assert (got <= exact * (1 + 1e-13)).all()  # a Rayleigh quotient never exceeds lambda_max
    assert torch.equal(top_eigenvalue_by_squaring(torch.zeros(2, 4, 4, dtype=f64)), torch.zeros(2, dtype=f64))
    big = torch.diag(torch.tensor([1e38, 1e38, 1e38, 5e37]))  # trace 3.5e38 > float32 max
    assert torch.allclose(top_eigenvalue_by_squaring(big[None]).double(), torch.tensor([1e38], dtype=f64), rtol=1e-6)
    x = torch.randn(50, 4, 6, generator=g, dtype=f64)
    leaf = (x @ x.transpose(-1, -2)).requires_grad_()
    top_eigenvalue_by_squaring(leaf).sum().backward()
    _, vecs = torch.linalg.eigh(leaf.detach())
    v = vecs[..., -1]
    assert torch.allclose(leaf.grad, v[..., :, None] * v[..., None, :], rtol=1e-8, atol=1e-10)
    with pytest.raises(ValueError, match="squarings"):
        top_eigenvalue_by_squaring(leaf, squarings=-1)
