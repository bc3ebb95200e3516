"""``FalconAttention``: the multi-head fast-weight token mixer (Falcon and the recurrent baselines).

Per token, with ``h_t`` the block input and per head::

    q_t, k_t, v_t = ShortConv(W_q h), ShortConv(W_k h), ShortConv(W_v h)   # causal, SiLU; optional
    q_t, k_t      = query_scale * N(phi(q_t)), N(phi(k_t))   # N: QK-RMSNorm / l2 / none
    beta_t, lambda-bar_t, g_t = ContextGates(h_t)           # see layers/gates.py
    o_t, S_t      = falcon_attention(q, k, v, beta, lambda-bar, rule, window, shift, normalize,
                                     log_gate=g, read, scale_ridge=normalize, eps_attn)
    o_t          += D * v_t                                  # optional skip (Mamba-2)
    y_t           = W_o RMSNorm(o_t) [* SiLU(W_g h_t)]       # per-head norm, optional output gate
                                                             # (Mamba-2: W_o RMSNorm(o_t * SiLU(W_g h_t)))

One class serves every recurrent mixer; the mixer only sets the switches
(``configuration.MIXER_DEFAULTS``): Falcon (shifted pairs, normalized step,
scale-coupled ridge, QK-RMSNorm), DeltaNet (rule 1, unshifted, raw ``beta``, l2 keys),
Gated DeltaNet (+ data-dependent ``g_t``), Mamba-2 SSD (rule 1A, ``beta = dt``,
``g_t = -dt exp(A_log)``, ``D`` skip) and RetNet/Lightning (rule 1A, fixed per-head decay).

Training and prefill use ``form`` (``"chunk"`` by default); a cached forward over
one token per row uses ``falcon_step`` (``O(1)`` per token; with ``backend="triton"``, on the fused
step kernel, or on the PyTorch step for a shape that kernel does not hold: ``step_backend``). Packed input
(``packing.cu_seqlens``) goes to the op's varlen path with one state per sequence.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..ops import falcon_attention, falcon_step, kernel_limits
from ..ops.api import cast_to
from ..ops.rules import get_rule
from ..ops.validate import trusted_values
from . import fla_backend
from .gates import ContextGates
from .layer_cache import LayerCache
from .norms import RMSNorm, normalize_features, rms_normalize
from .packing import Packing, layout_of
from .short_conv import ShortConv

__all__ = ["FEATURE_MAPS", "FalconAttention"]

def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _elu1(x: torch.Tensor) -> torch.Tensor:
    return F.elu(x) + 1.0


# module-level functions, not lambdas: a layer holds one, and a model must pickle (torch.save(model))
_FEATURE_MAPS = {"identity": _identity, "silu": F.silu, "elu1": _elu1, "relu": F.relu}
FEATURE_MAPS = tuple(_FEATURE_MAPS)
"""The feature maps ``phi`` a config's ``feature_map`` may name."""


