"""The causal language model: Pre-Norm blocks of a token mixer and a SwiGLU MLP.

::

    h_0 = E[x]            (or inputs_embeds)               # tied input/output embedding E
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
import weakref
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..layers.attention import CausalSelfAttention
from ..layers.falcon_attention import FalconAttention
from ..layers.gates import ContextGates
from ..layers.layer_cache import LayerCache
from ..layers.mlp import SwiGLU
from ..layers.norms import RMSNorm
from ..layers.packing import Packing, repad, unpad
from ..layers.short_conv import ShortConv
from ..ops.api import cast_to
from ..ops.seqlens import check_cu_seqlens, known_sequence_bounds, sequence_bounds
from ..ops.validate import check_positive_int
from .cache import FalconCache
from .configuration import FalconConfig

try:  # transformers >= 5: init functions that respect already-loaded weights
    from transformers import initialization as _init
except ImportError:  # pragma: no cover
    _init = nn.init

__all__ = ["FalconBlock", "FalconModel", "FalconForCausalLM", "FalconPreTrainedModel"]


def _copy_init(param: nn.Parameter, value: torch.Tensor) -> None:
    """``param <- value`` unless ``param`` is already set (``transformers.initialization.copy_``). A ``DTensor``
    ``param`` (FSDP2's ``fully_shard`` of a model built on the meta device, then ``to_empty`` and
    ``init_weights()``) gets ``value`` laid out as it is: every process holds the whole deterministic ``value`` and
    keeps its own part, with no communication."""
    value = value.to(param.device, param.dtype)
    placements = getattr(param, "placements", None)
    if placements is not None and hasattr(param, "device_mesh"):
        try:
            from torch.distributed.tensor import distribute_tensor
        except ImportError:  # pragma: no cover - torch 2.4: not yet public
            from torch.distributed._tensor import distribute_tensor

        try:
            value = distribute_tensor(value, param.device_mesh, placements, src_data_rank=None)
        except TypeError:  # pragma: no cover - torch < 2.7: sent from the first process (every process calls it)
            value = distribute_tensor(value, param.device_mesh, placements)
    if hasattr(_init, "copy_"):
        _init.copy_(param, value)
    else:  # pragma: no cover
        with torch.no_grad():
            param.copy_(value)


# The output field that carries the cache ("cache" from transformers 5.2x, "past_key_values" before).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


_NO_ATTENTIONS = ("output_attentions=True: the model returns no attention weights (its recurrent mixers have none, "
                  "and its attention runs as fused scaled_dot_product_attention); output_hidden_states=True returns "
                  "every block's input")


def _check_cache_type(cache) -> None:
    """A ``TypeError`` naming ``past_key_values`` unless ``cache`` is ``None`` or a :class:`FalconCache`."""
    if cache is not None and not isinstance(cache, FalconCache):
        raise TypeError(f"past_key_values must be a FalconCache (the model makes its own with use_cache=True), "
                        f"got {type(cache).__name__}")


def output_object(model) -> dict:
    """``{"return_dict": True}`` for a transformers model, ``{}`` for any other module: the keyword that makes a
    model return its output object (``.logits``, the cache) whatever its config's ``return_dict`` says
    (``from_pretrained(..., return_dict=False)`` or a saved config with it would make it a tuple), while a module
    that takes no such keyword is called as before. A wrapper (DDP's ``.module``, ``torch.compile``'s
    ``._orig_mod``) is looked through."""
    inner = getattr(model, "module", model)  # DistributedDataParallel (a compiled one forwards it too)
    inner = getattr(inner, "_orig_mod", inner)  # torch.compile's OptimizedModule
    return {"return_dict": True} if isinstance(inner, PreTrainedModel) else {}


def _check_left_padded(attention_mask, note: str = "") -> None:
    """A ``ValueError`` naming ``attention_mask`` if generation would continue a row after a pad: a row whose last
    column is 0 (right padding). ``generate()`` chooses each row's first new token from the last column's logits
    and appends the new tokens after the last column, so such a row would be continued from its pads (and its
    tokens would have pads in their midst); under left padding the last column is every row's last real token.
    ``note``: said after the advice."""
    if attention_mask is None or attention_mask.dim() != 2 or attention_mask.shape[1] == 0:
        return  # a mask of another shape is the forward's to refuse
    pads = ~attention_mask[:, -1].bool()
    if bool(pads.any()):
        rows = pads.nonzero()[:, 0].tolist()
        raise ValueError(f"attention_mask ends in padding in rows {rows} (right padding): generate() continues "
                         f"every row from its last column, so these rows would be continued from their pad tokens; "
                         f"pad the prompts on the left (tokenizer padding_side='left'){note}")


_NOTE_PAD_ID = "; without an attention_mask, generate() takes every id equal to pad_token_id for a pad"


def _mask_from_pads(ids, config, kwargs):
    """The ``attention_mask`` that ``generate()`` makes for ``ids`` given without one (its
    ``_prepare_attention_mask_for_generation``): 0 where an id equals ``pad_token_id`` (``kwargs``' or the generation
    config ``config``'s), 1 elsewhere; ``None`` where it makes one of ones (no pad id, a pad id that is also an eos
    id, no pad id among ``ids``, or no ``input_ids``)."""
    if not torch.is_tensor(ids) or ids.dim() != 2 or ids.is_floating_point() or kwargs.get("inputs_embeds") is not None:
        return None
    pad = kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
    eos = kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    if pad is None:
        return None
    pad = int(torch.as_tensor(pad).flatten()[0])
    if eos is not None and pad in torch.as_tensor(eos).flatten().tolist():
        return None
    pads = ids == pad
    return (~pads).long() if bool(pads.any()) else None


class FalconBlock(nn.Module):
    """``h + Mixer(RMSNorm(h))`` then ``h + SwiGLU(RMSNorm(h))``.

    With ``gradient_checkpointing`` set (``model.gradient_checkpointing_enable()``, or
    ``activation_checkpointing_enable()`` in transformers 5; with ``every_n_layers=n`` blocks ``0, n, 2n, ...``)
    the block keeps only its input for the backward and runs its forward again there, when training with
    gradients."""

    gradient_checkpointing = False

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
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            if cache is not None:  # the replay in the backward would write the cache a second time
                raise ValueError("activation checkpointing runs each block again in the backward, which would "
                                 "write the cache twice: pass use_cache=False (and no past_key_values) when "
                                 "training with it")
            if not h.requires_grad:  # a frozen embedding: the reentrant checkpoint (transformers 4's default) would
                h = h.detach().requires_grad_()  # give the block's weights no gradient
            return self._gradient_checkpointing_func(self._forward, h, packing, None)
        return self._forward(h, packing, cache)

    def _forward(self, h: torch.Tensor, packing: Packing, cache: Optional[LayerCache]) -> torch.Tensor:
        h = h + self.mixer(self.mixer_norm(h), packing, cache)
        return h + self.mlp(self.mlp_norm(h))


class FalconPreTrainedModel(PreTrainedModel):
    """The ``transformers`` base of the models of :class:`FalconConfig`: the config class, the weight
    initialization (``_init_weights``) and the Hugging Face loading and saving."""

    config_class = FalconConfig
    base_model_prefix = "model"
    _no_split_modules = ["FalconBlock"]
    _is_stateful = True
    supports_gradient_checkpointing = True

    def get_correct_attn_implementation(self, requested_attention, is_init_check: bool = False) -> str:
        """transformers' choice of ``attn_implementation``: ``"sdpa"``, which scripts pass to ``from_pretrained``
        and ``from_config``, is taken, as it names what the Transformer mixer runs (torch's
        ``scaled_dot_product_attention``; the recurrent mixers have none), and builds the same model; nothing
        asked stays ``"eager"`` (where transformers would pick ``"sdpa"`` and then refuse ``output_attentions``
        with its own message before the model's); any other request is transformers' to judge."""
        if requested_attention is None:
            return "eager"
        if requested_attention == "sdpa":
            return "sdpa"
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    def __init__(self, config: FalconConfig, *inputs, **kwargs):
        if isinstance(config, FalconConfig):  # fields set on the config after it was built are checked here
            config.validate_fields()
        super().__init__(config, *inputs, **kwargs)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=checkpoint,
                                    every_n_layers: int = 1) -> None:
        """Hugging Face's switch, with ``every_n_layers`` (``activation_checkpointing_enable(every_n_layers=n)``,
        transformers 5) applied to the blocks: blocks ``0, n, 2n, ...`` run again in the backward, the others keep
        their activations (transformers counts only its own layer class, so it would checkpoint every block)."""
        check_positive_int("every_n_layers", every_n_layers)
        super()._set_gradient_checkpointing(enable=enable, gradient_checkpointing_func=gradient_checkpointing_func)
        blocks = [m for m in self.modules() if isinstance(m, FalconBlock)]
        for i, block in enumerate(blocks):
            block.gradient_checkpointing = enable and i % every_n_layers == 0

    def _initialize_weights(self, module: nn.Module, *args, **kwargs) -> None:
        """transformers' per-module initialization, except on a module whose own parameters are all on the meta
        device: nothing can be set there, and transformers 4.x would still mark the module initialized when the model
        is built, so that ``init_weights()`` after ``to_empty`` left the memory as it came (transformers 5 skips the
        whole initialization on the meta device instead). A module with some parameters on the meta device and some
        not (transformers 4's ``from_pretrained``: those a checkpoint lacks are given memory first) is initialized."""
        own = list(module.parameters(recurse=False))
        if own and all(p.is_meta for p in own):
            return
        super()._initialize_weights(module, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        """muP-style init: embedding ``N(0, sigma^2)``; hidden matrices
        ``N(0, sigma^2 / m)`` (``m`` the width multiplier, i.e. variance ``~ 1/fan_in``);
        residual-branch outputs (``o_proj``, ``down_proj``) additionally ``/ (2L)``.
        Gate offsets and decays take their modules' starting values (``ContextGates.initial_values``),
        ``D`` ones, short-convolution kernels ``ShortConv.reset_parameters``; a parameter already set
        (loaded from a checkpoint, or a kernel drawn when its module was built) is left as it is, so
        ``from_pretrained`` initializes exactly the parameters a checkpoint lacks."""
        cfg = self.config
        std = cfg.initializer_range
        if isinstance(module, ContextGates):
            for name, value in module.initial_values().items():
                _copy_init(getattr(module, name), value)
        elif isinstance(module, FalconAttention) and module.D is not None:
            _init.ones_(module.D)
        elif isinstance(module, ShortConv):
            if not getattr(module.weight, "_is_hf_initialized", False):
                module.reset_parameters()
        elif isinstance(module, nn.Embedding):
            _init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Linear):
            s = std / math.sqrt(cfg.width_multiplier)
            if getattr(module, "residual_out", False):
                s = s / math.sqrt(2 * cfg.num_hidden_layers)
            _init.normal_(module.weight, mean=0.0, std=s)
        elif isinstance(module, RMSNorm):
            _init.ones_(module.weight)


class FalconModel(FalconPreTrainedModel):
    """Embedding, blocks and final norm; ``forward(h, packing, cache)`` maps the embeddings ``h``
    ``[B, T, D]`` (``D = hidden_size``; ``[1, N_tok, D]`` packed) to the final normalized hidden states
    of the same shape."""

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

    def forward(self, h: torch.Tensor, packing: Packing, cache: Optional[FalconCache],
                hidden_states: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """``h`` ``[B, T, D]`` embeddings in the layout of ``packing``. ``hidden_states``: a list that
        receives the input of every block and the final normalized output (``L + 1`` tensors like ``h``)."""
        for i, layer in enumerate(self.layers):
            if hidden_states is not None:
                hidden_states.append(h)
            h = layer(h, packing, None if cache is None else cache[i])
        h = self.norm(h)
        if hidden_states is not None:
            hidden_states.append(h)
        return h


class FalconForCausalLM(FalconPreTrainedModel, GenerationMixin):
    """Causal LM over any mixer of :class:`FalconConfig`, Hugging Face compatible.

    ``forward(input_ids, attention_mask=None, labels=None, past_key_values=None,
    use_cache=None, cu_seqlens=None, return_dict=None, output_hidden_states=None, logits_to_keep=0,
    inputs_embeds=None, position_ids=None)``:

    * ``input_ids`` ``[B, T]``, or instead ``inputs_embeds`` ``[B, T, hidden_size]`` (soft prompts,
      continuous inputs: they replace ``embed_tokens(input_ids)``, cast to its dtype, so the two give identical
      results and everything below applies to either; ``generate(inputs_embeds=...)`` consumes them in the
      prompt step and returns the new tokens); ``attention_mask`` ``[B, T_past + T]`` (1 real, 0 pad;
      left or right padding; exactly ``[B, T]`` without a cache that has consumed columns), only its last ``T``
      columns describe ``input_ids``;
    * ``cu_seqlens`` ``[N + 1]``: ``input_ids`` ``[1, total]`` holds ``N`` packed
      documents; each starts fresh (sentinel, conv, positions); logits keep the
      packed shape and the loss skips the boundary targets; an ``attention_mask`` with it can only be
      ones of the packed row's shape (any other mask is refused);
    * ``position_ids`` ``[B, T]`` (or ``[1, T]``): ``None`` or the positions the model counts itself change
      nothing; positions that restart at 0 inside a row (``DataCollatorWithFlattening``'s padding-free batches:
      examples flattened into a row, each numbered from 0, in one row or several) delimit packed sequences as
      ``cu_seqlens`` does, and the loss skips each one's first token; any other positions, positions that restart
      where ``cu_seqlens`` disagrees, or restarts with a cache that has consumed tokens are refused by name;
    * ``labels`` ``[B, T]`` integer ids (``-100`` ignored; pads are ignored anyway): mean
      next-token cross-entropy of ``logits[:, :-1]`` against ``labels[:, 1:]``;
    * ``past_key_values`` (or ``cache``): a :class:`FalconCache` to continue;
      ``use_cache=True`` returns it (a fresh one when none is given); with ``use_cache=False`` a filled one is
      still continued (it is the call's context), but not returned;
    * ``output_hidden_states``: also return the embeddings, the output of every block but the
      last and the final normalized output, ``L + 1`` tensors ``[B, T, D]`` (zeros at pads);
    * ``logits_to_keep`` ``k > 0``: logits of the last ``k`` columns only, ``[B, k, vocab]``
      (``generate()`` asks for 1: the prompt step then skips the vocabulary projection of every
      other prompt token); not with ``labels``.

    Returns ``CausalLMOutputWithPast`` (``loss``, ``logits`` ``[B, T, vocab]`` in
    at least float32, the cache, ``hidden_states``), or with ``return_dict=False`` (or
    ``config.return_dict = False``) the tuple of its fields that are not ``None``.
    On the meta device (a model built under ``torch.device("meta")``, for shape inference) the forward returns
    the shapes and dtypes of a real call (loss, cache and gradients included): the checks of the token ids in
    ``input_ids`` and ``labels`` have no values to read there, and ``attention_mask`` and ``cu_seqlens``, whose
    values lay the tokens out, are refused by name.
    ``generate()`` works with the recurrent cache. ``gradient_checkpointing_enable()`` (in transformers 5
    ``activation_checkpointing_enable()``) makes each block run again in the backward instead of keeping its
    activations; training then takes no cache.
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

    # generate() options that roll the cache back to the tokens a draft got accepted for
    _ASSISTED_OPTIONS = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``; assisted and prompt-lookup decoding are refused by name: they roll
        the cache back to the accepted draft tokens, and a recurrent state cannot be rolled back.

        ``prefill_chunk_size=n`` (or the generation config's): the prompt's columns the cache has not consumed go
        through the model ``n`` at a time (the first call reaches every row's first real token under left
        padding), the last ``n`` or fewer in ``generate()``'s first step, which continues that cache; without an
        ``attention_mask`` the chunks get the mask ``generate()`` makes (its ids equal to ``pad_token_id`` are pads,
        where that id is no eos id). Hugging
        Face's own chunked prefill needs a cache before the first step and, without padding, gives the chunks
        no mask that says which columns they are.

        Prompts are padded on the left: an ``attention_mask`` whose last column has a 0 in some row (right padding,
        or, without a mask, a row that ends in ``pad_token_id``) is a ``ValueError`` naming ``attention_mask``. Every
        row's first new token is chosen from the last column's logits and the new tokens follow the last column, so
        a right-padded row would be continued from its pads. The forward takes right padding (training, scoring)."""
        config = kwargs.get("generation_config") or self.generation_config
        for name in self._ASSISTED_OPTIONS:
            if kwargs.get(name) is not None or getattr(config, name, None) is not None:
                raise ValueError(f"generate({name}=...): assisted and prompt-lookup decoding roll the cache back to "
                                 f"the draft tokens that were accepted, which a recurrent state cannot do; decode "
                                 f"without them")
        if kwargs.get("output_attentions") or getattr(config, "output_attentions", False):
            raise ValueError(_NO_ATTENTIONS)
        chunk = kwargs.get("prefill_chunk_size", getattr(config, "prefill_chunk_size", None))
        note = ""
        if chunk is not None and kwargs.get("attention_mask") is None:
            # the chunks go through the forward before generate() makes its mask: they are given that mask
            mask = _mask_from_pads(args[0] if args else kwargs.get("input_ids", kwargs.get("inputs")), config,
                                   kwargs)
            if mask is not None:
                kwargs, note = {**kwargs, "attention_mask": mask}, _NOTE_PAD_ID
        _check_left_padded(kwargs.get("attention_mask"), note)
        if kwargs.get("position_ids") is not None:
            self._check_generate_positions(kwargs["position_ids"], kwargs.get("attention_mask"),
                                           kwargs.get("cache", kwargs.get("past_key_values")))
        if chunk is not None:
            args, kwargs = self._prefill_in_chunks(chunk, args, kwargs)
        return super().generate(*args, **kwargs)

    @staticmethod
    def _check_generate_positions(position_ids, attention_mask, cache) -> None:
        """A ``ValueError`` naming ``position_ids`` given to ``generate()`` unless they number each row's real
        tokens (the ``attention_mask``'s last columns, or all) one after another, from 0 without a filled cache:
        ``generate()`` continues one sequence per row and the model counts those positions itself (the
        ``position_ids`` that ``generate()`` passes on are not read), so positions that restart (packed examples) or
        skip would be silently replaced."""
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
            raise ValueError(f"position_ids given to generate() must be an integer tensor [B, T], got "
                             f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
        pos = position_ids.long()
        if attention_mask is not None and attention_mask.dim() == 2 and attention_mask.shape[1] >= pos.shape[1]:
            real = attention_mask[:, -pos.shape[1]:].bool().to(pos.device).expand(pos.shape[0], -1) \
                if attention_mask.shape[0] in (1, pos.shape[0]) else None
        else:
            real = None
        fresh = cache is None or getattr(cache, "empty", True)
        for r in range(pos.shape[0]):
            row = (pos[r] if real is None or real.shape[0] <= r else pos[r][real[r]]).tolist()
            bad = bool(row) and fresh and row[0] != 0
            bad = bad or any(b != a + 1 for a, b in zip(row, row[1:]))
            if bad:
                raise ValueError(f"position_ids given to generate() must number each row's real tokens 0, 1, 2, "
                                 f"... (continuing past_key_values' count), as generate() makes them; row {r} has "
                                 f"{row[:8]}{' ...' if len(row) > 8 else ''}: generate() continues one sequence per "
                                 f"row (packed examples, whose position_ids restart at 0, are for the forward)")

    def _prefill_in_chunks(self, chunk, args, kwargs):
        """``generate()``'s arguments after the prompt's columns but the last went through the cache ``chunk`` at
        a time (see :meth:`generate`): the same, with that cache and ``prefill_chunk_size=None``."""
        check_positive_int("prefill_chunk_size", chunk)
        if kwargs.get("use_cache") is False:
            raise ValueError("prefill_chunk_size fills the cache in chunks: it needs use_cache=True")
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        if ids is None or kwargs.get("inputs_embeds") is not None:
            raise ValueError("prefill_chunk_size prefills the prompt's input_ids in chunks; generate from "
                             "inputs_embeds without it")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        _check_cache_type(cache)
        if cache is None:
            cache = FalconCache(self.config.num_hidden_layers)
            kwargs = {**kwargs, _CACHE_FIELD: cache}
        # the mask covers the consumed columns and the new ones; the ids are all of them or the new ones only
        mask = kwargs.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        lead = mask.shape[1] - ids.shape[1]
        start = cache.num_positions
        end = start + chunk
        if cache.empty:  # the first call needs a real token in every row: its first under left padding
            end = max(end, int(mask.bool().float().argmax(1).max()) + 1)
        with torch.no_grad():
            while 0 <= lead <= start and end < mask.shape[1]:
                self(input_ids=ids[:, start - lead:end - lead], attention_mask=mask[:, :end], cache=cache,
                     use_cache=True, logits_to_keep=1)
                start, end = end, end + chunk
        return args, {**kwargs, "prefill_chunk_size": None}

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, cache=None, past_key_values=None,
                                      use_cache=None, inputs_embeds=None, is_first_iteration=None, **kwargs):
        """Feed only the columns the cache has not consumed yet. ``attention_mask`` covers the columns the cache
        consumed followed by the new ones, so the new ones are its last ``attention_mask.shape[1] -
        cache.num_positions``, whether the inputs repeat the consumed columns (the whole sequence) or hold only the
        new ones (Hugging Face's two conventions for a prefilled cache; also what a chunked prefill passes); without
        a mask, the inputs are the whole sequence (transformers 5.2x drops a mask of ones before the first step, so
        without padding only the whole sequence works there; it works with every version). A cache of ``R`` rows
        continued by ``k * R`` rows (``num_beams`` or ``num_return_sequences`` over a prefilled cache: ``generate()``
        repeats each input row ``k`` times) has each of its rows repeated ``k`` times first.

        ``generate(inputs_embeds=...)``: the first step (the prompt) consumes ``inputs_embeds``, the later ones the
        generated ids (``input_ids`` then need not line up with the cached columns: without a mask the new id is the
        last column). The prompt step is the one transformers 5 passes ``is_first_iteration`` for; transformers 4
        passes none, and there it is the step whose embeddings reach past the columns the cache consumed (after
        the prompt step the cache has consumed all of them). ``next_sequence_length``, which transformers 5 passes,
        is not relied on: its value at the prompt step differs between versions. Nor are the ``position_ids`` that
        ``generate()`` makes from the mask and passes here: the forward counts the same positions from the mask and
        the cache (:meth:`generate` checks those given to it)."""
        if kwargs.get("cu_seqlens") is not None:
            raise ValueError("generate() does not take cu_seqlens: pass the prompts as a padded batch with "
                             "attention_mask (left padding)")
        cache = cache if cache is not None else past_key_values
        _check_cache_type(cache)
        fresh = cache is None or cache.empty
        if fresh:  # the prompt step: also a mask generate() made from pad_token_id, which generate() did not see
            _check_left_padded(attention_mask, _NOTE_PAD_ID)
        if is_first_iteration is None and inputs_embeds is not None and not fresh:
            is_first_iteration = inputs_embeds.shape[1] > cache.num_positions
        use_embeds = inputs_embeds is not None and (fresh or bool(is_first_iteration))
        x, name = (inputs_embeds, "inputs_embeds") if use_embeds else (input_ids, "input_ids")
        if not fresh:
            past = cache.num_positions
            if attention_mask is not None and attention_mask.dim() == 2:
                new = attention_mask.shape[1] - past
            elif inputs_embeds is not None and not use_embeds:
                new = 1  # a decoding step after a prompt of embeddings: the new id is last
            else:
                new = x.shape[1] - past
            if not 1 <= new <= x.shape[1]:
                if inputs_embeds is not None:  # decoding steps are never refused: the embeddings are at fault
                    x, name = inputs_embeds, "inputs_embeds"
                if new < 1 or attention_mask is None:
                    raise ValueError(
                        f"past_key_values has consumed {past} columns, but {name} has {x.shape[1]}"
                        + ("" if attention_mask is None else f" (attention_mask {attention_mask.shape[1]})")
                        + ": pass the whole sequence the cache has seen followed by at least one new token")
                raise ValueError(
                    f"attention_mask has {attention_mask.shape[1]} columns and past_key_values has consumed {past}, "
                    f"so {name} needs at least the {new} new columns, got {x.shape[1]}")
            start = x.shape[1] - new
            rows = cache.seen.shape[0]
            if x.shape[0] != rows and x.shape[0] % rows == 0:
                cache.batch_repeat_interleave(x.shape[0] // rows)
            x = x[:, start:]
        inputs = {name: x.contiguous(), "attention_mask": attention_mask, "use_cache": use_cache}
        if kwargs.get("output_hidden_states"):
            inputs["output_hidden_states"] = True
        if kwargs.get("logits_to_keep"):  # generate() asks for the last column's logits only
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
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
    def _layout(self, x, name: str, attention_mask, cu_seqlens, cache: Optional[FalconCache]):
        """Decide dense vs packed for the input ``x`` (``input_ids`` ``[B, T]`` or ``inputs_embeds``
        ``[B, T, D]``, called ``name`` in errors; only its shape and device are read); returns
        (packing, unpad index or None, real tokens per row).

        ``attention_mask`` covers the columns a cache has consumed followed by these ``T``: ``[B, T_past + T]``,
        ``T_past = past_key_values.num_positions`` (0 without a cache or with an empty one, so the mask is then
        exactly ``[B, T]``); a continuing call may also give only the last columns of it (``[B, T]`` at the
        least). With ``cu_seqlens`` (``B = 1``) the documents' bounds say everything a mask could, so a mask
        there must be all ones, of that same shape ``[1, T]`` (``[1, T_past + T]`` at most when continuing)."""
        B, T = x.shape[:2]
        if cu_seqlens is not None and (x.is_meta or getattr(cu_seqlens, "is_meta", False)):
            raise ValueError("cu_seqlens: packed documents are laid out from the values of their offsets, which the "
                             "meta device does not hold; on it, pass [B, T] rows without cu_seqlens")
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens)
            if B != 1:
                shape = "[1, total, hidden_size]" if x.dim() == 3 else "[1, total]"
                raise ValueError(f"cu_seqlens needs {name} of shape {shape}, got {tuple(x.shape)}")
        if attention_mask is not None:
            past = 0 if cache is None or cache.empty else cache.num_positions
            width = attention_mask.shape[-1] if attention_mask.dim() else 0
            if attention_mask.dim() != 2 or attention_mask.shape[0] != B or not T <= width <= past + T:
                raise ValueError(f"attention_mask must have shape [B, >= T] = [{B}, >= {T}] and at most "
                                 f"[B, T_past + T] = [{B}, {past + T}] ({name}'s first two axes, T_past = {past} "
                                 f"columns consumed by past_key_values), got {tuple(attention_mask.shape)}")
            if x.is_meta or attention_mask.is_meta:
                raise ValueError("attention_mask: which columns are padding is read from its values, which the meta "
                                 "device does not hold; on it, call without attention_mask (the outputs have the "
                                 "same shapes)")
        offsets = None if cache is None or cache.empty else cache.seen
        if offsets is not None:
            rows = B if cu_seqlens is None else cu_seqlens.numel() - 1
            if offsets.shape[0] != rows:
                raise ValueError(f"past_key_values holds {offsets.shape[0]} sequences, but this call continues "
                                 f"{rows} ({name} of shape {tuple(x.shape)})")
        if cu_seqlens is not None:
            if attention_mask is not None and not bool(attention_mask.bool().all()):
                raise ValueError("pass either cu_seqlens or an attention_mask with padding, not both")
            cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
            bounds = sequence_bounds(cu, T)
            rows = torch.arange(cu.numel() - 1, device=x.device)
            packing = Packing.from_cu_seqlens(cu, rows, offsets, bounds, host_rows=range(cu.numel() - 1))
            return packing, None, cu[1:] - cu[:-1]
        if attention_mask is not None:
            mask = attention_mask[:, -T:].to(device=x.device, dtype=torch.bool)
            if not bool(mask.all()):
                _, index, cu, rows = unpad(mask[..., None], mask)
                if cache is not None and cache.empty and rows.numel() != B:
                    empty = sorted(set(range(B)) - set(rows.tolist()))
                    raise ValueError(f"attention_mask: every row needs at least one real token in the first call "
                                     f"with a cache, rows {empty} have none (a model in eval mode makes a cache "
                                     f"unless given use_cache=False, which takes empty rows)")
                return Packing.from_cu_seqlens(cu, rows, offsets), index, mask.sum(1)
        real = torch.full((B,), T, dtype=torch.int64, device=x.device)
        return Packing.dense(B, T, offsets, x.device), None, real

    _POSITIONS_ACCEPTED = ("position_ids must be the positions the model counts itself (0, 1, 2, ... along each "
                           "row's real tokens, after the tokens past_key_values holds; any value at a pad), or, for "
                           "examples packed into a row (DataCollatorWithFlattening), restart at 0 at each example's "
                           "first token and rise by 1 within it")

    def _position_layout(self, position_ids, x, packing: Packing, index, real, cu_seqlens,
                         cache: Optional[FalconCache]):
        """The layout of :meth:`_layout` (``packing``, ``index``, ``real``) checked against ``position_ids``
        ``[B, T]`` (or ``[1, T]``, shared by every row), and the flat indices into ``B * T`` of the first tokens
        of the sequences they delimit (``None`` where they change nothing).

        Positions equal to the ones the layout counts (real tokens only: a pad's position is never read) leave it
        as it is. Positions that restart at 0 inside a row (padding-free training: examples flattened into one
        row, each numbered from 0) split the rows' real tokens into packed sequences there, as ``cu_seqlens``
        would: each starts fresh (state, short convolutions, RoPE positions, attention span) and its first token
        is not scored. Anything else is a ``ValueError`` naming ``position_ids``: so are positions that restart
        with ``cu_seqlens`` given (which then says where sequences start) or with a cache that has consumed tokens
        (which continues one sequence per row)."""
        B, T = x.shape[:2]
        if not isinstance(position_ids, torch.Tensor):
            raise TypeError(f"position_ids must be an integer torch.Tensor of shape [B, T], got "
                            f"{type(position_ids).__name__}")
        if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
            raise TypeError(f"position_ids must hold integers, got {position_ids.dtype}")
        if position_ids.dim() != 2 or position_ids.shape[1] != T or position_ids.shape[0] not in (1, B):
            raise ValueError(f"position_ids must have shape [B, T] = [{B}, {T}] (or [1, {T}], shared by every row; "
                             f"the positions of these columns only), got {tuple(position_ids.shape)}")
        if x.is_meta or position_ids.is_meta:
            raise ValueError("position_ids: where sequences start is read from their values, which the meta device "
                             "does not hold; on it, call without position_ids")
        pos = position_ids.to(device=x.device, dtype=torch.int64).expand(B, T).reshape(-1)
        flat = pos if index is None else pos.index_select(0, index)  # the real tokens, in the layout's order
        if bool((flat == packing.positions.reshape(-1)).all()):
            return packing, index, real, None

        def where(i: int) -> str:  # the entry of position_ids at the layout's token i
            row, col = divmod(i if index is None else int(index[i]), T)
            return f"position_ids[{row if position_ids.shape[0] == B else 0}, {col}] = {int(flat[i])}"

        if cu_seqlens is not None:
            bad = int((flat != packing.positions.reshape(-1)).nonzero()[0])
            raise ValueError(f"position_ids disagree with cu_seqlens: {where(bad)}, but cu_seqlens puts that token "
                             f"at position {int(packing.positions.reshape(-1)[bad])} of its sequence; pass one of "
                             f"them, or position_ids that restart at 0 exactly where cu_seqlens starts a sequence")
        if cache is not None and not cache.empty:
            bad = int((flat != packing.positions.reshape(-1)).nonzero()[0])
            raise ValueError(f"position_ids must continue the positions of past_key_values, which continues one "
                             f"sequence per row: {where(bad)}, where the model counts "
                             f"{int(packing.positions.reshape(-1)[bad])} (packed examples need a fresh cache); "
                             + self._POSITIONS_ACCEPTED)
        # every row's first real token starts a sequence; so does every other token at position 0
        first = packing.cu_seqlens[:-1] if packing.packed else torch.arange(B, device=x.device) * T
        is_start = flat == 0
        ok = (flat[1:] == flat[:-1] + 1) | is_start[1:]
        ok = torch.cat([is_start[:1], ok])
        ok[first] = is_start[first]
        if not bool(ok.all()):
            bad = int((~ok).nonzero()[0])
            raise ValueError(f"position_ids cannot be read as sequences: {where(bad)} (a sequence's first position "
                             f"must be 0 and each next one 1 more); " + self._POSITIONS_ACCEPTED)
        heads = is_start.nonzero().flatten()
        cu = torch.cat([heads, heads.new_tensor([flat.numel()])])
        bounds = sequence_bounds(cu, flat.numel())
        packing = Packing.from_cu_seqlens(cu, torch.arange(cu.numel() - 1, device=x.device), None, bounds,
                                          host_rows=range(cu.numel() - 1))
        if index is None and B > 1:  # several rows: run as one packed row, put back in [B, T] after
            index = torch.arange(B * T, device=x.device)
        return packing, index, cu[1:] - cu[:-1], heads if index is None else index[heads]

    def _check_cache_fits(self, cache: FalconCache) -> None:
        """A ``ValueError`` naming ``past_key_values`` unless ``cache`` has one layer per block and, once filled,
        holds in each what the block's mixer stores there: keys and values for attention, a recurrent state and
        the short-convolution buffers (``q``, ``k``, ``v`` when it convolves) for the recurrent mixers. A cache of
        another model would otherwise start those layers from nothing at the positions it has counted."""
        blocks = self.model.layers
        if len(cache) != len(blocks):
            raise ValueError(f"past_key_values has {len(cache)} layers, the model {len(blocks)}: pass the cache this "
                             f"model returned (or a fresh FalconCache({len(blocks)}))")
        if cache.empty or (cache.checked_for is not None and cache.checked_for() is self):
            return
        for i, (block, layer) in enumerate(zip(blocks, cache.layers)):
            if isinstance(block.mixer, CausalSelfAttention):
                missing = "no keys and values" if layer.keys is None else None
            elif layer.state is None:
                missing = "no recurrent state"
            else:
                convs = set(block.mixer.convs)
                missing = None if set(layer.conv) == convs else \
                    f"short-convolution buffers {sorted(layer.conv)}, not {sorted(convs)}"
            if missing is not None:
                raise ValueError(f"past_key_values was filled by another model: layer {i} holds {missing} "
                                 f"({self.config.mixer} mixer); pass the cache this model returned")
        cache.checked_for = weakref.ref(self)

    def _input_embeddings(self, input_ids, inputs_embeds):
        """``embed_tokens(input_ids)`` or ``inputs_embeds`` (exactly one given), checked: ``[B, T, D]``, ``T >= 1``."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds, got "
                             + ("both" if input_ids is not None else "neither"))
        if input_ids is not None:
            if input_ids.dim() != 2 or input_ids.shape[1] == 0:
                raise ValueError(f"input_ids must have shape [B, T] with T >= 1, got {tuple(input_ids.shape)}")
            if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
                raise ValueError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
            # the lookup's own error names no argument (on CUDA: a device assert); not traced, where the
            # comparison would break the graph at every call; not on the meta device, which holds no values
            if not input_ids.is_cuda and not input_ids.is_meta and not torch.compiler.is_compiling():
                low, high = torch.aminmax(input_ids)
                V = self.model.embed_tokens.num_embeddings
                if low < 0 or high >= V:
                    raise ValueError(f"input_ids holds token id {int(low) if low < 0 else int(high)}, outside the "
                                     f"vocabulary [0, {V})")
            return self.model.embed_tokens(input_ids)
        D = self.config.hidden_size
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[1] == 0 or inputs_embeds.shape[2] != D:
            raise ValueError(f"inputs_embeds must have shape [B, T, hidden_size] = [B, T, {D}] with T >= 1, "
                             f"got {tuple(inputs_embeds.shape)}")
        if not inputs_embeds.is_floating_point():
            raise ValueError(f"inputs_embeds must be a floating-point tensor, got {inputs_embeds.dtype}")
        # in the dtype of embed_tokens(input_ids) (e.g. a soft prompt kept in float32 for a bfloat16 model);
        # the cast is differentiable, the gradient comes back in the embeddings' own dtype
        return inputs_embeds.to(self.model.embed_tokens.weight.dtype)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        past_key_values: Optional[FalconCache] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[FalconCache] = None,
        return_dict: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        logits_to_keep: int = 0,
        inputs_embeds: Optional[torch.Tensor] = None,
        output_attentions: Optional[bool] = None,
        position_ids: Optional[torch.Tensor] = None,
    ) -> CausalLMOutputWithPast:
        if output_attentions is None:  # None: the config's, as output_hidden_states and return_dict are read
            output_attentions = bool(getattr(self.config, "output_attentions", False))
        if output_attentions:
            raise ValueError(_NO_ATTENTIONS)
        h = self._input_embeddings(input_ids, inputs_embeds)
        if not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0: every position), got {logits_to_keep!r}")
        if logits_to_keep and labels is not None:
            raise ValueError(f"labels are scored against the logits of every position: logits_to_keep must be 0 "
                             f"with labels, got {logits_to_keep}")
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("cache and past_key_values are two names of one argument: pass one of them")
        cache = cache if cache is not None else past_key_values
        _check_cache_type(cache)
        if use_cache is not None:  # None (as Hugging Face may pass it): the config's, or True with a cache given
            if not isinstance(use_cache, (bool, np.bool_)):  # text such as "no" would count as true
                raise TypeError(f"use_cache must be True, False or None, got {use_cache!r}")
            use_cache = bool(use_cache)
        if use_cache is None:
            use_cache = cache is not None or (self.config.use_cache and not self.training)
        if use_cache and cache is None:
            cache = FalconCache(self.config.num_hidden_layers)
        # a cache that is passed is this call's context whatever use_cache says (as in transformers' own models:
        # generate() keeps a cache the user passes with use_cache=False); use_cache=False leaves it out of the output
        if not use_cache and (cache is None or cache.empty):
            cache = None
        if cache is not None:
            self._check_cache_fits(cache)
        B, T = h.shape[:2]
        x, name = (input_ids, "input_ids") if input_ids is not None else (inputs_embeds, "inputs_embeds")
        if labels is not None and tuple(labels.shape) != (B, T):
            raise ValueError(f"labels must have the shape of {name}'s first two axes, {(B, T)}, got "
                             f"{tuple(labels.shape)}")
        if labels is not None and (labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool):
            raise ValueError(f"labels must hold integer token ids (-100: not scored), got {labels.dtype}")
        if labels is not None and labels.is_meta and not h.is_meta:  # (labels on another real device are moved)
            raise ValueError(f"labels are on the meta device, which holds no values to score, and {name} on "
                             f"{x.device}: pass labels on {x.device} (labels on another device are moved to the "
                             f"logits'), or the model, {name} and labels all on the meta device for a call's shapes")
        packing, index, real = self._layout(x, name, attention_mask, cu_seqlens, cache)
        starts = None
        if position_ids is not None:
            packing, index, real, starts = self._position_layout(position_ids, x, packing, index, real, cu_seqlens,
                                                                 cache)
        targets = None if labels is None else self._targets(labels, attention_mask, cu_seqlens, T, starts)
        if targets is not None and not targets.is_cuda and not targets.is_meta and not torch.compiler.is_compiling():
            self._check_label_range(targets[:, 1:])  # the scored ones: a pad's label is never read
        if index is not None:
            h = h.reshape(B * T, -1).index_select(0, index)[None]
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        hidden = [] if output_hidden_states else None
        if index is not None and index.numel() == 0:  # every column a pad: no block has a token to see
            hidden = None if hidden is None else [h] * (len(self.model.layers) + 1)
        else:
            with known_sequence_bounds(packing.cu_seqlens, packing.bounds):  # one device read per batch
                h = self.model(h, packing, cache, hidden)
        if index is not None:
            hidden = None if hidden is None else [repad(x, index, B, T) for x in hidden]
            if logits_to_keep:  # the last columns of the padded layout
                h, index = repad(h, index, B, T), None
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = cast_to(F.linear(h, weight), torch.promote_types(h.dtype, torch.float32))
        if self.config.width_multiplier != 1.0:
            logits = logits / self.config.width_multiplier
        if index is not None:
            logits = repad(logits, index, B, T)
        if cache is not None:
            cache.advance(real, T)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   targets[:, 1:].to(logits.device).reshape(-1), ignore_index=-100)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=None if hidden is None else tuple(hidden),
                                     **{_CACHE_FIELD: cache if use_cache else None})
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict else out.to_tuple()

    def _check_label_range(self, labels: torch.Tensor) -> None:
        """Every scored label ``-100`` (not scored) or a row of the output head ``[0, vocab)``: cross-entropy's
        own error names no argument (on CUDA: a device assert, so this host check runs off CUDA only, as the one
        of ``input_ids``). One ``aminmax`` over the labels with the ignored ones set to 0."""
        if not labels.numel():
            return
        V = (self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight).shape[0]
        low, high = torch.aminmax(labels.masked_fill(labels == -100, 0))
        if low < 0 or high >= V:
            raise ValueError(f"labels holds token id {int(low) if low < 0 else int(high)}, outside the vocabulary "
                             f"[0, {V}) (-100: not scored)")

    @staticmethod
    def _targets(labels, attention_mask, cu_seqlens, T, starts=None):
        """``labels`` as int64 on their device, with ``-100`` (not scored) wherever the loss reads no
        prediction: pads, the token after a pad and each packed document's first token (``starts``: the flat
        indices into ``B * T`` of the first tokens of the sequences ``position_ids`` delimit). Column ``t`` is
        scored against the logits of column ``t - 1``."""
        targets = labels.to(torch.int64, copy=True)  # int32 ids score as int64 ones
        if attention_mask is not None:
            real = attention_mask[:, -T:].to(targets.device).bool()
            targets = targets.masked_fill(~real, -100)
            # a target is scored against the logits of the column before it: a pad there (left padding)
            # has zero logits and no context, so the first real token of a row is not a prediction
            targets[:, 1:] = targets[:, 1:].masked_fill(~real[:, :-1], -100)
        if cu_seqlens is not None:  # the first token of a document is not predicted from the previous one
            targets[:, cu_seqlens[1:-1].to(targets.device).long()] = -100
        if starts is not None:  # the same for the sequences position_ids restart
            starts = starts.to(targets.device)
            targets[starts // T, starts % T] = -100
        return targets
