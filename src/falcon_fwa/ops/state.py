"""The recurrent state that continues a sequence exactly across segments."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

__all__ = ["FalconState", "TENSOR_FIELDS"]

TENSOR_FIELDS = ("S", "last_key", "tail_x", "tail_y", "tail_valid", "z")
"""The state's tensor fields, each with the batch rows on its first axis (``S`` is always set)."""


@dataclass
class FalconState:
    """Everything a Falcon layer needs to continue a sequence exactly.

    Attributes (``B`` batch, ``H`` heads, ``K``/``V`` key/value dims, ``W`` window):

    * ``S`` ``[B, H, K, V]``: the fast-weight matrix ``S_T``.
    * ``last_key`` ``[B, H, K]``: ``phi(k_T)``, the first write feature of the next
      segment (so the next segment has no boundary sentinel). ``None`` when the
      pairing is unshifted (``shift=False``), or, with ``shift=True``, when the next call
      starts a new sequence from ``S`` (:meth:`fresh`): its first step is the sentinel.
    * ``tail_x`` ``[B, H, W-1, K]``, ``tail_y`` ``[B, H, W-1, V]``, ``tail_valid``
      ``[B, W-1]``: the last ``W-1`` causal pairs, oldest first, for the sliding
      rules 3/3A (Appendix C.7); ``None`` otherwise. ``tail_valid`` marks slots that
      hold a real pair (the sentinel ``t = 1`` and slots before the sequence start
      hold none).
    * ``z`` ``[B, H, K]`` (``[B, H, K, V]`` for rule 2A): the normalizer state of the
      normalized read (``eps_attn``, Appendix C.1); ``None`` for the denominator-free read.
    * ``rule``, ``window``, ``shift``: the configuration that produced the state (``window`` is
      1 for the non-sliding rules, which ignore the argument); ``falcon_attention`` refuses a
      state from another configuration.

    ``initial_state=None`` is the paper's fresh start ``S_0 = 0`` with the sentinel ``x_1 = 0``
    (Section 3, Appendix C.5); a returned state continues the sequence exactly, the sentinel not
    repeated (Appendix C.5, C.7).
    """

    rule: str
    window: int
    shift: bool
    S: torch.Tensor
    last_key: Optional[torch.Tensor] = None
    tail_x: Optional[torch.Tensor] = None
    tail_y: Optional[torch.Tensor] = None
    tail_valid: Optional[torch.Tensor] = None
    z: Optional[torch.Tensor] = None

    @classmethod
    def fresh(cls, S: torch.Tensor, *, rule: str, window: int = 4, shift: bool = True,
              z: Optional[torch.Tensor] = None) -> "FalconState":
        """The state that starts a new sequence from the fast weights ``S`` ``[B, H, K, V]`` (the
        paper's ``S_init``; ``S = 0`` is the fresh start of ``initial_state=None``).

        With ``shift=True`` the first step is the boundary sentinel, as on any fresh sequence:
        ``x_1 = 0`` and ``eta_1 = 0``, so nothing is written and the ridge does not shrink ``S``
        (``gamma_1 = 1``); a ``log_gate`` decays it as at every step (``S' = exp(g_1) S``). With
        ``shift=False`` there is no sentinel: step 1 writes ``(k_1, v_1)`` and its ridge shrinks ``S``.
        The window of the sliding rules holds no earlier pair. ``z``: the normalizer state of
        the normalized read, for calls with ``eps_attn`` (``[B, H, K]``, ``[B, H, K, V]`` for
        rule 2A; a regression rule has none: ``ValueError``). ``rule``, ``window`` and ``shift`` are those
        of the call that takes the state."""
        from .pairs import empty_tail
        from .rules import get_rule
        from .validate import check_switches, check_window

        spec = get_rule(rule)
        if not isinstance(S, torch.Tensor) or S.dim() != 4:
            raise ValueError(f"S must be a tensor of shape [B, H, K, V], got "
                             f"{tuple(S.shape) if isinstance(S, torch.Tensor) else type(S).__name__}")
        if not S.is_floating_point():
            raise TypeError(f"S must be a floating-point tensor, got {S.dtype}")
        check_switches(shift=shift)
        check_window(spec, window)
        if z is not None and spec.regression:
            raise ValueError(f"z is the read normalizer of the inner-product rules 1A, 2A and 3A (eps_attn); rule "
                             f"{spec.name!r} is a regression rule, which has none")
        W = window if spec.sliding else 1
        state = cls(rule=spec.name, window=W, shift=shift, S=S, z=z)
        if W > 1:  # W - 1 empty slots shaped like the keys [B, H, K] and values [B, H, V] of S
            state.tail_x, state.tail_y, state.tail_valid = empty_tail(S[..., 0], S[:, :, 0], W - 1)
        return state

    def detach(self) -> "FalconState":
        """The same state cut from the autograd graph (truncated backpropagation through time)."""
        return replace(self, S=self.S.detach(),
                       last_key=None if self.last_key is None else self.last_key.detach(),
                       tail_x=None if self.tail_x is None else self.tail_x.detach(),
                       tail_y=None if self.tail_y is None else self.tail_y.detach(),
                       z=None if self.z is None else self.z.detach())

    def index_select(self, index) -> "FalconState":
        """The state of the batch rows ``index`` ``[N]`` (an integer tensor, or a sequence of ints; ``N`` rows
        out, in that order, repeats allowed), every field's leading ``B`` axis indexed (beam search / batched
        generation reordering). A boolean mask or float rows are a ``TypeError`` naming ``index``."""
        if not isinstance(index, torch.Tensor):
            if isinstance(index, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                          for i in index):
                raise TypeError(f"index must be an integer tensor or a sequence of ints, got {index!r}")
            index = torch.tensor(list(index), dtype=torch.long)
        if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise TypeError(f"index must be an integer tensor of rows, got dtype {index.dtype}")

        def sel(t):
            return None if t is None else t.index_select(0, index.to(t.device))

        return replace(self, S=sel(self.S), last_key=sel(self.last_key), tail_x=sel(self.tail_x),
                       tail_y=sel(self.tail_y), tail_valid=sel(self.tail_valid), z=sel(self.z))

    @staticmethod
    def cat(states: "list[FalconState]") -> "FalconState":
        """Stack states of the same configuration (rule, window, shift, the same fields present, each of the
        same shape after its batch axis) along the batch dimension; another configuration or shape is a
        ``ValueError`` naming the field."""
        states = list(states)
        if not states or not all(isinstance(s, FalconState) for s in states):
            raise ValueError("FalconState.cat takes a non-empty list of FalconState")
        first = states[0]
        for i, s in enumerate(states[1:], 1):
            for field in ("rule", "window", "shift"):
                if getattr(s, field) != getattr(first, field):
                    raise ValueError(f"FalconState.cat: states[{i}].{field} is {getattr(s, field)!r}, "
                                     f"states[0].{field} is {getattr(first, field)!r}")
            for field in TENSOR_FIELDS:
                t, t0 = getattr(s, field), getattr(first, field)
                if (t is None) != (t0 is None):
                    raise ValueError(f"FalconState.cat: states[{i}].{field} is {'None' if t is None else 'set'}, "
                                     f"states[0].{field} is {'None' if t0 is None else 'set'}")
                if t is not None and tuple(t.shape[1:]) != tuple(t0.shape[1:]):
                    raise ValueError(f"FalconState.cat: states[{i}].{field} has shape {tuple(t.shape)}, "
                                     f"states[0].{field} has shape {tuple(t0.shape)} (only the batch axis may differ)")

        def cat(name):
            ts = [getattr(s, name) for s in states]
            return None if ts[0] is None else torch.cat(ts, dim=0)

        return replace(first, **{field: cat(field) for field in TENSOR_FIELDS})

    @property
    def requires_grad(self) -> bool:
        """Whether any of the state's tensors requires a gradient (a learned or carried-through state)."""
        return any(isinstance(t, torch.Tensor) and t.requires_grad
                   for t in (self.S, self.last_key, self.tail_x, self.tail_y, self.z))

    @property
    def batch_size(self) -> int:
        """The number of rows ``B`` of ``S`` (sequences, one per row)."""
        return self.S.shape[0]
