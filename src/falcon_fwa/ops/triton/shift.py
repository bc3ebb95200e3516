r"""Delaying time-major rows by whole-buffer copies: the shifted write features.

The write feature of step ``t`` is the key of step ``t - 1`` (``x_t = phi(k_{t-1})``,
``ops.pairs.write_pairs``), and rule 3A reads its pairs ``W - 1`` steps late. On
time-major ``[B, T, H, D]`` tensors a row ``[H, D]`` is contiguous, so delaying every
batch row by ``m`` steps is delaying the flat buffer by ``m`` rows: one contiguous copy
(a device memcpy), after which the first ``m`` rows of each batch row, which received the
end of the previous batch row, are overwritten by the prefix. Slice assignment
(``x[:, 1:] = k[:, :-1]``) makes a strided copy instead, and its autograd backward a
zero fill, two clones and two more strided copies of the whole tensor.
"""
from __future__ import annotations

import math

import torch

__all__ = ["delay_rows", "advance_rows", "shift_rows"]


def delay_rows(prefix: torch.Tensor, body: torch.Tensor) -> torch.Tensor:
    """Rows ``0 .. T-1`` of ``[prefix | body]`` along time, contiguous:
    ``out[:, :m] = prefix[:, :m]`` and ``out[:, m:] = body[:, :T - m]`` with
    ``m = min(n_pre, T)``; ``prefix`` ``[B, n_pre, *row]``, ``body`` ``[B, T, *row]``."""
    n_pre, T = prefix.shape[1], body.shape[1]
    if n_pre == 0:
        return body.contiguous()
    m = min(n_pre, T)
    body = body.contiguous()
    out = torch.empty_like(body)
    if T > m:
        shift = m * math.prod(body.shape[2:])  # elements in m rows
        out.view(-1)[shift:].copy_(body.view(-1)[:-shift])
    out[:, :m] = prefix[:, :m]
    return out


def advance_rows(d_out: torch.Tensor, m: int) -> torch.Tensor:
    """The adjoint of ``delay_rows`` for the body: ``d_body[:, :T - m] = d_out[:, m:]`` and
    ``d_body[:, T - m:] = 0`` (the last ``m`` rows feed no output row)."""
    T = d_out.shape[1]
    m = min(m, T)
    d_out = d_out.contiguous()
    if m == 0:
        return d_out
    d_body = torch.empty_like(d_out)
    if T > m:
        shift = m * math.prod(d_out.shape[2:])
        d_body.view(-1)[:-shift].copy_(d_out.view(-1)[shift:])
    d_body[:, T - m:] = 0
    return d_body


class _ShiftRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, first):
        return delay_rows(first, k)

    @staticmethod
    def backward(ctx, dx):
        d_first = dx[:, :1] if ctx.needs_input_grad[1] else None
        return (advance_rows(dx, 1) if ctx.needs_input_grad[0] else None), d_first


def shift_rows(k: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``x[:, 0] = first[:, 0]``, ``x[:, t] = k[:, t - 1]``: ``k`` ``[B, T, *row]``, ``first``
    ``[B, 1, *row]`` of ``k``'s dtype; differentiable in both."""
    if first.shape != (k.shape[0], 1, *k.shape[2:]) or first.dtype != k.dtype:
        raise ValueError(f"first must have shape {(k.shape[0], 1, *k.shape[2:])} and dtype {k.dtype}, "
                         f"got {tuple(first.shape)} {first.dtype}")
    return _ShiftRows.apply(k, first)
