"""falcon-fwa: Falcon fast-weight attention."""
from .ops import FalconState, FalconTrace, falcon_attention, falcon_step, falcon_trace
from .models import PRESETS, FalconConfig, FalconForCausalLM, FalconFWAConfig, get_preset  # also registers the Auto classes

__version__ = "0.1.0"

__all__ = ["falcon_attention", "falcon_step", "falcon_trace", "FalconState", "FalconTrace", "FalconConfig",
           "FalconFWAConfig", "FalconForCausalLM", "PRESETS", "get_preset", "__version__"]
