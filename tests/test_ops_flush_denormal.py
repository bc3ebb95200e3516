"""The op under flush-to-zero: ``torch.set_flush_denormal(True)`` (a common CPU setting, also left on by some
compiled libraries when they load) makes every subnormal result 0, Python's own float arithmetic in the thread
included. The op's floor for the gate is the log of the smallest subnormal; it is computed as a sum of logs, so that
it does not become ``log(0)`` there (a ``ValueError: math domain error`` from every gated call before). Values this
test uses are far from the subnormal range, so the outputs with and without the flag agree to rounding."""
from __future__ import annotations

import pytest
import torch

from falcon_fwa import falcon_attention

RULES = ["1", "2", "3", "1A", "2A", "3A"]
FORMS = ["recurrent", "parallel", "chunk"]


@pytest.fixture
def flush_denormal():
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        assert 2.2250738585072014e-308 * 2.220446049250313e-16 == 0.0  # the thread flushes Python's floats too
        yield
    finally:
        torch.set_flush_denormal(False)


def _inputs(seed, dtype, T=9):
    g = torch.Generator().manual_seed(seed)
    B, H, K, V = 2, 2, 4, 3
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V),
                beta=torch.rand(B, T, H, V, generator=g, dtype=dtype) * 1.5 + 0.1,
                lam=torch.rand(B, T, H, generator=g, dtype=dtype),
                log_gate=-torch.rand(B, T, H, generator=g, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rule", RULES)
def test_gated_op_under_flush_to_zero_matches_the_op_without_it(rule, form, dtype, request):
    x = _inputs(RULES.index(rule) * 10 + FORMS.index(form), dtype)
    if rule in ("1", "1A", "3", "3A"):
        x["beta"] = x["beta"][..., 0]
    kw = dict(rule=rule, form=form, chunk_size=4, backend="torch")
    expected = falcon_attention(**x, **kw)
    request.getfixturevalue("flush_denormal")
    got = falcon_attention(**x, **kw)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)
