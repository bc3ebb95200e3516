"""Packed sequences (``cu_seqlens``) in segments: the initial state's rows and q's shape refused as one
call refuses them."""
from __future__ import annotations

import pytest
import torch

from falcon_fwa import FalconState, falcon_attention


def _packed(N=4, L=3, H=2, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = N * L
    q, k, v = (torch.randn(1, T, H, D, generator=g) for _ in range(3))
    beta, lam = torch.rand(1, T, H, generator=g), torch.rand(1, T, H, generator=g)
    cu = torch.arange(0, T + 1, L)
    return q, k, v, beta, lam, cu


@pytest.mark.parametrize("rows", [2, 5])
@pytest.mark.parametrize("segments", [1, 2])
def test_packed_segments_refuse_initial_state_of_other_row_count(rows, segments):
    """With ``cu_seqlens`` the initial state must hold one row per sequence; ``segments`` (which cuts the
    packed call into groups of whole sequences) must not change that: a state with too many rows was used
    silently (its first rows), one with too few raised an IndexError naming ``index``, not the argument."""
    q, k, v, beta, lam, cu = _packed()
    state = FalconState.fresh(torch.randn(rows, 2, 4, 4), rule="1A")
    with pytest.raises(ValueError, match=rf"^initial_state has {rows} rows, but cu_seqlens holds 4 sequences"):
        falcon_attention(q, k, v, beta, lam, rule="1A", cu_seqlens=cu, initial_state=state, segments=segments)


def test_packed_segments_name_the_callers_shape_of_q():
    """A packed call needs ``q`` ``[1, total, H, K]``; with ``segments`` the refusal reported the shape of a
    piece (the time axis cut in groups) instead of the caller's."""
    q, k, v, beta, lam, cu = _packed()
    two = [torch.cat([t, t]) for t in (q, k, v, beta, lam)]
    for segments in (1, 2):
        with pytest.raises(ValueError, match=r"^q must have shape \[1, total, H, K\].*got \(2, 12, 2, 4\)"):
            falcon_attention(*two, rule="1A", cu_seqlens=cu, segments=segments)
