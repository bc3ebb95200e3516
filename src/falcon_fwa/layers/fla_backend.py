"""Optional flash-linear-attention (``fla``) kernels for the baseline recurrences.

With ``backend="fla"`` the recurrent core of a baseline mixer is computed by fla's
Triton kernels instead of the library's op; everything around it (projections,
short convolutions, gates, norms) stays the same module, so the two backends share
weights and their forward passes can be compared directly. Only the recurrences
fla implements are accepted:

* ``"delta"``: rule 1, unshifted, raw ``beta``, no ridge, no gate (DeltaNet) ->
  ``chunk_delta_rule``;
* ``"gated_delta"``: the same with ``log_gate`` (Gated DeltaNet) -> ``chunk_gated_delta_rule``;
* ``"gated_linear"``: rule 1A, unshifted, raw ``beta``, no ridge, with ``log_gate``
  (Mamba-2 SSD, RetNet) -> ``chunk_simple_gla`` on ``(q, k, beta * v)``.

The state is exchanged as a :class:`FalconState` (``S`` ``[B, H, K, V]``, the layout
fla uses), so cached decoding continues with ``falcon_step`` on either backend.
"""
from __future__ import annotations

import importlib.util
from typing import Optional, Tuple

import torch

from ..ops import FalconState

__all__ = ["available", "classify", "check_supported", "run"]

SUPPORTED = ("delta", "gated_delta", "gated_linear")


def available() -> bool:
    """True when ``fla`` is importable and CUDA is present."""
    return importlib.util.find_spec("fla") is not None and torch.cuda.is_available()


def classify(*, rule: str, shift: bool, normalize: bool, has_ridge: bool, log_gate: str, read: str,
             normalized_read: bool = False) -> str:
    """Name of the known recurrence these op switches give, or ``"falcon"``."""
    plain = not shift and not normalize and not has_ridge and read == "after" and not normalized_read
    if plain and rule == "1":
        return "delta" if log_gate == "none" else "gated_delta"
    if plain and rule == "1A" and log_gate != "none":
        return "gated_linear"
    return "falcon"


def check_supported(kind: str) -> None:
    if kind not in SUPPORTED:
        raise ValueError(f"config field 'backend' = 'fla' supports the DeltaNet, Gated DeltaNet, Mamba-2 and RetNet "
                         f"recurrences only; these switches give the {kind!r} recurrence (use backend='native')")


def run(kind: str, q, k, v, beta, log_gate, *, initial_state: Optional[FalconState], output_final_state: bool,
        cu_seqlens: Optional[torch.Tensor], rule: str, shift: bool
        ) -> Tuple[torch.Tensor, Optional[FalconState]]:
    """``q``, ``k`` ``[B, T, H, K]``, ``v`` ``[B, T, H, V]``, ``beta`` ``[B, T, H]``,
    ``log_gate`` ``[B, T, H]``; returns ``o`` ``[B, T, H, V]`` and the final state (``rule`` and
    ``shift`` are recorded on it; the recurrences fla runs have no sliding window)."""
    check_supported(kind)
    h0 = None if initial_state is None else initial_state.S.float()
    cu = None if cu_seqlens is None else cu_seqlens.to(torch.long)
    if kind == "delta":
        from fla.ops.delta_rule import chunk_delta_rule
        o, ht = chunk_delta_rule(q, k, v, beta.to(q.dtype), scale=1.0, initial_state=h0,
                                 output_final_state=output_final_state, cu_seqlens=cu)
    elif kind == "gated_delta":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        o, ht = chunk_gated_delta_rule(q, k, v, log_gate.float(), beta.to(q.dtype), scale=1.0, initial_state=h0,
                                       output_final_state=output_final_state, cu_seqlens=cu)
    else:
        from fla.ops.simple_gla import chunk_simple_gla
        o, ht = chunk_simple_gla(q, k, v * beta[..., None].to(v.dtype), g=log_gate.float(), scale=1.0,
                                 initial_state=h0, output_final_state=output_final_state, cu_seqlens=cu)
    final = None
    if output_final_state:
        final = FalconState(rule=rule, window=1, shift=shift, S=ht)
    return o.to(v.dtype), final
