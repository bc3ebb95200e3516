"""Named configurations: the paper's 124M-130M models and tiny ones for tests.

``get_preset(name, **overrides)`` returns a :class:`FalconConfig`; any config field
can be overridden (``get_preset("falcon-1a.3-130m", vocab_size=32000)``).

The 130M presets share the GPT-2-small scaffold (12 layers, width 768, vocabulary
50304 = GPT-2's 50257 rounded up to a multiple of 64, tied embeddings); each mixer's
SwiGLU width is chosen so that the models land at 124M (Transformer) and ~130M
(recurrent mixers), as in the paper's Table 1. ``falcon-fwa params`` prints the
counts (recorded in benchmarks/results/params.md): 124,029,696 for the Transformer
(embedding 38,633,472; per layer 4 x 768^2 attention + 3 x 768 x 2064 MLP + 2 norms);
129.8M-130.0M for the recurrent models (per Falcon layer 5 x 768^2 for q, k, v, output gate
and output, 3 x 3,072 convolution taps, 2 x 4,614 gate weights and offsets, 128 norm gains,
3 x 768 x 2016 MLP). The paper gives neither the tokenizer nor the layer shapes; these are
this library's choices.

The paper's Falcon variants (Table 1; Falcon-1.3 from the earlier version's tables) are
named ``Falcon-<rule>.<n>`` with ``n`` the feature/gate recipe:

================  ====  =======  ================  =================================
preset            rule  QK norm  gates             paper label
================  ====  =======  ================  =================================
falcon-1a.1-130m  1A    l2       ctx-beta, ridge   QK-l2-norm, ctx-beta-ctx-lambda
falcon-1a.2-130m  1A    l2       ctx-eta, ridge    QK-l2-norm, ctx-eta-ctx-lambda
falcon-1a.3-130m  1A    rmsnorm  ctx-eta, ridge    QK-RMSNorm, ctx-eta-ctx-lambda
falcon-3a.3-130m  3A    rmsnorm  ctx-eta, ridge    QK-RMSNorm, ctx-eta-ctx-lambda
falcon-1.3-130m   1     rmsnorm  ctx-eta, ridge    QK-RMSNorm (the regression rule)
================  ====  =======  ================  =================================

All of them: the shifted pair ``(k_{t-1}, v_t)`` with the sentinel ``x_1 = 0, eta_1 = 0``,
read after write, the normalized step, the scale-coupled ridge ``lambda_t = lambda-bar_t E_t``
(Appendix C.1; Appendix G.1 instead bounds an unscaled ``lambda_t`` in ``[0, 1]``, whose decay
fraction under QK-RMSNorm, ``E_t ~ d``, is about ``d`` times smaller; under QK-l2 ``E_t = 1`` and
the two readings agree), the clamp ``alpha_t = min(eta_t lambda_t, 1 - decay_floor)``, the
denominator-free read, no value norm, and the short convolution on q, k, v (Section 5.1).
Where the paper gives no value, the presets choose (see ``layers/gates.py`` for the gates):
ctx-beta is ``2 sigmoid(.)`` and ctx-eta ``eta_t = eta-bar_t / E_t`` with ``eta-bar_t =
sigmoid(.)`` (the paper names the gates without defining them); ``lambda_scale = 1``
(``lambda-bar in (0, 1)``); window ``B = 4`` for 3A (the window of the paper's figures, and
Appendix H.3's example of "the small sliding windows used in our experiments (e.g., B = 4)";
Section 5 and Appendix B give none); ``decay_floor = 1e-3``, ``eps = 1e-6``; a convolution of 4 taps
ending in SiLU (as in DeltaNet); 6 heads of 128; a SiLU output gate and a per-head output
RMSNorm (as in Gated DeltaNet; the paper mentions neither). Appendix B's "no bias terms" holds
for every linear layer, but each gate has a learned per-head offset, as Mamba-2's and Gated
DeltaNet's ``dt_bias``: without one the ridge would start at ``lambda-bar = 1/2``, a memory of
3-4 tokens in every head.

The baselines run their recurrence in the same block (Pre-Norm, SwiGLU MLP, no biases: nor
in the convolution, which Mamba-2 gives one), so they differ from the reference configurations
at their layer widths: RetNet has no xPos/RoPE on q and k, a per-head RMSNorm with a gain in
place of its GroupNorm and no value expansion (fla: ``expand_v=2``); Mamba-2 has expansion 1,
6 heads of 128 (Mamba-2 130M: 24 layers without an MLP, expansion 2, heads of 64) and one B, C
and norm group per head (``ngroups`` = heads, where Mamba-2 has one group); Gated DeltaNet has
keys of 128 per head and no value expansion (fla: ``head_dim=256``, ``expand_v=2``); DeltaNet
matches fla's layer (heads of 128, SiLU + l2 keys, sigmoid beta, no output gate). The sigmoid
beta of DeltaNet and Gated DeltaNet has the per-head offset of every gate (starting at 0),
which fla's ``b_proj`` lacks. The MLP widths make up the difference in parameters.
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
    # The regression rule with the .3 recipe (reported in the paper's earlier Tables 1-3).
    "falcon-1.3-130m": dict(_SCAFFOLD, mixer="falcon", rule="1", num_heads=6, qk_norm="rmsnorm", gate="ctx-eta",
                            intermediate_size=2016),
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
