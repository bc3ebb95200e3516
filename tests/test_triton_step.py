"""The fused decoding-step kernel against ``falcon_step`` in float64, token by token.

Runs on the CPU through Triton's interpreter without CUDA, on the GPU with it."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not prepare_interpreter(), reason=FRESH_PROCESS_REASON)
pytest.importorskip("triton")

from falcon_fwa import falcon_step  # noqa: E402
from falcon_fwa.ops.triton import falcon_step_triton  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"


def _sequence(B, T, H, K, V, dtype, seed, gate):
    g = torch.Generator().manual_seed(seed)
    t = dict(q=torch.randn(B, T, H, K, generator=g), k=torch.randn(B, T, H, K, generator=g) / K ** 0.5,
             v=torch.randn(B, T, H, V, generator=g), beta=torch.rand(B, T, H, generator=g),
             lam=torch.rand(B, T, H, generator=g) * 0.5,
             log_gate=-torch.rand(B, T, H, generator=g) * 0.2 if gate else None)
    return {n: None if x is None else x.to(DEVICE, dtype) for n, x in t.items()}


def _decode(step, seq, T, **options):
    state, outs = None, []
    for t in range(T):
        a = {n: None if x is None else x[:, t] for n, x in seq.items()}
        o, state = step(a["q"], a["k"], a["v"], a["beta"], a["lam"], log_gate=a["log_gate"], state=state, **options)
        outs.append(o)
    return torch.stack(outs, 1), state


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("rule", ["1", "1A"])
@pytest.mark.parametrize("shift,read,gate,normalize,scale_ridge", [
    (True, "after", True, True, False), (False, "before", False, False, False), (True, "before", True, True, True)])
def test_step_matches_reference(rule, shift, read, gate, normalize, scale_ridge):
    B, T, H, K, V = 2, 6, 2, 16, 20
    options = dict(rule=rule, shift=shift, read=read, normalize=normalize, scale_ridge=scale_ridge)
    ours = _decode(falcon_step_triton, _sequence(B, T, H, K, V, torch.float32, 0, gate), T, **options)
    ref = _decode(falcon_step, _sequence(B, T, H, K, V, torch.float64, 0, gate), T, **options)
    assert _rel(ours[0], ref[0]) < 1e-5
    assert _rel(ours[1].S, ref[1].S) < 1e-5
    if shift:
        assert torch.equal(ours[1].last_key.double(), ref[1].last_key)


def test_step_refuses_what_it_does_not_cover():
    q = torch.randn(1, 1, 16, device=DEVICE)
    b = torch.rand(1, 1, device=DEVICE)
    with pytest.raises(NotImplementedError, match="rule"):
        falcon_step_triton(q, q, q, b, b, state=None, rule="2")
    with pytest.raises(NotImplementedError, match="gradients"):
        falcon_step_triton(q.requires_grad_(), q, q, b, b, state=None)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rule", ["1", "1A"])
def test_step_cuda_bf16_head_dim_128(rule):
    B, T, H, K, V = 4, 32, 6, 128, 128
    ours = _decode(falcon_step_triton, _sequence(B, T, H, K, V, torch.bfloat16, 1, True), T, rule=rule)
    seq64 = {n: None if x is None else x.double() for n, x in _sequence(B, T, H, K, V, torch.bfloat16, 1, True).items()}
    ref = _decode(falcon_step, seq64, T, rule=rule)
    assert _rel(ours[0], ref[0]) < 1e-2
    assert _rel(ours[1].S, ref[1].S) < 1e-3


def test_fused_step_checks_its_inputs_like_the_torch_step():
    seq = _sequence(2, 1, 2, 16, 16, torch.float32, seed=5, gate=True)
    a = {n: x[:, 0] for n, x in seq.items()}
    bad = dict(a, lam=-a["lam"])
    if not CUDA:  # on a GPU a bad value is a device-side assertion (test below); it would end this process's context
        with pytest.raises(ValueError, match=r"\blam\b"):
            falcon_step(bad["q"], bad["k"], bad["v"], bad["beta"], bad["lam"], log_gate=bad["log_gate"], state=None,
                        rule="1A", backend="triton")
    with pytest.raises(ValueError, match=r"\bbeta\b"):
        falcon_step(a["q"], a["k"], a["v"], a["beta"][..., None].expand(-1, -1, 16), a["lam"],
                    log_gate=a["log_gate"], state=None, rule="1A", backend="triton")
    _, state = falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], log_gate=a["log_gate"], state=None, rule="1",
                           backend="triton")
    with pytest.raises(ValueError, match=r"\bstate\b.*rule"):
        falcon_step(a["q"], a["k"], a["v"], a["beta"], a["lam"], log_gate=a["log_gate"], state=state, rule="1A",
                    backend="triton")
    # validate=False: the caller vouches for its inputs (the model's layers); the kernel runs unchecked
    o, _ = falcon_step(bad["q"], bad["k"], bad["v"], bad["beta"], bad["lam"], log_gate=bad["log_gate"], state=None,
                       rule="1A", backend="triton", validate=False)
    assert o.shape == a["v"].shape


_BAD_LAM_ON_CUDA = """
import torch
from falcon_fwa import falcon_step
q, k, v = (torch.randn(2, 2, 16, device="cuda") for _ in range(3))
beta, lam = torch.rand(2, 2, device="cuda"), -torch.rand(2, 2, device="cuda") - 0.1
falcon_step(q, k, v, beta, lam, state=None, rule="1A", backend="triton")
torch.cuda.synchronize()
"""


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_a_bad_value_on_cuda_is_a_device_assertion_naming_the_argument():
    # the value checks do not wait for the device: a negative lam stops the process at the next synchronization,
    # with the argument's name in the message (run in a child process, since the assertion ends its CUDA context)
    run = subprocess.run([sys.executable, "-c", _BAD_LAM_ON_CUDA], capture_output=True, text=True, timeout=240)
    assert run.returncode != 0
    assert "lam must be >= 0" in run.stderr
