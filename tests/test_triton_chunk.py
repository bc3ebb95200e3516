"""Triton chunk kernels against the float64 recurrent form (the definition).

On a machine without CUDA the kernels run on the CPU through Triton's interpreter
(tiny shapes, fp32/fp16); with CUDA the same checks run on the GPU at larger and
ragged shapes, bf16/fp16/fp32. Every output, final state and gradient is compared
with ``falcon_attention(form="recurrent")`` in float64 on the same (rounded) inputs.
"""
from __future__ import annotations

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, check_kernel, check_segments_continue, in_this_process, needs_cuda, rel_norm

from falcon_fwa import FalconState, falcon_attention
from falcon_fwa.ops.triton import delta, falcon_chunk_triton, falcon_recurrent_triton

pytestmark = in_this_process
each_rule = pytest.mark.parametrize("rule", ["1A", "1"])


# ---- every switch, tiny shapes (interpreter on CPU, GPU when present) ----

@pytest.mark.parametrize("read", ["after", "before"])
@pytest.mark.parametrize("shift,normalize", [(True, True), (False, False)])
@each_rule
def test_switches_match_recurrent(rule, read, shift, normalize):
    check_kernel(rule, (1, 37, 2, 16, 24), torch.float32, read=read, shift=shift, normalize=normalize, seed=1)


@each_rule
def test_scale_ridge_no_gate_chunk_32(rule):
    check_kernel(rule, (1, 64, 2, 16, 16), torch.float32, gate=False, scale_ridge=True, chunk_size=32, seed=2)


@each_rule
def test_clamped_decay(rule):
    # eta * lam reaches past 1 - decay_floor on many steps: the clamp and its zero gradient.
    check_kernel(rule, (1, 40, 2, 16, 16), torch.float32, normalize=False, lam_scale=3.0, decay_floor=0.05, seed=8)


@each_rule
def test_state_in_and_out_several_key_blocks(rule):
    # K = 80 spans two key blocks of the kernels; initial state with the last-key carry.
    check_kernel(rule, (2, 21, 1, 80, 20), torch.float32, state=True, output_final_state=True, seed=3)


@each_rule
def test_three_heads(rule):
    # a head count that is not a power of two: the per-chunk kernels that take every head at once mask the rest
    check_kernel(rule, (2, 33, 3, 16, 16), torch.float32, seed=9)


@each_rule
def test_packed_sequences_with_states(rule):
    check_kernel(rule, (1, 70, 2, 16, 20), torch.float32, state=True, output_final_state=True,
                 cu_seqlens=[0, 5, 40, 41, 70], read="before", seed=4)


@each_rule
def test_packed_sequences_fresh_start_chunk_64(rule):
    # the default chunk size: the WY solve runs over a whole 64 x 64 tile
    check_kernel(rule, (1, 80, 1, 16, 16), torch.float32, output_final_state=True, cu_seqlens=[0, 17, 80],
                 chunk_size=64, seed=5)


def test_chunk_128_two_chunks():
    # rule 1A only: the WY kernels of rules 1 and 3 run 128 as 64 (next test)
    check_kernel("1A", (1, 150, 1, 16, 16), torch.float32, chunk_size=128, read="before", seed=9)


@pytest.mark.parametrize("rule", ["1", "3"])
def test_wy_kernels_run_chunk_128_as_64(rule):
    # delta.WY_MAX_CHUNK: a request for 128 computes exactly what 64 computes
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 70, 1, 16, generator=g).to(DEVICE) * 0.5 for _ in range(3))
    beta, lam = torch.rand(1, 70, 1, generator=g).to(DEVICE), 0.2 * torch.rand(1, 70, 1, generator=g).to(DEVICE)
    window = 2 if rule == "3" else 1
    o128, _ = falcon_chunk_triton(q, k, v, beta, lam, rule=rule, window=window, chunk_size=128)
    o64, _ = falcon_chunk_triton(q, k, v, beta, lam, rule=rule, window=window, chunk_size=64)
    assert torch.equal(o128, o64)


