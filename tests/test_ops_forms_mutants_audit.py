"""Behaviour of the PyTorch forms that the other op tests left open, each checked against a float64 loop of the
update written here (rule 1: ``S_t = gamma_t S' + eta_t x_t (y_t - S'^T x_t)^T``, rule 1A:
``S_t = gamma_t S' + eta_t x_t y_t^T``, ``S' = exp(g_t) S_{t-1}``, ``x_t = k_{t-1}`` with the sentinel at ``t = 1``):

* the chunk form with a ``chunk_size`` far above ``T`` runs one chunk of ``T`` steps (its block tensors are sized by
  ``min(chunk_size, T)``, not by ``chunk_size``), and gives the loop's outputs;
* a float64 ``log_gate`` beside float32 features makes every form (and the decoding step) compute in float64:
  the state comes back in float64 with the loop's values to float64 rounding;
* the column groups of the per-column rules count the blocks of the chunks the form runs: of ``min(chunk_size, T)``
  steps, so that a sequence shorter than ``chunk_size`` is not cut into more groups than its blocks need
  (hand-counted elements).
"""
from __future__ import annotations

import math

import pytest
import torch

from falcon_fwa import falcon_attention, falcon_step

f64 = torch.float64


def _loop(q, k, v, beta, lam, *, rule, log_gate=None, eps=1e-6, decay_floor=1e-3):
    """``o`` ``[B, T, H, V]`` and ``S_T`` ``[B, H, K, V]`` of rule 1 or 1A (``shift=True``, ``normalize=True``,
    read after write) in float64, one step at a time."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    o = torch.zeros(B, T, H, V, dtype=f64)
    S_T = torch.zeros(B, H, K, V, dtype=f64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, V, dtype=f64)
            for t in range(T):
                if log_gate is not None:
                    S = math.exp(float(log_gate[b, t, h])) * S
                if t > 0:
                    x, y = k[b, t - 1, h].double(), v[b, t, h].double()
                    lam_t = float(lam[b, t, h])
                    eta = float(beta[b, t, h]) / (float(x @ x) + lam_t + eps)
                    gamma = 1.0 - min(eta * lam_t, 1.0 - decay_floor)
                    r = y - S.T @ x if rule == "1" else y
                    S = gamma * S + eta * torch.outer(x, r)
                o[b, t, h] = S.T @ q[b, t, h].double()
            S_T[b, h] = S
    return o, S_T


def _inputs(B=1, T=3, H=1, K=2, V=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=f64) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=f64)
    beta = torch.rand(B, T, H, generator=g, dtype=f64) + 0.5
    lam = torch.rand(B, T, H, generator=g, dtype=f64)
    return q, k, v, beta, lam


@pytest.mark.parametrize("rule", ["1", "1A"])
def test_a_chunk_size_far_above_the_sequence_is_one_chunk_of_the_sequence(rule):
    q, k, v, beta, lam = _inputs()
    o_ref, S_ref = _loop(q, k, v, beta, lam, rule=rule)
    # a chunk of 10**7 steps would hold scores of 10**14 elements; one of T = 3 steps holds 9
    o, st = falcon_attention(q, k, v, beta, lam, rule=rule, form="chunk", chunk_size=10 ** 7, backend="torch",
                             output_final_state=True)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st.S, S_ref, rtol=1e-12, atol=1e-12)


def _gated_float32_inputs():
    q, k, v, beta, lam = (t.float() for t in _inputs(T=4, seed=1))
    log_gate = -torch.rand(1, 4, 1, generator=torch.Generator().manual_seed(2), dtype=f64) / 3 - 1e-3
    return q, k, v, beta, lam, log_gate


@pytest.mark.parametrize("form", ["recurrent", "parallel", "chunk"])
@pytest.mark.parametrize("rule", ["1", "1A"])
def test_a_float64_log_gate_makes_the_forms_compute_in_float64(rule, form):
    q, k, v, beta, lam, log_gate = _gated_float32_inputs()
    o_ref, S_ref = _loop(q, k, v, beta, lam, rule=rule, log_gate=log_gate)
    o, st = falcon_attention(q, k, v, beta, lam, rule=rule, form=form, chunk_size=3, log_gate=log_gate,
                             backend="torch", output_final_state=True)
    assert o.dtype == torch.float32 and st.S.dtype == f64  # o in v's dtype, the state in the compute dtype
    torch.testing.assert_close(st.S, S_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(o, o_ref.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rule", ["1", "1A"])
def test_a_float64_log_gate_makes_the_decoding_step_compute_in_float64(rule):
    q, k, v, beta, lam, log_gate = _gated_float32_inputs()
    _, S_ref = _loop(q, k, v, beta, lam, rule=rule, log_gate=log_gate)
    state = None
    for t in range(q.shape[1]):
        _, state = falcon_step(q[:, t], k[:, t], v[:, t], beta[:, t], lam[:, t], log_gate=log_gate[:, t],
                               state=state, rule=rule, backend="torch")
    assert state.S.dtype == f64
    torch.testing.assert_close(state.S, S_ref, rtol=1e-12, atol=1e-12)


def test_column_groups_count_chunks_of_a_sequence_shorter_than_chunk_size(monkeypatch):
    """``T = 3`` steps with ``chunk_size = 64`` run as one chunk of ``C = 3``: with ``B = H = 1``, ``W = 1``,
    ``K = 3``, per column ``C * C W + C W * K + K * K = 9 + 9 + 9 = 27`` elements for rule 2 and ``18`` for 2A. A
    budget of five such columns runs all five at once (``None``), one element less runs four (2), and 2A's
    ``5 * 18`` fits too; a chunk counted as 64 steps (``4096 + 192 + 9`` per column) would run one at a time."""
    from falcon_fwa.ops import chunk

    q, xs, log_a = torch.zeros(1, 1, 3, 3), torch.zeros(1, 1, 3, 1, 3), torch.zeros(1, 1, 3, 5)
    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", 5 * 27)
    assert chunk._column_group(q, xs, log_a, regression=True, chunk_size=64) is None
    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", 5 * 27 - 1)
    assert chunk._column_group(q, xs, log_a, regression=True, chunk_size=64) == 4
    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", 5 * 18)
    assert chunk._column_group(q, xs, log_a, regression=False, chunk_size=64) is None
