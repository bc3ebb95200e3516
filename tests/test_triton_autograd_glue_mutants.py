"""The host-side glue of the regression and step kernels held to what its docstrings state: the
refusals of ``ops.triton.delta.delta_chunk`` (each naming the argument at fault, with its limits at
their bounds: the value axis built from ``value_prefix`` taken at both ends of its range, ``query_slot``
only with grouped writes), the chunk of 128 run at ``WY_MAX_CHUNK``, the launch settings of
``_full_k`` and the query-row arguments of ``_query_args`` (from the tables and rules their
docstrings give), a second backward through a windowed graph with one query per step, the chunk-size
refusals of the scalar- and column-decay ops, the key block of the step kernels, and the refusals of
the fused recurrent kernel (``ops.triton.recurrent``) at their bounds. Most cases run no kernel; the
few that do (marked) take a handful of elements through the interpreter, against a float64
recurrence written out here."""
from __future__ import annotations

import pytest
import torch

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter

from falcon_fwa.ops.rules import get_rule
from falcon_fwa.ops.triton import api, column_delta, delta, recurrent, step_sizes
from falcon_fwa.ops.triton.column_decay import column_decay_chunk
from falcon_fwa.ops.triton.delta import delta_chunk
from falcon_fwa.ops.triton.scalar_decay import scalar_decay_chunk

KERNELS_RUN = prepare_interpreter()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)
CHUNKS = "(16, 32, 64, 128)"


