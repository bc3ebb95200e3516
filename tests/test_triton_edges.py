"""Edges of the Triton kernels through the public op, for all six rules, against the float64 recurrent form.

What the per-rule files and ``test_triton_matrix.py`` leave out: packed sequences of one and two steps beside
ones that cross a chunk by one step (shorter than the window of rules 3 and 3A, each from its own carried state:
``S``, the last key, the window's tail) given as strided views (``q``, ``k``, ``v`` read from head-first buffers,
``beta``, ``lam``, ``log_gate`` from time-major ones) with ``K != V`` both ways, on NaN-poisoned fresh buffers,
outputs, final state and every gradient; a sequence cut off the chunk grid and continued from the returned state
on the chunk kernels, the fused recurrent kernel and the fused decoding step in turn; and strong gates, under
which the chunk-local log prefixes grow large and the exit state's weight of a chunk's last write must stay
exactly one. Besides: keys and values in another dtype than the query (cast to it; the output in the values'
dtype), a state read from a strided buffer with strided gradients of the output and final state reaching the
backward (no input changed by either pass), a single packed sequence from its state, and packed sequences of
whole chunks.
"""
from __future__ import annotations

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import (DEVICE, OP_INPUTS, TOL, PoisonedEmpty, check_kernel, in_this_process, kernel_inputs,
                           on_device, rel_norm, run_op)

from falcon_fwa import FalconState, falcon_attention, falcon_step

pytestmark = in_this_process
RULES = ("1", "2", "3", "1A", "2A", "3A")
WINDOW = {"3": 4, "3A": 3}
each_rule = pytest.mark.parametrize("rule", RULES)


def _state(x, rule, window, shift=True):
    return FalconState(rule=rule, window=window, shift=shift, S=x["S0"], last_key=x["last_key"] if shift else None,
                       tail_x=x["tail_x"], tail_y=x["tail_y"], tail_valid=x["tail_valid"])


def _reference(x, rule, window, **switches):
    """The float64 recurrent form on the leaves ``x`` (fixed-length rows, from their state)."""
    x = on_device(x, DEVICE, torch.float64)
    return falcon_attention(*(x[n] for n in OP_INPUTS), rule=rule, window=window, log_gate=x["log_gate"],
                            initial_state=_state(x, rule, window), output_final_state=True, form="recurrent",
                            backend="torch", **switches)


def _assert_state_close(got, ref, tol):
    assert rel_norm(got.S, ref.S) < tol and rel_norm(got.last_key, ref.last_key) < tol
    if ref.tail_valid is not None:  # what an empty slot holds is not part of the state
        assert torch.equal(got.tail_valid, ref.tail_valid)
        held = ref.tail_valid[:, None, :, None]
        for a, b in ((got.tail_x, ref.tail_x), (got.tail_y, ref.tail_y)):
            assert rel_norm(torch.where(held, a.double(), 0.0), torch.where(held, b, 0.0)) < tol


def _head_first(t):  # the same values, read from a [B, H, T, D] buffer
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _time_major(t):  # the same values, read from a [T, B, ...] buffer
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _strided_op(q, k, v, beta, lam, *, log_gate, **kw):
    q, k, v = map(_head_first, (q, k, v))
    beta, lam, log_gate = map(_time_major, (beta, lam, log_gate))
    return falcon_attention(q, k, v, beta, lam, log_gate=log_gate, form="chunk", backend="triton", **kw)


@each_rule
def test_short_packed_sequences_from_states_on_strided_views(rule, monkeypatch):
    # sequences of 1, 2, 17, 2 and 17 steps (chunk 16), each from its own state (the tail's oldest slot of the
    # first one empty); K = 12, V = 8 for rules 1, 2, 3A and K = 8, V = 12 for the others
    W = WINDOW.get(rule, 1)
    K, V = (12, 8) if rule in ("1", "2", "3A") else (8, 12)
    cu = [0, 1, 3, 20, 22, 39]
    H = 1 if rule == "3" else 2  # rule 3's T x window writes are the slowest in the interpreter
    leaves = kernel_inputs(1, cu[-1], H, K, V, torch.float32, seed=201, rule=rule, window=W, state=True,
                           N=len(cu) - 1)
    switches = dict(rule=rule, window=W, shift=True, output_final_state=True, chunk_size=16,
                    cu_seqlens=torch.tensor(cu, device=DEVICE))
    with PoisonedEmpty(monkeypatch):
        tri = run_op(_strided_op, on_device(leaves, DEVICE), **switches)
    ref = run_op(falcon_attention, on_device(leaves, DEVICE, torch.float64), form="recurrent", backend="torch",
                 **switches)
    assert tri[0]["o"].dtype == torch.float32 and tri[0]["o"].shape == ref[0]["o"].shape
    if W > 1:
        assert torch.equal(tri[0]["tail_valid"], ref[0]["tail_valid"])
    errors = {n: rel_norm(tri[0][n], r) for n, r in ref[0].items() if r is not None and n != "tail_valid"}
    assert set(tri[1]) == set(ref[1])
    errors.update({f"d{n}": rel_norm(tri[1][n], ref[1][n]) for n in ref[1]})
    bad = {n: e for n, e in errors.items() if not e <= TOL[torch.float32]}
    assert not bad, f"relative errors above {TOL[torch.float32]}: {bad} (all: {errors})"


