"""A misspelt keyword of the public ops is named with the argument it most likely meant; the ops' own keywords,
their signatures and their results are unchanged."""
import inspect
import re

import pytest
import torch

from falcon_fwa.ops import falcon_attention, falcon_step, falcon_trace

B, T, H, K, V = 1, 3, 2, 4, 3


def _seq():
    g = torch.Generator().manual_seed(0)
    f64 = dict(generator=g, dtype=torch.float64)
    q, k, v = torch.randn(B, T, H, K, **f64), torch.randn(B, T, H, K, **f64), torch.randn(B, T, H, V, **f64)
    beta, lam = torch.rand(B, T, H, **f64), torch.rand(B, T, H, **f64)
    return q, k, v, beta, lam


@pytest.mark.parametrize("wrong,meant", [("lamda", "lam"), ("chunksize", "chunk_size"), ("decayfloor", "decay_floor"),
                                         ("output_final_states", "output_final_state"), ("state", "initial_state")])
def test_falcon_attention_names_a_misspelt_keyword_with_the_one_meant(wrong, meant):
    q, k, v, beta, lam = _seq()
    args = (q, k, v, beta) if wrong == "lamda" else (q, k, v, beta, lam)
    value = lam if wrong == "lamda" else {"chunksize": 2, "decayfloor": 1e-2, "output_final_states": True,
                                          "state": None}[wrong]
    with pytest.raises(TypeError, match=re.escape(f"falcon_attention() got an unexpected keyword argument {wrong!r} "
                                                  f"(did you mean {meant!r}?)")):
        falcon_attention(*args, **{wrong: value})


@pytest.mark.parametrize("wrong,meant", [("lamda", "lam"), ("initial_state", "state"), ("decayfloor", "decay_floor")])
def test_falcon_step_names_a_misspelt_keyword_with_the_one_meant(wrong, meant):
    q, k, v, beta, lam = (t[:, 0] for t in _seq())
    args = (q, k, v, beta) if wrong == "lamda" else (q, k, v, beta, lam)
    value = {"lamda": lam, "initial_state": None, "decayfloor": 1e-2}[wrong]
    with pytest.raises(TypeError, match=re.escape(f"falcon_step() got an unexpected keyword argument {wrong!r} "
                                                  f"(did you mean {meant!r}?)")):
        falcon_step(*args, **{wrong: value})


@pytest.mark.parametrize("wrong,meant", [("lamda", "lam"), ("state", "initial_state"), ("rul", "rule")])
def test_falcon_trace_names_a_misspelt_keyword_with_the_one_meant(wrong, meant):
    _, k, v, beta, lam = _seq()
    args = (k, v, beta) if wrong == "lamda" else (k, v, beta, lam)
    value = {"lamda": lam, "state": None, "rul": "1"}[wrong]
    with pytest.raises(TypeError, match=re.escape(f"falcon_trace() got an unexpected keyword argument {wrong!r} "
                                                  f"(did you mean {meant!r}?)")):
        falcon_trace(*args, **{wrong: value})


def test_unknown_keywords_without_a_close_name_list_what_the_op_takes():
    q, k, v, beta, lam = _seq()
    with pytest.raises(TypeError) as err:
        falcon_attention(q, k, v, beta, lam, attention_mask=None, xyz=1)
    message = str(err.value)
    assert message.startswith("falcon_attention() got unexpected keyword arguments 'attention_mask', 'xyz'; it takes ")
    listed = message.split("; it takes ")[1].split(", ")
    assert listed == list(inspect.signature(falcon_attention).parameters)


def test_other_type_errors_pass_unchanged():
    """Too many positional arguments (no keyword at fault) keep Python's own message; so does a keyword given
    twice, once by position."""
    q, k, v, beta, lam = _seq()
    with pytest.raises(TypeError, match=r"falcon_attention\(\) takes 5 positional arguments but 6 were given"):
        falcon_attention(q, k, v, beta, lam, lam)
    with pytest.raises(TypeError, match="multiple values for argument 'lam'"):
        falcon_attention(q, k, v, beta, lam, lam=lam)


def test_the_ops_keep_their_signatures():
    """The keyword-only arguments the documentation lists are still the ops' own (no catch-all ``**kwargs``)."""
    for op in (falcon_attention, falcon_step):
        params = inspect.signature(op).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in params)
        assert [p.name for p in params][:5] == ["q", "k", "v", "beta", "lam"]
    assert "initial_state" in inspect.signature(falcon_attention).parameters
    assert "state" in inspect.signature(falcon_step).parameters


def test_the_keywords_reach_the_op():
    """Rule 1A, shift=False, normalize=False on a fresh state: the first step writes ``S = beta k v^T`` and reads
    ``o = S^T q = beta (k . q) v`` (hand-derived from the rule's update); with the default shift=True the first
    step writes the sentinel and reads zero. Both through keywords, on both ops (the ridge's decay acts on the
    empty state only, no effect on the first step)."""
    q, k, v, beta, lam = _seq()
    want = beta[:, 0, :, None] * (k[:, 0] * q[:, 0]).sum(-1, keepdim=True) * v[:, 0]
    o, _ = falcon_attention(q, k, v, beta, lam, rule="1A", shift=False, normalize=False, form="recurrent")
    lam0 = lam[:, 0]
    torch.testing.assert_close(o[:, 0], want, rtol=1e-12, atol=1e-12)
    o1, _ = falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam0, rule="1A", shift=False, normalize=False)
    torch.testing.assert_close(o1, want, rtol=1e-12, atol=1e-12)
    o2, _ = falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam0, rule="1A")
    torch.testing.assert_close(o2, torch.zeros_like(want), rtol=0, atol=0)
