"""Causal language models over the Falcon mixer and the baselines, Hugging Face compatible."""
from transformers import AutoConfig, AutoModelForCausalLM

from .cache import FalconCache
from .configuration import MIXERS, FalconConfig, FalconFWAConfig
from .modeling import FalconForCausalLM, FalconModel, FalconPreTrainedModel
from .params import count_parameters, parameter_table
from .presets import PRESETS, get_preset

AutoConfig.register(FalconConfig.model_type, FalconConfig, exist_ok=True)
AutoModelForCausalLM.register(FalconConfig, FalconForCausalLM, exist_ok=True)

__all__ = ["FalconConfig", "FalconFWAConfig", "FalconForCausalLM", "FalconModel", "FalconPreTrainedModel",
           "FalconCache", "MIXERS", "PRESETS", "get_preset", "count_parameters", "parameter_table"]
