"""Falcon-3A (sliding-window inner-product rule) on the Triton chunk kernels against
the float64 recurrent form (the definition).

Outputs, final states (``S``, the last key and the window tail) and the gradients of
``q, k, v, beta, lam, log_gate`` and of every initial-state tensor are compared with
``falcon_attention(rule="3A", form="recurrent")`` in float64 on the same inputs. On a
machine without CUDA the kernels run through Triton's interpreter on tiny shapes;
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
from falcon_fwa.ops.triton import falcon_chunk_triton  # noqa: E402
from falcon_fwa.ops.triton.sliding import completed_gains, open_weights  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 1e-2}
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
STATE_NAMES = ("S0", "last_key", "tail_x", "tail_y")


def _inputs(B, T, H, K, V, W, dtype, *, seed, state, N=None):
    """Leaf tensors (state ones ``None`` without ``state``) and the tail validity."""
    g = torch.Generator().manual_seed(seed)
    N = B if N is None else N
    t = dict(
        q=torch.randn(B, T, H, K, generator=g) / K ** 0.25,
        k=torch.randn(B, T, H, K, generator=g) / K ** 0.25,
        v=torch.randn(B, T, H, V, generator=g),
        beta=torch.rand(B, T, H, generator=g) * 0.9 + 0.1,
        lam=torch.rand(B, T, H, generator=g) * 0.5,
        log_gate=-torch.rand(B, T, H, generator=g) * 0.1,
        S0=torch.randn(N, H, K, V, generator=g) * 0.1 if state else None,
        last_key=torch.randn(N, H, K, generator=g) / K ** 0.25 if state else None,
        tail_x=torch.randn(N, H, W - 1, K, generator=g) / K ** 0.25 if state and W > 1 else None,
        tail_y=torch.randn(N, H, W - 1, V, generator=g) if state and W > 1 else None,
    )
    tail_valid = None
    if state and W > 1:  # the oldest slot of the first row is empty (that segment was short)
        tail_valid = torch.ones(N, W - 1, dtype=torch.bool)
        tail_valid[0, 0] = False
        t["tail_x"][0, :, 0] = 0.0
        t["tail_y"][0, :, 0] = 0.0
    return {n: None if x is None else x.to(dtype) for n, x in t.items()}, tail_valid


def _run(fn, leaves, tail_valid, window, shift, output_final_state, **options):
    leaves = {n: None if x is None else x.detach().clone().requires_grad_() for n, x in leaves.items()}
    state = None
    if leaves["S0"] is not None:
        state = FalconState(rule="3A", window=window, shift=shift, S=leaves["S0"],
                            last_key=leaves["last_key"] if shift else None, tail_x=leaves["tail_x"],
                            tail_y=leaves["tail_y"], tail_valid=tail_valid)
    o, final = fn(leaves["q"], leaves["k"], leaves["v"], leaves["beta"], leaves["lam"], rule="3A", window=window,
                  log_gate=leaves["log_gate"], shift=shift, initial_state=state,
                  output_final_state=output_final_state, **options)
    g = torch.Generator().manual_seed(123)

    def probe(t):
        t = t.double()
        return (t * torch.randn(t.shape, generator=g, dtype=torch.float64).to(t.device)).sum()

    loss = probe(o)
    outs = {"o": o}
    if output_final_state:
        outs.update(S_T=final.S, last_key=final.last_key, tail_x=final.tail_x, tail_y=final.tail_y,
                    tail_valid=final.tail_valid)
        for name in ("S_T", "last_key", "tail_x", "tail_y"):
            if outs[name] is not None:
                loss = loss + probe(outs[name])
    loss.backward()
    grads = {n: x.grad for n, x in leaves.items() if x is not None and x.grad is not None}
    return outs, grads


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(dims, window, dtype=torch.float32, *, device=DEVICE, seed=0, state=False, shift=True,
           output_final_state=True, cu_seqlens=None, chunk_size=16, **options):
    B, T, H, K, V = dims
    N = None if cu_seqlens is None else len(cu_seqlens) - 1
    leaves, tail_valid = _inputs(B, T, H, K, V, window, dtype, seed=seed, state=state, N=N)
    tv = None if tail_valid is None else tail_valid.to(device)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=device)
    tri = _run(falcon_chunk_triton, {n: None if x is None else x.to(device) for n, x in leaves.items()}, tv,
               window, shift, output_final_state, chunk_size=chunk_size, cu_seqlens=cu, **options)
    ref = _run(falcon_attention, {n: None if x is None else x.to(device, torch.float64) for n, x in leaves.items()},
               tv, window, shift, output_final_state, form="recurrent", cu_seqlens=cu, backend="torch", **options)
    tol = TOL[dtype]
    assert tri[0]["o"].dtype == dtype and tri[0]["o"].shape == ref[0]["o"].shape
    errors = {}
    for name, r in ref[0].items():
        if name == "tail_valid":
            assert (r is None) == (tri[0][name] is None) and (r is None or torch.equal(tri[0][name], r))
        elif r is None:
            assert tri[0][name] is None, name
        else:
            errors[name] = _rel(tri[0][name], r)
    assert set(tri[1]) == set(ref[1]), (set(tri[1]), set(ref[1]))
    errors.update({f"d{n}": _rel(tri[1][n], ref[1][n]) for n in ref[1]})
    bad = {n: e for n, e in errors.items() if not e <= tol}
    assert not bad, f"relative errors above {tol}: {bad} (all: {errors})"
    return errors


# ---- the decomposition itself: completed gains and open weights, by hand ----

def test_gains_and_open_weights_by_hand():
    # W = 3, constant carry a: pair j is written at steps j, j+1, j+2 with gains c[j, 0],
    # c[j+1, 1], c[j+2, 2]; completed at step j+2 with e = c[j,0] a^2 + c[j+1,1] a + c[j+2,2].
    T, a = 6, 0.5
    c = torch.arange(1.0, 1.0 + 3 * T, dtype=torch.float64).reshape(T, 3)
    log_a = torch.full((T,), math.log(a), dtype=torch.float64)
    e = completed_gains(c, log_a)
    for p in range(T):
        want = sum(c[s, s - (p - 2)] * a ** (p - s) for s in range(max(0, p - 2), p + 1))
        assert abs(e[p].item() - want) < 1e-12
    rho = open_weights(c, log_a)  # rho[t, d-1]: pair t + d - 2 after step t
    for t in range(T):
        for d in (1, 2):
            j = t + d - 2
            want = sum(c[s, s - j] * a ** (t - s) for s in range(max(0, j), t + 1))
            assert abs(rho[t, d - 1].item() - want) < 1e-12


# ---- every switch, tiny shapes (interpreter on CPU, GPU when present) ----

@pytest.mark.parametrize("window", [1, 2, 3, 4, 5, 6])
def test_windows_read_after(window):
    _check((2, 21, 2, 16, 16), window, seed=window)


@pytest.mark.parametrize("window,read,shift", [(2, "before", True), (4, "before", False), (5, "after", False)])
def test_read_and_shift(window, read, shift):
    _check((1, 37, 2, 16, 24), window, read=read, shift=shift, seed=10 + window)


@pytest.mark.parametrize("window", [1, 3])
def test_unnormalized_scale_ridge_chunk_32(window):
    _check((1, 45, 1, 16, 16), window, normalize=False, scale_ridge=True, chunk_size=32, seed=20 + window)


@pytest.mark.parametrize("window,shift", [(1, True), (4, True), (3, False)])
def test_continuation_from_state_with_tail(window, shift):
    # K = 80 spans two key blocks; the window reaches into the previous segment's tail.
    _check((2, 19, 1, 80, 20), window, state=True, shift=shift, seed=30 + window)


@pytest.mark.parametrize("window", [1, 4])
def test_packed_sequences_with_states(window):
    _check((1, 46, 2, 16, 16), window, state=True, cu_seqlens=[0, 5, 30, 31, 46], read="before", seed=40 + window)


def test_packed_sequences_fresh_start():
    _check((1, 40, 1, 16, 16), 3, cu_seqlens=[0, 2, 40], seed=50)


def test_fp16_inputs():
    _check((1, 33, 2, 32, 32), 4, torch.float16, seed=60)


def test_two_segments_continue_exactly():
    # a segment cut inside the windows: the tail carries the open writes across the cut
    B, T, H, K, V, W = 1, 40, 2, 16, 16, 4
    x, _ = _inputs(B, T, H, K, V, W, torch.float32, seed=70, state=False)
    x = {n: None if t is None else t.to(DEVICE) for n, t in x.items()}

    def run(a, b, state=None, final=False):
        return falcon_chunk_triton(*[x[n][:, a:b] for n in ("q", "k", "v", "beta", "lam")], rule="3A", window=W,
                                   log_gate=x["log_gate"][:, a:b], chunk_size=16, initial_state=state,
                                   output_final_state=final)

    whole, end = run(0, T, final=True)
    first, st = run(0, 18, final=True)
    second, end2 = run(18, T, st, final=True)
    assert _rel(torch.cat([first, second], 1), whole) < 1e-5
    assert _rel(end2.S, end.S) < 1e-5 and torch.equal(end2.tail_x, end.tail_x)


def test_window_state_is_checked():
    q = torch.randn(1, 8, 1, 16, device=DEVICE)
    beta, lam = torch.rand(1, 8, 1, device=DEVICE), torch.rand(1, 8, 1, device=DEVICE)
    _, st = falcon_chunk_triton(q, q, q, beta, lam, rule="3A", window=3, output_final_state=True)
    assert st.window == 3 and st.tail_x.shape == (1, 1, 2, 16)
    with pytest.raises(ValueError, match="window"):
        falcon_chunk_triton(q, q, q, beta, lam, rule="3A", window=4, initial_state=st)


# ---- GPU: larger, ragged and packed shapes ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window", [2, 4, 8])
def test_cuda_benchmark_head_dims(window, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check((1, 2048, 2, 128, 128), window, dtype, chunk_size=64, state=True, device="cuda")


@needs_cuda
@pytest.mark.parametrize("K,V,read,window", [(64, 64, "after", 4), (100, 100, "before", 3), (128, 64, "before", 8),
                                             (256, 256, "after", 4)])
def test_cuda_ragged(K, V, read, window):
    _check((2, 1000, 2, K, V), window, torch.bfloat16, chunk_size=64, read=read, device="cuda")


@needs_cuda
def test_cuda_packed_fp16():
    _check((1, 1500, 2, 128, 128), 4, torch.float16, chunk_size=64, state=True,
           cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")


def test_public_op_routes_3a_to_the_kernels_only_when_asked():
    from falcon_fwa.ops.triton import GPU_CHECKED_RULES, TRITON_RULES
    x, _ = _inputs(2, 21, 2, 16, 16, 4, torch.float32, seed=80, state=False)
    args = [x[n].to(DEVICE) for n in ("q", "k", "v", "beta", "lam")]
    ref, _ = falcon_attention(*args, rule="3A", window=4, chunk_size=16, backend="torch")
    out, _ = falcon_attention(*args, rule="3A", window=4, chunk_size=16, backend="triton")
    assert _rel(out, ref) < 1e-5
    assert "3A" in TRITON_RULES
    if "3A" not in GPU_CHECKED_RULES:  # "auto" keeps the PyTorch chunk form until the kernels pass on a GPU
        auto, _ = falcon_attention(*args, rule="3A", window=4, chunk_size=16)
        assert torch.equal(auto, ref)
