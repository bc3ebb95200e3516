"""The host-side glue of the Triton kernels held to what its docstrings and ``docs/ops.md`` state:
the chunk bookkeeping of ``ops.triton.chunk_index`` (chunk counts and ``(sequence, chunk)`` rows of
hand-picked ``cu_seqlens``, worked out by hand), the launch settings of ``ops.triton.launch`` (block
sizes capped by the head dims, buffers, dot precision, layout arguments), the refusals of
``ops.triton.api`` (each naming the argument at fault, with the limits exactly at their bounds), the
pairs of ``api._shifted_keys`` and the messages of ``ops.triton.checks.assert_ranges``. Most cases
run no kernel; the few that do (marked) take a handful of elements through the interpreter."""
from __future__ import annotations

import pytest
import torch

from test_triton_interpreter import FRESH_PROCESS_REASON, prepare_interpreter

from falcon_fwa.ops.state import FalconState
from falcon_fwa.ops.triton import api, launch
from falcon_fwa.ops.triton.chunk_index import chunk_layout

KERNELS_RUN = prepare_interpreter()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
kernels = pytest.mark.skipif(not KERNELS_RUN, reason=FRESH_PROCESS_REASON)


# ---- chunk_index ----

def test_fixed_length_layout_counts_partial_chunks():
    lay = chunk_layout(3, 13, 4, None)  # 13 steps in chunks of 4: 4 chunks (the last one step), per row
    assert (lay.N, lay.T, lay.BT, lay.num_chunks, lay.max_chunks) == (3, 13, 4, 12, 4)
    assert not lay.varlen and lay.cu_seqlens is None and lay.chunk_offsets is None and lay.chunk_indices is None
    assert chunk_layout(2, 16, 16, None).num_chunks == 2  # whole chunks: no extra one


def test_packed_layout_of_hand_picked_lengths():
    cu = torch.tensor([0, 3, 12, 13, 17])  # lengths 3, 9, 1, 4 in chunks of 4: 1, 3, 1, 1 chunks
    lay = chunk_layout(1, 17, 4, cu)
    assert lay.varlen and (lay.N, lay.T, lay.BT, lay.num_chunks, lay.max_chunks) == (4, 17, 4, 6, 3)
    assert lay.cu_seqlens.dtype == lay.chunk_offsets.dtype == lay.chunk_indices.dtype == torch.int32
    assert lay.cu_seqlens.tolist() == [0, 3, 12, 13, 17]
    assert lay.chunk_offsets.tolist() == [0, 1, 4, 5, 6]
    assert lay.chunk_indices.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [3, 0]]
    # the same sequences in chunks of 16: one chunk each, a layout of its own (not the one above)
    wide = chunk_layout(1, 17, 16, cu)
    assert wide.BT == 16 and wide.num_chunks == 4 and wide.max_chunks == 1
    assert wide.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [3, 0]]


def test_layout_args_hand_the_kernels_the_layout():
    cu = torch.tensor([0, 5, 7])
    lay = chunk_layout(1, 7, 4, cu)
    args = launch.layout_args(lay)
    assert set(args) == {"cu_seqlens", "chunk_offsets", "T", "BT", "IS_VARLEN"}
    assert args["cu_seqlens"] is lay.cu_seqlens and args["chunk_offsets"] is lay.chunk_offsets
    assert (args["T"], args["BT"], args["IS_VARLEN"]) == (7, 4, True)
    fixed = launch.layout_args(chunk_layout(2, 40, 16, None))
    assert (fixed["T"], fixed["BT"], fixed["IS_VARLEN"], fixed["cu_seqlens"]) == (40, 16, False, None)


# ---- launch ----

def test_launch_config_caps_each_block_by_its_own_head_dim():
    # BK follows K and BV follows V: the next power of two, at least 16, at most the table's 64
    assert launch.launch_config("state_fwd", 8, 200) == dict(BK=16, BV=64, num_warps=4, num_stages=2)
    assert launch.launch_config("dqk_bwd", 40, 20) == dict(BK=64, BV=32, num_warps=4, num_stages=2)
    assert launch.launch_config("output_fwd", 17, 3)["BK"] == 32 and launch.launch_config("output_fwd", 17, 3)["BV"] == 16
    table = {"wide": dict(BK=128, num_warps=8)}  # a table of its own; entries without BV keep none
    assert launch.launch_config("wide", 50, 7, table) == dict(BK=64, num_warps=8)
    assert launch.launch_config("wide", 300, 7, table) == dict(BK=128, num_warps=8)
    assert launch.LAUNCH["state_fwd"]["BK"] == 64  # the shared table itself is left as it was


