"""The switch combinations of the chunk kernels that the per-rule files leave out, for all six
rules, against the float64 recurrent form.

Each test is one row of the coverage matrix: a combination of ``shift``, ``normalize``,
``log_gate``, ``read``, ``scale_ridge``, the initial and final state (last-key carry, window
tail, read normalizer), ``cu_seqlens``, ``chunk_size``, ``segments`` and the normalized read
``eps_attn``, run at ragged tiny shapes (``T`` not a multiple of the chunk, head dims off the
powers of two, ``K = 12`` standing in for 100). ``check_kernel`` compares the outputs, every
final-state tensor and the gradient of every input (``q, k, v, beta, lam, log_gate`` and each
initial-state tensor) with ``falcon_attention(form="recurrent")`` in float64; the last test
does the same for the fused recurrent kernel (outputs and final state: it computes no
gradients). On a machine without CUDA the kernels run through Triton's interpreter (fp32; its
bf16 dots are not those of a GPU, so bf16 is checked on the GPU only).
"""
from __future__ import annotations

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, OP_INPUTS, check_kernel, in_this_process, kernel_inputs, on_device, rel_norm

from falcon_fwa import FalconState, falcon_attention

pytestmark = in_this_process
RULES = ("1", "2", "3", "1A", "2A", "3A")
INNER = ("1A", "2A", "3A")
WINDOW = {"3": 4, "3A": 3}  # rule 3's kernels take windows 1, 2, 4, 8, 16; 3A's any up to 65
CHUNK = {"1": 16, "2": 32, "3": 64, "1A": 32, "2A": 64, "3A": 16}  # chunk sizes spread over the rules
each_rule = pytest.mark.parametrize("rule", RULES)


def _check(rule, dims, **switches):
    if rule == "3":  # one head: its T x window writes make rule 3 the slowest in the interpreter
        dims = (dims[0], dims[1], 1, *dims[3:])
    return check_kernel(rule, dims, window=WINDOW.get(rule, 1), output_final_state=True, state=True, **switches)


@pytest.mark.parametrize("rule,read", [("1", "before"), ("1A", "after"), ("2", "after"), ("2A", "before")])
def test_unshifted_pairs_from_a_state_with_gate(rule, read):
    # shift=False from an initial state on fixed-length rows (no last key to carry), gated and normalized
    _check(rule, (2, 27, 2, 16, 12), shift=False, read=read, seed=101)


@each_rule
def test_packed_unshifted_from_states_scale_ridge(rule):
    # varlen + initial state + shift=False (+ the window's tail for 3/3A), scale_ridge with a gate; a
    # sequence of one step and one shorter than the window
    _check(rule, (1, 45, 2, 16, 12), shift=False, cu_seqlens=[0, 3, 20, 21, 45], scale_ridge=True, read="before",
           chunk_size=CHUNK[rule], seed=102)


@each_rule
def test_packed_ungated_unnormalized_from_states(rule):
    # varlen + initial state with the last-key carry, no gate (rule 1: kappa is eta), eta = beta, the clamp
    # active on some steps
    _check(rule, (1, 40, 1, 16, 16), gate=False, normalize=False, cu_seqlens=[0, 11, 12, 40], key_power=0.5,
           lam_scale=3.0, decay_floor=0.05, chunk_size=32, seed=103)


@each_rule
def test_head_dims_below_a_tile(rule):
    # K = V = 12 (below the 16-wide tiles of the dots, not a power of two), T = 29 over two chunks, two rows and
    # heads from a state; the sliding rules without a gate, the others gated with scale_ridge
    sliding = rule in WINDOW
    _check(rule, (2, 29, 2, 12, 12), gate=not sliding, scale_ridge=not sliding, seed=104)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rule", INNER)
def test_normalized_read_gradients(rule, packed):
    # eps_attn through the op: the read normalizer z carried in and out of the state, and every gradient, z0's
    # included; gated; packed: shift=False, read="before"
    if packed:
        _check(rule, (1, 40, 2, 12, 12), through_op=True, eps_attn=0.05, cu_seqlens=[0, 9, 40], shift=False,
               read="before", seed=105)
    else:
        _check(rule, (2, 26, 2, 16, 12), through_op=True, eps_attn=0.05, chunk_size=CHUNK[rule], seed=106)


