"""falcon-fwa: Falcon fast-weight attention."""
from .ops import FalconState, falcon_attention, falcon_step

__version__ = "0.1.0"

__all__ = ["falcon_attention", "falcon_step", "FalconState", "__version__"]
