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
        from .validate import check_switches, check_window, plain_number

        window = plain_number(window)
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

    def _map(self, fn) -> "FalconState":
        """The state with ``fn`` applied to each tensor field that is set."""
        return replace(self, **{field: None if getattr(self, field) is None else fn(getattr(self, field))
                                for field in TENSOR_FIELDS})

    def detach(self) -> "FalconState":
        """The same state cut from the autograd graph (truncated backpropagation through time)."""
        return self._map(torch.Tensor.detach)

    def clone(self) -> "FalconState":
        """A copy whose tensors share no memory with this state's (a snapshot that later in-place writes, such
        as a decoder refilling static buffers, cannot change)."""
        return self._map(torch.Tensor.clone)

    def to(self, device=None, dtype: Optional[torch.dtype] = None, *, non_blocking: bool = False) -> "FalconState":
        """The state on ``device`` and/or with its floating-point fields in ``dtype`` (``tail_valid`` stays a
        boolean mask): to offload a cache to the host, or keep it in less memory. A call casts the state it is
        given to its own compute dtype (float32 for float32, bfloat16 and float16 inputs). As with
        ``torch.Tensor.to``, a dtype alone may come first: ``state.to(torch.bfloat16)``."""
        if isinstance(device, torch.dtype):  # to(dtype), Tensor.to's and Module.to's positional form
            if dtype is not None:
                raise TypeError(f"device must be a device, got the dtype {device} (and dtype={dtype})")
            device, dtype = None, device
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
        if device is not None:
            device = torch.device(device)

        def move(t):
            return t.to(device=device, dtype=dtype if t.is_floating_point() else None, non_blocking=non_blocking)

        return self._map(move)

    def split(self, sizes) -> "list[FalconState]":
        """The inverse of :meth:`cat`: states of consecutive batch rows, ``sizes`` an int (rows per state, the
        last one may be shorter) or a list of ints summing to the batch size (``torch.split``'s rule)."""
        B = self.batch_size
        if isinstance(sizes, int) and not isinstance(sizes, bool):
            if sizes < 1:
                raise ValueError(f"sizes must be a positive int or a list of ints summing to {B}, got {sizes}")
            sizes = [min(sizes, B - a) for a in range(0, B, sizes)]
        else:
            sizes = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes]
            if (not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
                    or sum(sizes) != B):
                raise ValueError(f"sizes must be a positive int or a list of ints >= 0 summing to the batch size "
                                 f"{B}, got {sizes}")
        out, a = [], 0
        for n in sizes:
            out.append(self._map(lambda t, a=a, n=n: t[a:a + n]))
            a += n
        return out

    def index_select(self, index) -> "FalconState":
        """The state of the batch rows ``index`` ``[N]`` (an integer tensor, or a sequence of ints; ``N`` rows
        out, in that order, repeats allowed), every field's leading ``B`` axis indexed (beam search / batched
        generation reordering). A boolean mask or float rows are a ``TypeError`` naming ``index``, a row outside
        ``[0, B)`` (a negative one too) an ``IndexError`` naming it."""
        if not isinstance(index, torch.Tensor):
            if isinstance(index, (str, bytes)) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                          for i in index):
                raise TypeError(f"index must be an integer tensor or a sequence of ints, got {index!r}")
            index = torch.tensor(list(index), dtype=torch.long)
        if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
            raise TypeError(f"index must be an integer tensor of rows, got dtype {index.dtype}")
        if index.dim() > 1:
            raise ValueError(f"index must be one-dimensional [N], got shape {tuple(index.shape)}")
        if index.device.type == "cpu" and index.numel():  # host rows are checked here (others on their device)
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= self.batch_size:
                raise IndexError(f"index holds row {low if low < 0 else high}, outside the state's rows "
                                 f"[0, {self.batch_size})")
        return self._map(lambda t: t.index_select(0, index.to(t.device)))

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
                   for t in (getattr(self, field) for field in TENSOR_FIELDS))

    @property
    def batch_size(self) -> int:
        """The number of rows ``B`` of ``S`` (sequences, one per row)."""
        return self.S.shape[0]
