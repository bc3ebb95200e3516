"""``delta_chunk(..., query_slot=r)``: one query per step of ``slots`` writes, read on the
step's row ``r``, against the same scan with the queries laid out over every row (zeros on
the rows that read nothing) and the outputs of row ``r`` picked out, which is what the kernels
computed before they read the query rows in place. Outputs, final states and every gradient
must agree (two independent layouts of one computation); fresh buffers start as NaN."""
from __future__ import annotations

import pytest
import torch

from kernel_checks import DEVICE, PoisonedEmpty, in_this_process, rel_norm
from test_triton_wy_forward import wy_inputs

from falcon_fwa.ops.triton.delta import delta_chunk

pytestmark = in_this_process


def _padded_queries(q, slots, read):
    """``[B, S, H, K]`` -> ``[B, S * slots, H, K]``: step ``j``'s query on row ``j*slots + read``."""
    B, S, H, K = q.shape
    rows = q.new_zeros(B, S, slots, H, K)
    rows[:, :, read] = q
    return rows.flatten(1, 2)


# chunk 64 with 4 slots: the outputs take the steps' query rows packed (16 per chunk; the last chunk of a
# sequence partly filled), the other cases one tile row per write row
@pytest.mark.parametrize("slots,read_after,cu_seqlens,chunk_size", [
    (4, True, None, 16), (4, False, None, 16), (2, True, [0, 24, 72], 16), (8, False, [0, 16, 64], 16),
    (4, True, None, 64), (4, False, [0, 40, 152], 64)])
def test_query_rows_equal_zero_padded_queries(monkeypatch, slots, read_after, cu_seqlens, chunk_size):
    B = 1 if cu_seqlens is not None else 2
    T, H, K, V = 72 if cu_seqlens is not None else 48, 2, 24, 20
    if cu_seqlens is not None:
        T = cu_seqlens[-1]
    x, v, eta, kappa, log_a = wy_inputs(B, T, H, K, V, slots=slots, seed=slots)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, T // slots, H, K, generator=g) / K ** 0.5
    S0 = torch.randn(B if cu_seqlens is None else len(cu_seqlens) - 1, H, K, V, generator=g) / 4
    read = slots - 1 if read_after else 0
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device=DEVICE)
    opts = dict(read_after=read_after, chunk_size=chunk_size, cu_seqlens=cu, output_final_state=True, slots=slots)
    w_o = torch.randn(B, T // slots, H, V, generator=g).to(DEVICE)
    w_s = torch.randn(S0.shape, generator=g).to(DEVICE)

    def run(query_slot):
        # fresh leaves per run: on the CPU, .to(DEVICE) is the tensor itself, whose .grad both runs would share
        leaves = [t.to(DEVICE).clone().requires_grad_() for t in (q, x, v, eta, kappa, log_a, S0)]
        q_in = leaves[0] if query_slot is not None else _padded_queries(leaves[0], slots, read)
        with PoisonedEmpty(monkeypatch):
            o, S_T = delta_chunk(q_in, *leaves[1:], query_slot=query_slot, **opts)
            if query_slot is None:
                o = o.view(B, T // slots, slots, H, V)[:, :, read]
            ((o * w_o).sum() + (S_T * w_s).sum()).backward()
        return o.detach(), S_T.detach(), [t.grad for t in leaves]

    o, S_T, grads = run(read)
    o_ref, S_ref, grads_ref = run(None)
    assert o.shape == (B, T // slots, H, V)
    assert rel_norm(o, o_ref) < 1e-5 and rel_norm(S_T, S_ref) < 1e-5
    for name, a, b in zip(("q", "x", "v", "eta", "kappa", "log_a", "S0"), grads, grads_ref):
        assert torch.isfinite(a).all() and rel_norm(a, b) < 1e-5, name


def test_query_slot_arguments_are_checked():
    x, v, eta, kappa, log_a = (t.to(DEVICE) for t in wy_inputs(1, 16, 1, 16, 16, slots=4))
    q = torch.zeros(1, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"query_slot must be in \[0, slots\)"):
        delta_chunk(q, x, v, eta, kappa, log_a, None, read_after=True, slots=4, query_slot=4)
    with pytest.raises(ValueError, match="with query_slot, q must have T // slots = 4 rows, got 16"):
        delta_chunk(x, x, v, eta, kappa, log_a, None, read_after=True, slots=4, query_slot=3)
