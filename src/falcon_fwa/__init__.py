"""falcon-fwa: Falcon fast-weight attention."""
from .ops import FalconState, falcon_attention, falcon_step
from .models import PRESETS, FalconConfig, FalconForCausalLM, get_preset  # also registers the Auto classes

__version__ = "0.1.0"

__all__ = ["falcon_attention", "falcon_step", "FalconState", "FalconConfig", "FalconForCausalLM", "PRESETS",
           "get_preset", "__version__"]
