"""The causal language model: Pre-Norm blocks of a token mixer and a SwiGLU MLP.

::

    h_0 = E[x]                                             # tied input/output embedding E
    h   = h + Mixer(RMSNorm(h), packing, cache)            # FalconAttention or RoPE attention
    h   = h + SwiGLU(RMSNorm(h))
    logits = RMSNorm(h_L) E^T / m                          # m: muP width multiplier

No biases, no dropout. Padding is handled once, here: an ``attention_mask`` with
zeros is turned into packed per-sequence boundaries (``unpad`` -> ``cu_seqlens`` ->
every mixer's varlen path -> ``repad``), so a pad token never enters a write, gate,
decay, short-convolution buffer or normalizer of any mixer. Rows given already
packed (``cu_seqlens`` with ``B = 1``) keep their document boundaries the same way.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..layers.attention import CausalSelfAttention
from ..layers.falcon_attention import FalconAttention
from ..layers.layer_cache import LayerCache
from ..layers.mlp import SwiGLU
from ..layers.norms import RMSNorm
from ..layers.packing import Packing, repad, unpad
from ..ops.api import cast_to
from ..ops.seqlens import known_sequence_bounds, sequence_bounds
from .cache import FalconCache
from .configuration import FalconConfig

try:  # transformers >= 5: init functions that respect already-loaded weights
    from transformers import initialization as _init
except ImportError:  # pragma: no cover
    _init = nn.init

__all__ = ["FalconBlock", "FalconModel", "FalconForCausalLM", "FalconPreTrainedModel"]

# The output field that carries the cache ("cache" from transformers 5.2x, "past_key_values" before).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class FalconBlock(nn.Module):
    """``h + Mixer(RMSNorm(h))`` then ``h + SwiGLU(RMSNorm(h))``."""

    def __init__(self, config: FalconConfig, layer_idx: int):
        super().__init__()
        self.mixer_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.mixer == "transformer":
            self.mixer = CausalSelfAttention(config, layer_idx)
        else:
            self.mixer = FalconAttention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size)
        # Residual-branch outputs get the depth-scaled init (see _init_weights).
        self.mixer.o_proj.residual_out = True
        self.mlp.down_proj.residual_out = True

    def forward(self, h: torch.Tensor, packing: Packing, cache: Optional[LayerCache]) -> torch.Tensor:
        h = h + self.mixer(self.mixer_norm(h), packing, cache)
        return h + self.mlp(self.mlp_norm(h))


class FalconPreTrainedModel(PreTrainedModel):
    config_class = FalconConfig
    base_model_prefix = "model"
    _no_split_modules = ["FalconBlock"]
    _is_stateful = True
    supports_gradient_checkpointing = False

    def _init_weights(self, module: nn.Module) -> None:
        """muP-style init: embedding ``N(0, sigma^2)``; hidden matrices
        ``N(0, sigma^2 / m)`` (``m`` the width multiplier, i.e. variance ``~ 1/fan_in``);
        residual-branch outputs (``o_proj``, ``down_proj``) additionally ``/ (2L)``.
        Gate offsets, decays and conv kernels keep the values their modules set."""
        cfg = self.config
        std = cfg.initializer_range
        if isinstance(module, nn.Embedding):
            _init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Linear):
            s = std / math.sqrt(cfg.width_multiplier)
            if getattr(module, "residual_out", False):
                s = s / math.sqrt(2 * cfg.num_hidden_layers)
            _init.normal_(module.weight, mean=0.0, std=s)
        elif isinstance(module, RMSNorm):
            _init.ones_(module.weight)


class FalconModel(FalconPreTrainedModel):
    """Embedding, blocks and final norm; returns the final hidden states."""

    def __init__(self, config: FalconConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([FalconBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, h: torch.Tensor, packing: Packing, cache: Optional[FalconCache]) -> torch.Tensor:
        """``h`` ``[B, T, D]`` embeddings in the layout of ``packing``."""
        for i, layer in enumerate(self.layers):
            h = layer(h, packing, None if cache is None else cache[i])
        return self.norm(h)


class FalconForCausalLM(FalconPreTrainedModel, GenerationMixin):
    """Causal LM over any mixer of :class:`FalconConfig`, Hugging Face compatible.

    ``forward(input_ids, attention_mask=None, labels=None, past_key_values=None,
    use_cache=None, cu_seqlens=None)``:

    * ``input_ids`` ``[B, T]``; ``attention_mask`` ``[B, T_past + T]`` (1 real, 0 pad;
      left or right padding), only its last ``T`` columns describe ``input_ids``;
    * ``cu_seqlens`` ``[N + 1]``: ``input_ids`` ``[1, total]`` holds ``N`` packed
      documents; each starts fresh (sentinel, conv, positions); logits keep the
      packed shape and the loss skips the boundary targets;
    * ``labels`` ``[B, T]`` (``-100`` ignored; pads are ignored anyway): mean
      next-token cross-entropy of ``logits[:, :-1]`` against ``labels[:, 1:]``;
    * ``past_key_values`` (or ``cache``): a :class:`FalconCache` to continue;
      ``use_cache=True`` returns it (a fresh one when none is given).

    Returns ``CausalLMOutputWithPast`` (``loss``, ``logits`` ``[B, T, vocab]`` in
    at least float32, the cache). ``generate()`` works with the recurrent cache.
    """

    def __init__(self, config: FalconConfig):
        super().__init__(config)
        self.model = FalconModel(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    # --- Hugging Face plumbing -------------------------------------------------------------
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model makes its own FalconCache

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, cache=None, past_key_values=None,
                                      use_cache=None, **kwargs):
        """Feed only the columns the cache has not consumed yet."""
        cache = cache if cache is not None else past_key_values
        if cache is not None and not cache.empty:
            input_ids = input_ids[:, cache.num_positions:]
        inputs = {"input_ids": input_ids.contiguous(), "attention_mask": attention_mask, "use_cache": use_cache}
        inputs["cache" if _CACHE_FIELD == "cache" else "past_key_values"] = cache
        return inputs

    # --- muP ---------------------------------------------------------------------------------
    def param_groups(self, lr: float, weight_decay: float) -> List[Dict]:
        """AdamW parameter groups with muP learning-rate multipliers.

        Recipe (width multiplier ``m = hidden_size / mup_base_width``; ``m = 1``
        without a base width, i.e. standard parametrization at the proxy width):

        * hidden matrices (every ``nn.Linear`` weight, untied output head included):
          init std ``sigma / sqrt(m)`` (residual outputs also ``/ sqrt(2L)``),
          learning rate ``lr / m``, weight decay ``weight_decay``;
        * the embedding (tied to the output): init std ``sigma``, learning rate ``lr``,
          weight decay ``weight_decay``; the logits are multiplied by ``1 / m``;
        * vectors and per-head scalars (norm gains, gate offsets, ``A_log``, ``D``,
          short-conv kernels, whose fan-in does not grow with width): learning rate
          ``lr``, no weight decay.

        Tune ``lr`` on a proxy of width ``mup_base_width`` and reuse it at any width.
        Each group carries ``lr_multiplier`` so a schedule can set
        ``group["lr"] = lr_t * group["lr_multiplier"]``.
        """
        m = self.config.width_multiplier
        embed = self.model.embed_tokens.weight
        matrices, vectors = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad or p is embed:
                continue
            is_matrix = p.dim() == 2 and name.endswith(".weight") and "embed" not in name
            (matrices if is_matrix else vectors).append(p)
        groups = [
            {"name": "matrices", "params": matrices, "lr": lr / m, "lr_multiplier": 1.0 / m,
             "weight_decay": weight_decay},
            {"name": "embedding", "params": [embed], "lr": lr, "lr_multiplier": 1.0, "weight_decay": weight_decay},
            {"name": "vectors", "params": vectors, "lr": lr, "lr_multiplier": 1.0, "weight_decay": 0.0},
        ]
        return [g for g in groups if g["params"]]

    # --- forward -----------------------------------------------------------------------------
    def _layout(self, input_ids, attention_mask, cu_seqlens, cache: Optional[FalconCache]):
        """Decide dense vs packed; returns (packing, unpad index or None, real tokens per row)."""
        B, T = input_ids.shape
        offsets = None if cache is None or cache.empty else cache.seen
        if cu_seqlens is not None:
            if B != 1:
                raise ValueError(f"cu_seqlens needs input_ids of shape [1, total], got {tuple(input_ids.shape)}")
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError("pass either cu_seqlens or an attention_mask with padding, not both")
            cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)
            bounds = sequence_bounds(cu, T)
            rows = torch.arange(cu.numel() - 1, device=input_ids.device)
            return Packing.from_cu_seqlens(cu, rows, offsets, bounds), None, cu[1:] - cu[:-1]
        if attention_mask is not None:
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
                raise ValueError(f"attention_mask must have shape [B, >= T] = [{B}, >= {T}], "
                                 f"got {tuple(attention_mask.shape)}")
            mask = attention_mask[:, -T:].to(device=input_ids.device, dtype=torch.bool)
            if not bool(mask.all()):
                _, index, cu, rows = unpad(input_ids[..., None], mask)
                if cache is not None and cache.empty and rows.numel() != B:
                    raise ValueError("attention_mask: every row needs at least one real token in the first call "
                                     "with a cache")
                return Packing.from_cu_seqlens(cu, rows, offsets), index, mask.sum(1)
        real = torch.full((B,), T, dtype=torch.int64, device=input_ids.device)
        return Packing.dense(B, T, offsets, input_ids.device), None, real

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        past_key_values: Optional[FalconCache] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[FalconCache] = None,
        return_dict: Optional[bool] = None,
    ) -> CausalLMOutputWithPast:
        cache = cache if cache is not None else past_key_values
        if use_cache is None:
            use_cache = cache is not None or (self.config.use_cache and not self.training)
        if use_cache and cache is None:
            cache = FalconCache(self.config.num_hidden_layers)
        if not use_cache:
            cache = None
        B, T = input_ids.shape
        packing, index, real = self._layout(input_ids, attention_mask, cu_seqlens, cache)
        h = self.model.embed_tokens(input_ids)
        if index is not None:
            h = h.reshape(B * T, -1).index_select(0, index)[None]
        with known_sequence_bounds(packing.cu_seqlens, packing.bounds):  # one device read per batch
            h = self.model(h, packing, cache)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = cast_to(F.linear(h, weight), torch.promote_types(h.dtype, torch.float32))
        if self.config.width_multiplier != 1.0:
            logits = logits / self.config.width_multiplier
        if index is not None:
            logits = repad(logits, index, B, T)
        if cache is not None:
            cache.advance(real, T)
        loss = None
        if labels is not None:
            loss = self._loss(logits, labels, attention_mask, cu_seqlens, T)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})

    @staticmethod
    def _loss(logits, labels, attention_mask, cu_seqlens, T):
        targets = labels.to(logits.device).clone()
        if attention_mask is not None:
            real = attention_mask[:, -T:].to(targets.device).bool()
            targets = targets.masked_fill(~real, -100)
            # a target is scored against the logits of the column before it: a pad there (left padding)
            # has zero logits and no context, so the first real token of a row is not a prediction
            targets[:, 1:] = targets[:, 1:].masked_fill(~real[:, :-1], -100)
        if cu_seqlens is not None:  # the first token of a document is not predicted from the previous one
            targets[:, cu_seqlens[1:-1].to(targets.device).long()] = -100
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1),
                               ignore_index=-100)
