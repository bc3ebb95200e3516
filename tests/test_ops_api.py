"""The public entries of ``falcon_fwa.ops`` agree with each other and with their docstrings:
the same keyword names, order, defaults and kinds across ``falcon_attention``, ``falcon_step``,
``falcon_trace`` and the Triton entries; the shapes and dtypes that ``FalconState``,
``FalconTrace`` and the entries' docstrings state, for every rule, form and switch that changes
them; and the block equations of ``ops/parallel.py``'s docstring against a plain float64 loop."""
from __future__ import annotations

import inspect

import pytest
import torch
from conftest import FORMS, PER_COLUMN, RULE_NAMES, SLIDING, random_inputs

from falcon_fwa.ops import FalconState, falcon_attention, falcon_step, falcon_trace
from falcon_fwa.ops.parallel import prepare_block, propagate, transition, write_vectors

B, T, H, K, V, W = 2, 7, 3, 5, 4, 3  # all different, so that a swapped axis changes a shape
POSITIONAL = ("q", "k", "v", "beta", "lam")


def _entries():
    entries = {"falcon_attention": falcon_attention, "falcon_step": falcon_step, "falcon_trace": falcon_trace}
    try:
        from falcon_fwa.ops.triton import falcon_chunk_triton, falcon_recurrent_triton, falcon_step_triton
    except ImportError:
        return entries
    return {**entries, "falcon_chunk_triton": falcon_chunk_triton,
            "falcon_recurrent_triton": falcon_recurrent_triton, "falcon_step_triton": falcon_step_triton}


def _params(fn):
    return inspect.signature(inspect.unwrap(fn)).parameters


# What each entry leaves out of falcon_attention's arguments (its docstring says why), and adds.
LEFT_OUT = {
    "falcon_attention": set(),
    "falcon_step": {"form", "chunk_size", "initial_state", "output_final_state", "cu_seqlens", "segments"},
    "falcon_trace": {"q", "form", "read", "output_final_state", "cu_seqlens", "eps_attn", "segments"},
    "falcon_chunk_triton": {"form", "backend", "eps_attn", "segments"},
    "falcon_recurrent_triton": {"form", "chunk_size", "backend", "eps_attn", "segments"},
    "falcon_step_triton": {"form", "chunk_size", "initial_state", "output_final_state", "cu_seqlens", "backend",
                           "eps_attn", "segments"},
}
ADDED = {"falcon_step": {"state", "validate"}, "falcon_chunk_triton": {"validate"},
         "falcon_recurrent_triton": {"validate"}, "falcon_step_triton": {"state"}}


