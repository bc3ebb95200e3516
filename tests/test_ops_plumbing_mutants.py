"""The op's state and sequence plumbing, case by case: what a state carries and in which dtype, how
packed offsets are read and declared, where the pieces of ``segments`` are cut, and the per-column
groups of the chunk form continuing a non-zero state. Each case is checked against hand-built values
or the float64 loop of ``conftest``."""
from __future__ import annotations

import pytest
import torch
from conftest import FORMS, SLIDING, random_inputs, reference_falcon, rel_err

from falcon_fwa import FalconState, falcon_attention, falcon_step
from falcon_fwa.ops.pairs import write_pairs
from falcon_fwa.ops.segments import run_segments
from falcon_fwa.ops.seqlens import known_sequence_bounds, last_steps, memo, sequence_bounds
from falcon_fwa.ops.triton.chunk_index import chunk_layout

TOL = 1e-10


def _segment(inp, a, b):
    return {name: t[:, a:b] for name, t in inp.items()}


# ----------------------------------------------------------------------------- FalconState
@pytest.mark.parametrize("rule", SLIDING)
def test_a_fresh_sliding_state_holds_an_empty_tail_for_every_window(rule):
    """``FalconState.fresh`` of a sliding rule holds ``window - 1`` empty slots for every window above one (two
    included), and a call from it is the float64 loop started at ``S_init`` with that window."""
    S0 = torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    inp = random_inputs(rule, B=1, T=7, seed=4, lam_range=(0.0, 2.0))
    for window in (2, 3, 5):
        st = FalconState.fresh(S0, rule=rule, window=window)
        assert st.window == window
        assert st.tail_x.shape == (1, 2, window - 1, 5) and st.tail_y.shape == (1, 2, window - 1, 4)
        assert st.tail_valid.shape == (1, window - 1) and not st.tail_valid.any()
        o, final = falcon_attention(**inp, rule=rule, window=window, chunk_size=4, initial_state=st,
                                    output_final_state=True)
        ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, window=window, initial_S=S0)
        assert rel_err(o, ref_o) <= TOL and rel_err(final.S, ref_S) <= TOL, window


def test_cat_refuses_a_field_that_only_a_later_state_sets():
    """A field set in one state and not in another is refused in either order (a field missing from the first
    state would otherwise be dropped from the stack silently), naming the field and both states."""
    S = torch.zeros(1, 2, 5, 4)
    plain, normed = FalconState.fresh(S, rule="1A"), FalconState.fresh(S, rule="1A", z=torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match=r"states\[1\]\.z is set, states\[0\]\.z is None"):
        FalconState.cat([plain, normed])
    with pytest.raises(ValueError, match=r"states\[1\]\.z is None, states\[0\]\.z is set"):
        FalconState.cat([normed, plain])
    keyed = FalconState.fresh(S, rule="1A")
    keyed.last_key = torch.zeros(1, 2, 5)
    with pytest.raises(ValueError, match=r"states\[2\]\.last_key is set, states\[0\]\.last_key is None"):
        FalconState.cat([plain, plain, keyed])


@pytest.mark.parametrize("form", FORMS)
def test_the_final_last_key_is_not_a_view_of_the_callers_keys(form):
    """Keys already in the compute dtype are not copied on the way in, so the final state's last key must be a
    tensor of its own: a caller that refills its key tensor after the call (a reused buffer) leaves the state,
    and the continuation from it, as they were (the float64 loop over the whole sequence)."""
    inp = random_inputs("1", B=2, T=11, seed=5, with_gate=True)
    ref_o, ref_S, _ = reference_falcon(**inp, rule="1")
    first = {n: t[:, :6].clone() for n, t in inp.items()}
    _, st = falcon_attention(**first, rule="1", form=form, chunk_size=4, output_final_state=True)
    first["k"].fill_(float("nan"))  # the caller's buffer takes other keys
    assert torch.equal(st.last_key, inp["k"][:, 5])
    o, final = falcon_attention(**_segment(inp, 6, 11), rule="1", form=form, chunk_size=4, initial_state=st,
                                output_final_state=True)
    assert rel_err(o, ref_o[:, 6:]) <= TOL and rel_err(final.S, ref_S) <= TOL