def test_empty_buffer_dtype_and_device():
    like = torch.zeros(2, dtype=torch.bfloat16)
    assert launch.empty_buffer((3, 4), like).dtype == torch.bfloat16
    buf = launch.empty_buffer((3, 4), like, torch.float32)
    assert buf.dtype == torch.float32 and buf.shape == (3, 4) and buf.device == like.device


def test_dot_precision_and_interpreted(monkeypatch):
    assert launch.dot_precision(torch.bfloat16) == launch.dot_precision(torch.float16) == "tf32"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert launch.dot_precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("medium")
        assert launch.dot_precision(torch.float32) == "tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    cpu = torch.zeros(1)
    assert launch.interpreted(cpu)
    monkeypatch.setattr(launch, "COMPILE_FOR_GPU", True)
    assert not launch.interpreted(cpu)


def test_interpreting_needs_the_variable_set(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not api._interpreting()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not api._interpreting()


# ---- api: refusals ----

def _args(K=16, dtype=torch.float32):
    q = torch.zeros(1, 4, 1, K, dtype=dtype)
    beta, lam = torch.zeros(1, 4, 1), torch.zeros(1, 4, 1)
    return q, q, q, beta, lam, None


@pytest.mark.parametrize("name", ["q", "k", "v", "beta", "lam", "log_gate"])
def test_dtype_refusal_names_the_argument_that_holds_float64(name):
    q, k, v, beta, lam, _ = _args()
    args = dict(q=q, k=k, v=v, beta=beta, lam=lam, log_gate=torch.zeros(1, 4, 1))
    args[name] = args[name].double()
    with pytest.raises(NotImplementedError) as info:
        api.check_kernel_dtypes("the Triton kernels", *args.values())
    assert str(info.value).startswith(f"{name}.dtype=torch.float64 is not supported by the Triton kernels"), info.value
    if name == "q":  # the first tensor under the name the caller gives it
        with pytest.raises(NotImplementedError, match=r"^keys\.dtype=torch\.float64"):
            api.check_kernel_dtypes("the step kernel", *args.values(), query="keys")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kernel_dtypes_are_taken(dtype):
    q, k, v, _, _, _ = _args(dtype=dtype)
    g = torch.zeros(1, 4, 1, dtype=dtype)
    api.check_kernel_dtypes("the Triton kernels", q, k, v, g, g, g)  # no exception


def test_limits_hold_exactly_at_their_bounds(monkeypatch):
    monkeypatch.setattr(api, "_interpreting", lambda: True)  # the device check passes for CPU tensors here
    q, k, v, beta, lam, g = _args(K=api.MAX_WY_HEAD_DIM)
    for rule in ("1", "2", "3"):  # K = 256 is taken by the regression rules, 257 is not
        api._check_supported(q, k, v, beta, lam, g, rule, 64, None, 1e-3)
    wide = torch.zeros(1, 4, 1, 257)
    for rule in ("1", "2", "3"):
        with pytest.raises(NotImplementedError, match=f"^head dim K=257 is above 256, the largest the rule-{rule} "):
            api._check_supported(wide, wide, wide, beta, lam, g, rule, 64, None, 1e-3)
    for rule in ("1A", "2A", "3A"):  # the masked-attention rules take any key dim
        api._check_supported(wide, wide, wide, beta, lam, g, rule, 64, None, 1e-3)
    for chunk in (16, 32, 64, 128):
        api._check_supported(q, k, v, beta, lam, g, "1A", chunk, None, 1e-3)
    for chunk in (8, 24, 256):
        with pytest.raises(NotImplementedError, match=f"^chunk_size={chunk} is not supported"):
            api._check_supported(q, k, v, beta, lam, g, "1A", chunk, None, 1e-3)
    api._check_supported(q, k, v, beta, lam, g, "1A", 64, None, 2.0 ** -24)  # the smallest floor taken
    with pytest.raises(NotImplementedError, match=r"^decay_floor=2\.98\d*e-08 is below 5\.96e-08"):
        api._check_supported(q, k, v, beta, lam, g, "1A", 64, None, 2.0 ** -25)
    state = FalconState(rule="1A", window=1, shift=True, S=torch.zeros(1, 1, 256, 256, dtype=torch.float64),
                        last_key=torch.zeros(1, 1, 256))
    with pytest.raises(NotImplementedError, match=r"^initial_state\.S\.dtype=float64 is not supported"):
        api._check_supported(q, k, v, beta, lam, g, "1A", 64, state, 1e-3)
    api._check_supported(q, k, v, beta, lam, g, "1A", 64, FalconState(
        rule="1A", window=1, shift=True, S=torch.zeros(1, 1, 256, 256), last_key=torch.zeros(1, 1, 256)), 1e-3)


def test_every_rule_has_chunk_kernels():
    from falcon_fwa.ops.rules import RULES
    assert sorted(api.TRITON_RULES) == sorted(RULES) == ["1", "1A", "2", "2A", "3", "3A"]


# ---- api: shifted keys; checks: assertion messages (a few elements through the kernels) ----

@kernels
def test_shifted_keys_of_fixed_rows_by_hand():
    k = torch.arange(2 * 3 * 1 * 2, dtype=torch.float32, device=DEVICE).reshape(2, 3, 1, 2) + 1
    x, valid = api._shifted_keys(k, False, None, [0])
    assert x is k and valid.all() and valid.shape == (2, 3)
    x, valid = api._shifted_keys(k, True, None, [0])
    assert torch.equal(x[:, 0], torch.zeros_like(k[:, 0])) and torch.equal(x[:, 1:], k[:, :2])
    assert valid.tolist() == [[False, True, True]] * 2
    last = torch.tensor([[[-1.0, -2.0]], [[-3.0, -4.0]]], device=DEVICE)  # [N, H, K]
    x, valid = api._shifted_keys(k, True, last, [0])
    assert torch.equal(x[:, 0], last) and torch.equal(x[:, 1:], k[:, :2]) and valid.all()


@kernels
def test_shifted_keys_of_packed_sequences_by_hand():
    k = torch.arange(1, 7, dtype=torch.float32, device=DEVICE).reshape(1, 6, 1, 1)  # sequences [0, 2), [2, 6)
    starts = torch.tensor([0, 2], device=DEVICE)
    x, valid = api._shifted_keys(k, True, None, starts)
    assert x.flatten().tolist() == [0, 1, 0, 3, 4, 5]
    assert valid.tolist() == [[False, True, False, True, True, True]]
    last = torch.tensor([[[10.0]], [[20.0]]], device=DEVICE)
    x, valid = api._shifted_keys(k, True, last, starts)
    assert x.flatten().tolist() == [10, 1, 20, 3, 4, 5] and valid.all()


@kernels
def test_assert_ranges_fails_with_the_message_of_the_bad_argument():
    """Through the interpreter, where a failed check raises in this process. On CUDA it is a device assertion,
    which ends the process's CUDA context (and every later test of the process with it): there
    ``test_triton_checks`` checks the messages in child processes."""
    if DEVICE == "cuda":
        pytest.skip("a device assertion ends this process's CUDA context: test_triton_checks checks it in a child")
    from falcon_fwa.ops.triton.checks import assert_ranges

    def run(lam, gate):
        assert_ranges(lam, gate, "lam must be finite", "log_gate must be <= 0")

    good_lam, good_gate = torch.ones(5, device=DEVICE), -torch.ones(5, device=DEVICE)
    run(good_lam, good_gate)
    run(good_lam, None)
    with pytest.raises(RuntimeError, match="lam must be finite"):
        run(torch.tensor([1.0, -1.0], device=DEVICE), good_gate)
    with pytest.raises(RuntimeError, match="log_gate must be <= 0"):
        run(good_lam, torch.tensor([0.0, 0.5], device=DEVICE))


@kernels
def test_direct_call_takes_a_state_of_a_non_sliding_rule_and_returns_the_last_key_under_shift():
    """``falcon_chunk_triton`` with ``validate=True``: ``window`` (default 4) is ignored by the non-sliding
    rules, so their states (made with ``window=1``) are taken; the final state's ``last_key`` is the last
    key under ``shift`` and ``None`` without it, and the output matches the PyTorch chunk form."""
    from falcon_fwa import falcon_attention
    from falcon_fwa.ops.triton.api import falcon_chunk_triton

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 5, 1, 16, generator=g) / 4 for _ in range(3))
    beta, lam = 0.5 + torch.rand(1, 5, 1, generator=g), torch.rand(1, 5, 1, generator=g)
    q, k, v, beta, lam = (t.to(DEVICE) for t in (q, k, v, beta, lam))
    for shift in (True, False):
        state = FalconState(rule="1A", window=1, shift=shift, S=0.1 * torch.ones(1, 1, 16, 16, device=DEVICE),
                            last_key=torch.ones(1, 1, 16, device=DEVICE) / 8 if shift else None)
        o, final = falcon_chunk_triton(q, k, v, beta, lam, rule="1A", chunk_size=16, shift=shift,
                                       initial_state=state, output_final_state=True)
        ref, _ = falcon_attention(q.double(), k.double(), v.double(), beta.double(), lam.double(), rule="1A",
                                  form="chunk", chunk_size=16, shift=shift, backend="torch",
                                  initial_state=FalconState(rule="1A", window=1, shift=shift, S=state.S.double(),
                                                            last_key=None if not shift else state.last_key.double()))
        assert torch.allclose(o.double(), ref, atol=1e-4), shift
        if shift:
            assert torch.equal(final.last_key, k[:, -1].float())
        else:
            assert final.last_key is None