@pytest.mark.parametrize("name", sorted(_entries()))
def test_entries_share_falcon_attentions_arguments(name):
    ref = _params(falcon_attention)
    ps = _params(_entries()[name])
    assert not any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ps.values()), "no *args or **kwargs"
    assert set(ref) - set(ps) == LEFT_OUT[name]
    assert set(ps) - set(ref) == ADDED.get(name, set())
    # the tensors are positional, in the op's order; every option is keyword-only
    positional = [n for n, p in ps.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == [n for n in POSITIONAL if n in ps]
    assert all(ps[n].kind == inspect.Parameter.KEYWORD_ONLY for n in ps if n not in POSITIONAL)
    # the shared options in falcon_attention's order, with its defaults
    shared = [n for n in ps if n in ref]
    assert shared == [n for n in ref if n in ps]
    for n in shared:
        assert ps[n].default == ref[n].default, f"{name}: {n} defaults to {ps[n].default!r}"
    if "state" in ps:  # the one-step entries take the state as `state`, where the sequence entries take initial_state
        assert list(ps).index("state") == len(POSITIONAL)
        assert ps["state"].default is None, f"{name}: state=None starts a fresh sequence, as in falcon_step"


def _inputs(rule, dtype=torch.float32, **kw):
    return random_inputs(rule, B=kw.pop("B", B), T=kw.pop("T", T), H=H, K=K, V=V, with_gate=True, dtype=dtype, **kw)


def _expected_state(rule, *, rows, shift, normalized):
    """The fields of FalconState's docstring: S [B, H, K, V], last_key [B, H, K] (shifted), the sliding tail
    [B, H, W-1, K], [B, H, W-1, V], [B, W-1], z [B, H, K] ([B, H, K, V] for 2A) with eps_attn."""
    sliding = rule in SLIDING
    return {"S": (rows, H, K, V), "last_key": (rows, H, K) if shift else None,
            "tail_x": (rows, H, W - 1, K) if sliding else None, "tail_y": (rows, H, W - 1, V) if sliding else None,
            "tail_valid": (rows, W - 1) if sliding else None,
            "z": None if not normalized else (rows, H, K, V) if rule in PER_COLUMN else (rows, H, K)}


def _check_state(st, rule, *, rows, shift, normalized, dtype):
    want = _expected_state(rule, rows=rows, shift=shift, normalized=normalized)
    got = {f: None if getattr(st, f) is None else tuple(getattr(st, f).shape) for f in want}
    assert got == want
    for f, shape in want.items():
        if shape is not None:
            assert getattr(st, f).dtype == (torch.bool if f == "tail_valid" else dtype), f
    assert (st.rule, st.window, st.shift) == (rule, W if rule in SLIDING else 1, shift)


@pytest.mark.parametrize("rule", RULE_NAMES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shift", [True, False])
def test_attention_returns_the_documented_shapes(rule, form, shift):
    """o [B, T, H, V] in v's dtype; the state's fields in the compute dtype (float32 for bf16 inputs)."""
    inp = _inputs(rule, dtype=torch.bfloat16)
    for eps_attn in (None,) if rule in ("1", "2", "3") else (None, 1e-3):
        o, st = falcon_attention(inp["q"], inp["k"], inp["v"], inp["beta"], inp["lam"], rule=rule, window=W,
                                 form=form, chunk_size=4, shift=shift, log_gate=inp["log_gate"], eps_attn=eps_attn,
                                 output_final_state=True, backend="torch")
        assert o.shape == (B, T, H, V) and o.dtype == torch.bfloat16
        _check_state(st, rule, rows=B, shift=shift, normalized=eps_attn is not None, dtype=torch.float32)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_step_packed_and_fresh_states_have_the_documented_shapes(rule):
    inp = _inputs(rule, dtype=torch.float16)
    step = {n: inp[n][:, 0] for n in ("q", "k", "v", "beta", "lam", "log_gate")}
    o, st = falcon_step(step["q"], step["k"], step["v"], step["beta"], step["lam"], rule=rule, window=W,
                        log_gate=step["log_gate"], backend="torch")
    assert o.shape == (B, H, V) and o.dtype == torch.float16
    _check_state(st, rule, rows=B, shift=True, normalized=False, dtype=torch.float32)
    # packed: one state row per sequence, o [1, total, H, V]
    packed = _inputs(rule, B=1, T=9, dtype=torch.float64)
    o, st = falcon_attention(packed["q"], packed["k"], packed["v"], packed["beta"], packed["lam"], rule=rule,
                             window=W, cu_seqlens=torch.tensor([0, 2, 6, 9]), output_final_state=True)
    assert o.shape == (1, 9, H, V) and o.dtype == torch.float64
    _check_state(st, rule, rows=3, shift=True, normalized=False, dtype=torch.float64)
    # FalconState.fresh: S as given, no last key, an empty window
    fresh = FalconState.fresh(torch.zeros(B, H, K, V), rule=rule, window=W)
    want = _expected_state(rule, rows=B, shift=False, normalized=False)  # shift=False: no last key
    assert {f: None if getattr(fresh, f) is None else tuple(getattr(fresh, f).shape) for f in want} == want
    assert fresh.tail_valid is None or not fresh.tail_valid.any()


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_trace_returns_the_documented_shapes(rule):
    """FalconTrace: eta, gamma, clamped [B, T, H] ([B, T, H, V] per column), prediction and residual
    [B, T, H, V], loss [B, T, H], valid [B, T]; floats in the compute dtype."""
    inp = _inputs(rule, dtype=torch.bfloat16)
    tr = falcon_trace(inp["k"], inp["v"], inp["beta"], inp["lam"], rule=rule, window=W, log_gate=inp["log_gate"])
    per_step = (B, T, H, V) if rule in PER_COLUMN else (B, T, H)
    want = {"eta": (per_step, torch.float32), "gamma": (per_step, torch.float32), "clamped": (per_step, torch.bool),
            "prediction": ((B, T, H, V), torch.float32), "residual": ((B, T, H, V), torch.float32),
            "loss": ((B, T, H), torch.float32), "valid": ((B, T), torch.bool)}
    assert {f: (tuple(getattr(tr, f).shape), getattr(tr, f).dtype) for f in want} == want


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_parallel_block_equations_of_its_docstring(rule):
    """``ops/parallel.py``: the write vectors ``d_p = eta_p y_p - kappa_p S_{s_p-1}^T x_p`` (``kappa_p =
    eta_p exp(g_{s_p})``: the residual at the gated state), the exit state ``S_C = exp(u_C) S_0 +
    sum_p exp(u_C - u_{s_p}) x_p d_p^T`` and the affine map ``S_C = G S_0 + b`` of ``transition``, against
    a float64 loop over the block's steps and slots."""
    regression, per_column, Wr = rule in ("1", "2", "3"), rule in PER_COLUMN, W if rule in SLIDING else 1
    Vd, C = V if per_column else 1, 6
    g = torch.Generator().manual_seed(5)
    N = 2
    q = torch.randn(N, C, K, generator=g, dtype=torch.float64)
    xs = torch.randn(N, C, Wr, K, generator=g, dtype=torch.float64) / K ** 0.5
    ys = torch.randn(N, C, Wr, V, generator=g, dtype=torch.float64)
    eta = torch.rand(N, C, Wr, Vd, generator=g, dtype=torch.float64)
    gate = -torch.rand(N, C, generator=g, dtype=torch.float64)
    log_gamma = torch.log1p(-0.5 * torch.rand(N, C, Vd, generator=g, dtype=torch.float64))
    kappa = eta * torch.exp(gate)[..., None, None] if regression else None
    S0 = torch.randn(N, K, V, generator=g, dtype=torch.float64)
    blk = prepare_block(q, xs, ys, eta, kappa, log_gamma + gate[..., None], read_after=True)

    # the recurrence, step by step: S' = exp(g) S, slot writes d = eta (y - S'^T x) (or eta y), S = gamma S' + sum x d^T
    S, writes = S0.clone(), []
    cols = torch.arange(V) if per_column else torch.zeros(V, dtype=torch.long)  # each value column's gain column
    for t in range(C):
        gated = torch.exp(gate[:, t])[:, None, None] * S
        d = torch.stack([eta[:, t, m][:, cols] * (ys[:, t, m] - (torch.einsum("nk,nkv->nv", xs[:, t, m], gated)
                                                                  if regression else 0)) for m in range(Wr)], 1)
        writes.append(d)  # [N, W, V]
        S = torch.exp(log_gamma[:, t])[:, None, cols] * gated + torch.einsum("nmk,nmv->nkv", xs[:, t], d)
    want_D = torch.stack(writes, 1).reshape(N, C * Wr, V)  # slot p = (t, m) at row t * W + m

    D = write_vectors(blk, S0)  # [N, Vd, CW, V // Vd]
    got_D = D.permute(0, 2, 1, 3).reshape(N, C * Wr, V)
    assert torch.allclose(got_D, want_D, rtol=1e-12, atol=1e-12)
    _, S_end = propagate(blk, S0)
    assert torch.allclose(S_end, S, rtol=1e-12, atol=1e-12)
    G, b = transition(blk)
    S0g = S0.reshape(N, K, Vd, V // Vd).permute(0, 2, 1, 3)
    affine = (G @ S0g if regression else G * S0g) + b
    assert torch.allclose(affine.permute(0, 2, 1, 3).reshape(N, K, V), S, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rule", RULE_NAMES)
def test_rules_answer_to_the_papers_names(rule):
    """``get_rule`` takes the short name or the paper's ``Falcon-<name>`` in any case and with surrounding spaces
    (its docstring), each the same spec; the op run under the paper's name is the op under the short one."""
    from falcon_fwa.ops.rules import get_rule

    spec = get_rule(rule)
    assert spec.name == rule and spec.paper_name == f"Falcon-{rule}"
    assert spec.regression == (not rule.endswith("A")) and spec.per_column == (rule in PER_COLUMN)
    assert spec.sliding == (rule in SLIDING)
    for name in (f"Falcon-{rule}", f"  falcon-{rule.lower()} ", f"FALCON-{rule}", rule.lower(), f" {rule}\t"):
        assert get_rule(name) is spec, name
    for bad in (f"Falcon{rule}", f"Falcon--{rule}", f"-{rule}", f"{rule}B"):
        with pytest.raises(ValueError, match="rule must be one of"):
            get_rule(bad)
    inp = random_inputs(rule, B=1, T=6, H=2, K=3, V=2, seed=3)
    assert torch.equal(falcon_attention(**inp, rule=f" falcon-{rule.lower()}", window=2)[0],
                       falcon_attention(**inp, rule=rule, window=2)[0])
