"""Triton kernels (CUDA; on CPU through ``TRITON_INTERPRET=1``): the chunk form
``falcon_chunk_triton`` (training and prefill), the fused recurrent form
``falcon_recurrent_triton`` (short prompts) and its decoding step ``falcon_step_triton``.
Import lazily: importing this package imports ``triton``. With a Triton older than ``MIN_TRITON`` (torch 2.4 and
2.5 pin 3.0 and 3.1, whose ``tl.arange`` takes only literal bounds) the kernels cannot be built: importing this
package raises ``ImportError`` naming both versions, so ``backend="auto"`` runs the PyTorch forms and
``backend="triton"`` says why it cannot run. The kernels were checked on GPUs with Triton 3.6.
"""
import re as _re

import triton as _triton

MIN_TRITON = (3, 2)


def _release(version: str) -> tuple:
    """``(major, minor)`` of a version string such as ``"3.6.0"`` or ``"3.2.0+git1234"`` (``(0, 0)`` if it has none)."""
    m = _re.match(r"(\d+)\.(\d+)", version)
    return (int(m[1]), int(m[2])) if m else (0, 0)


if _release(_triton.__version__) < MIN_TRITON:
    raise ImportError(f"falcon_fwa's Triton kernels need triton >= {'.'.join(map(str, MIN_TRITON))} (checked on GPUs "
                      f"with 3.6), and triton {_triton.__version__} is installed (torch 2.4 and 2.5 pin 3.0 and 3.1): "
                      "backend='auto' runs the PyTorch forms; for the kernels, install a torch that brings a newer "
                      "triton")

from .api import GPU_CHECKED_RULES, TRITON_DTYPES, TRITON_RULES, falcon_chunk_triton
from .recurrent import SHORT_PROMPT_LIMITS, STEP_RULES, falcon_recurrent_triton, falcon_step_triton, wants_gradient

__all__ = ["falcon_chunk_triton", "falcon_recurrent_triton", "falcon_step_triton", "TRITON_RULES", "GPU_CHECKED_RULES",
           "STEP_RULES", "SHORT_PROMPT_LIMITS", "TRITON_DTYPES", "wants_gradient"]
