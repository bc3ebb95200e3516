"""SwiGLU feed-forward block: ``W_down (SiLU(W_gate x) * W_up x)``, no biases."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SwiGLU"]


class SwiGLU(nn.Module):
    """``down(silu(gate(h)) * up(h))``: ``[..., hidden_size]`` -> ``[..., hidden_size]``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden]`` -> ``[..., hidden]``."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