def test_wy_inverse_with_strongly_coupled_writes():
    # DeltaNet through the op with unit keys sharing a direction and beta near 2: the 16 x 16
    # blocks of I + N are far from the identity (entries near 1.8), where a product of powers
    # of N would cancel terms of order |N|^8 (the WY inverse must stay exact to fp32)
    g = torch.Generator().manual_seed(0)
    B, T, H, K, V = 1, 32, 1, 32, 16
    k = torch.randn(1, 1, H, K, generator=g) + 0.3 * torch.randn(B, T, H, K, generator=g)
    k = k / k.norm(dim=-1, keepdim=True)
    q, v = torch.randn(B, T, H, K, generator=g) / K ** 0.25, torch.randn(B, T, H, V, generator=g)
    beta, lam = 1.8 + 0.2 * torch.rand(B, T, H, generator=g), torch.zeros(B, T, H)
    kw = dict(rule="1", shift=False, normalize=False)
    o, _ = falcon_chunk_triton(*(t.to(DEVICE) for t in (q, k, v, beta, lam)), chunk_size=16, **kw)
    ref, _ = falcon_attention(q.double(), k.double(), v.double(), beta.double(), lam.double(), form="recurrent",
                              **kw)
    assert rel_norm(o.cpu(), ref) < 1e-5


@each_rule
def test_key_dim_above_128(rule):
    # K = 136 takes the 256-row key tile of the kernels that hold the whole key dimension, mostly masked
    check_kernel(rule, (1, 24, 1, 136, 24), torch.float32, chunk_size=16, state=True, output_final_state=True,
                 seed=11)


def test_key_dim_256_is_the_widest_regression_tile():
    # api.MAX_WY_HEAD_DIM: K = 256 itself runs on the rule-1 kernels (K = 264 is refused, below)
    check_kernel("1", (1, 6, 1, 256, 8), torch.float32, chunk_size=16, state=True, output_final_state=True, seed=12)


@each_rule
def test_smallest_decay_floor_the_kernels_take(rule):
    # api.MIN_DECAY_FLOOR = 2^-24, where 1 - decay_floor is still a float32 (one below 1): taken, with the clamp
    # reached on many steps (eta * lam up to 3); half of it is refused, naming decay_floor
    check_kernel(rule, (1, 20, 1, 16, 8), torch.float32, normalize=False, lam_scale=3.0, decay_floor=2.0 ** -24,
                 seed=13)
    q = torch.randn(1, 4, 1, 16, device=DEVICE)
    beta, lam = torch.rand(1, 4, 1, device=DEVICE), torch.rand(1, 4, 1, device=DEVICE)
    with pytest.raises(NotImplementedError, match="decay_floor=2.98"):
        falcon_chunk_triton(q, q, q, beta, lam, rule=rule, decay_floor=2.0 ** -25)


@each_rule
def test_fp16_inputs(rule):
    check_kernel(rule, (1, 40, 2, 32, 32), torch.float16, seed=6)


@pytest.mark.parametrize("small_grid", [delta.SMALL_GRID, 0])
def test_fp16_state_kernels_at_either_grid_setting(small_grid, monkeypatch):
    # 16-bit inputs: two sequences x two heads take the state kernels' small-grid settings (16 or 32
    # value columns: V = 40 over three or two blocks); SMALL_GRID 0 gives them the wide-grid ones (64)
    monkeypatch.setattr(delta, "SMALL_GRID", small_grid)
    check_kernel("1", (2, 40, 2, 32, 40), torch.float16, state=True, output_final_state=True, seed=16)


@each_rule
def test_two_segments_continue_exactly(rule):
    check_segments_continue(rule, seed=7, cut=23)


