"""Triton kernels (CUDA; on CPU through ``TRITON_INTERPRET=1``): the chunk form
``falcon_chunk_triton`` (training and prefill) and the fused decoding step
``falcon_step_triton``. Import lazily: importing this package imports ``triton``.
"""
from .api import GPU_CHECKED_RULES, TRITON_DTYPES, TRITON_RULES, falcon_chunk_triton
from .recurrent_step import STEP_RULES, falcon_step_triton

__all__ = ["falcon_chunk_triton", "falcon_step_triton", "TRITON_RULES", "GPU_CHECKED_RULES", "STEP_RULES",
           "TRITON_DTYPES"]
