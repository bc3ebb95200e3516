"""The host-side glue of the sliding-window rules on the Triton kernels (rule 3A, ``ops.triton.sliding``;
rule 3, ``ops.triton.sliding_delta``; ``ops.triton.window_sum``; the unpacking of ``api._sliding``) held
to what its docstrings and ``docs/ops.md`` state: the extended axis ``[tail | pairs]`` of
``window_prefix`` and the rows ``_ext_rows`` reads from it, worked out by hand (no kernel); then, on
shapes of a few steps through the interpreter, a fresh state's empty slots and sentinel pair, the final
tails of packed sequences shorter than the window, the output in ``v``'s dtype when the inputs mix
dtypes, ``axis_concat``'s refusals, and which gradient buffers of window 1 stay in place. The kernels
are compared with the float64 recurrent form (``falcon_attention(form="recurrent", backend="torch")``)."""
from __future__ import annotations

import pytest
import torch

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter

KERNELS_RUN = prepare_interpreter()
kernels = pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)

from kernel_checks import DEVICE, check_kernel, rel_norm  # noqa: E402

from falcon_fwa import falcon_attention  # noqa: E402
from falcon_fwa.ops.triton import falcon_chunk_triton  # noqa: E402
from falcon_fwa.ops.triton import sliding  # noqa: E402
from falcon_fwa.ops.triton.window_sum import axis_concat  # noqa: E402

RULES = ("3A", "3")


# ---- the extended axis [tail | pairs], by hand (no kernel) ----

def _tail(B, H, n, K, V, valid):
    x = torch.arange(B * H * n * K, dtype=torch.float32).view(B, H, n, K) + 1
    y = -torch.arange(B * H * n * V, dtype=torch.float32).view(B, H, n, V) - 1
    return x, y, torch.tensor(valid)


def test_window_prefix_of_a_tail_and_padded_rows_by_hand():
    # W = 3 (two tail slots), shift, rows of 4 and 1 real steps out of T = 4: x_pre holds the two
    # slots oldest first (the empty one zeroed, whatever it held) and then the last key; the steps
    # past a row's length carry no pair
    B, T, H, K, V, W = 2, 4, 1, 2, 3, 3
    q = torch.zeros(B, T, H, K)
    v = torch.zeros(B, T, H, V)
    tx, ty, tv = _tail(B, H, W - 1, K, V, [[False, True], [True, True]])
    last = torch.tensor([[[7.0, 8.0]], [[9.0, 10.0]]])
    x_pre, y_pre, valid = sliding.window_prefix(q, q, v, last, (tx, ty, tv), torch.tensor([4, 1]), window=W,
                                                shift=True)
    assert x_pre.shape == (B, W, H, K) and y_pre.shape == (B, W - 1, H, V)
    assert torch.equal(x_pre[0, :, 0], torch.tensor([[0.0, 0.0], [3.0, 4.0], [7.0, 8.0]]))
    assert torch.equal(x_pre[1, :, 0], torch.tensor([[5.0, 6.0], [7.0, 8.0], [9.0, 10.0]]))
    assert torch.equal(y_pre[0, :, 0], torch.tensor([[0.0, 0.0, 0.0], [-4.0, -5.0, -6.0]]))
    assert torch.equal(y_pre[1, :, 0], torch.tensor([[-7.0, -8.0, -9.0], [-10.0, -11.0, -12.0]]))
    assert valid.tolist() == [[False, True, True, True, True, True], [True, True, True, False, False, False]]
    # a fresh state (FalconState.fresh: slots empty, no last key): the first pair is the sentinel's
    x_pre, _, valid = sliding.window_prefix(q, q, v, None, (tx, ty, torch.zeros(B, W - 1, dtype=torch.bool)),
                                            None, window=W, shift=True)
    assert not x_pre.any() and valid.tolist() == [[False, False, False, True, True, True]] * B
    # no state: empty slots; the last key (without a tail, window 1's case) or the sentinel after them
    x_pre, y_pre, valid = sliding.window_prefix(q, q, v, None, None, torch.tensor([2, 4]), window=W, shift=True)
    assert x_pre.shape == (B, W, H, K) and not x_pre.any() and not y_pre.any()
    assert valid.tolist() == [[False, False, False, True, False, False], [False, False, False, True, True, True]]
    x_pre, _, valid = sliding.window_prefix(q, q, v, last, None, None, window=W, shift=True)
    assert torch.equal(x_pre[:, W - 1], last) and not x_pre[:, :W - 1].any()
    assert valid.tolist() == [[False, False, True, True, True, True]] * B
    # without the shift: no feature after the slots, and the first step's pair is real
    x_pre, _, valid = sliding.window_prefix(q, q, v, last, (tx, ty, tv), None, window=W, shift=False)
    assert x_pre.shape == (B, W - 1, H, K) and valid.tolist() == [[False, True, True, True, True, True],
                                                                   [True, True, True, True, True, True]]


