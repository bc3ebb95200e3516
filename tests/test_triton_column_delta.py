"""Falcon-2 (per-column regression: one step size and decay per value column) on the
Triton chunk kernels against the float64 recurrent form (the definition).

Outputs, final states and the gradients of ``q, k, v, beta, lam, log_gate``, of the
initial state and of its last key are compared with
``falcon_attention(rule="2", form="recurrent")`` in float64 on the same inputs. Every
buffer the kernels allocate starts as NaN, so a value read before it is written shows.
On a machine without CUDA the kernels run through Triton's interpreter on tiny shapes;
with CUDA the same checks run at larger and ragged shapes.
"""
from __future__ import annotations

import math

import pytest
import torch

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter  # noqa: E402

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not prepare_interpreter(), reason=FRESH_PROCESS_REASON)
pytest.importorskip("triton")

from falcon_fwa import FalconState, falcon_attention  # noqa: E402
from falcon_fwa.ops.triton import column_delta, falcon_chunk_triton  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Kernel buffers start as NaN instead of whatever memory held."""
    def poisoned(shape, like, dtype=None):
        return torch.full(shape, float("nan"), dtype=like.dtype if dtype is None else dtype, device=like.device)

    monkeypatch.setattr(column_delta, "_empty", poisoned)


def _inputs(B, T, H, K, V, dtype, *, seed, gate=True, state=False, N=None, lam_scale=0.5, beta_scale=0.9):
    """Leaf tensors ``q, k, v, beta, lam, log_gate, S0, last_key`` (gate/state may be None).
    Keys have norm about 1, so the normalized per-column steps ``eta x x^T`` are strong."""
    g = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    t = dict(
        q=torch.randn(B, T, H, K, generator=g) / K ** 0.5,
        k=torch.randn(B, T, H, K, generator=g) / K ** 0.5,
        v=torch.randn(B, T, H, V, generator=g),
        beta=torch.rand(B, T, H, V, generator=g) * beta_scale + 0.1,
        lam=torch.rand(B, T, H, generator=g) * lam_scale,
        log_gate=-torch.rand(B, T, H, generator=g) * 0.1 if gate else None,
        S0=torch.randn(N, H, K, V, generator=g) * 0.1 if state else None,
        last_key=torch.randn(N, H, K, generator=g) / K ** 0.5 if state else None,
    )
    return {n: None if x is None else x.to(dtype) for n, x in t.items()}


def _run(fn, leaves, shift, output_final_state, **options):
    leaves = {n: None if x is None else x.detach().clone().requires_grad_() for n, x in leaves.items()}
    state = None
    if leaves["S0"] is not None:
        state = FalconState(rule="2", window=1, shift=shift, S=leaves["S0"],
                            last_key=leaves["last_key"] if shift else None)
    o, final = fn(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves["lam"], rule="2",
                  log_gate=leaves["log_gate"], shift=shift, initial_state=state,
                  output_final_state=output_final_state, **options)
    g = torch.Generator().manual_seed(123)

    def probe(t):
        t = t.double()
        return (t * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)).sum()

    loss = probe(o)
    if output_final_state:
        loss = loss + probe(final.S)
        if shift:
            loss = loss + probe(final.last_key)
    loss.backward()
    grads = {n: x.grad for n, x in leaves.items() if x is not None and (shift or n != "last_key")}
    return o, final, grads


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(dims, dtype=torch.float32, *, device=DEVICE, seed=0, gate=True, state=False, shift=True,
           output_final_state=False, cu_seqlens=None, chunk_size=16, lam_scale=0.5, beta_scale=0.9, **options):
    B, T, H, K, V = dims
    N = None if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = _inputs(B, T, H, K, V, dtype, seed=seed, gate=gate, state=state, N=N, lam_scale=lam_scale,
                     beta_scale=beta_scale)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    tri = _run(falcon_chunk_triton, {n: None if x is None else x.to(device) for n, x in leaves.items()},
               shift, output_final_state, chunk_size=chunk_size, cu_seqlens=cu, **options)
    ref = _run(falcon_attention, {n: None if x is None else x.to(device, torch.float64) for n, x in leaves.items()},
               shift, output_final_state, form="recurrent", cu_seqlens=cu, **options)
    tol = TOL[dtype]
    assert tri[0].dtype == dtype and tri[0].shape == ref[0].shape
    errors = {"o": _rel(tri[0], ref[0])}
    if output_final_state:
        errors["S_T"] = _rel(tri[1].S, ref[1].S)
        if shift:
            errors["last_key"] = _rel(tri[1].last_key, ref[1].last_key)
    assert set(tri[2]) == set(ref[2])
    errors.update({f"d{n}": _rel(tri[2][n], ref[2][n]) for n in ref[2]})
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"
    return errors


# ---- every switch, tiny shapes (interpreter on CPU, GPU when present) ----

@pytest.mark.parametrize("read", ["after", "before"])
@pytest.mark.parametrize("shift,normalize", [(True, True), (False, False)])
def test_switches_match_recurrent(read, shift, normalize):
    # chunk 32 = two sub-chunks of the read kernels; T = 37 ends inside the second chunk
    T, chunk_size = (37, 32) if shift else (21, 16)
    _check((1, T, 1, 16, 24), read=read, shift=shift, normalize=normalize, chunk_size=chunk_size, seed=1,
           beta_scale=0.9 if normalize else 0.5)


def test_scale_ridge_no_gate_unshifted_state():
    _check((1, 40, 1, 16, 8), gate=False, scale_ridge=True, chunk_size=32, state=True, shift=False,
           output_final_state=True, seed=2)


def test_clamped_decay_per_column():
    # eta_{t,j} lam_t passes 1 - decay_floor on some columns of a step and not on others
    x = _inputs(1, 40, 1, 16, 16, torch.float64, seed=8, lam_scale=30.0, beta_scale=1.5)
    E = (x["k"][:, :-1] ** 2).sum(-1)  # ||x_t||^2 of the shifted pairs t >= 2
    lam = x["lam"][:, 1:]
    clamped = x["beta"][:, 1:] / (E + lam + 1e-6)[..., None] * lam[..., None] > 0.95
    assert 0.1 < clamped.double().mean() < 0.9 and (clamped.any(-1) & ~clamped.all(-1)).any()
    _check((1, 40, 1, 16, 16), lam_scale=30.0, beta_scale=1.5, decay_floor=0.05, seed=8)


def test_strong_decay_never_overflows():
    # gamma at the floor 1e-3 on most columns: log-prefixes reach -200 within the chunk,
    # where any exp(-u) (a positive exponent) would overflow fp32
    errors = _check((1, 40, 1, 16, 8), normalize=False, beta_scale=0.5, lam_scale=40.0, chunk_size=64,
                    read="before", seed=9)
    assert all(math.isfinite(e) for e in errors.values())


def test_state_in_and_out_several_value_blocks():
    # K = 40 in one padded key tile, V = 40 over two value blocks; the last-key carry
    _check((2, 18, 1, 40, 40), state=True, output_final_state=True, seed=3)


def test_packed_sequences_with_states():
    _check((1, 60, 1, 16, 20), state=True, output_final_state=True, cu_seqlens=[0, 5, 38, 39, 60], read="before",
           chunk_size=32, seed=4)


def test_packed_fresh_starts_chunk_128_partial_second_chunk():
    _check((1, 134, 1, 16, 8), chunk_size=128, output_final_state=True, cu_seqlens=[0, 3, 134], seed=10)


def test_fp16_inputs():
    _check((1, 33, 1, 16, 16), torch.float16, chunk_size=32, seed=6)


def test_per_column_steps_differ_from_a_shared_step():
    # the kernels follow each column's own step: rule 2 with beta equal across the columns is
    # rule 1, and a per-column beta moves the output away from it
    x = _inputs(1, 33, 1, 16, 8, torch.float32, seed=12)
    args = [x[n].to(DEVICE) for n in ("q", "k", "v", "beta", "lam")]
    shared = args[3][..., :1].expand_as(args[3]).contiguous()
    rule2, _ = falcon_chunk_triton(*args[:3], shared, args[4], rule="2", log_gate=x["log_gate"].to(DEVICE),
                                   chunk_size=16)
    rule1, _ = falcon_chunk_triton(*args[:3], shared[..., 0], args[4], rule="1", log_gate=x["log_gate"].to(DEVICE),
                                   chunk_size=16)
    assert _rel(rule2, rule1) < 1e-5
    own, _ = falcon_chunk_triton(*args, rule="2", log_gate=x["log_gate"].to(DEVICE), chunk_size=16)
    assert _rel(own, rule1) > 1e-2


def test_two_segments_continue_exactly():
    B, T, H, K, V = 1, 40, 2, 16, 16
    x = _inputs(B, T, H, K, V, torch.float32, seed=7)
    x = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}

    def run(a, b, state=None):
        return falcon_chunk_triton(*[x[n][:, a:b] for n in ("q", "k", "v", "beta", "lam")], rule="2",
                                   log_gate=x["log_gate"][:, a:b], chunk_size=16, initial_state=state,
                                   output_final_state=True)

    whole, end = run(0, T)
    first, st = run(0, 23)
    second, end2 = run(23, T, st)
    assert _rel(torch.cat([first, second], 1), whole) < 1e-5
    assert _rel(end2.S, end.S) < 1e-5 and torch.equal(end2.last_key, end.last_key)


def test_public_op_routes_2_to_the_kernels_only_when_asked():
    from falcon_fwa.ops.triton import GPU_CHECKED_RULES, TRITON_RULES
    x = _inputs(2, 21, 2, 16, 16, torch.float32, seed=11)
    args = [x[n].to(DEVICE) for n in ("q", "k", "v", "beta", "lam")]
    ref, _ = falcon_attention(*args, rule="2", chunk_size=16, backend="torch")
    out, _ = falcon_attention(*args, rule="2", chunk_size=16, backend="triton")
    assert _rel(out, ref) < 1e-5
    assert "2" in TRITON_RULES
    if "2" not in GPU_CHECKED_RULES:  # "auto" keeps the PyTorch chunk form until the kernels pass on a GPU
        auto, _ = falcon_attention(*args, rule="2", chunk_size=16)
        assert torch.equal(auto, ref)
    with pytest.raises(NotImplementedError, match="chunk_size"):
        falcon_chunk_triton(*args, rule="2", chunk_size=24)
    wide = torch.zeros(1, 4, 1, 160, device=DEVICE)
    with pytest.raises(NotImplementedError, match="K=160"):
        falcon_chunk_triton(wide, wide, torch.zeros(1, 4, 1, 8, device=DEVICE), torch.ones(1, 4, 1, 8, device=DEVICE),
                            torch.zeros(1, 4, 1, device=DEVICE), rule="2", chunk_size=16)


# ---- GPU: benchmark-sized, ragged and packed shapes ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_benchmark_head_dims(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check((1, 2048, 2, 128, 128), dtype, chunk_size=64, output_final_state=True, state=True, device="cuda")


@needs_cuda
@pytest.mark.parametrize("K,V,read,chunk_size", [(64, 64, "after", 64), (100, 100, "before", 64),
                                                 (128, 64, "before", 128), (32, 256, "after", 32),
                                                 (128, 128, "after", 16)])
def test_cuda_ragged(K, V, read, chunk_size):
    _check((2, 1000, 2, K, V), torch.bfloat16, chunk_size=chunk_size, read=read, output_final_state=True,
           device="cuda")


@needs_cuda
def test_cuda_packed_fp16():
    _check((1, 1500, 2, 128, 128), torch.float16, chunk_size=64, state=True, output_final_state=True,
           cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")
