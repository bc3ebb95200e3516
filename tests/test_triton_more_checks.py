"""Host-side dispatch to the Triton kernels under derivatives other than a reverse-mode gradient.

The fused recurrent kernel (the short-prompt path of ``backend="auto"``, ``form="recurrent"`` on
``backend="triton"``, the decoding step) is no autograd node, and the chunk kernels' nodes have no ``jvp``
or ``setup_context``: a forward-mode tangent (``torch.autograd.forward_ad``) or a ``torch.func`` transform
must keep ``backend="auto"`` on the PyTorch forms (which take both), and make ``backend="triton"`` raise
``NotImplementedError``, never drop the tangent silently. Without CUDA, "auto" on CUDA is simulated as in
``test_triton_dispatch.py`` (``api._triton_chunk`` handing out the chunk kernels), and the kernels run
through Triton's interpreter; tiny shapes.
"""
from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.func as tfunc

from kernel_checks import CUDA, DEVICE, in_this_process

from falcon_fwa import falcon_attention, falcon_step


def _inputs(rule="1", T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, H, K, V = 1, 1, 4, 4
    q, k = (torch.randn(B, T, H, K, generator=g) / 2 for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g)
    beta = torch.rand(*((B, T, H, V) if rule in ("2", "2A") else (B, T, H)), generator=g) + 0.1
    lam = torch.rand(B, T, H, generator=g)
    direction = torch.randn(B, T, H, K, generator=g)
    return [t.to(DEVICE) for t in (q, k, v, beta, lam, direction)]


@pytest.fixture
def auto_on_cuda(monkeypatch):
    """``backend="auto"`` as it dispatches on CUDA: on the CPU, ``_triton_chunk`` hands out the chunk kernels."""
    if not CUDA:
        from falcon_fwa.ops import api
        from falcon_fwa.ops.triton import falcon_chunk_triton
        monkeypatch.setattr(api, "_triton_chunk", lambda backend, q, rule: falcon_chunk_triton)


def _tangent(backend, rule="1", **options):
    q, k, v, beta, lam, dq = _inputs(rule)
    with fwAD.dual_level():
        o, _ = falcon_attention(fwAD.make_dual(q, dq), k, v, beta, lam, rule=rule, chunk_size=16, backend=backend,
                                **options)
        return fwAD.unpack_dual(o).tangent


@in_this_process
@pytest.mark.parametrize("rule", ["1", "3A"])
def test_auto_short_prompt_keeps_a_forward_mode_tangent(rule, auto_on_cuda):
    """A dual ``q`` that does not require grad, on a prompt short enough for the fused kernel: "auto" gave an output
    without a tangent (the fused kernel ran, no gradient being wanted); the tangent must be the PyTorch forms'."""
    ref = _tangent("torch", rule, window=2)
    assert ref is not None and ref.abs().max() > 0
    got = _tangent("auto", rule, window=2)
    assert got is not None, "backend='auto' dropped the forward-mode tangent"
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@in_this_process
def test_fused_kernels_refuse_a_forward_mode_tangent():
    """``backend="triton"`` with a dual input: the fused recurrent kernel (and the step on it) computes no derivative,
    so it raises ``NotImplementedError`` as for a ``requires_grad`` input instead of returning an output without it."""
    q, k, v, beta, lam, dq = _inputs()
    with fwAD.dual_level():
        dual = fwAD.make_dual(q, dq)
        with pytest.raises(NotImplementedError, match="tangent"):
            falcon_attention(dual, k, v, beta, lam, rule="1", form="recurrent", backend="triton")
        with pytest.raises(NotImplementedError, match="tangent"):
            falcon_step(dual[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], rule="1", backend="triton")


@in_this_process
@pytest.mark.parametrize("transform", ["grad", "jvp"])
def test_auto_under_torch_func_runs_the_pytorch_forms(transform, auto_on_cuda):
    """``torch.func.grad`` / ``jvp`` through ``backend="auto"``: the kernels' autograd nodes (no ``setup_context``)
    raised a RuntimeError there, where the PyTorch forms, which "auto" falls back to, give the derivative."""
    q, k, v, beta, lam, dq = _inputs()

    def loss(backend):
        return lambda q: falcon_attention(q, k, v, beta, lam, rule="1", chunk_size=16, backend=backend)[0].sum()

    if transform == "grad":
        ref, got = tfunc.grad(loss("torch"))(q), tfunc.grad(loss("auto"))(q)
    else:
        ref, got = (tfunc.jvp(loss(backend), (q,), (dq,))[1] for backend in ("torch", "auto"))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