@each_rule
def test_cut_off_the_chunk_grid_continues_on_each_kernel(rule, monkeypatch):
    # [0, 17) on the chunk kernels (one chunk of 16 and one step), [17, 20) on the fused recurrent kernel, then
    # one fused decoding step at a time: the outputs and final state of the whole sequence (float64, one call)
    W = WINDOW.get(rule, 1)
    T, cut, steps_from = 23, 17, 20
    leaves = kernel_inputs(2, T, 2, 12, 8, torch.float32, seed=202, rule=rule, window=W, state=True)
    x = on_device(leaves, DEVICE)

    def part(a, b):
        return [x[n][:, a:b] for n in OP_INPUTS], x["log_gate"][:, a:b]

    outs = []
    with torch.no_grad(), PoisonedEmpty(monkeypatch):
        args, gate = part(0, cut)
        o, st = falcon_attention(*args, rule=rule, window=W, log_gate=gate, initial_state=_state(x, rule, W),
                                 output_final_state=True, chunk_size=16, form="chunk", backend="triton")
        outs.append(o)
        args, gate = part(cut, steps_from)
        o, st = falcon_attention(*args, rule=rule, window=W, log_gate=gate, initial_state=st,
                                 output_final_state=True, form="recurrent", backend="triton")
        outs.append(o)
        for t in range(steps_from, T):
            o, st = falcon_step(*(x[n][:, t] for n in OP_INPUTS), state=st, rule=rule, window=W,
                                log_gate=x["log_gate"][:, t], backend="triton")
            outs.append(o[:, None])
    ref_o, ref = _reference(leaves, rule, W)
    assert rel_norm(torch.cat(outs, 1), ref_o) < 1e-5
    _assert_state_close(st, ref, 1e-5)


@pytest.mark.parametrize("rule,chunk_size", [("1A", 128), ("3A", 128), ("1", 64)])
def test_strong_gates_keep_a_chunks_last_write_whole(rule, chunk_size):
    # log_gate = -50 at every step: the final state is, up to exp(-50), the last step's write, which enters it with
    # the weight exp(u_C - u_C) = 1, u the chunk-local log prefix (-50 per step: -6400 at the end of a chunk of 128,
    # -3200 in rule 1's, whose kernels run 64). A u_C summed apart from the prefix rounds away from it by units of
    # the last place there (5e-4 at 6400), and the weight with it: S was off by 6e-4 to 1.2e-3 (relative).
    W = WINDOW.get(rule, 1)
    leaves = kernel_inputs(2, chunk_size, 2, 16, 16, torch.float32, seed=203, rule=rule, window=W, state=True)
    leaves["log_gate"] = torch.full_like(leaves["log_gate"], -50.0)
    x = on_device(leaves, DEVICE)
    with torch.no_grad():
        o, final = falcon_attention(*(x[n] for n in OP_INPUTS), rule=rule, window=W, log_gate=x["log_gate"],
                                    initial_state=_state(x, rule, W), output_final_state=True,
                                    chunk_size=chunk_size, backend="triton")
    ref_o, ref = _reference(leaves, rule, W)
    assert rel_norm(o, ref_o) < 1e-5
    _assert_state_close(final, ref, 1e-5)


