"""The exact op's PyTorch core held to its docstrings where the comparisons of the forms with each other and
with the float64 loop do not reach: the top eigenvalue by squaring with no or one squaring (by hand) and on a
window with an empty slot; the log carry of a decay far below float32's epsilon (``math.log1p``); rule 3's
statistic of a non-finite window (NaN for it alone, ``eigvalsh`` for the others); gains of either sign in every
form; the column groups of the chunk form counted by hand; the normalizer's padding to a multiple of 16
values; and the trace continuing the state of a normalized read. Each case is checked against hand-computed
values, a float64 computation written here, or the float64 loop of ``conftest``."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import FORMS, random_inputs, reference_falcon, rel_err

from falcon_fwa import falcon_attention, falcon_trace
from falcon_fwa.ops.rules import get_rule
from falcon_fwa.ops.step_sizes import log_carry, normalization_statistic, top_eigenvalue_by_squaring

f64 = torch.float64


# ----------------------------------------------------------------------------- step sizes
def test_top_eigenvalue_by_squaring_with_no_squaring_is_one_more_product():
    """With ``squarings=0`` (allowed) ``M`` is ``G`` up to a scale: the column with the largest diagonal entry,
    ``G e_0``, times ``G`` once more is ``G^2 e_0``, and the result its Rayleigh quotient. For
    ``G = [[2, 1], [1, 1]]``: ``G^2 e_0 = (5, 3)``, ``G (5, 3) = (13, 8)``, quotient ``(65 + 24) / 34 = 89 / 34``
    (below ``lambda_max = (3 + sqrt 5) / 2``); one squaring gives the quotient of ``G^3 e_0 = (13, 8)``,
    ``(13 * 34 + 8 * 21) / 233 = 610 / 233``."""
    G = torch.tensor([[2.0, 1.0], [1.0, 1.0]], dtype=f64)
    assert top_eigenvalue_by_squaring(G, squarings=0).item() == pytest.approx(89 / 34, rel=1e-15)
    assert top_eigenvalue_by_squaring(G, squarings=1).item() == pytest.approx(610 / 233, rel=1e-15)
    assert 89 / 34 < 610 / 233 < (3 + math.sqrt(5)) / 2


@pytest.mark.parametrize("dtype", [torch.float32, f64])
def test_top_eigenvalue_by_squaring_of_a_partly_empty_window(dtype):
    """A window with an empty slot (a zero row of ``X``, as the sentinel's or one before the start) has a zero
    diagonal entry in its Gram; the scale is the largest diagonal entry, so the estimate is still
    ``lambda_max`` (``(3 + sqrt 5) / 2`` for the nonzero block ``[[2, 1], [1, 1]]``, ``4`` for ``diag(4, 0)``)."""
    G = torch.tensor([[2.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=dtype)
    D = torch.tensor([[0.0, 0.0], [0.0, 4.0]], dtype=dtype)
    top = top_eigenvalue_by_squaring(G)
    assert torch.isfinite(top) and top.item() == pytest.approx((3 + math.sqrt(5)) / 2, rel=1e-6)
    assert top_eigenvalue_by_squaring(D).item() == pytest.approx(4.0, rel=1e-6)


def test_log_carry_of_a_tiny_decay_keeps_its_digits():
    """``log gamma_t = log1p(-alpha_t)``: a decay fraction far below float32's epsilon still gives
    ``log gamma_t ~ -alpha_t`` (``1 - alpha_t`` would round to 1 and lose it), against ``math.log1p``."""
    alpha = torch.tensor([1e-12, 3e-9, 1e-7, 0.25], dtype=torch.float32)
    got = log_carry(alpha, 1e-3).double()
    want = torch.tensor([math.log1p(-a) for a in alpha.double().tolist()], dtype=f64)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_window_has_a_nan_statistic_of_its_own(bad):
    """Rule 3's ``mu_t = lambda_max(X_t X_t^T) / B_t``: a window holding a non-finite feature gets a NaN statistic
    (not the 0 of a zeroed Gram, which would pass for an empty window), and every other window, in the same
    batch, its own value (float64 ``eigvalsh`` of each window's Gram, one at a time)."""
    g = torch.Generator().manual_seed(11)
    xs = torch.randn(2, 1, 5, 3, 4, generator=g, dtype=f64)  # [B, H, T, W, K]
    slot_valid = torch.ones(2, 5, 3, dtype=torch.bool)
    slot_valid[0, 0, 1:] = False
    xs[0, :, 0, 1:] = 0.0  # step 1 of row 0 holds one pair
    xs[1, 0, 2, 1, 3] = bad
    stat = normalization_statistic(get_rule("3"), xs, slot_valid.sum(-1))
    for b in range(2):
        for t in range(5):
            if b == 1 and t == 2:
                assert torch.isnan(stat[b, 0, t])
                continue
            X = xs[b, 0, t]
            want = torch.linalg.eigvalsh(X @ X.T)[-1] / slot_valid[b, t].sum()
            assert stat[b, 0, t].item() == pytest.approx(want.item(), rel=1e-12)


@pytest.mark.parametrize("rule", ["1", "2A", "3"])
def test_a_negative_gain_is_taken_as_given(rule):
    """``eta_t = beta_t / (E_t + lambda_t + eps)`` for a gain of either sign (an anti-Hebbian write, and with a
    ridge ``gamma_t = 1 - eta_t lambda_t > 1``): every form is the float64 loop of ``conftest`` with gains in
    ``(-1, 1)``."""
    inp = random_inputs(rule, B=1, T=9, beta_range=(-1.0, 1.0), lam_range=(0.0, 0.5), seed=21)
    assert (inp["beta"] < 0).any()
    ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, window=3)
    for form in FORMS:
        o, st = falcon_attention(**inp, rule=rule, window=3, form=form, chunk_size=4, output_final_state=True)
        assert rel_err(o, ref_o) <= 1e-10 and rel_err(st.S, ref_S) <= 1e-10, form


# ----------------------------------------------------------------------------- chunk form
def test_column_groups_count_the_documented_block_elements(monkeypatch):
    """``_column_group``: per column and chunk, scores ``C * C W``, history coupling ``C W * K`` and, for the
    regression rules, the transition ``K * K``. With ``B = H = 1``, ``T = 8``, ``C = 4`` (two chunks), ``W = 1``,
    ``K = 3``: ``2 (16 + 12 + 9) = 74`` elements per column for rule 2, ``2 (16 + 12) = 56`` for 2A. A budget of
    120 holds one column of rule 2 and two of 2A; a budget of five columns or more runs them all at once
    (``None``)."""
    from falcon_fwa.ops import chunk

    q, xs = torch.zeros(1, 1, 8, 3), torch.zeros(1, 1, 8, 1, 3)
    log_a = torch.zeros(1, 1, 8, 5)
    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", 120)
    assert chunk._column_group(q, xs, log_a, regression=True, chunk_size=4) == 1
    assert chunk._column_group(q, xs, log_a, regression=False, chunk_size=4) == 2
    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", 5 * 74)
    assert chunk._column_group(q, xs, log_a, regression=True, chunk_size=4) is None
    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", 5 * 74 - 1)
    assert chunk._column_group(q, xs, log_a, regression=True, chunk_size=4) == 4


# ----------------------------------------------------------------------------- normalized read
def test_normalizer_columns_fill_rows_to_a_multiple_of_16():
    """``_z_columns``: one ``z`` column (``V`` for 2A) and the fewest zero columns that make the extended row a
    multiple of 16 values, by hand: ``V = 4``: 1A ``(1, 11)``, 2A ``(4, 8)``; ``V = 15``: 1A ``(1, 0)``;
    ``V = 16``: 1A ``(1, 15)``, 2A ``(16, 0)``; ``V = 24``: 2A ``(24, 0)``, 3A ``(1, 7)``."""
    from falcon_fwa.ops.read_norm import _z_columns

    cases = {("1A", 4): (1, 11), ("2A", 4): (4, 8), ("1A", 15): (1, 0), ("1A", 16): (1, 15), ("2A", 16): (16, 0),
             ("2A", 24): (24, 0), ("3A", 24): (1, 7)}
    for (rule, V), want in cases.items():
        assert _z_columns(get_rule(rule), V) == want, (rule, V)


# ----------------------------------------------------------------------------- trace
@pytest.mark.parametrize("rule", ["1A", "3A"])
def test_trace_continues_the_state_of_a_normalized_read(rule):
    """A state from a call with ``eps_attn`` carries ``z``, which takes no part in the learner: the trace of the
    second segment from it has the step sizes, carries and predictions of the float64 loop over the whole
    sequence at those steps."""
    inp = random_inputs(rule, B=2, T=12, seed=31, lam_range=(0.0, 2.0))
    inp["q"], inp["k"] = inp["q"].abs(), inp["k"].abs()  # nonnegative features, a positive denominator
    _, _, ref = reference_falcon(**inp, rule=rule, window=3)
    first = {n: t[:, :5] for n, t in inp.items()}
    _, st = falcon_attention(**first, rule=rule, window=3, eps_attn=1e-6, output_final_state=True)
    assert st.z is not None
    rest = {n: t[:, 5:] for n, t in inp.items() if n != "q"}
    tr = falcon_trace(**rest, rule=rule, window=3, chunk_size=4, initial_state=st)
    for name in ("eta", "gamma", "prediction"):
        assert torch.allclose(getattr(tr, name), ref[name][:, 5:], rtol=1e-9, atol=1e-12), name
    assert tr.valid.all()
