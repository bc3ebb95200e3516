"""Causal depthwise short convolution that restarts at every sequence boundary.

``y_t = SiLU(sum_{j=0}^{W-1} w_j * x_{t-W+1+j})`` per channel (``conv1d``'s order, as in
``nn.Conv1d`` with causal padding: the last tap ``w_{W-1}`` weights the current token ``x_t``), where
each ``x`` is taken from the same sequence, from the carried buffer (the last ``W-1`` inputs of the
cached prefix) when its step falls before the segment, or zero on a fresh sequence.

All layouts go through one valid (unpadded) ``conv1d``: each sequence is laid out
as ``[buffer (W-1 rows), tokens]`` back to back, so every output window lies inside
its own sequence; tokens of different packed sequences never mix. A decoding step
(dense rows of one token) has one window per row, summed directly against the kernel.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.api import cast_to
from ..ops.validate import check_positive_int
from .packing import Packing, layout_of

__all__ = ["ShortConv"]


class ShortConv(nn.Module):
    """Depthwise causal convolution of width ``W = kernel_size`` (default 4) over ``C = channels``,
    then SiLU (module docstring): ``forward(x, packing=None, buffer=None)`` maps ``x`` ``[B, T, C]`` to
    ``y`` ``[B, T, C]`` and the new buffer ``[B, W-1, C]`` (``packing=None``: dense rows)."""

    def __init__(self, channels: int, kernel_size: int = 4):
        super().__init__()
        for name, value in (("channels", channels), ("kernel_size", kernel_size)):
            check_positive_int(name, value)
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        self.reset_parameters()
        # A kernel drawn here is final: the model's weight initialization, which also draws the kernels a
        # checkpoint lacks (built on the meta device, they hold no values yet), leaves it as it is.
        self.weight._is_hf_initialized = not self.weight.is_meta

    def reset_parameters(self) -> None:
        """Draw the kernel ``[C, 1, W]`` as ``nn.Conv1d`` does (Kaiming-uniform, bound ``1 / sqrt(W)``)."""
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(
        self, x: torch.Tensor, packing: Optional[Packing] = None, buffer: Optional[torch.Tensor] = None
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[B, T, C]`` (dense) or ``[1, N_tok, C]`` (packed); ``buffer``
        ``[R, W-1, C]``: last inputs of each cache row (``None``: fresh sequences).

        Returns ``y`` like ``x`` and the new buffer (``[B, W-1, C]`` dense;
        ``[N, W-1, C]`` packed, one row per sequence, to be stored at ``packing.rows``). A packed call
        with a ``buffer`` refuses ``packing.rows`` outside ``0 .. R-1`` (``Packing.check_rows``).
        """
        W1 = self.kernel_size - 1
        C = x.shape[-1]
        if x.dim() != 3 or C != self.weight.shape[0]:
            raise ValueError(f"x must have shape [B, T, channels={self.weight.shape[0]}], got {tuple(x.shape)}")
        if x.shape[1] == 0:  # as the op refuses it; conv1d's own message would name a padded size
            raise ValueError(f"x must have at least one time step (T >= 1), got shape {tuple(x.shape)}")
        packing = layout_of(packing, x, name="x")
        if buffer is not None and (buffer.dim() != 3 or tuple(buffer.shape[1:]) != (W1, C)):
            raise ValueError(f"buffer must have shape [rows, kernel_size - 1 = {W1}, channels = {C}], "
                             f"got {tuple(buffer.shape)}")
        if not packing.packed:
            B = x.shape[0]
            if buffer is not None and buffer.shape[0] != B:
                raise ValueError(f"buffer must have one row per row of x ({B}), got {tuple(buffer.shape)}")
            buf = x.new_zeros(B, W1, C) if buffer is None else cast_to(buffer, x.dtype)
            ext = torch.cat([buf, x], dim=1)
            if x.shape[1] == 1:  # one token (decoding): the window's dot product with the kernel
                y = self._dot(ext)
            else:
                y = self._conv(ext)
            return F.silu(y), ext[:, ext.shape[1] - W1:]
        cu, N = packing.cu_seqlens, packing.num_sequences
        total = x.shape[1]
        if buffer is not None:  # each sequence continues a row the buffer holds (a ValueError naming ``rows``)
            packing.check_rows(buffer.shape[0])
        buf = x.new_zeros(N, W1, C) if buffer is None else cast_to(buffer, x.dtype)[packing.rows]
        # Position of token j of sequence n in the extended layout: j + (n + 1) * (W - 1).
        tok_dest = torch.arange(total, device=x.device) + (packing.seq_ids + 1) * W1
        seg_start = cu[:-1] + torch.arange(N, device=x.device) * W1  # where each buffer block begins
        buf_dest = (seg_start[:, None] + torch.arange(W1, device=x.device)[None, :]).flatten()
        ext = x.new_zeros(total + N * W1, C)
        ext = ext.index_copy(0, tok_dest, x[0]).index_copy(0, buf_dest, buf.reshape(N * W1, C))
        y = self._conv(ext[None])[0]  # output i covers ext[i : i + W]
        y = y.index_select(0, tok_dest - W1)
        seg_end = cu[1:] + torch.arange(1, N + 1, device=x.device) * W1  # one past each segment
        tail_idx = (seg_end[:, None] - W1 + torch.arange(W1, device=x.device)[None, :]).flatten()
        new_buf = ext.index_select(0, tail_idx).view(N, W1, C)
        return F.silu(y)[None], new_buf

    def _dot(self, ext: torch.Tensor) -> torch.Tensor:
        """The one output of a window ``ext`` ``[B, W, C]`` -> ``[B, 1, C]``: per channel ``c``,
        ``sum_i w_{c,i} ext_{b,i,c}``, as one matrix product batched over the channels
        (``[C, B, W] @ [C, W, 1]``). It accumulates in at least float32 like the convolution, and for a
        single output costs a fraction of a depthwise ``conv1d`` call."""
        w = cast_to(self.weight, ext.dtype).transpose(1, 2)  # [C, W, 1]
        return torch.bmm(ext.permute(2, 0, 1), w).permute(1, 2, 0).contiguous()

    def _conv(self, ext: torch.Tensor) -> torch.Tensor:
        """Valid depthwise conv over ``ext`` ``[B, L, C]`` -> ``[B, L - W + 1, C]``: per channel ``c``,
        ``y_{b,t,c} = sum_j w_{c,j} ext_{b,t+j,c}``. One ``conv1d`` call when run eagerly; inside a
        ``torch.compile`` graph, ``_shifted_sum``."""
        if torch.compiler.is_compiling():
            return self._shifted_sum(ext)
        return F.conv1d(ext.transpose(1, 2), cast_to(self.weight, ext.dtype), groups=ext.shape[-1]).transpose(1, 2)

    def _shifted_sum(self, ext: torch.Tensor) -> torch.Tensor:
        """``_conv`` as the sum of ``W`` shifted products: the kernel rounded to the input's dtype, as
        the convolution takes it, and the sum accumulated in at least float32, as the convolution
        does. Inductor fuses it into one element-wise kernel forward and one backward, where the
        depthwise ``conv1d`` is an external call on a transposed layout (several times slower on a GPU
        at the model sizes of the presets)."""
        W = self.kernel_size
        L = ext.shape[1] - W + 1
        acc = torch.promote_types(ext.dtype, torch.float32)
        w = cast_to(self.weight[:, 0], ext.dtype).to(acc)  # [C, W], rounded to ext's dtype as in _conv
        y = ext[:, :L].to(acc) * w[:, 0]
        for j in range(1, W):
            y = y + ext[:, j:j + L].to(acc) * w[:, j]
        return y.to(ext.dtype)
