"""Device-side value checks of the op's arguments on a GPU, without a host synchronization.

One kernel reads ``lam`` and ``log_gate`` once and clears a flag per argument where an entry
lies out of range (``lam`` finite and ``>= 0``; ``log_gate <= 0``, ``-inf`` allowed, NaN not);
``torch._assert_async`` on each flag then fails at the next synchronization with the message
that names the argument. Three small launches in all (the flags' fill, the kernel, the
assertions), where reductions and comparisons in PyTorch took six or more."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .launch import cdiv

__all__ = ["range_flags", "assert_ranges"]

_BLOCK = 4096


@triton.jit
def range_flags_kernel(lam, gate, flags, n_lam, n_gate, BLOCK: tl.constexpr, HAS_GATE: tl.constexpr):
    """Grid ``(cdiv(max(n_lam, n_gate), BLOCK),)``: ``flags[0] = 0`` where an entry of ``lam`` is not
    finite and ``>= 0``, ``flags[1] = 0`` where one of ``gate`` is not ``<= 0`` (both start at 1)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_lam
    b_lam = tl.load(lam + offs, mask=m, other=0.0).to(tl.float64)  # exact for every input dtype
    bad = m & ~((b_lam >= 0.0) & (b_lam < float("inf")))  # NaN fails both comparisons
    tl.store(flags, 0, mask=tl.max(bad.to(tl.int32), axis=0) > 0)
    if HAS_GATE:
        m = offs < n_gate
        b_g = tl.load(gate + offs, mask=m, other=0.0).to(tl.float64)
        bad = m & ~(b_g <= 0.0)
        tl.store(flags + 1, 0, mask=tl.max(bad.to(tl.int32), axis=0) > 0)


def range_flags(lam: torch.Tensor, log_gate: Optional[torch.Tensor]) -> torch.Tensor:
    """``[2]`` int32 on ``lam``'s device: ``1`` where every entry of ``lam`` (first) and of
    ``log_gate`` (second; ``1`` when ``None``) lies in range, else ``0``. No synchronization."""
    flags = torch.ones(2, dtype=torch.int32, device=lam.device)
    lam = lam.reshape(-1)
    gate = None if log_gate is None else log_gate.reshape(-1)
    n = max(lam.numel(), 0 if gate is None else gate.numel())
    if n:
        range_flags_kernel[(cdiv(n, _BLOCK),)](lam, gate, flags, lam.numel(), 0 if gate is None else gate.numel(),
                                               BLOCK=_BLOCK, HAS_GATE=gate is not None)
    return flags


def assert_ranges(lam: torch.Tensor, log_gate: Optional[torch.Tensor], lam_message: str, gate_message: str) -> None:
    """Device-side assertions (``torch._assert_async``) that ``lam`` and ``log_gate`` lie in range
    (``range_flags``), each failing with its message at the next synchronization."""
    flags = range_flags(lam, log_gate)
    torch._assert_async(flags[0], lam_message)
    if log_gate is not None:
        torch._assert_async(flags[1], gate_message)
