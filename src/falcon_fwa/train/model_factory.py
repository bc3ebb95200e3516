"""Build the language model of a recipe and its optimizer parameter groups."""
from __future__ import annotations

from typing import List

from torch import nn

from .config import EOS_OVERRIDE_REFUSED, ModelSection


def build_model(section: ModelSection, *, vocab_size: int, eos_token_id: int) -> nn.Module:
    """``FalconForCausalLM`` from ``get_preset(section.preset, **overrides)``. Unless the
    overrides set ``vocab_size``, a preset vocabulary smaller than the tokenizer's grows to the
    tokenizer's rounded up to a multiple of 64 (a larger one is kept: padding rows)."""
    from ..models import FalconForCausalLM, get_preset

    overrides = dict(section.overrides)
    if "eos_token_id" in overrides:  # (a recipe's check refuses it too, before any data are read)
        raise ValueError(EOS_OVERRIDE_REFUSED)
    if "vocab_size" not in overrides and get_preset(section.preset).vocab_size < vocab_size:
        overrides["vocab_size"] = 64 * -(-vocab_size // 64)
    # before the config is built: its own check of eos_token_id against the vocabulary would name the
    # end-of-text id, not the override that is too small
    if overrides.get("vocab_size", vocab_size) < vocab_size:
        raise ValueError(f"config field model.overrides.vocab_size = {overrides['vocab_size']} is smaller than the "
                         f"tokenizer's {vocab_size} tokens")
    return FalconForCausalLM(get_preset(section.preset, eos_token_id=eos_token_id, **overrides))


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Keep only each block's input for the backward and run the block again there
    (``train.activation_checkpointing``, ``throughput --activation-checkpointing``): the memory of the
    blocks' activations for one more forward of them. Non-reentrant ``torch.utils.checkpoint``, inside
    each block's ``forward`` (FSDP2's hooks on the block stay outside it); gradients are unchanged."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"activation checkpointing: {type(model).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5: the new name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def param_groups(model: nn.Module, *, lr: float, weight_decay: float) -> List[dict]:
    """The model's own (muP) groups when it defines ``param_groups(lr, weight_decay)``, else
    weight decay on matrices only. Each group records ``lr_multiplier`` = its lr / ``lr`` (the key the
    model's own groups carry)."""
    if hasattr(model, "param_groups"):
        groups = [dict(g) for g in model.param_groups(lr=lr, weight_decay=weight_decay)]
    else:
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        other = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "lr": lr, "weight_decay": weight_decay},
                  {"params": other, "lr": lr, "weight_decay": 0.0}]
    for g in groups:
        g["params"] = list(g["params"])
        g["lr_multiplier"] = g.get("lr", lr) / lr
        g["lr"] = lr * g["lr_multiplier"]
    return [g for g in groups if g["params"]]
