"""Launch settings shared by the chunk kernels: chunk sizes, dot precision, block
sizes and warps per kernel, and the layout arguments every chunk kernel takes."""
from __future__ import annotations

from typing import Optional

import torch

from ..kernel_limits import SUPPORTED_CHUNK_SIZES
from .chunk_index import ChunkLayout

__all__ = ["SUPPORTED_CHUNK_SIZES", "LAUNCH", "cdiv", "next_power_of_2", "dot_precision", "launch_config", "empty_buffer",
           "layout_args", "interpreted"]

# Per kernel: key/value block sizes (capped by the head dims), warps, pipeline stages.
LAUNCH = {
    "state_fwd": dict(BK=64, BV=64, num_warps=4, num_stages=2),
    "output_fwd": dict(BK=64, BV=64, num_warps=4, num_stages=2),
    "state_bwd": dict(BK=64, BV=64, num_warps=4, num_stages=2),
    "dv_bwd": dict(BK=64, BV=64, num_warps=4, num_stages=2),
    "dqk_bwd": dict(BK=64, BV=64, num_warps=4, num_stages=2),
}


COMPILE_FOR_GPU = False
"""Set by ``benchmarks/kernel_resources.py``, which compiles the launches for a GPU from CPU tensors:
:func:`interpreted` then answers ``False``, so that it sees the GPU's block sizes."""


def interpreted(t: torch.Tensor) -> bool:
    """Whether the kernels on ``t`` run through Triton's interpreter (a CPU tensor), whose cost is per
    program and op rather than per element: the element-wise kernels take their largest blocks there."""
    return not t.is_cuda and not COMPILE_FOR_GPU


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for grid sizes. Plain integer arithmetic: ``triton.cdiv`` goes through
    Triton's function wrapper, several microseconds per call on the host, and a training
    step makes dozens of these calls per layer."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (``n >= 1``), for block sizes; see ``cdiv``."""
    return 1 << (n - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """The ``input_precision`` of the kernels' dots. 16-bit inputs use the tensor cores (fp32
    accumulation). fp32 inputs follow PyTorch's float32 matmul setting, as cuBLAS does: exact fp32
    products ("ieee", FMA units) under ``torch.get_float32_matmul_precision() == "highest"`` (the
    default), TF32 tensor cores under "high" or "medium"
    (``torch.set_float32_matmul_precision("high")``; about 10 bits of mantissa per product)."""
    if dtype != torch.float32:
        return "tf32"
    return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def launch_config(name: str, K: int, V: int, table: Optional[dict] = None) -> dict:
    """``table[name]`` (default ``LAUNCH``) with its block sizes ``BK`` / ``BV`` capped by the head dims."""
    c = dict((LAUNCH if table is None else table)[name])
    for block, dim in (("BK", K), ("BV", V)):
        if block in c:
            c[block] = min(c[block], max(16, next_power_of_2(dim)))
    return c


def empty_buffer(shape, like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Uninitialized buffer on ``like``'s device (every element the kernels read is written first)."""
    return torch.empty(shape, dtype=like.dtype if dtype is None else dtype, device=like.device)


def layout_args(layout: ChunkLayout) -> dict:
    return dict(cu_seqlens=layout.cu_seqlens, chunk_offsets=layout.chunk_offsets, T=layout.T,
                BT=layout.BT, IS_VARLEN=layout.varlen)