def test_unsupported_switches_name_themselves():
    q = torch.randn(1, 8, 1, 16, device=DEVICE)
    beta, lam = torch.rand(1, 8, 1, device=DEVICE), torch.rand(1, 8, 1, device=DEVICE)
    with pytest.raises(NotImplementedError, match="window=3"):
        falcon_chunk_triton(q, q, q, beta, lam, rule="3", window=3)
    with pytest.raises(NotImplementedError, match="chunk_size"):
        falcon_chunk_triton(q, q, q, beta, lam, chunk_size=24)
    with pytest.raises(NotImplementedError, match="dtype"):
        falcon_chunk_triton(q.double(), q.double(), q.double(), beta, lam)
    state64 = FalconState(rule="1A", window=1, shift=True, S=torch.zeros(1, 1, 16, 16, dtype=torch.float64,
                                                                       device=DEVICE),
                          last_key=torch.zeros(1, 1, 16, device=DEVICE))
    for kernels in (falcon_chunk_triton, falcon_recurrent_triton):  # float64 states compute in float64 elsewhere
        with pytest.raises(NotImplementedError, match="initial_state.S.dtype=float64"):
            kernels(q, q, q, beta, lam, initial_state=state64)
    wide = torch.randn(1, 8, 1, 264, device=DEVICE)
    with pytest.raises(NotImplementedError, match="head dim K=264 is above 256"):
        falcon_chunk_triton(wide, wide, q, beta, lam, rule="1")


# ---- GPU: benchmark-sized, ragged and packed shapes ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@each_rule
def test_cuda_benchmark_head_dims(rule, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    check_kernel(rule, (1, 2048, 2, 128, 128), dtype, chunk_size=64, output_final_state=True, state=True, device="cuda")


@needs_cuda
def test_cuda_bf16_state_kernels_at_wide_grid_settings(monkeypatch):
    # the benchmark shapes' B x H is at or above SMALL_GRID: the wide-grid launch settings, here on 2 x 2
    monkeypatch.setattr(delta, "SMALL_GRID", 0)
    check_kernel("1", (1, 2048, 2, 128, 128), torch.bfloat16, chunk_size=64, output_final_state=True, state=True,
                 device="cuda")


@needs_cuda
@each_rule
def test_cuda_key_dim_256_fp32(rule):
    # rule 1's kernels that hold the whole key dimension run one pipeline stage here (delta._full_k)
    torch.backends.cuda.matmul.allow_tf32 = False
    check_kernel(rule, (1, 300, 2, 256, 256), torch.float32, chunk_size=64, state=True, output_final_state=True,
                 device="cuda")


@needs_cuda
@pytest.mark.parametrize("rule,K,V,read", [
    (rule, K, V, read) for rule in ("1A", "1")
    for K, V, read in [(64, 64, "after"), (100, 100, "before"), (128, 64, "before"), (256, 256, "after"),
                       (200, 96, "before")]])
def test_cuda_ragged(rule, K, V, read):
    check_kernel(rule, (2, 1000, 2, K, V), torch.bfloat16, chunk_size=64, read=read, output_final_state=True,
                 device="cuda")


@needs_cuda
@each_rule
def test_cuda_packed_fp16(rule):
    check_kernel(rule, (1, 1500, 2, 128, 128), torch.float16, chunk_size=64, state=True, output_final_state=True,
                 cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")


@pytest.mark.parametrize("rule", ["1", "2", "3", "1A", "2A", "3A"])
def test_new_sequence_from_given_fast_weights(rule):
    """``FalconState.fresh``: a state without a last key opens with the sentinel (no write, no shrink of
    ``S0``), its window tail holds no pair; the outputs, final state and every gradient (``S0``'s included)
    as the float64 recurrent form, for rows of a batch and for packed sequences."""
    window = 4 if rule in ("3", "3A") else 1
    check_kernel(rule, (2, 21, 2, 16, 16), torch.float32, window=window, state=True, sentinel=True,
                 output_final_state=True, lam_scale=3.0, seed=31)
    check_kernel(rule, (1, 30, 2, 16, 16), torch.float32, window=window, state=True, sentinel=True,
                 output_final_state=True, cu_seqlens=[0, 7, 30], seed=32)
