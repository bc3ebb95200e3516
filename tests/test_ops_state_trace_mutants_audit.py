"""Promises of the segment, state, trace, read-normalizer, pair and packed-offset modules (ops/segments.py,
ops/state.py, ops/trace.py, ops/read_norm.py, ops/pairs.py, ops/seqlens.py) that the other tests left open:

* ``segment_bounds`` cuts at most ``segments`` pieces of equal length (hand-computed cuts);
* each group of packed sequences that ``segments`` runs is given offsets of its own, from 0, whose values
  on the device are the host bounds declared for them (the kernels read the tensor, not the declaration);
* ``FalconState.fresh`` of a sliding rule at window 2 holds its one empty slot and continues as the
  float64 loop of ``conftest`` from ``S_init``;
* ``FalconState.index_select`` names the first row outside ``[0, B)`` (``B`` itself, or a negative row)
  and takes row ``B - 1``;
* ``FalconState.cat`` refuses states of another ``shift`` (two fresh states, neither with a last key);
* the normalized read's extended value rows hold a multiple of 16 values (``_z_columns``, hand-computed);
* ``write_pairs`` leaves the caller's ``step_mask`` as it was (the sentinel is flagged in a copy).

Tiny shapes throughout; every case is hand-computed or checked against the float64 loop.
"""
from __future__ import annotations

import pytest
import torch
from conftest import random_inputs, reference_falcon, rel_err

from falcon_fwa import FalconState, falcon_attention
from falcon_fwa.ops.pairs import write_pairs
from falcon_fwa.ops.read_norm import _z_columns
from falcon_fwa.ops.rules import get_rule
from falcon_fwa.ops.segments import run_segments, segment_bounds
from falcon_fwa.ops.seqlens import sequence_bounds


@pytest.mark.parametrize("T, segments, chunk, cuts", [
    (10, 3, 1, [0, 4, 8, 10]),  # ceil(10 / 3) = 4 steps a piece: three pieces, not four of 3
    (7, 2, 1, [0, 4, 7]),
    (9, 4, 1, [0, 3, 6, 9]),  # ceil(9 / 4) = 3: three pieces
    (10, 3, 2, [0, 4, 8, 10]),
    (17, 2, 4, [0, 12, 17]),  # ceil(17 / 2) = 9, rounded up to 3 chunks of 4
])
def test_segment_bounds_cut_at_most_segments_pieces(T, segments, chunk, cuts):
    assert segment_bounds(T, segments, chunk) == cuts


def test_segment_bounds_sweep():
    """Every cut of a sweep: at most ``segments`` pieces, interior cuts on whole chunks, all pieces but the last of
    one length, and that length the fewest whole chunks holding ``ceil(T / segments)`` steps."""
    for T in range(1, 30):
        for segments in range(1, 7):
            for chunk in (1, 2, 3, 4):
                b = segment_bounds(T, segments, chunk)
                assert b[0] == 0 and b[-1] == T and len(b) - 1 <= segments, (T, segments, chunk, b)
                per = chunk * (((T + segments - 1) // segments + chunk - 1) // chunk)
                assert b[:-1] == list(range(0, T, per)), (T, segments, chunk, b)


def test_packed_groups_get_offsets_of_their_own_on_the_device():
    """Each group of whole sequences is a packed call whose ``cu_seqlens`` tensor runs from 0 over that group
    alone, and the host bounds declared for it (which the op reads instead of the tensor) are its values."""
    seen = []

    def call(q, k, v, beta, lam, log_gate, *, initial_state, output_final_state, cu_seqlens):
        seen.append((cu_seqlens.tolist(), list(sequence_bounds(cu_seqlens))))
        return q.clone(), None

    inp = random_inputs("1", B=1, T=60, seed=3)
    cu = torch.tensor([0, 7, 19, 20, 41, 60])
    tensors = tuple(inp[n] for n in ("q", "k", "v", "beta", "lam")) + (None,)
    with torch.no_grad():
        o, _ = run_segments(call, tensors, None, False, segments=3, chunk_size=4, cu_seqlens=cu)
    assert torch.equal(o, inp["q"])
    expected = [[0, 7, 19, 20], [0, 21], [0, 19]]  # groups of 20, 21 and 19 steps (cuts nearest 20 and 40)
    assert seen == [(e, e) for e in expected]


@pytest.mark.parametrize("rule", ["3", "3A"])
def test_a_fresh_sliding_state_at_window_two(rule):
    g = torch.Generator().manual_seed(5)
    inp = random_inputs(rule, B=1, T=6, H=1, K=3, V=2, seed=21)
    S0 = torch.randn(1, 1, 3, 2, generator=g, dtype=torch.float64)
    st = FalconState.fresh(S0, rule=rule, window=2)
    assert st.window == 2 and st.tail_x.shape == (1, 1, 1, 3) and st.tail_y.shape == (1, 1, 1, 2)
    assert not st.tail_valid.any() and not st.tail_x.any() and not st.tail_y.any()
    o, final = falcon_attention(**inp, rule=rule, window=2, initial_state=st, output_final_state=True)
    ref_o, ref_S, _ = reference_falcon(**inp, rule=rule, window=2, initial_S=S0)
    assert rel_err(o, ref_o) <= 1e-12 and rel_err(final.S, ref_S) <= 1e-12


def test_index_select_names_the_first_row_outside_the_state():
    S = torch.arange(3.0)[:, None, None, None].expand(3, 1, 2, 2).contiguous()
    st = FalconState.fresh(S, rule="1")
    assert torch.equal(st.index_select([2, 0]).S[:, 0, 0, 0], torch.tensor([2.0, 0.0]))
    with pytest.raises(IndexError, match=r"index holds row 3, outside the state's rows \[0, 3\)"):
        st.index_select([0, 3])
    with pytest.raises(IndexError, match=r"index holds row -1, outside the state's rows \[0, 3\)"):
        st.index_select(torch.tensor([-1, 1]))


def test_cat_refuses_states_of_another_shift():
    """Fresh states carry no last key with either ``shift``, so only the configuration tells them apart."""
    a = FalconState.fresh(torch.zeros(1, 1, 2, 2), rule="1", shift=True)
    b = FalconState.fresh(torch.zeros(1, 1, 2, 2), rule="1", shift=False)
    with pytest.raises(ValueError, match=r"states\[1\]\.shift is False, states\[0\]\.shift is True"):
        FalconState.cat([a, b])


@pytest.mark.parametrize("rule, V, n, pad", [("1A", 4, 1, 11), ("3A", 15, 1, 0), ("3A", 16, 1, 15), ("2A", 4, 4, 8),
                                             ("2A", 8, 8, 0), ("1A", 128, 1, 15), ("2A", 3, 3, 10)])
def test_the_normalizer_columns_pad_the_rows_to_16_values(rule, V, n, pad):
    assert _z_columns(get_rule(rule), V) == (n, pad)


def test_write_pairs_leave_the_callers_step_mask_alone():
    k = torch.arange(12.0).reshape(1, 1, 4, 3)
    mask = torch.tensor([[True, True, False, True]])
    x, valid = write_pairs(k, True, None, mask)
    assert torch.equal(mask, torch.tensor([[True, True, False, True]]))
    assert torch.equal(valid, torch.tensor([[False, True, False, True]]))
    assert torch.equal(x[0, 0], torch.tensor([[0.0, 0, 0], [0, 1, 2], [3, 4, 5], [6, 7, 8]]))
