"""Causal language models over the Falcon mixer and the baselines, Hugging Face compatible."""
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def _check_transformers_torch() -> None:
    """Refuse a transformers release that turns its PyTorch models off for the installed torch.

    Such a release (the newest need torch >= 2.6) imports, but every model class in it is a stand-in
    that fails on first use with a message about a missing PyTorch; this says which two versions
    disagree and what to install instead."""
    from transformers.utils import is_torch_available
    if not is_torch_available():
        raise ImportError(
            f"falcon_fwa needs transformers' PyTorch models, and transformers {transformers.__version__} turns "
            f"them off with torch {torch.__version__} (it asks for a newer torch). With this torch, install a "
            f"transformers release that supports it (for torch 2.4-2.5: pip install 'transformers>=4.56,<5'), "
            f"or a newer torch")


_check_transformers_torch()

from .cache import FalconCache
from .configuration import MIXERS, FalconConfig, FalconFWAConfig
from .modeling import FalconForCausalLM, FalconModel, FalconPreTrainedModel
from .params import count_parameters, parameter_table
from .presets import PRESETS, get_preset

AutoConfig.register(FalconConfig.model_type, FalconConfig, exist_ok=True)
AutoModelForCausalLM.register(FalconConfig, FalconForCausalLM, exist_ok=True)

__all__ = ["FalconConfig", "FalconFWAConfig", "FalconForCausalLM", "FalconModel", "FalconPreTrainedModel",
           "FalconCache", "MIXERS", "PRESETS", "get_preset", "count_parameters", "parameter_table"]
