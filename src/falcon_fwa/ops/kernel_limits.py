"""The shapes the Triton kernels take, defined once and without importing ``triton``.

The kernel modules (``ops.triton``: their package imports ``triton``) refuse past these limits and keep
each name as a module attribute (``ops.triton.launch.SUPPORTED_CHUNK_SIZES``, ``ops.triton.delta.SLOT_COUNTS``,
``ops.triton.sliding.MAX_WINDOW``, ``ops.triton.api.MAX_WY_HEAD_DIM``, ``ops.triton.recurrent.MAX_FUSED_WINDOW``
and ``MAX_FUSED_HEAD_DIM``); the model config refuses a ``backend="triton"`` model past them when it is built,
and its layers decode on the PyTorch step where the fused step kernel does not hold a shape the chunk kernels take
(``FalconAttention.step_backend``).
"""
from __future__ import annotations

__all__ = ["SUPPORTED_CHUNK_SIZES", "SLOT_COUNTS", "MAX_WY_HEAD_DIM", "MAX_WINDOW", "MAX_FUSED_WINDOW",
           "MAX_FUSED_HEAD_DIM"]

SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)  # the chunk sizes of every chunk kernel
# Writes per step the WY kernels group (16-row blocks of the inverse): the windows of rule 3's chunk kernels.
SLOT_COUNTS = (1, 2, 4, 8, 16)
MAX_WY_HEAD_DIM = 256  # the regression kernels (rules 1, 2, 3) keep the whole key dimension in one tile
# Rule 3A's chunk kernels: the widest window tested on the GPU (the gain kernels of ``ops.triton.sliding`` hold
# [_BT, W] tiles in registers).
MAX_WINDOW = 65
MAX_FUSED_WINDOW = 16  # the fused recurrent kernel (rules 3 and 3A): window slots are unrolled in the kernel
MAX_FUSED_HEAD_DIM = 256  # the fused recurrent kernel: the program holds the whole key dimension of its state columns