@each_rule
def test_hard_resets_and_zero_keys(rule):
    # log_gate = -inf on two steps (floored by the op, so that the chunk-local log differences stay finite) and
    # zero keys on three (E_t = 0: nothing written, the ridge still shrinks the state), from a state
    _check(rule, (1, 37, 2, 16, 16), through_op=True, reset_at=(9, 22), zero_keys_at=(4, 15, 16), seed=107)


@pytest.mark.parametrize("rule,packed", [("1", True), ("1A", True), ("2A", False), ("3A", False)])
def test_segments_from_states(rule, packed):
    # segments=2 through the op from an initial state (test_triton_segments.py compares fresh calls of rules 1, 2,
    # 3 and 1A with one call): the pieces pass on S, the last key and the tail; packed: whole sequences per piece
    if packed:
        _check(rule, (1, 40, 2, 16, 12), through_op=True, segments=2, cu_seqlens=[0, 13, 14, 40], read="before",
               seed=108)
    else:
        _check(rule, (2, 34, 2, 16, 12), through_op=True, segments=2, seed=108)


@pytest.mark.parametrize("rule,chunk_size", [("3A", 64), ("3A", 128), ("3", 64)])
def test_sliding_rules_at_large_chunks(rule, chunk_size):
    # the default chunk size (and 128) for the sliding rules: T = 75 ends inside the second chunk of 64
    _check(rule, (1, 75, 1, 16, 16), read="before", chunk_size=chunk_size, seed=109)


@pytest.mark.parametrize("rule,packed", [("1", True), ("1A", True), ("3", False), ("3A", False)])
def test_three_heads_packed_and_sliding(rule, packed):
    # H = 3, not a power of two: the per-chunk kernels that take every head at once (d log a of the scans under
    # 1, 1A, 3 and 3A) mask the fourth; test_triton_chunk.py runs rules 1 and 1A so on fixed-length rows only
    rows = dict(cu_seqlens=[0, 7, 30]) if packed else dict()
    check_kernel(rule, (1, 30, 3, 16, 12), window=WINDOW.get(rule, 1), state=True, output_final_state=True,
                 read="before", seed=111, **rows)


@each_rule
def test_fused_recurrent_kernel_packed_unshifted_from_states(rule):
    # the fused recurrent kernel (form="recurrent", backend="triton"; no gradients) on what its own tests leave
    # out: shift=False from carried states (S and the window's tail), packed sequences of 2, 5, 1 and 6 steps,
    # K = V = 12, read="before", scale_ridge and a gate; outputs and final state against float64
    W = WINDOW.get(rule, 1)
    H = 1 if rule == "3" else 2  # rule 3's window eigenvalue by squarings at every step: slow in the interpreter
    cu = [0, 2, 7, 8, 14]
    leaves = kernel_inputs(1, 14, H, 12, 12, torch.float32, seed=110, rule=rule, window=W, state=True, N=len(cu) - 1)

    def run(device, dtype, backend):
        x = on_device(leaves, device, dtype)
        state = FalconState(rule=rule, window=W, shift=False, S=x["S0"], tail_x=x["tail_x"], tail_y=x["tail_y"],
                            tail_valid=x["tail_valid"])
        return falcon_attention(*(x[n] for n in OP_INPUTS), rule=rule, window=W, log_gate=x["log_gate"], shift=False,
                                read="before", scale_ridge=True, initial_state=state, output_final_state=True,
                                cu_seqlens=torch.tensor(cu, device=device), form="recurrent", backend=backend)

    o, final = run(DEVICE, None, "triton")
    ref_o, ref = run("cpu", torch.float64, "torch")
    assert o.dtype == torch.float32 and rel_norm(o.cpu(), ref_o) < 1e-5
    assert rel_norm(final.S.cpu(), ref.S) < 1e-5 and final.last_key is None and ref.last_key is None
    if W > 1:  # the tail: the last W - 1 pairs of each sequence, those of the carried tail for the short ones
        assert torch.equal(final.tail_valid.cpu(), ref.tail_valid)
        held = ref.tail_valid[:, None, :, None]  # what an empty slot holds is not part of the state
        for a, b in ((final.tail_x, ref.tail_x), (final.tail_y, ref.tail_y)):
            assert torch.equal(torch.where(held, a.cpu().double(), 0.0), torch.where(held, b, 0.0))