def _delta_reference(q, x, v, eta, kappa, log_a, read_after):
    """``S_t = a_t S_{t-1} + x_t (eta_t v_t - kappa_t S_{t-1}^T x_t)^T`` in float64, one write per
    step from a zero state; ``o_t = S_t^T q_t`` (``read_after``) or ``S_{t-1}^T q_t``."""
    q, x, v, eta, kappa, log_a = (t.double().cpu() for t in (q, x, v, eta, kappa, log_a))
    B, T, H, K = x.shape
    o = torch.zeros(B, T, H, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            S = torch.zeros(K, v.shape[-1], dtype=torch.float64)
            for t in range(T):
                prev = S
                S = log_a[b, t, h].exp() * prev + torch.outer(x[b, t, h], eta[b, t, h] * v[b, t, h]
                                                              - kappa[b, t, h] * (prev.T @ x[b, t, h]))
                o[b, t, h] = (S if read_after else prev).T @ q[b, t, h]
    return o


def _inputs(T, K=16, V=16, H=1, seed=0, axis=None):
    g = torch.Generator().manual_seed(seed)
    q, x = (torch.randn(1, T if axis is None else axis, H, K, generator=g) / 4 for _ in range(2))
    v = torch.randn(1, T if axis is None else axis, H, V, generator=g)
    eta = 0.1 + 0.5 * torch.rand(1, T, H, generator=g)
    log_a = -0.3 * torch.rand(1, T, H, generator=g)
    return q, x, v, eta, log_a


# ---- delta_chunk: refusals (no kernel runs) ----

def test_delta_chunk_refuses_a_chunk_size_outside_the_supported_ones():
    q, x, v, eta, log_a = _inputs(16)
    for chunk in (8, 48, 256):
        with pytest.raises(ValueError) as info:
            delta_chunk(q, x, v, eta, eta, log_a, None, read_after=True, chunk_size=chunk)
        assert str(info.value) == f"chunk_size must be one of {CHUNKS} for the Triton kernels, got {chunk}"


def test_delta_chunk_refuses_slots_that_do_not_divide_16():
    q, x, v, eta, log_a = _inputs(24)
    for slots in (3, 6, 32):
        with pytest.raises(ValueError) as info:
            delta_chunk(q, x, v, eta, eta, log_a, None, read_after=True, chunk_size=16, slots=slots)
        assert str(info.value) == f"slots must be one of (1, 2, 4, 8, 16) (a divisor of 16), got {slots}"


def test_rows_refusal_names_the_tensor_with_the_wrong_rows():
    q, x, v, eta, log_a = _inputs(6)
    with pytest.raises(ValueError) as info:
        delta_chunk(q, x, v[:, :5], eta, eta, log_a, None, read_after=True, chunk_size=16)
    assert str(info.value) == "v must have T = 6 rows (those of eta), got 5"
    with pytest.raises(ValueError) as info:
        delta_chunk(q, x[:, :4], v, eta, eta, log_a, None, read_after=True, chunk_size=16)
    assert str(info.value) == "x must have T = 6 rows (those of eta), got 4"


def test_query_slot_needs_grouped_writes():
    q, x, v, eta, log_a = _inputs(8)
    with pytest.raises(ValueError) as info:  # slots=1: no group to pick a row of, even query_slot=0
        delta_chunk(q, x, v, eta, eta, log_a, None, read_after=True, chunk_size=16, query_slot=0)
    assert str(info.value) == "query_slot must be in [0, slots) with slots > 1, got query_slot=0, slots=1"
    with pytest.raises(ValueError, match=r"got query_slot=-1, slots=2$"):
        delta_chunk(q[:, :4], x, v, eta, eta, log_a, None, read_after=True, chunk_size=16, slots=2, query_slot=-1)


def test_value_prefix_axis_outside_its_range_is_refused():
    # T=8 write rows, slots=2: the axis has 8 // 2 + 2 - 1 = 5 rows
    q, _, _, eta, log_a = _inputs(8)
    _, x, v, _, _ = _inputs(8, axis=5)
    for n, m in ((2, 2), (6, 0), (6, 3)):  # the prefix and body together short of 5 rows, or the prefix past them
        with pytest.raises(ValueError) as info:
            delta_chunk(q, x, v[:, :m], eta, eta, log_a, None, read_after=True, chunk_size=16, slots=2,
                        windowed=True, value_prefix=torch.zeros(1, n, 1, 16))
        assert str(info.value) == (f"with value_prefix, the axis of 5 rows must lie between value_prefix's {n} rows "
                                   f"and those plus v's {m}")


# ---- delta: launch settings and query rows (no kernel runs) ----

@pytest.mark.parametrize("name", ["state_fwd", "state_bwd", "wy_bwd"])
def test_full_k_of_16_bit_inputs_takes_the_tables(name):
    for dtype in (torch.bfloat16, torch.float16):
        for slots, table in ((1, delta.FULL_K_16BIT), (4, delta.FULL_K_16BIT_GROUPED)):
            c = table[name]
            for K in (16, 100, 128):  # BK the whole key dim: 16, 128, 128; the K <= 128 tables
                BK = {16: 16, 100: 128, 128: 128}[K]
                assert delta._full_k(name, K, 128, dtype, slots) == (BK, c["BV"], c["num_warps"], c["num_stages"])
            c = delta.FULL_K_16BIT_256[name]
            for K in (129, 256):  # 128 < K <= 256: the 256-row table, one write per step or grouped
                assert delta._full_k(name, K, 128, dtype, slots) == (256, c["BV"], c["num_warps"], c["num_stages"])
            assert delta._full_k(name, 16, 8, dtype, slots)[1] == 16  # BV follows V, at least 16


@pytest.mark.parametrize("name", ["state_fwd", "state_bwd", "wy_bwd"])
def test_full_k_small_grid_entries_below_small_grid(name):
    bf16 = torch.bfloat16
    for slots, table, small in ((1, delta.FULL_K_16BIT, delta.FULL_K_16BIT_SMALL_GRID),
                                (4, delta.FULL_K_16BIT_GROUPED, delta.FULL_K_16BIT_GROUPED_SMALL_GRID)):
        wide = table[name]
        c = small.get(name, wide)  # an entry the small-grid table lacks keeps the wide-grid setting
        settings = (128, c["BV"], c["num_warps"], c["num_stages"])
        assert delta._full_k(name, 128, 128, bf16, slots, delta.SMALL_GRID - 1) == settings
        for n in (delta.SMALL_GRID, None):  # at SMALL_GRID sequences x heads, or unknown: the wide grid
            assert delta._full_k(name, 128, 128, bf16, slots, n) == (128, wide["BV"], wide["num_warps"],
                                                                     wide["num_stages"])
        c256 = delta.FULL_K_16BIT_256[name]  # a 256-row key tile: its own table whatever the grid
        assert delta._full_k(name, 256, 128, bf16, slots, 1) == (256, c256["BV"], c256["num_warps"],
                                                                 c256["num_stages"])
        assert delta._full_k(name, 128, 128, torch.float32, slots, 1) == delta._full_k(name, 128, 128,
                                                                                       torch.float32, slots)
    # by hand, the values the tables hold: rule 1 at B=2, H=16 (32 sequences x heads) and rule 3 at B=4
    assert delta._full_k("state_fwd", 128, 128, bf16, 1, 32) == (128, 16, 2, 2)
    assert delta._full_k("state_bwd", 128, 128, bf16, 1, 32) == (128, 32, 4, 2)
    assert delta._full_k("state_fwd", 128, 128, bf16, 4, 64) == (128, 32, 2, 2)
    assert delta._full_k("state_bwd", 128, 128, bf16, 4, 64) == (128, 64, 4, 2)
    assert delta._full_k("state_fwd", 100, 24, bf16, 1, 32)[1] == 16  # BV follows V


def test_full_k_of_four_byte_inputs_by_hand():
    f32 = torch.float32
    # BV = clamp(next_pow2(V), 16, min(32, 4096 // BK)); stages 3 to BK 64, 2 at 128, 1 at 256;
    # warps: wy_bwd at WY_WARPS' (8), the others 4 to BK 128 and 8 above
    assert delta._full_k("state_fwd", 64, 128, f32, 1) == (64, 32, 4, 3)
    assert delta._full_k("state_bwd", 128, 128, f32, 1) == (128, 32, 4, 2)
    assert delta._full_k("state_bwd", 65, 20, f32, 4) == (128, 32, 4, 2)
    assert delta._full_k("state_fwd", 256, 128, f32, 1) == (256, 16, 8, 1)
    assert delta._full_k("state_bwd", 200, 8, f32, 1) == (256, 16, 8, 1)
    assert delta._full_k("wy_bwd", 16, 16, f32, 1) == (16, 16, 8, 3)
    assert delta._full_k("wy_bwd", 128, 64, f32, 1) == (128, 32, 8, 2)


def test_query_args_pack_where_a_chunk_holds_16_steps():
    assert delta._query_args(4, None, 64) == {}
    assert delta._query_args(4, 3, 64) == dict(QSLOTS=4, QREAD=3, QPACK=True)  # 64 rows: 16 steps
    assert delta._query_args(4, 1, 32) == dict(QSLOTS=4, QREAD=1, QPACK=False)  # 8 steps
    assert delta._query_args(2, 0, 32) == dict(QSLOTS=2, QREAD=0, QPACK=True)
    assert delta._query_args(16, 15, 128) == dict(QSLOTS=16, QREAD=15, QPACK=False)
    assert delta._key_args(4, True) == dict(XWIN=4) and delta._key_args(4, False) == {}


# ---- delta_chunk through the interpreter ----

@kernels
@pytest.mark.parametrize("chunk,runs_at", [(128, 64), (64, 64), (32, 32)])
def test_chunk_of_128_runs_at_64(chunk, runs_at):
    q, x, v, eta, log_a = (t.to(DEVICE) for t in _inputs(20, seed=chunk))
    q.requires_grad_()
    o, _ = delta_chunk(q, x, v, eta, 0.8 * eta, log_a, None, read_after=True, chunk_size=chunk)
    assert o.grad_fn.layout.BT == runs_at  # the autograd node holds the layout the kernels ran
    ref = _delta_reference(q.detach(), x, v, eta, 0.8 * eta, log_a, True)
    assert torch.allclose(o.detach().double().cpu(), ref, atol=1e-5)


@kernels
@pytest.mark.parametrize("n,m", [(8, 2), (3, 5), (2, 6)])
def test_value_prefix_taken_at_both_ends_of_its_range(n, m):
    # slots=1, windowed: the axis is the T = 8 write rows; the prefix may cover all of it (m rows of v
    # unread), or prefix and body meet it exactly
    q, x, v_axis, eta, log_a = (t.to(DEVICE) for t in _inputs(8, seed=10 + n))
    extra = torch.ones(1, m, 1, 16, device=DEVICE)
    pre = v_axis[:, :n].clone().requires_grad_()
    body = (torch.cat([v_axis[:, n:], extra], 1) if n == 8 else v_axis[:, n:]).clone().requires_grad_()
    o, _ = delta_chunk(q, x, body, eta, None, log_a, None, read_after=False, chunk_size=16, windowed=True,
                       value_prefix=pre)
    ref = _delta_reference(q, x, v_axis, eta, eta, log_a, False)
    assert torch.allclose(o.detach().double().cpu(), ref, atol=1e-5)
    o.sum().backward()
    assert pre.grad.shape == pre.shape and body.grad.shape == body.shape
    if n == 8:
        assert torch.equal(body.grad, torch.zeros_like(body.grad))  # the rows past the axis are not read


@kernels
def test_second_backward_of_a_windowed_graph_with_step_queries():
    """``retain_graph=True``: the second backward recomputes what the first wrote over, over the same
    extended axis (``windowed``), and gives the first one's gradients exactly; both against float64."""
    S, T, H = 2, 16, 1
    L = T // S + S - 1
    g = torch.Generator().manual_seed(5)
    x_axis = (torch.randn(1, L, H, 16, generator=g) / 4).to(DEVICE).requires_grad_()
    v_axis = torch.randn(1, L, H, 16, generator=g).to(DEVICE).requires_grad_()
    q = (torch.randn(1, T // S, H, 16, generator=g) / 4).to(DEVICE).requires_grad_()
    eta = (0.1 + 0.5 * torch.rand(1, T, H, generator=g)).to(DEVICE)
    log_a = -0.3 * torch.rand(1, T, H, generator=g)
    log_a[:, 1::S] = 0  # nonzero only on a group's first row
    log_a = log_a.to(DEVICE).requires_grad_()
    leaves = (q, x_axis, v_axis, log_a)
    o, _ = delta_chunk(q, x_axis, v_axis, eta, None, log_a, None, read_after=False, chunk_size=16, slots=S,
                       windowed=True, query_slot=0)
    probe = torch.randn(o.shape, generator=g).to(DEVICE)
    first = torch.autograd.grad((o * probe).sum(), leaves, retain_graph=True)
    second = torch.autograd.grad((o * probe).sum(), leaves)
    for name, a, b in zip(("q", "x", "v", "log_a"), first, second):
        assert torch.equal(a, b), f"d{name} differs in the second backward"

    # float64: step j's writes i = 0, 1 read axis rows j + i and see the state before step j; step j's
    # query (read before, on the group's first row, as rule 3 reads) sees the state before the step
    def reference(q, xa, va, log_a):
        Sm = torch.zeros(16, 16, dtype=torch.float64)
        out = []
        for j in range(T // S):
            out.append(Sm.T @ q[0, j, 0])
            prev = Sm
            Sm = log_a[0, j * S, 0].exp() * prev
            for i in range(S):
                r, xr = j * S + i, xa[0, j + i, 0]
                Sm = Sm + torch.outer(xr, eta[0, r, 0].double().cpu() * va[0, j + i, 0] - eta[0, r, 0].double().cpu()
                                      * (prev.T @ xr))
        return torch.stack(out)[None, :, None]

    leaves64 = [t.detach().double().cpu().requires_grad_() for t in leaves]
    ref = reference(*leaves64)
    assert torch.allclose(o.detach().double().cpu(), ref, atol=1e-5)
    want = torch.autograd.grad((ref * probe.double().cpu()).sum(), leaves64)
    for name, a, b in zip(("q", "x", "v"), second, want):
        assert torch.allclose(a.double().cpu(), b, atol=1e-4), name
    # log_a's gradient on the groups' first rows (the others hold 0 by the layout, their gradient is the kernel's)
    assert torch.allclose(second[3][:, ::S].double().cpu(), want[3][:, ::S], atol=1e-4)


# ---- scalar- and column-decay ops, step kernels (no kernel runs) ----

@pytest.mark.parametrize("op", [scalar_decay_chunk, column_decay_chunk])
def test_decay_ops_refuse_a_chunk_size_outside_the_supported_ones(op):
    q = torch.zeros(1, 16, 1, 16)
    eta = torch.zeros(1, 16, 1) if op is scalar_decay_chunk else torch.zeros(1, 16, 1, 16)
    for chunk in (8, 256):
        with pytest.raises(ValueError) as info:
            op(q, q, q, eta, eta, None, read_after=True, chunk_size=chunk)
        assert str(info.value) == f"chunk_size must be one of {CHUNKS} for the Triton kernels, got {chunk}"


def _column_steps(**kw):
    q = torch.zeros(1, 4, 1, 16)
    args = dict(first=None, valid=None, shift=True, eps=1e-6, decay_floor=1e-3, normalize=True, scale_ridge=False,
                read_after=True, chunk_size=16)
    args.update(kw)
    return column_delta.column_delta_steps(q, q, torch.zeros(1, 4, 1, 8), torch.ones(1, 4, 1, 8),
                                           torch.ones(1, 4, 1), None, None, **args)


def test_column_delta_steps_refusals_name_their_switch():
    with pytest.raises(ValueError) as info:
        _column_steps(chunk_size=8)
    assert str(info.value) == f"chunk_size must be one of {CHUNKS} for the Triton kernels, got 8"
    with pytest.raises(ValueError) as info:  # the kernel shifts fixed-length rows only
        _column_steps(cu_seqlens=torch.tensor([0, 1, 4]))
    assert str(info.value) == ("shift=True shifts fixed-length rows in the kernel; with cu_seqlens pass the shifted "
                               "features as k, shift=False and their validity")
    with pytest.raises(ValueError) as info:
        _column_steps(shift=False, first=torch.zeros(1, 1, 16))
    assert str(info.value) == "first (the carried last key) goes with shift=True"


def test_column_delta_takes_the_factors_of_eta_both_or_neither():
    q, eta = torch.zeros(1, 4, 1, 16), torch.zeros(1, 4, 1, 16)
    for beta, scale, got in ((None, torch.ones(1, 4, 1), "beta=None and eta_scale=a tensor"),
                             (eta, None, "beta=a tensor and eta_scale=None")):
        with pytest.raises(ValueError) as info:
            column_delta.column_delta_chunk(q, q, q, eta, None, eta, None, read_after=True, chunk_size=16,
                                            beta=beta, eta_scale=scale)
        assert str(info.value) == f"beta and eta_scale go together (the factors of eta = beta * eta_scale), got {got}"
    with pytest.raises(ValueError) as info:  # beta of the wrong shape, eta_scale right
        column_delta.column_delta_chunk(q, q, q, eta, None, eta, None, read_after=True, chunk_size=16,
                                        beta=eta[..., :8], eta_scale=torch.ones(1, 4, 1))
    assert str(info.value) == ("beta must have eta's shape (1, 4, 1, 16) and eta_scale (1, 4, 1), got (1, 4, 1, 8) "
                               "and (1, 4, 1)")
    with pytest.raises(ValueError, match=r"got \(1, 4, 1, 16\) and \(1, 4\)$"):  # eta_scale of the wrong shape
        column_delta.column_delta_chunk(q, q, q, eta, None, eta, None, read_after=True, chunk_size=16,
                                        beta=eta, eta_scale=torch.ones(1, 4))


def test_step_kernels_key_block_is_capped_by_the_head_dim():
    x = torch.zeros(1, 1, 3, 8)
    for name in ("step_fwd", "step_bwd"):
        table = step_sizes.LAUNCH[name]
        assert step_sizes._launch(name, x, 8) == dict(H=3, K=8, BR=table["BR"], BK=16, num_warps=table["num_warps"])
        assert step_sizes._launch(name, x, 40)["BK"] == 64
        assert step_sizes._launch(name, x, 300)["BK"] == table["BK"]
    c = step_sizes._column_launch(x, 8, 20)
    assert (c["H"], c["K"], c["V"], c["BK"], c["BV"]) == (3, 8, 20, 16, 32)
    assert step_sizes._column_launch(x, 500, 500)["BK"] == step_sizes.COLUMN_LAUNCH["BK"]


def test_first_key_of_the_wrong_shape_is_refused():
    k = torch.zeros(2, 5, 3, 4)
    step_sizes.check_first(None, k)
    step_sizes.check_first(torch.zeros(2, 3, 4), k)
    with pytest.raises(ValueError) as info:
        step_sizes.check_first(torch.zeros(2, 5, 4), k)
    assert str(info.value) == "first (the carried last key) must have shape (2, 3, 4) = [B, H, K], got (2, 5, 4)"


# ---- recurrent: the fused kernel's refusals at their bounds (no kernel runs) ----

def _fused_args(K=16, **grad):
    q = torch.zeros(1, 2, 1, K)
    beta, lam = torch.ones(1, 2, 1), torch.ones(1, 2, 1)
    args = dict(q=q, k=q.clone(), v=torch.zeros(1, 2, 1, 8), beta=beta, lam=lam, log_gate=None)
    for name in grad:
        args[name] = args[name].clone().requires_grad_()
    return args


def test_fused_window_and_head_dim_limits_hold_at_their_bounds(monkeypatch):
    monkeypatch.setattr(api, "_interpreting", lambda: True)  # the device check passes for CPU tensors here
    a = _fused_args(K=recurrent.MAX_FUSED_HEAD_DIM)
    recurrent._check_fused(get_rule("3A"), 16, *a.values(), None, 1e-3)  # window 16 and K = 256 are taken
    with pytest.raises(NotImplementedError) as info:
        recurrent._check_fused(get_rule("3"), 17, *a.values(), None, 1e-3)
    assert str(info.value) == "window=17 is above 16, the largest the fused recurrent kernel unrolls"
    wide = _fused_args(K=257)
    with pytest.raises(NotImplementedError) as info:
        recurrent._check_fused(get_rule("1"), 1, *wide.values(), None, 1e-3)
    assert str(info.value) == "head dim K=257 is above 256, the largest the fused recurrent kernel holds in one tile"


@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "lam"])
def test_a_gradient_of_any_input_is_refused(monkeypatch, name):
    monkeypatch.setattr(api, "_interpreting", lambda: True)
    a = _fused_args(**{name: True})
    assert recurrent.wants_gradient(tuple(a.values()), None)
    with torch.no_grad():
        assert not recurrent.wants_gradient(tuple(a.values()), None)
    with pytest.raises(NotImplementedError, match="computes no gradients"):
        recurrent._check_fused(get_rule("1A"), 1, *a.values(), None, 1e-3)


def test_fused_step_refuses_queries_of_a_segment():
    q = torch.zeros(1, 2, 1, 16)
    with pytest.raises(ValueError) as info:
        recurrent.falcon_step_triton(q, q, q, q[..., 0], q[..., 0])
    assert str(info.value) == "q must have shape [B, H, K], got (1, 2, 1, 16)"


@kernels
def test_fused_segment_of_a_non_sliding_rule_keeps_one_slot_and_an_fp32_last_key():
    """``window`` (default 4) is ignored by the non-sliding rules: the final state has ``window=1`` and
    no tail; with 16-bit keys the carried last key is fp32, like the state (``k``'s last row, exactly)."""
    from falcon_fwa import falcon_attention

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 3, 1, 16, generator=g) / 4 for _ in range(3))
    beta, lam = 0.5 + torch.rand(1, 3, 1, generator=g), torch.rand(1, 3, 1, generator=g)
    q16, k16, v16 = (t.half().to(DEVICE) for t in (q, k, v))
    o, final = recurrent.falcon_recurrent_triton(q16, k16, v16, beta.to(DEVICE), lam.to(DEVICE), rule="1",
                                                 output_final_state=True)
    assert final.window == 1 and final.tail_x is None and final.tail_y is None and final.tail_valid is None
    assert final.last_key.dtype == torch.float32 and torch.equal(final.last_key, k16[:, -1].float())
    ref_o, ref = falcon_attention(q16.double().cpu(), k16.double().cpu(), v16.double().cpu(), beta.double(),
                                  lam.double(), rule="1", form="recurrent", backend="torch", output_final_state=True)
    assert torch.allclose(final.S.double().cpu(), ref.S, atol=1e-4)
    assert torch.allclose(o.double().cpu(), ref_o, atol=2e-3)  # o in fp16


@kernels
def test_fused_steps_of_a_non_sliding_rule_continue_under_the_default_window():
    """``falcon_step_triton`` with the default ``window=4``: a state of a non-sliding rule (made with
    ``window=1``) is taken back, and two steps give the float64 recurrent form's outputs of two tokens."""
    from falcon_fwa import falcon_attention

    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, 2, 1, 16, generator=g) / 4 for _ in range(3))
    beta, lam = 0.5 + torch.rand(1, 2, 1, generator=g), torch.rand(1, 2, 1, generator=g)
    dev = [t.to(DEVICE) for t in (q, k, v, beta, lam)]
    o0, state = recurrent.falcon_step_triton(*(t[:, 0] for t in dev), rule="1A")
    assert state.window == 1
    o1, state = recurrent.falcon_step_triton(*(t[:, 1] for t in dev), state=state, rule="1A")
    ref_o, ref = falcon_attention(q.double(), k.double(), v.double(), beta.double(), lam.double(), rule="1A",
                                  form="recurrent", backend="torch", output_final_state=True)
    assert torch.allclose(torch.stack([o0, o1], 1).double().cpu(), ref_o, atol=1e-5)
    assert torch.allclose(state.S.double().cpu(), ref.S, atol=1e-5)
