"""Triton chunk kernels against the float64 recurrent form (the definition).

On a machine without CUDA the kernels run on the CPU through Triton's interpreter
(tiny shapes, fp32/fp16); with CUDA the same checks run on the GPU at larger and
ragged shapes, bf16/fp16/fp32. Every output, final state and gradient is compared
with ``falcon_attention(form="recurrent")`` in float64 on the same (rounded) inputs.
"""
from __future__ import annotations

import pytest
import torch

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not prepare_interpreter(), reason=FRESH_PROCESS_REASON)
pytest.importorskip("triton")

from falcon_fwa import FalconState, falcon_attention  # noqa: E402
from falcon_fwa.ops.triton import falcon_chunk_triton  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
each_rule = pytest.mark.parametrize("rule", ["1A", "1"])


def _inputs(B, T, H, K, V, dtype, *, seed, gate, state, N=None, lam_scale=0.5):
    """Leaf tensors ``q, k, v, beta, lam, log_gate, S0, last_key`` (gate/state may be None)."""
    g = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    t = dict(
        q=torch.randn(B, T, H, K, generator=g) / K ** 0.25,
        k=torch.randn(B, T, H, K, generator=g) / K ** 0.25,
        v=torch.randn(B, T, H, V, generator=g),
        beta=torch.rand(B, T, H, generator=g) * 0.9 + 0.1,
        lam=torch.rand(B, T, H, generator=g) * lam_scale,
        log_gate=-torch.rand(B, T, H, generator=g) * 0.1 if gate else None,
        S0=torch.randn(N, H, K, V, generator=g) * 0.1 if state else None,
        last_key=torch.randn(N, H, K, generator=g) / K ** 0.25 if state else None,
    )
    return {n: None if x is None else x.to(dtype) for n, x in t.items()}


