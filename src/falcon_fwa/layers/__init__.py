"""Token mixers and blocks: the Falcon fast-weight layer (which also runs the recurrent
baselines), RoPE attention, short convolution, gates, norms, SwiGLU, packing."""
from .attention import CausalSelfAttention, apply_rope
from .falcon_attention import FalconAttention
from .gates import ContextGates
from .layer_cache import LayerCache
from .mlp import SwiGLU
from .norms import RMSNorm, normalize_features, rms_normalize
from .packing import Packing, cu_seqlens_from_lengths, repad, unpad
from .short_conv import ShortConv

__all__ = ["FalconAttention", "CausalSelfAttention", "apply_rope", "ContextGates", "LayerCache", "SwiGLU",
           "RMSNorm", "normalize_features", "rms_normalize", "Packing", "cu_seqlens_from_lengths", "repad", "unpad",
           "ShortConv"]