def test_ext_rows_reads_the_prefix_then_the_body():
    prefix = torch.arange(2 * 2, dtype=torch.float32).view(2, 2, 1, 1)  # rows 0, 1 | 2, 3
    body = 10 + torch.arange(2 * 3, dtype=torch.float32).view(2, 3, 1, 1)  # rows 10, 11, 12 | 13, 14, 15
    pos = torch.tensor([[0, 1, 2, 4], [1, 2, 3, 0]])
    got = sliding._ext_rows(prefix, body, pos)[..., 0, 0]
    assert got.tolist() == [[0.0, 1.0, 10.0, 12.0], [3.0, 13.0, 14.0, 2.0]]
    # no prefix: the body alone
    pos = torch.tensor([[2, 0, 1], [1, 2, 0]])
    assert sliding._ext_rows(prefix[:, :0], body, pos)[..., 0, 0].tolist() == [[12.0, 10.0, 11.0], [14.0, 15.0, 13.0]]


# ---- a fresh state: every tail slot empty, the first pair the sentinel's ----

@kernels
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("T", [3, 7])
def test_fresh_state_with_a_window_writes_no_sentinel_pair(rule, T):
    # FalconState.fresh under the shift: no last key and W - 1 empty tail slots. The first step's
    # pair is the sentinel's (zero key), which must not count in the window's pair count B_t either;
    # at T = W - 1 the final tail holds it, flagged empty
    check_kernel(rule, (1, T, 1, 16, 16), window=4, state=True, sentinel=True, shift=True,
                 output_final_state=True, seed=11 + T)


# ---- packed sequences: rows that end in padding ----

@kernels
@pytest.mark.parametrize("rule", RULES)
def test_packed_fresh_sequences_shorter_than_the_window_keep_their_empty_slots(rule):
    # no initial state and no shift: sequences of 1 and 2 steps with W - 1 = 3 slots end with
    # empty slots in their final tails (flagged False), unpacked into rows padded to 6 steps
    check_kernel(rule, (1, 9, 1, 16, 16), window=4, shift=False, read="before", cu_seqlens=[0, 1, 7, 9],
                 output_final_state=True, seed=31)


# ---- dtypes ----

@kernels
@pytest.mark.parametrize("rule", RULES)
def test_mixed_dtypes_give_the_output_in_the_dtype_of_v(rule):
    # docs/ops.md: the output has v's dtype; the kernels take k and v in q's dtype
    g = torch.Generator().manual_seed(5)
    B, T, H, K = 1, 6, 1, 16
    q, k = (torch.randn(B, T, H, K, generator=g).div(2).half() for _ in range(2))
    v = torch.randn(B, T, H, K, generator=g)
    beta, lam = torch.rand(B, T, H, generator=g) * 0.9 + 0.1, torch.rand(B, T, H, generator=g) * 0.5
    o, _ = falcon_chunk_triton(*(t.to(DEVICE) for t in (q, k, v, beta, lam)), rule=rule, window=4)
    assert o.dtype == torch.float32 and o.shape == (B, T, H, K)
    want, _ = falcon_attention(q.double(), k.double(), v.half().double(), beta.double(), lam.double(), rule=rule,
                               window=4, form="recurrent", backend="torch")
    assert rel_norm(o.cpu(), want) < 5e-3


# ---- axis_concat ----

def test_axis_concat_refuses_another_dtype_or_batch():
    head = torch.zeros(2, 2, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype"):
        axis_concat(head, torch.zeros(2, 5, 3, dtype=torch.float32), 4)
    with pytest.raises(ValueError, match="batch"):
        axis_concat(head, torch.zeros(1, 5, 3, dtype=torch.float16), 4)


# ---- the delayed pairs' gradient buffers ----

@kernels
@pytest.mark.parametrize("shift", [True, False])
def test_window_one_gradients_stay_in_place_unless_the_shift_delays_the_keys(shift, monkeypatch):
    # window 1: nothing delays the values, so their gradient is the scan's own buffer, and so is the
    # keys' without the shift. With it, pair t's feature is k_{t-1} and band_bwd_pairs reads the
    # scan's gradient of row t + 1 for k_t: written into the scan's buffer, a program would overwrite
    # rows that the next program still reads (in parallel on a GPU; the interpreter runs the programs
    # in order and could not tell), so dk must be a buffer of its own
    seen = []
    launch = sliding.kern.band_bwd_pairs

    class Spy:
        def __getitem__(self, grid):
            def run(q, do, k, x_pre, v, y_pre, rho, dx_del, dy_del, d_stat, valid_ext, dk, dx_pre, dv, dy_pre, *a,
                    **kw):
                seen.append((dx_del.data_ptr(), dk.data_ptr(), dy_del.data_ptr(), dv.data_ptr()))
                return launch[grid](q, do, k, x_pre, v, y_pre, rho, dx_del, dy_del, d_stat, valid_ext, dk, dx_pre,
                                    dv, dy_pre, *a, **kw)
            return run

    monkeypatch.setattr(sliding.kern, "band_bwd_pairs", Spy())
    check_kernel("3A", (1, 5, 1, 16, 16), window=1, state=True, shift=shift, output_final_state=True, seed=21)
    assert len(seen) == 1
    dx_del, dk, dy_del, dv = seen[0]
    assert (dk != dx_del) == shift
    assert dv == dy_del