@pytest.mark.parametrize("rule", ["1A", "2", "3A"])
def test_keys_and_values_in_another_dtype_than_the_query(rule):
    # q in fp32, k and v in fp16: the kernels compute in q's dtype (k and v cast to it), the output comes back in
    # v's dtype and k, v receive fp16 gradients; against the float64 recurrent form on the same rounded values
    W = WINDOW.get(rule, 1)
    leaves = kernel_inputs(1, 20, 2, 16, 8, torch.float32, seed=204, rule=rule, window=W, state=True)
    leaves["k"], leaves["v"] = leaves["k"].half(), leaves["v"].half()
    switches = dict(rule=rule, window=W, shift=True, output_final_state=True)
    tri = run_op(falcon_attention, on_device(leaves, DEVICE), form="chunk", backend="triton", chunk_size=16,
                 **switches)
    ref = run_op(falcon_attention, on_device(leaves, DEVICE, torch.float64), form="recurrent", backend="torch",
                 **switches)
    assert tri[0]["o"].dtype == torch.float16 and tri[0]["S_T"].dtype == torch.float32
    assert tri[1]["k"].dtype == tri[1]["v"].dtype == torch.float16 and tri[1]["q"].dtype == torch.float32
    errors = {n: rel_norm(tri[0][n], r) for n, r in ref[0].items() if r is not None and n != "tail_valid"}
    errors.update({f"d{n}": rel_norm(tri[1][n], ref[1][n]) for n in ref[1]})
    bad = {n: e for n, e in errors.items() if not e <= TOL[torch.float16]}
    assert not bad, f"relative errors above {TOL[torch.float16]}: {bad} (all: {errors})"


@each_rule
def test_strided_state_and_upstream_gradients_leave_the_inputs_whole(rule):
    # S0 read from a [N, H, V, K] buffer, and a loss that reads o head-first and S transposed, so that the gradients
    # reaching the kernels' backward (of o and of the final S) are strided views; unshifted pairs, where the write
    # features are the caller's keys themselves: outputs and every gradient as the float64 recurrent form, and no
    # input changed by the forward or the backward
    W = WINDOW.get(rule, 1)
    H = 1 if rule == "3" else 2
    leaves = kernel_inputs(2, 20, H, 12, 8, torch.float32, seed=205, rule=rule, window=W, state=True)
    g = torch.Generator().manual_seed(206)
    probe_o = torch.randn(2, H, 20, 8, generator=g, dtype=torch.float64)
    probe_S = torch.randn(2, H, 8, 12, generator=g, dtype=torch.float64)

    def run(x, **kw):
        x = {n: t if t is None or not t.is_floating_point() else t.detach().clone().requires_grad_()
             for n, t in x.items()}
        S = x["S0"].transpose(-1, -2).contiguous().transpose(-1, -2)  # the values of S0, strided
        assert not S.is_contiguous()
        state = FalconState(rule=rule, window=W, shift=False, S=S, tail_x=x["tail_x"], tail_y=x["tail_y"],
                            tail_valid=x["tail_valid"])
        args = [x[n] for n in OP_INPUTS] + [x["log_gate"]]
        before = [t.detach().clone() for t in args]
        o, final = falcon_attention(*args[:5], rule=rule, window=W, log_gate=args[5], shift=False,
                                    initial_state=state, output_final_state=True, **kw)
        loss = (o.transpose(1, 2).double() * probe_o.to(o.device)).sum() \
            + (final.S.transpose(-1, -2).double() * probe_S.to(o.device)).sum()
        loss.backward()
        assert all(torch.equal(a, b) for a, b in zip(args, before)), "an input changed"
        return o, final.S, {n: t.grad for n, t in x.items() if t is not None and t.is_floating_point()}

    o, S, grads = run(on_device(leaves, DEVICE), form="chunk", backend="triton", chunk_size=16)
    ref_o, ref_S, ref_grads = run(on_device(leaves, DEVICE, torch.float64), form="recurrent", backend="torch")
    errors = {"o": rel_norm(o, ref_o), "S_T": rel_norm(S, ref_S)}
    errors.update({f"d{n}": rel_norm(grads[n], ref_grads[n]) for n in ref_grads if ref_grads[n] is not None})
    assert set(errors) >= {"dq", "dk", "dv", "dbeta", "dlam", "dlog_gate", "dS0"}
    bad = {n: e for n, e in errors.items() if not e <= TOL[torch.float32]}
    assert not bad, f"relative errors above {TOL[torch.float32]}: {bad} (all: {errors})"


