"""The op's choice between the Triton kernels and the PyTorch forms, and the kernels' chunk layout.

Pinned here, on tiny shapes and without running a kernel:

* ``backend="auto"`` takes the chunk kernels only for a query on CUDA and only for a rule in
  ``GPU_CHECKED_RULES``; ``backend="triton"`` asks for them whatever the device, dtype
  or rule. On CPU tensors ``"auto"`` runs neither the chunk kernels nor the fused step kernel.
* ``chunk_layout``: ``ceil(length / BT)`` chunks per sequence, the last partial chunk counted, for
  fixed-length rows and packed sequences, with the ``(sequence, chunk)`` rows and offsets.
* Packed sequences need one row (``B = 1``) on both backends, ``q`` named as the argument at fault.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take

from falcon_fwa.ops import api as ops_api  # noqa: E402
from falcon_fwa.ops import falcon_attention, falcon_step  # noqa: E402
import falcon_fwa.ops.triton as ops_triton  # noqa: E402
from falcon_fwa.ops.triton import api as triton_api  # noqa: E402
from falcon_fwa.ops.triton.chunk_index import chunk_layout  # noqa: E402

needs_interpreter = pytest.mark.skipif(not triton_api._interpreting() and not torch.cuda.is_available(),
                                       reason="the kernels' CPU checks need TRITON_INTERPRET=1 at import")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _CudaLike(torch.Tensor):
    """A CPU tensor that answers ``is_cuda`` as a GPU tensor would: only the dispatch reads it here."""

    @property
    def is_cuda(self):
        return True


def _inputs(B=1, T=5, H=1, K=4, V=3, rule="1A", dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, T, H, K, generator=g, dtype=dtype).to(device) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=g, dtype=dtype).to(device)
    beta = torch.rand(*((B, T, H, V) if rule in ("2", "2A") else (B, T, H)), generator=g, dtype=dtype).to(device)
    lam = torch.rand(B, T, H, generator=g, dtype=dtype).to(device)
    return q, k, v, beta, lam


def test_auto_takes_the_chunk_kernels_only_for_a_checked_rule_on_a_cuda_query(monkeypatch):
    cuda_q = torch.zeros(1, 2, 1, 4).as_subclass(_CudaLike)
    assert cuda_q.is_cuda
    for rule in ops_triton.GPU_CHECKED_RULES:
        assert ops_api._triton_chunk("auto", cuda_q, rule) is ops_triton.falcon_chunk_triton, rule
    assert ops_api._triton_chunk("auto", torch.zeros(1, 2, 1, 4), "1A") is None  # a CPU query
    monkeypatch.setattr(ops_triton, "GPU_CHECKED_RULES", ("1",))
    assert ops_api._triton_chunk("auto", cuda_q, "1A") is None  # kernels not checked on a GPU
    assert ops_api._triton_chunk("auto", cuda_q, "1") is ops_triton.falcon_chunk_triton
    for q in (cuda_q, torch.zeros(1, 2, 1, 4), cuda_q.double()):  # "triton" asks for the kernels anyway (rule 1A too)
        assert ops_api._triton_chunk("triton", q, "1A") is ops_triton.falcon_chunk_triton


def test_auto_on_cpu_runs_neither_the_chunk_kernels_nor_the_step_kernel(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a kernel was called for CPU tensors under backend='auto'")

    for name in ("falcon_chunk_triton", "falcon_recurrent_triton", "falcon_step_triton"):
        monkeypatch.setattr(ops_triton, name, refuse)
    q, k, v, beta, lam = _inputs()
    o, _ = falcon_attention(q, k, v, beta, lam, rule="1A", backend="auto", chunk_size=16)
    ref, _ = falcon_attention(q, k, v, beta, lam, rule="1A", backend="torch", chunk_size=16)
    torch.testing.assert_close(o, ref, rtol=0, atol=0)
    step = [t[:, 0] for t in (q, k, v, beta, lam)]
    o1, _ = falcon_step(*step, rule="1A", backend="auto")
    r1, _ = falcon_step(*step, rule="1A", backend="torch")
    torch.testing.assert_close(o1, r1, rtol=0, atol=0)


def test_chunk_layout_counts_the_last_partial_chunk():
    for T, BT, nt in ((1, 16, 1), (16, 16, 1), (17, 16, 2), (64, 64, 1), (65, 32, 3)):
        lay = chunk_layout(3, T, BT, None)
        assert (lay.N, lay.num_chunks, lay.max_chunks, lay.varlen) == (3, 3 * nt, nt, False), (T, BT)
    cu = torch.tensor([0, 16, 17, 50, 51], dtype=torch.int64)  # lengths 16, 1, 33, 1
    lay = chunk_layout(1, 51, 16, cu)
    assert (lay.N, lay.num_chunks, lay.max_chunks, lay.varlen) == (4, 6, 3, True)
    assert lay.cu_seqlens.tolist() == [0, 16, 17, 50, 51] and lay.cu_seqlens.dtype == torch.int32
    assert lay.chunk_offsets.tolist() == [0, 1, 2, 5, 6]
    assert lay.chunk_indices.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2], [3, 0]]


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
def test_packed_sequences_need_one_row(backend):
    q, k, v, beta, lam = _inputs(B=2, T=6, device=DEVICE)
    cu = torch.tensor([0, 2, 6], device=DEVICE)
    with pytest.raises(ValueError, match=r"^q must have shape \[1, total, H, K\] with cu_seqlens"):
        falcon_attention(q, k, v, beta, lam, rule="1A", backend=backend, chunk_size=16, cu_seqlens=cu)