@pytest.mark.parametrize("rule", SLIDING)
def test_a_float64_state_continued_in_float32_keeps_every_field_in_float32(rule):
    """A call casts the state it is given to its compute dtype: a float64 state continued with float32 inputs
    (by a call or by a step) returns a state whose float fields (S, the last key, the window tail) are all
    float32, equal to those of the same call from the state first rounded to float32."""
    inp = random_inputs(rule, B=2, T=9, seed=6, with_gate=True)
    _, wide = falcon_attention(**_segment(inp, 0, 5), rule=rule, window=3, output_final_state=True)
    rounded = wide.to(dtype=torch.float32)
    rest = {n: t[:, 5:].float() for n, t in inp.items()}
    o, narrow = falcon_attention(**rest, rule=rule, window=3, initial_state=wide, output_final_state=True)
    o_ref, want = falcon_attention(**rest, rule=rule, window=3, initial_state=rounded, output_final_state=True)
    tok = {n: t[:, 0] for n, t in rest.items()}
    o_step, stepped = falcon_step(**tok, state=wide, rule=rule, window=3, backend="torch")
    o_step_ref, stepped_want = falcon_step(**tok, state=rounded, rule=rule, window=3, backend="torch")
    assert torch.equal(o, o_ref) and torch.equal(o_step, o_step_ref)
    for got, ref in ((narrow, want), (stepped, stepped_want)):
        for name in ("S", "last_key", "tail_x", "tail_y"):
            x = getattr(got, name)
            assert x.dtype == torch.float32, name
            assert torch.equal(x, getattr(ref, name)), name
        assert torch.equal(got.tail_valid, ref.tail_valid)


# ----------------------------------------------------------------------------- pairs and last steps
def test_write_pairs_by_hand():
    """The shifted pairs of a fresh and of a continued segment, written out, and the caller's step mask left as
    it was (the sentinel is marked in a copy)."""
    k = torch.arange(1.0, 9.0, dtype=torch.float64).reshape(1, 1, 4, 2)  # keys (1,2) (3,4) (5,6) (7,8)
    mask = torch.tensor([[True, True, True, False]])
    x, valid = write_pairs(k, True, None, mask)
    assert x[0, 0].tolist() == [[0.0, 0.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert valid.tolist() == [[False, True, True, False]]
    assert mask.tolist() == [[True, True, True, False]]
    x, valid = write_pairs(k, True, torch.tensor([[[-1.0, -2.0]]], dtype=torch.float64), mask)
    assert x[0, 0].tolist() == [[-1.0, -2.0], [1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert valid.tolist() == [[True, True, True, False]]
    x, valid = write_pairs(k, False, None)
    assert torch.equal(x, k) and valid.all()


def test_last_steps_by_hand():
    """Each sequence's last step: of packed sequences (``cu_seqlens``, int32 or int64), of right-padded rows
    (``lengths``) and of whole rows, the last one a copy that a later write to ``x`` leaves alone."""
    x = torch.arange(18.0).reshape(1, 9, 2)  # step t holds (2t, 2t+1)
    for dtype in (torch.int32, torch.int64):
        got = last_steps(x, cu_seqlens=torch.tensor([0, 3, 4, 9], dtype=dtype))
        assert got.tolist() == [[4.0, 5.0], [6.0, 7.0], [16.0, 17.0]]  # steps 2, 3 and 8
    rows = torch.arange(12.0).reshape(2, 3, 2)
    assert last_steps(rows, lengths=torch.tensor([3, 1])).tolist() == [[4.0, 5.0], [6.0, 7.0]]
    last = last_steps(rows)
    rows.zero_()
    assert last.tolist() == [[4.0, 5.0], [10.0, 11.0]]


# ----------------------------------------------------------------------------- cu_seqlens
def test_empty_or_boolean_cu_seqlens_are_named():
    """Offsets of no sequence at all are a ValueError naming ``cu_seqlens`` (not an IndexError), and a boolean
    tensor is not one of integers."""
    with pytest.raises(ValueError, match="cu_seqlens must rise strictly from 0 to T = 8"):
        sequence_bounds(torch.tensor([], dtype=torch.long), 8)
    inp = random_inputs("1A", B=1, T=6, seed=7)
    with pytest.raises(ValueError, match="cu_seqlens"):
        falcon_attention(**inp, rule="1A", cu_seqlens=torch.tensor([], dtype=torch.long))
    with pytest.raises(TypeError, match="cu_seqlens must hold integers, got torch.bool"):
        falcon_attention(**inp, rule="1A", cu_seqlens=torch.tensor([False, True, True]))


def test_a_nested_block_does_not_answer_with_the_outer_blocks_derived_quantities():
    """A nested ``known_sequence_bounds`` for the same tensor declares other bounds: what ``memo`` built for the
    outer ones is not the inner answer, and the outer one is back after the inner block."""
    cu = torch.tensor([0, 3, 8])
    with known_sequence_bounds(cu, [0, 3, 8]):
        assert memo(cu, "key", lambda: "outer") == "outer"
        outer = chunk_layout(1, 8, 4, cu)  # lengths 3 and 5: one chunk, then two
        assert outer.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1]]
        with known_sequence_bounds(cu, [0, 5, 8]):
            assert memo(cu, "key", lambda: "inner") == "inner"
            inner = chunk_layout(1, 8, 4, cu)  # lengths 5 and 3: two chunks, then one
            assert inner.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0]]
        assert memo(cu, "key", lambda: "again") == "outer" and chunk_layout(1, 8, 4, cu) is outer


