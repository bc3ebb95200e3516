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

import functools
import math

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import (DEVICE, check_kernel, check_public_op_routing, check_segments_continue, in_this_process,
                           kernel_inputs, needs_cuda, poison_allocator, rel_norm)

from falcon_fwa.ops.triton import column_delta, falcon_chunk_triton

pytestmark = in_this_process
KEY_POWER = 0.5  # keys of norm about 1, so that the normalized per-column steps eta x x^T are strong
_inputs = functools.partial(kernel_inputs, rule="2", key_power=KEY_POWER)
_check = functools.partial(check_kernel, "2", key_power=KEY_POWER)


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Kernel buffers start as NaN instead of whatever memory held."""
    poison_allocator(monkeypatch, column_delta)


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


@pytest.mark.parametrize("wide_grid", [column_delta.WIDE_GRID, 0])
def test_state_in_and_out_several_value_blocks(wide_grid, monkeypatch):
    # K = 40 in one padded key tile, V = 40 over two value blocks; the last-key carry. WIDE_GRID 0: the
    # sequential kernels take the launch settings of large grids (state_fwd: V = 40 in one 64-column block)
    monkeypatch.setattr(column_delta, "WIDE_GRID", wide_grid)
    _check((2, 18, 1, 40, 40), state=True, output_final_state=True, seed=3)


@pytest.mark.parametrize("kernel", ["state_fwd", "state_bwd"])
def test_launch_settings_follow_the_grid(kernel):
    # B=2 and B=8 at H=16, V=128: 256 and 1,024 programs of 16 columns, either side of WIDE_GRID
    small = column_delta._sequential(kernel, 128, 128, 2 * 16)
    wide = column_delta._sequential(kernel, 128, 128, 8 * 16)
    table, small_table = column_delta.SEQUENTIAL[kernel], column_delta.SEQUENTIAL_SMALL_GRID.get(kernel)
    assert (wide["BV"], wide["num_warps"]) == (table["BV"], table["num_warps"])
    if small_table is None:
        assert small == wide
    else:
        assert (small["BV"], small["num_warps"]) == (small_table["BV"], small_table["num_warps"]) == (16, small["num_warps"])
    # on a wide grid a head dim below the block caps it (V=24: blocks of 32)
    assert column_delta._sequential(kernel, 32, 24, 64 * 16)["BV"] == min(table["BV"], 32)
    # a key tile of 256 rows halves the value block (the fp32 state tile stays within 128 x 64 elements)
    assert column_delta._sequential(kernel, 256, 256, 64 * 16)["BV"] == min(table["BV"], 32)


def test_packed_sequences_with_states():
    _check((1, 60, 1, 16, 20), state=True, output_final_state=True, cu_seqlens=[0, 5, 38, 39, 60], read="before",
           chunk_size=32, seed=4)


def test_packed_fresh_starts_chunk_128_partial_second_chunk():
    _check((1, 134, 1, 16, 8), chunk_size=128, output_final_state=True, cu_seqlens=[0, 3, 134], seed=10)


@pytest.mark.parametrize("read", ["after", "before"])
def test_no_gate_folds_the_residual_gain_into_eta(read):
    # without a gate kappa is eta itself: one gradient, (y - R) z, for both gains, and the residual reads'
    # upstream gradient is -dv; states, packing and two value blocks of the sequential kernels
    _check((1, 60, 1, 16, 40), gate=False, state=True, output_final_state=True, cu_seqlens=[0, 7, 41, 60], read=read,
           chunk_size=32, seed=11)


def test_key_dim_above_128():
    # K = 136 takes the 256-row key tile of the sequential kernels, mostly masked, and their narrower value block
    _check((1, 20, 1, 136, 40), chunk_size=16, state=True, output_final_state=True, seed=12)


def test_fp16_inputs():
    _check((1, 33, 1, 16, 16), torch.float16, chunk_size=32, seed=6)


def _direct_inputs(B, T, H, K, V, dtype, *, seed):
    """Inputs of ``column_delta_chunk`` itself: ``q, x, v``, the factors ``beta`` and ``eta_scale``
    (zero on one row, as at the sentinel) with ``eta = beta * eta_scale``, a per-row ``log_gate``
    and ``log_a``."""
    g = torch.Generator().manual_seed(seed)
    q, x = ((torch.randn(B, T, H, K, generator=g) / 4).to(DEVICE, dtype) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g).to(DEVICE, dtype)
    beta = (0.05 + 0.6 * torch.rand(B, T, H, V, generator=g)).to(DEVICE)
    eta_scale = (0.5 + torch.rand(B, T, H, generator=g)).to(DEVICE)
    eta_scale[:, 0] = 0.0
    eta = column_delta._eta_of(beta, eta_scale)
    log_gate = (-0.2 * torch.rand(B, T, H, generator=g)).to(DEVICE)
    log_a = (-0.2 * torch.rand(B, T, H, V, generator=g)).to(DEVICE)
    return q, x, v, beta, eta_scale, eta, log_gate, log_a


@pytest.mark.parametrize("dtype,gate,factored", [(torch.float16, False, True), (torch.float16, True, False),
                                                 (torch.float32, False, False), (torch.float32, True, True)])
def test_second_backward_sees_the_same_graph(gate, dtype, factored):
    # the backward writes d log a over the saved residual reads (and, with 16-bit values, deta over the
    # saved fp32 outputs); a second backward through the same graph (retain_graph=True) recomputes them
    # (and, when eta was not kept, eta from its factors) and gives the first one's gradients exactly
    q, x, v, beta, eta_scale, eta, log_gate, log_a = _direct_inputs(1, 40, 1, 16, 24, dtype, seed=12)
    log_gate = log_gate if gate else None
    leaves = tuple(t.requires_grad_() for t in (q, x, v, eta, log_gate, log_a) if t is not None)
    factors = dict(beta=beta, eta_scale=eta_scale) if factored else {}
    o, _ = column_delta.column_delta_chunk(q, x, v, eta, log_gate, log_a, None, read_after=True, chunk_size=16,
                                           **factors)
    probe = torch.randn(o.shape, generator=torch.Generator().manual_seed(13)).to(DEVICE, o.dtype)
    first = torch.autograd.grad((o * probe).float().sum(), leaves, retain_graph=True)
    second = torch.autograd.grad((o * probe).float().sum(), leaves)
    for i, (a, b) in enumerate(zip(first, second)):
        assert torch.isfinite(a).all(), i
        assert torch.equal(a, b), f"gradient {i} differs in the second backward"


@pytest.mark.parametrize("read_after", [True, False])
def test_eta_formed_from_its_factors_gives_the_kept_etas_gradients_exactly(read_after):
    # beta and eta_scale instead of a kept eta: state_bwd multiplies eta out again, one fp32 product
    # as the step-size kernel formed it, so outputs and every gradient are those of the kept eta, to the
    # bit; two value blocks of the sequential kernels (V = 40) and a gate
    q, x, v, beta, eta_scale, eta, log_gate, log_a = _direct_inputs(1, 37, 2, 16, 40, torch.float32, seed=14)
    probe = torch.randn(1, 37, 2, 40, generator=torch.Generator().manual_seed(15)).to(DEVICE)
    results = []
    for factors in ({}, dict(beta=beta, eta_scale=eta_scale)):
        leaves = [t.clone().requires_grad_() for t in (q, x, v, eta, log_gate, log_a)]
        o, _ = column_delta.column_delta_chunk(*leaves[:6], None, read_after=read_after, chunk_size=16, **factors)
        (o * probe).sum().backward()
        results.append([o.detach()] + [t.grad for t in leaves])
    for name, a, b in zip(("o", "q", "x", "v", "eta", "log_gate", "log_a"), *results):
        assert torch.equal(a, b), name


def test_the_factors_of_eta_go_together():
    q, x, v, beta, eta_scale, eta, log_gate, log_a = _direct_inputs(1, 4, 1, 16, 8, torch.float32, seed=1)
    with pytest.raises(ValueError, match="beta and eta_scale go together"):
        column_delta.column_delta_chunk(q, x, v, eta, None, log_a, None, read_after=True, chunk_size=16, beta=beta)
    with pytest.raises(ValueError, match=r"eta_scale \(1, 4, 1\)"):
        column_delta.column_delta_chunk(q, x, v, eta, None, log_a, None, read_after=True, chunk_size=16, beta=beta,
                                        eta_scale=eta_scale[..., None])


@pytest.mark.parametrize("shift", [True, False])
def test_the_public_op_gives_a_second_backward_the_first_ones_gradients(shift):
    # rule 2's step sizes and scan are one node, whose backward uses up what its forward kept (the fp32
    # outputs, the residual reads, D, and with shift the shifted keys, over which it writes their gradient):
    # a second backward through the same graph runs the forward again and gives the same gradients exactly
    from falcon_fwa.ops.state import FalconState
    x = _inputs(1, 37, 2, 16, 24, torch.float16, seed=16, state=True)
    names = ("q", "k", "v", "beta", "lam", "log_gate")
    leaves = {n: x[n].to(DEVICE, torch.float16 if n in ("q", "k", "v") else torch.float32).requires_grad_()
              for n in names}
    S0 = x["S0"].to(DEVICE).requires_grad_()
    last = x["last_key"].to(DEVICE).requires_grad_() if shift else None
    init = FalconState(rule="2", window=1, shift=shift, S=S0, last_key=last)
    o, _ = falcon_chunk_triton(*(leaves[n] for n in names[:5]), rule="2", log_gate=leaves["log_gate"],
                               initial_state=init, shift=shift, chunk_size=16)
    probe = torch.randn(o.shape, generator=torch.Generator().manual_seed(17)).to(DEVICE, o.dtype)
    wrt = [*leaves.values(), S0] + ([last] if shift else [])
    first = torch.autograd.grad((o * probe).float().sum(), wrt, retain_graph=True)
    second = torch.autograd.grad((o * probe).float().sum(), wrt)
    for name, a, b in zip((*names, "S0", "last_key"), first, second):
        assert torch.isfinite(a).all() and a.abs().sum() > 0, name
        assert torch.equal(a, b), f"the gradient of {name} differs in the second backward"


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
    assert rel_norm(rule2, rule1) < 1e-5
    own, _ = falcon_chunk_triton(*args, rule="2", log_gate=x["log_gate"].to(DEVICE), chunk_size=16)
    assert rel_norm(own, rule1) > 1e-2


def test_two_segments_continue_exactly():
    check_segments_continue("2", seed=7, cut=23, key_power=KEY_POWER)


def test_public_op_routes_2_to_the_kernels_only_when_asked():
    args = check_public_op_routing("2", seed=11, key_power=KEY_POWER)
    with pytest.raises(NotImplementedError, match="chunk_size"):
        falcon_chunk_triton(*args, rule="2", chunk_size=24)
    wide = torch.zeros(1, 4, 1, 264, device=DEVICE)
    with pytest.raises(NotImplementedError, match="K=264 is above 256"):
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
                                                 (128, 128, "after", 16), (256, 256, "after", 64),
                                                 (200, 96, "before", 32)])
def test_cuda_ragged(K, V, read, chunk_size):
    _check((2, 1000, 2, K, V), torch.bfloat16, chunk_size=chunk_size, read=read, output_final_state=True,
           device="cuda")


@needs_cuda
@pytest.mark.parametrize("wide_grid", [column_delta.WIDE_GRID, 0])
def test_cuda_key_dim_256_fp32(wide_grid, monkeypatch):
    # WIDE_GRID 0: the sequential kernels' settings of large grids (32 value columns at K = 256)
    monkeypatch.setattr(column_delta, "WIDE_GRID", wide_grid)
    torch.backends.cuda.matmul.allow_tf32 = False
    _check((1, 300, 2, 256, 256), torch.float32, chunk_size=64, state=True, output_final_state=True, device="cuda")


@needs_cuda
def test_cuda_packed_fp16():
    _check((1, 1500, 2, 128, 128), torch.float16, chunk_size=64, state=True, output_final_state=True,
           cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")
