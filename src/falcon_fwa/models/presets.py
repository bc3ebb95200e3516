"""Named configurations: the paper's 124M-130M models and tiny ones for tests.

``get_preset(name, **overrides)`` returns a :class:`FalconConfig`; any config field
can be overridden (``get_preset("falcon-1a.3-130m", vocab_size=32000)``).

The 130M presets share the GPT-2-small scaffold (12 layers, width 768, vocabulary
50304 = GPT-2's 50257 rounded up to a multiple of 64, tied embeddings); each mixer's
SwiGLU width is chosen so that the models land at 124M (Transformer) and ~130M
(recurrent mixers), as in the paper's Table 1. ``falcon-fwa params`` prints the
counts (recorded in benchmarks/results/params.md).
"""
from __future__ import annotations

from typing import Dict

from .configuration import FalconConfig, check_field_names

__all__ = ["PRESETS", "get_preset"]

_SCAFFOLD = dict(vocab_size=50304, hidden_size=768, num_hidden_layers=12, mup_base_width=256)
_TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=2, chunk_size=8, conv_size=3)

PRESETS: Dict[str, dict] = {
    # The paper's LM comparison (Section 5.1, Table 1).
    "transformer-124m": dict(_SCAFFOLD, mixer="transformer", num_heads=12, intermediate_size=2064),
    "retnet-130m": dict(_SCAFFOLD, mixer="retnet", num_heads=6, intermediate_size=2016),
    "mamba2-130m": dict(_SCAFFOLD, mixer="mamba2", num_heads=6, intermediate_size=2016),
    "deltanet-130m": dict(_SCAFFOLD, mixer="deltanet", num_heads=6, intermediate_size=2272),
    "gated_deltanet-130m": dict(_SCAFFOLD, mixer="gated_deltanet", num_heads=6, intermediate_size=2016),
    "falcon-1a.1-130m": dict(_SCAFFOLD, mixer="falcon", rule="1A", num_heads=6, qk_norm="l2", gate="ctx-beta",
                             intermediate_size=2016),
    "falcon-1a.2-130m": dict(_SCAFFOLD, mixer="falcon", rule="1A", num_heads=6, qk_norm="l2", gate="ctx-eta",
                             intermediate_size=2016),
    "falcon-1a.3-130m": dict(_SCAFFOLD, mixer="falcon", rule="1A", num_heads=6, qk_norm="rmsnorm", gate="ctx-eta",
                             intermediate_size=2016),
    "falcon-3a.3-130m": dict(_SCAFFOLD, mixer="falcon", rule="3A", window=4, num_heads=6, qk_norm="rmsnorm",
                             gate="ctx-eta", intermediate_size=2016),
    # Tiny models for tests and quick experiments (vocab 64, width 32, 2 layers).
    "tiny-transformer": dict(_TINY, mixer="transformer"),
    "tiny-falcon": dict(_TINY, mixer="falcon"),
    "tiny-deltanet": dict(_TINY, mixer="deltanet"),
    "tiny-gated_deltanet": dict(_TINY, mixer="gated_deltanet"),
    "tiny-mamba2": dict(_TINY, mixer="mamba2"),
    "tiny-retnet": dict(_TINY, mixer="retnet"),
}
"""The presets by name: keyword arguments of :class:`FalconConfig` (module docstring)."""


def get_preset(name: str, **overrides) -> FalconConfig:
    """The :class:`FalconConfig` of preset ``name`` with ``overrides`` applied. An override that
    is not a config field is an error naming it (a misspelt field would otherwise be stored
    unused and leave the model unchanged)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    check_field_names(overrides, f" for preset {name!r}")
    return FalconConfig(**{**PRESETS[name], **overrides})
