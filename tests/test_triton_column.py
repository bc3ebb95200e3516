"""Falcon-2A (one step size and decay per value column) on the Triton chunk kernels
against the float64 recurrent form (the definition).

Outputs, final states and the gradients of ``q, k, v, beta, lam, log_gate`` and of the
initial state are compared with ``falcon_attention(rule="2A", form="recurrent")`` in
float64 on the same inputs. Every buffer the kernels allocate starts as NaN, so a
value read before it is written shows. On a machine without CUDA the kernels run
through Triton's interpreter on tiny shapes; with CUDA the same checks run at larger
and ragged shapes.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import (check_kernel, check_public_op_routing, check_segments_continue, in_this_process,
                           needs_cuda, poison_allocator)

from falcon_fwa.ops.triton import column_decay, falcon_chunk_triton

pytestmark = in_this_process
_check = functools.partial(check_kernel, "2A")


@pytest.fixture(autouse=True)
def nan_buffers(monkeypatch):
    """Kernel buffers start as NaN instead of whatever memory held."""
    poison_allocator(monkeypatch, column_decay)


# ---- every switch, tiny shapes (interpreter on CPU, GPU when present) ----

@pytest.mark.parametrize("read", ["after", "before"])
@pytest.mark.parametrize("shift,normalize", [(True, True), (False, False)])
def test_switches_match_recurrent(read, shift, normalize):
    # chunk 32 = two sub-chunks; T = 37 ends inside the second chunk's first sub-chunk
    _check((1, 37, 1, 16, 24), read=read, shift=shift, normalize=normalize, chunk_size=32, seed=1)


def test_scale_ridge_no_gate_unshifted_state():
    _check((1, 40, 2, 16, 16), gate=False, scale_ridge=True, chunk_size=32, state=True, shift=False,
           output_final_state=True, seed=2)


def test_clamped_decay_per_column():
    # eta_{t,j} lam_t passes 1 - decay_floor on some columns of a step and not on others
    _check((1, 40, 1, 16, 16), normalize=False, lam_scale=3.0, decay_floor=0.05, seed=8)


def test_strong_decay_never_overflows():
    # gamma at the floor 1e-3 on most columns: log-prefixes reach -400 within a chunk of 64,
    # where any exp(-u) (a positive exponent) would overflow fp32
    errors = _check((1, 70, 1, 16, 16), normalize=False, lam_scale=40.0, chunk_size=64, read="before", seed=9)
    assert all(math.isfinite(e) for e in errors.values())


def test_strong_decay_in_a_partial_last_sub_chunk():
    # T = 40: the last 16-step sub-chunk holds 8 steps; its reference log-prefix must be read at its
    # last real step (reading past the end gave 0 and exp(-u) = inf in the backward)
    errors = _check((1, 40, 1, 16, 16), normalize=False, lam_scale=40.0, chunk_size=64, read="after", seed=10)
    assert all(math.isfinite(e) for e in errors.values())


def test_strong_decay_chunk_128_packed_short_sequences():
    # 7 levels of pairs; sequences of 1 and 3 steps and a last chunk of 9 steps leave blocks whose
    # first half runs past the chunk's end (their log-prefix is read at the chunk's last step)
    errors = _check((1, 150, 1, 16, 24), normalize=False, lam_scale=40.0, chunk_size=128, read="before",
                    cu_seqlens=[0, 1, 4, 150], state=True, output_final_state=True, seed=13)
    assert all(math.isfinite(e) for e in errors.values())


def test_state_in_and_out_several_key_and_value_blocks():
    # K = V = 80 span two key and two value blocks; initial state with the last-key carry
    _check((2, 21, 1, 80, 80), state=True, output_final_state=True, seed=3)


def test_packed_sequences_with_states():
    _check((1, 70, 1, 16, 20), state=True, output_final_state=True, cu_seqlens=[0, 5, 40, 41, 70], read="before",
           chunk_size=32, seed=4)


def test_packed_sequences_fresh_start_chunk_64():
    _check((1, 80, 1, 16, 16), output_final_state=True, cu_seqlens=[0, 17, 80], chunk_size=64, seed=5)


def test_chunk_128_partial_second_chunk():
    _check((1, 150, 1, 16, 16), chunk_size=128, read="before", output_final_state=True, seed=10)


def test_fp16_inputs():
    _check((1, 40, 2, 32, 32), torch.float16, chunk_size=32, seed=6)


def test_two_segments_continue_exactly():
    check_segments_continue("2A", seed=7, cut=23)


def test_public_op_routes_2a_to_the_kernels_only_when_asked():
    args = check_public_op_routing("2A", seed=11)
    with pytest.raises(NotImplementedError, match="chunk_size"):
        falcon_chunk_triton(*args, rule="2A", chunk_size=24)


# ---- GPU: benchmark-sized, ragged and packed shapes ----

@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_benchmark_head_dims(dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    _check((1, 2048, 2, 128, 128), dtype, chunk_size=64, output_final_state=True, state=True, device="cuda")


@needs_cuda
@pytest.mark.parametrize("K,V,read,chunk_size", [(64, 64, "after", 64), (100, 100, "before", 64),
                                                 (128, 64, "before", 128), (256, 256, "after", 32)])
def test_cuda_ragged(K, V, read, chunk_size):
    _check((2, 1000, 2, K, V), torch.bfloat16, chunk_size=chunk_size, read=read, output_final_state=True,
           device="cuda")


@needs_cuda
def test_cuda_packed_fp16():
    _check((1, 1500, 2, 128, 128), torch.float16, chunk_size=64, state=True, output_final_state=True,
           cu_seqlens=[0, 1, 300, 301, 999, 1500], device="cuda")
