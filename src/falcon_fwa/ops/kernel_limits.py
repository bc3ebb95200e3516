"""The shapes the Triton kernels take, defined once and without importing ``triton``.

The kernel modules (``ops.triton``: their package imports ``triton``) refuse past these limits and keep
each name as a module attribute (``ops.triton.launch.SUPPORTED_CHUNK_SIZES``, ``ops.triton.delta.SLOT_COUNTS``,
``ops.triton.sliding.MAX_WINDOW``, ``ops.triton.api.MAX_WY_HEAD_DIM``, ``ops.triton.recurrent.MAX_FUSED_WINDOW``
and ``MAX_FUSED_HEAD_DIM``); the model config refuses a ``backend="triton"`` model past them when it is built,
and its layers decode on the PyTorch step where the fused step kernel does not hold a shape the chunk kernels take
(``FalconAttention.step_backend``). The oldest Triton the kernels take is here too (``triton_refusal``): the kernels'
package refuses an older one when it is imported, and the tests skip what needs the kernels there.
"""
from __future__ import annotations

import re
from typing import Optional

__all__ = ["SUPPORTED_CHUNK_SIZES", "SLOT_COUNTS", "MAX_WY_HEAD_DIM", "MAX_WINDOW", "MAX_FUSED_WINDOW",
           "MAX_FUSED_HEAD_DIM", "MIN_TRITON", "TRITON_REFUSED", "triton_refusal"]

SUPPORTED_CHUNK_SIZES = (16, 32, 64, 128)  # the chunk sizes of every chunk kernel
# Writes per step the WY kernels group (16-row blocks of the inverse): the windows of rule 3's chunk kernels.
SLOT_COUNTS = (1, 2, 4, 8, 16)
MAX_WY_HEAD_DIM = 256  # the regression kernels (rules 1, 2, 3) keep the whole key dimension in one tile
# Rule 3A's chunk kernels: the widest window tested on the GPU (the gain kernels of ``ops.triton.sliding`` hold
# [_BT, W] tiles in registers).
MAX_WINDOW = 65
MAX_FUSED_WINDOW = 16  # the fused recurrent kernel (rules 3 and 3A): window slots are unrolled in the kernel
MAX_FUSED_HEAD_DIM = 256  # the fused recurrent kernel: the program holds the whole key dimension of its state columns

# Triton 3.0 and 3.1 (pinned by torch 2.4 and 2.5) cannot build the kernels: their ``tl.arange`` takes only literal
# bounds. The kernels were checked on GPUs with Triton 3.6.
MIN_TRITON = (3, 2)
TRITON_REFUSED = "falcon_fwa's Triton kernels need triton"  # how the refusal of an older Triton begins


def _release(version: str) -> tuple:
    """``(major, minor)`` of a version string such as ``"3.6.0"`` or ``"3.2.0+git1234"`` (``(0, 0)`` if it has none)."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else (0, 0)


def triton_refusal(version: str) -> Optional[str]:
    """Why the kernels cannot run on Triton ``version`` (the message of the ``ImportError`` that importing
    ``ops.triton`` raises there), or ``None`` where they take it."""
    if _release(version) >= MIN_TRITON:
        return None
    return (f"{TRITON_REFUSED} >= {'.'.join(map(str, MIN_TRITON))} (checked on GPUs with 3.6), and triton {version} "
            "is installed (torch 2.4 and 2.5 pin 3.0 and 3.1): backend='auto' runs the PyTorch forms; for the "
            "kernels, install a torch that brings a newer triton")