# ----------------------------------------------------------------------------- segments
def test_segments_are_cut_on_whole_chunks_and_hand_the_state_on():
    """``run_segments`` calls the op once per piece, ``ceil(T / segments)`` rounded up to whole chunks long (two
    pieces included), each from the state the one before it returned; under autograd too."""
    inp = random_inputs("1", B=1, T=45, seed=8, with_gate=True)
    for grad in (False, True):
        for segments, lengths in ((2, [24, 21]), (3, [16, 16, 13]), (5, [16, 16, 13])):  # ceil(45/5) = 9 -> 16
            calls = []

            def call(q, k, v, beta, lam, log_gate, *, initial_state, output_final_state):
                o, st = falcon_attention(q, k, v, beta, lam, log_gate=log_gate, rule="1", chunk_size=8,
                                         initial_state=initial_state, output_final_state=output_final_state)
                calls.append((q.shape[1], initial_state, st))
                return o, st

            with torch.set_grad_enabled(grad):
                tensors = tuple(t.clone().requires_grad_(grad) for t in inp.values())
                o, _ = run_segments(call, tensors, None, False, segments=segments, chunk_size=8)
            assert [n for n, _, _ in calls] == lengths, (grad, segments)
            assert calls[0][1] is None
            for (_, _, handed), (_, entry, _) in zip(calls, calls[1:]):
                assert entry is handed
            assert rel_err(o, reference_falcon(**inp, rule="1")[0]) <= TOL


# ----------------------------------------------------------------------------- chunk form, columns in groups
@pytest.mark.parametrize("rule", ["2", "2A"])
def test_column_groups_continue_a_nonzero_state(rule, monkeypatch):
    """The per-column rules run a column per group when the block tensors are large; each group starts from its
    own columns of the entry state: from a random ``S_init`` the outputs and final state are the float64 loop's."""
    from falcon_fwa.ops import chunk

    monkeypatch.setattr(chunk, "BLOCK_ELEMENTS", 1)  # one column per group
    widths, inner = [], chunk._chunk_form

    def spy(q, xs, ys, *args, **kwargs):
        widths.append(ys.shape[-1])
        return inner(q, xs, ys, *args, **kwargs)

    monkeypatch.setattr(chunk, "_chunk_form", spy)
    S0 = torch.randn(2, 2, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(10))
    inp = random_inputs(rule, B=2, T=13, seed=11, with_gate=True)
    with torch.no_grad():
        o, st = falcon_attention(**inp, rule=rule, chunk_size=4, initial_state=FalconState.fresh(S0, rule=rule),
                                 output_final_state=True)
    assert widths == [1, 1, 1, 1]
    ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, initial_S=S0)
    assert rel_err(o, ref_o) <= TOL and rel_err(st.S, ref_S) <= TOL
