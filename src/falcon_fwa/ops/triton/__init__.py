"""Triton kernels (CUDA; on CPU through ``TRITON_INTERPRET=1``): the chunk form
``falcon_chunk_triton`` (training and prefill), the fused recurrent form
``falcon_recurrent_triton`` (short prompts) and its decoding step ``falcon_step_triton``.
Import lazily: importing this package imports ``triton``. With a Triton older than the kernels take
(``ops.kernel_limits.MIN_TRITON``) it raises ``ImportError`` naming both versions (``kernel_limits.triton_refusal``),
so ``backend="auto"`` runs the PyTorch forms and ``backend="triton"`` says why it cannot run.
"""
import triton as _triton

from ..kernel_limits import triton_refusal as _triton_refusal

_refused = _triton_refusal(_triton.__version__)
if _refused is not None:
    raise ImportError(_refused)

from .api import GPU_CHECKED_RULES, TRITON_DTYPES, TRITON_RULES, falcon_chunk_triton
from .recurrent import SHORT_PROMPT_LIMITS, STEP_RULES, falcon_recurrent_triton, falcon_step_triton, wants_gradient

__all__ = ["falcon_chunk_triton", "falcon_recurrent_triton", "falcon_step_triton", "TRITON_RULES", "GPU_CHECKED_RULES",
           "STEP_RULES", "SHORT_PROMPT_LIMITS", "TRITON_DTYPES", "wants_gradient"]