@pytest.mark.parametrize("rule", ["1A", "2"])
def test_one_packed_sequence_from_a_state(rule):
    # cu_seqlens with a single sequence: its first write feature is the carried last key (not the sentinel)
    check_kernel(rule, (1, 20, 2, 16, 8), torch.float32, state=True, output_final_state=True, cu_seqlens=[0, 20],
                 seed=207)


@pytest.mark.parametrize("rule", ["1A", "1", "2A", "2"])
def test_packed_sequences_of_whole_chunks(rule):
    # sequences of exactly one and two chunks (16, 32 steps) beside a short one: chunk_index's chunk count per
    # sequence has no empty chunk to spare, each sequence from its own state
    check_kernel(rule, (1, 50, 1, 16, 8), torch.float32, state=True, output_final_state=True,
                 cu_seqlens=[0, 16, 48, 50], seed=208)


@pytest.mark.parametrize("rule", ["1", "3", "3A"])
def test_numpy_scalar_options_run_the_kernels_as_python_numbers(rule):
    """``window``, ``chunk_size``, ``eps``, ``decay_floor`` and ``segments`` given as numpy scalars (as a config may
    hold them) reach the kernels as the Python numbers they are: the chunk kernels, the fused recurrent kernel and
    the fused step give what the same call with Python numbers gives, to the bit, and the state records an int."""
    import numpy as np

    x = on_device(kernel_inputs(1, 20, 2, 8, 8, torch.float32, seed=3, rule=rule), DEVICE)
    args = [x[n] for n in OP_INPUTS]
    W = WINDOW.get(rule, 4)
    plain = dict(window=W, eps=0.25, decay_floor=0.125)
    numpy = dict(window=np.int64(W), eps=np.float32(0.25), decay_floor=np.float64(0.125))
    for form, extra, numpy_extra in (("chunk", dict(chunk_size=16, segments=2),
                                      dict(chunk_size=np.int32(16), segments=np.int64(2))),
                                     ("recurrent", {}, {})):
        want = falcon_attention(*args, rule=rule, log_gate=x["log_gate"], form=form, backend="triton",
                                output_final_state=True, **plain, **extra)
        got = falcon_attention(*args, rule=rule, log_gate=x["log_gate"], form=form, backend="triton",
                               output_final_state=True, **numpy, **numpy_extra)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1].S, got[1].S), form
        assert type(got[1].window) is int
    step = dict(q=args[0][:, 0], k=args[1][:, 0], v=args[2][:, 0], beta=args[3][:, 0], lam=args[4][:, 0])
    want = falcon_step(**step, rule=rule, backend="triton", **plain)
    got = falcon_step(**step, rule=rule, backend="triton", **numpy)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1].S, got[1].S) and type(got[1].window) is int


def test_the_kernel_entries_take_numpy_scalar_options_too():
    """``falcon_chunk_triton``, ``falcon_recurrent_triton`` and ``falcon_step_triton`` called directly with numpy
    scalars give what Python numbers give (they reached the kernels unconverted, which cannot take them)."""
    import numpy as np

    from falcon_fwa.ops.triton import falcon_chunk_triton
    from falcon_fwa.ops.triton.recurrent import falcon_recurrent_triton, falcon_step_triton

    x = on_device(kernel_inputs(1, 12, 2, 8, 8, torch.float32, seed=4, rule="3A"), DEVICE)
    args = [x[n] for n in OP_INPUTS]
    plain, numpy = dict(window=3, eps=0.25, decay_floor=0.125), dict(window=np.int64(3), eps=np.float32(0.25),
                                                                      decay_floor=np.float64(0.125))
    for op, extra, numpy_extra in ((falcon_chunk_triton, dict(chunk_size=16), dict(chunk_size=np.int16(16))),
                                   (falcon_recurrent_triton, {}, {})):
        want = op(*args, rule="3A", output_final_state=True, **plain, **extra)
        got = op(*args, rule="3A", output_final_state=True, **numpy, **numpy_extra)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1].S, got[1].S), op.__name__
    step = [t[:, 0] for t in args]
    want, state = falcon_step_triton(*step, rule="3A", **plain)
    got, _ = falcon_step_triton(*step, rule="3A", **numpy)
    assert torch.equal(want, got)
    got, _ = falcon_step_triton(*[t[:, 1] for t in args], rule="3A", state=state, **numpy)
    assert torch.equal(got, falcon_step_triton(*[t[:, 1] for t in args], rule="3A", state=state, **plain)[0])