def _run(fn, leaves, rule, shift, output_final_state, **options):
    leaves = {n: None if x is None else x.detach().clone().requires_grad_() for n, x in leaves.items()}
    state = None
    if leaves["S0"] is not None:
        state = FalconState(rule=rule, window=1, shift=shift, S=leaves["S0"],
                            last_key=leaves["last_key"] if shift else None)
    o, final = fn(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves["lam"], rule=rule,
                  log_gate=leaves["log_gate"], shift=shift, initial_state=state,
                  output_final_state=output_final_state, **options)
    g = torch.Generator().manual_seed(123)
    loss = (o.double() * torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
    if output_final_state:
        loss = loss + (final.S.double() * torch.randn(final.S.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
        if shift:
            lk = final.last_key.double()
            loss = loss + (lk * torch.randn(lk.shape, generator=g, dtype=torch.float64).to(o.device)).sum()
    loss.backward()
    grads = {n: x.grad for n, x in leaves.items() if x is not None and (shift or n != "last_key")}
    return o, final, grads


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(rule, dims, dtype, *, device=DEVICE, seed=0, gate=True, state=False, shift=True, output_final_state=False,
           cu_seqlens=None, chunk_size=16, lam_scale=0.5, **options):
    B, T, H, K, V = dims
    N = None if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = _inputs(B, T, H, K, V, dtype, seed=seed, gate=gate, state=state, N=N, lam_scale=lam_scale)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    tri = _run(falcon_chunk_triton, {n: None if x is None else x.to(device) for n, x in leaves.items()},
               rule, shift, output_final_state, chunk_size=chunk_size, cu_seqlens=cu, **options)
    ref = _run(falcon_attention, {n: None if x is None else x.to(device, torch.float64) for n, x in leaves.items()},
               rule, shift, output_final_state, form="recurrent", cu_seqlens=cu, **options)
    tol = TOL[dtype]
    assert tri[0].dtype == dtype and tri[0].shape == ref[0].shape
    errors = {"o": _rel(tri[0], ref[0])}
    if output_final_state:
        errors["S_T"] = _rel(tri[1].S, ref[1].S)
        if shift:
            errors["last_key"] = _rel(tri[1].last_key, ref[1].last_key)
    errors.update({f"d{n}": _rel(tri[2][n], ref[2][n]) for n in ref[2]})
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"


# ---- every switch, tiny shapes (interpreter on CPU, GPU when present) ----

@pytest.mark.parametrize("read", ["after", "before"])
@pytest.mark.parametrize("shift,normalize", [(True, True), (False, False)])
@each_rule
def test_switches_match_recurrent(rule, read, shift, normalize):
    _check(rule, (1, 37, 2, 16, 24), torch.float32, read=read, shift=shift, normalize=normalize, seed=1)


@each_rule
def test_scale_ridge_no_gate_chunk_32(rule):
    _check(rule, (1, 64, 2, 16, 16), torch.float32, gate=False, scale_ridge=True, chunk_size=32, seed=2)


@each_rule
def test_clamped_decay(rule):
    # eta * lam reaches past 1 - decay_floor on many steps: the clamp and its zero gradient.
    _check(rule, (1, 40, 2, 16, 16), torch.float32, normalize=False, lam_scale=3.0, decay_floor=0.05, seed=8)


@each_rule
def test_state_in_and_out_several_key_blocks(rule):
    # K = 80 spans two key blocks of the kernels; initial state with the last-key carry.
    _check(rule, (2, 21, 1, 80, 20), torch.float32, state=True, output_final_state=True, seed=3)


@each_rule
def test_packed_sequences_with_states(rule):
    _check(rule, (1, 70, 2, 16, 20), torch.float32, state=True, output_final_state=True, cu_seqlens=[0, 5, 40, 41, 70],
           read="before", seed=4)


@each_rule
def test_packed_sequences_fresh_start_chunk_64(rule):
    # the default chunk size: the WY solve runs over a whole 64 x 64 tile
    _check(rule, (1, 80, 1, 16, 16), torch.float32, output_final_state=True, cu_seqlens=[0, 17, 80], chunk_size=64,
           seed=5)


@each_rule
def test_chunk_128_two_chunks(rule):
    _check(rule, (1, 150, 1, 16, 16), torch.float32, chunk_size=128, read="before", seed=9)


@each_rule
def test_fp16_inputs(rule):
    _check(rule, (1, 40, 2, 32, 32), torch.float16, seed=6)


@each_rule
def test_two_segments_continue_exactly(rule):
    B, T, H, K, V = 1, 40, 2, 16, 16
    x = _inputs(B, T, H, K, V, torch.float32, seed=7, gate=True, state=False)
    x = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}
    args = lambda a, b: [x[n][:, a:b] for n in ("q", "k", "v", "beta", "lam")]  # noqa: E731
    whole, _ = falcon_chunk_triton(*args(0, T), rule=rule, log_gate=x["log_gate"], chunk_size=16)
    first, st = falcon_chunk_triton(*args(0, 23), rule=rule, log_gate=x["log_gate"][:, :23], chunk_size=16,
                                    output_final_state=True)
    second, _ = falcon_chunk_triton(*args(23, T), rule=rule, log_gate=x["log_gate"][:, 23:], chunk_size=16,
                                    initial_state=st)
    assert _rel(torch.cat([first, second], 1), whole) < 1e-5


def test_unsupported_switches_name_themselves():
    q = torch.randn(1, 8, 1, 16, device=DEVICE)
    beta, lam = torch.rand(1, 8, 1, device=DEVICE), torch.rand(1, 8, 1, device=DEVICE)
    with pytest.raises(NotImplementedError, match="rule"):
        falcon_chunk_triton(q, q, q, beta, lam, rule="3")
    with pytest.raises(NotImplementedError, match="chunk_size"):
        falcon_chunk_triton(q, q, q, beta, lam, chunk_size=24)
    with pytest.raises(NotImplementedError, match="dtype"):
        falcon_chunk_triton(q.double(), q.double(), q.double(), beta, lam)
    wide = torch.randn(1, 8, 1, 256, device=DEVICE)
    with pytest.raises(NotImplementedError, match="head dim K=256"):
        falcon_chunk_triton(wide, wide, q, beta, lam, rule="1")


# ---- GPU: benchmark-sized, ragged and packed shapes ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@each_rule
def test_cuda_benchmark_head_dims(rule, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check(rule, (1, 2048, 2, 128, 128), dtype, chunk_size=64, output_final_state=True, state=True, device="cuda")


@needs_cuda
@pytest.mark.parametrize("rule,K,V,read", [
    (rule, K, V, read) for rule in ("1A", "1")
    for K, V, read in [(64, 64, "after"), (100, 100, "before"), (128, 64, "before"), (256, 256, "after")]
    if rule == "1A" or K <= 128])  # rule 1 takes K <= 128 (test_unsupported_switches_name_themselves)
def test_cuda_ragged(rule, K, V, read):
    _check(rule, (2, 1000, 2, K, V), torch.bfloat16, chunk_size=64, read=read, output_final_state=True, device="cuda")


@needs_cuda
@each_rule
def test_cuda_packed_fp16(rule):
    _check(rule, (1, 1500, 2, 128, 128), torch.float16, chunk_size=64, state=True, output_final_state=True,
           cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")