class FalconAttention(nn.Module):
    """Fast-weight mixer configured by a :class:`~falcon_fwa.models.FalconConfig`.

    ``forward(h, packing=None, cache=None)``: ``h`` ``[B, T, D]`` (dense rows; ``packing=None``
    is their layout) or ``[1, N_tok, D]`` (packed, see :class:`Packing`); ``cache``: this layer's :class:`LayerCache`,
    updated in place. Returns ``[B, T, D]`` like ``h``. Inside, per head: ``q``, ``k``
    ``[B, T, H, K]`` (``K = head_k_dim``), ``v`` ``[B, T, H, V]`` (``V = head_v_dim``) and the
    gates ``beta``, ``lam``, ``log_gate`` of :class:`ContextGates` go to ``falcon_attention``
    (``falcon_step`` for one cached token per row) as in the module docstring.
    """

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.spec = get_rule(c.rule)
        self.num_heads, self.head_k_dim, self.head_v_dim = c.num_heads, c.head_k_dim, c.head_v_dim
        self.rule, self.window, self.shift, self.normalize, self.read = c.rule, c.window, c.shift, c.normalize, c.read
        self.form, self.chunk_size, self.eps, self.decay_floor = c.form, c.chunk_size, c.eps, c.decay_floor
        self.eps_attn = getattr(c, "eps_attn", None)
        self.segments = getattr(c, "segments", 1)  # (configs saved before the field have none)
        self.qk_norm, self.v_norm, self.query_scale = c.qk_norm, c.v_norm, c.query_scale
        self.feature_map = _FEATURE_MAPS[c.feature_map]
        self.norm_eps = c.rms_norm_eps
        self.backend = c.backend
        kd, vd = c.num_heads * c.head_k_dim, c.num_heads * c.head_v_dim
        self.q_proj = nn.Linear(c.hidden_size, kd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, kd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, vd, bias=False)
        self.convs = nn.ModuleDict()
        if c.use_short_conv:
            self.convs.update({"q": ShortConv(kd, c.conv_size), "k": ShortConv(kd, c.conv_size),
                               "v": ShortConv(vd, c.conv_size)})
        self.gates = ContextGates(c.hidden_size, c.num_heads, c.head_v_dim, gate=c.gate, log_gate=c.log_gate,
                                  lambda_scale=c.lambda_scale, per_column=self.spec.per_column)
        self.D = nn.Parameter(torch.ones(c.num_heads)) if c.use_d_skip else None
        self.g_proj = nn.Linear(c.hidden_size, vd, bias=False) if c.output_gate else None
        self.o_norm = RMSNorm(c.head_v_dim, eps=c.rms_norm_eps)
        self.norm_before_gate = c.norm_before_gate
        self.o_proj = nn.Linear(vd, c.hidden_size, bias=False)
        if self.backend == "fla":
            fla_backend.check_supported(self.core_kind())

    def core_kind(self) -> str:
        """Which known recurrence the op computes with these switches (for the fla backend)."""
        return fla_backend.classify(rule=self.rule, shift=self.shift, normalize=self.normalize,
                                    has_ridge=self.gates.lambda_scale > 0, log_gate=self.gates.log_gate_kind,
                                    read=self.read, normalized_read=self.eps_attn is not None)

    def op_backend(self) -> str:
        """The op backend of the layer's ``backend``: "torch" and "triton" forced, "auto" otherwise (the op picks;
        "fla" runs the op where flash-linear-attention does not)."""
        return self.backend if self.backend in ("torch", "triton") else "auto"

    def step_backend(self) -> str:
        """The op backend of a one-token decoding step: the layer's, except that with ``backend="triton"`` a key
        dim above ``kernel_limits.MAX_FUSED_HEAD_DIM`` or a sliding window above ``MAX_FUSED_WINDOW``, which the
        fused step kernel does not hold but the chunk kernels train with (the inner-product rules' tiled keys,
        rule 3A's windows up to ``MAX_WINDOW``), decodes on the PyTorch step."""
        backend = self.op_backend()
        if backend == "triton" and (self.head_k_dim > kernel_limits.MAX_FUSED_HEAD_DIM
                                    or (self.spec.sliding and self.window > kernel_limits.MAX_FUSED_WINDOW)):
            return "torch"
        return backend

    def _project(self, h, packing, cache):
        B, T, _ = h.shape
        out = {}
        for name, proj in (("q", self.q_proj), ("k", self.k_proj), ("v", self.v_proj)):
            x = proj(h)
            if name in self.convs:
                x, buf = self.convs[name](x, packing, None if cache is None else cache.conv.get(name))
                if cache is not None:
                    cache.store_conv(name, buf, packing.rows)
            out[name] = x
        q = out["q"].view(B, T, self.num_heads, self.head_k_dim)
        k = out["k"].view(B, T, self.num_heads, self.head_k_dim)
        v = out["v"].view(B, T, self.num_heads, self.head_v_dim)
        # The normalizations compute in float32 under autocast; the op gets the projections' dtype back
        # (bf16 under bf16 autocast), so its kernels run on the tensor cores.
        dt = v.dtype
        q = normalize_features(self.feature_map(q), self.qk_norm, self.norm_eps)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        q = cast_to(q, dt)
        k = cast_to(normalize_features(self.feature_map(k), self.qk_norm, self.norm_eps), dt)
        if self.v_norm:
            v = cast_to(rms_normalize(v, self.norm_eps), dt)
        return q, k, v

    def forward(self, h: torch.Tensor, packing: Optional[Packing] = None,
                cache: Optional[LayerCache] = None) -> torch.Tensor:
        """``h`` ``[B, T, D]`` (``D = hidden_size``; ``[1, N_tok, D]`` packed) -> ``[B, T, D]``; reads and
        writes ``cache`` (the recurrent state and short-convolution buffers) when given. ``packing=None``:
        dense rows (each row one sequence, continuing its cache row)."""
        if h.dim() != 3 or h.shape[-1] != self.q_proj.in_features:
            raise ValueError(f"h must have shape [B, T, hidden_size={self.q_proj.in_features}], got {tuple(h.shape)}")
        if cache is not None and not isinstance(cache, LayerCache):
            raise TypeError(f"cache must be a LayerCache (or None: no state carried to the next call), "
                            f"got {type(cache).__name__}")
        B, T, _ = h.shape
        if isinstance(packing, Packing) and packing.packed and (
                B != 1 or (packing.bounds is not None and T != packing.bounds[-1])):
            total = "N_tok" if packing.bounds is None else packing.bounds[-1]
            raise ValueError(f"h must have shape [1, {total}, hidden_size] for packed sequences (packing.cu_seqlens), "
                             f"got {tuple(h.shape)}")
        packing = layout_of(packing, h, cache=cache)
        if cache is not None and not packing.packed:
            held = cache.state.S.shape[0] if cache.state is not None else next(
                (buf.shape[0] for buf in cache.conv.values()), B)
            if held != B:
                raise ValueError(f"cache holds {held} rows, h has {B}: dense rows continue the cache row by row")
        q, k, v = self._project(h, packing, cache)
        beta, lam, log_gate = self.gates(h)
        o = self._core(q, k, v, beta, lam, log_gate, packing, cache)
        if self.D is not None:
            o = o + cast_to(self.D, o.dtype)[:, None] * v
        gate = None if self.g_proj is None else self.g_proj(h).view(B, T, self.num_heads, self.head_v_dim)
        o = self.o_norm(o, gate, norm_before_gate=self.norm_before_gate)
        return self.o_proj(o.reshape(B, T, -1))

    def _core(self, q, k, v, beta, lam, log_gate, packing: Packing, cache: Optional[LayerCache]):
        """The recurrence; reads and writes ``cache.state`` when a cache is given."""
        opts = dict(rule=self.rule, window=self.window, eps=self.eps, decay_floor=self.decay_floor,
                    shift=self.shift, normalize=self.normalize, read=self.read, scale_ridge=self.normalize,
                    eps_attn=self.eps_attn)
        state = None if cache is None else cache.state
        want_state = cache is not None
        if packing.packed:
            init = None if state is None else state.index_select(packing.rows)
        else:
            init = state
        if not packing.packed and q.shape[1] == 1 and init is not None:
            # the layer's projections make valid inputs (lam >= 0, log_gate <= 0, its own state)
            o, final = falcon_step(q[:, 0], k[:, 0], v[:, 0], beta[:, 0], lam[:, 0], state=init,
                                   log_gate=None if log_gate is None else log_gate[:, 0], validate=False,
                                   backend=self.step_backend(), **opts)
            o = o[:, None]
        elif self.backend == "fla" and q.is_cuda:
            o, final = fla_backend.run(self.core_kind(), q, k, v, beta, log_gate, initial_state=init,
                                       output_final_state=want_state, cu_seqlens=packing.cu_seqlens,
                                       rule=self.rule, shift=self.shift)
        else:
            with trusted_values():  # the gates' ranges hold by construction; a NaN goes on to the loss
                o, final = falcon_attention(q, k, v, beta, lam, form=self.form, chunk_size=self.chunk_size,
                                            log_gate=log_gate, initial_state=init, output_final_state=want_state,
                                            cu_seqlens=packing.cu_seqlens, segments=self.segments,
                                            backend=self.op_backend(), **opts)
        if cache is not None:
            cache.store_state(final, packing.rows)
        return o
