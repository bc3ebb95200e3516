"""``FalconConfig``, the presets, the parameter table and ``FalconCache`` held to their stated values: each
mixer's resolved defaults as the configuration's and the presets' docstrings describe them, the MLP width
rule 8d/3 rounded up to 64 and the query scale by hand, each bound of the validation at its edge (the error
naming the field), the hint for another library's field names, the recorded table of
``benchmarks/results/params.md`` as ``falcon-fwa params`` prints it, and the cache's row bookkeeping on
hand-made rows."""
import math
import os
import re

import pytest
import torch

from falcon_fwa.layers import LayerCache
from falcon_fwa.models import PRESETS, FalconCache, FalconConfig, get_preset
from falcon_fwa.models.params import parameter_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1)


def _config(**kwargs):
    return FalconConfig(**{**SMALL, **kwargs})


# --------------------------------------------------------------------------------------- the mixers' defaults
# What the docstrings of configuration.py and presets.py say each mixer is (fields left unset).
STATED = {
    # Falcon-1A.3: QK-RMSNorm, ctx-eta with the context ridge, lambda_scale = 1 (lambda-bar in (0, 1)),
    # the shifted pair, the normalized step, the short convolution, the output gate
    "falcon": dict(rule="1A", shift=True, normalize=True, read="after", gate="ctx-eta", log_gate="none",
                   lambda_scale=1.0, qk_norm="rmsnorm", use_short_conv=True, output_gate=True),
    # DeltaNet: the regression rule, l2 keys, sigmoid beta, no ridge, no output gate (fla's layer)
    "deltanet": dict(rule="1", shift=False, normalize=False, gate="sigmoid", log_gate="none", lambda_scale=0.0,
                     qk_norm="l2", use_short_conv=True, output_gate=False),
    # Gated DeltaNet: DeltaNet with the data-dependent decay exp(g_t) and the gated output norm
    "gated_deltanet": dict(rule="1", shift=False, normalize=False, gate="sigmoid", log_gate="data",
                           lambda_scale=0.0, qk_norm="l2", use_short_conv=True, output_gate=True,
                           norm_before_gate=True),
    # Mamba-2 SSD: dt as the write gain and the decay, the D skip, RMSNorm(y * SiLU(z)) (the gate first)
    "mamba2": dict(rule="1A", shift=False, gate="dt", log_gate="dt", lambda_scale=0.0, qk_norm="none",
                   use_short_conv=True, output_gate=True, use_d_skip=True, norm_before_gate=False),
    # RetNet: a fixed per-head decay, the constant gain, no short convolution, the gated output norm
    "retnet": dict(rule="1A", shift=False, gate="one", log_gate="fixed", lambda_scale=0.0, qk_norm="none",
                   use_short_conv=False, output_gate=True, use_d_skip=False, norm_before_gate=True),
}


@pytest.mark.parametrize("mixer", list(STATED))
def test_each_mixer_resolves_its_stated_defaults_and_query_scale(mixer):
    """``query_scale`` left unset is 1.0 for "falcon" and "mamba2", else ``head_k_dim ** -0.5`` (of the key
    width, not the value width: here 16 and 4 wide heads)."""
    cfg = _config(mixer=mixer, head_k_dim=16, head_v_dim=4)
    assert {k: getattr(cfg, k) for k in STATED[mixer]} == STATED[mixer]
    assert cfg.query_scale == (1.0 if mixer in ("falcon", "mamba2") else 0.25)
    assert (cfg.head_k_dim, cfg.head_v_dim) == (16, 4)


@pytest.mark.parametrize("d,want", [(32, 128), (768, 2048), (96, 256), (100, 320), (24, 64), (1, 64)])
def test_the_mlp_width_defaults_to_eight_thirds_of_the_width_rounded_up_to_64(d, want):
    """``intermediate_size`` left unset: 8d/3 rounded up to a multiple of 64 (32 -> 85.3 -> 128, 768 -> 2048
    exactly, 96 -> 256 exactly, 100 -> 266.7 -> 320)."""
    assert want == 64 * math.ceil(8 * d / 3 / 64)
    assert FalconConfig(vocab_size=64, hidden_size=d, num_heads=1).intermediate_size == want


def test_presets_are_the_documented_shapes():
    """The 130M scaffold (12 layers of width 768, vocabulary 50304, muP base 256); the Transformer's 12 heads of
    64 and the recurrent models' 6 heads of 128; the tiny models' vocabulary 64, width 32, 2 layers, 2 heads,
    each with its own mixer."""
    for name, fields in PRESETS.items():
        cfg = get_preset(name)
        if name.startswith("tiny-"):
            assert cfg.mixer == name[len("tiny-"):]
            assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_heads) == (64, 32, 2, 2)
            continue
        assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.mup_base_width) == (50304, 768, 12, 256)
        if cfg.mixer == "transformer":
            assert cfg.num_heads * 64 == 768 and cfg.num_heads == 12
        else:
            assert (cfg.num_heads, cfg.head_k_dim, cfg.head_v_dim) == (6, 128, 128)


# ----------------------------------------------------------------------------------- the validation's edges
EDGES = [
    # the head widths are sizes like the others: 0 is refused by name, not left to fail in the layer
    (dict(head_k_dim=0), "head_k_dim"),
    (dict(head_v_dim=0), "head_v_dim"),
    (dict(head_k_dim=-4), "head_k_dim"),
    # num_heads must divide the width wherever a head width is left to it (one of the two is enough)
    (dict(hidden_size=30, num_heads=4), "num_heads"),
    (dict(hidden_size=30, num_heads=4, head_k_dim=8), "num_heads"),
    (dict(hidden_size=30, num_heads=4, head_v_dim=8), "num_heads"),
    # the Transformer's head dim is the width over the heads even with the head widths given
    (dict(mixer="transformer", hidden_size=36, num_heads=8, head_k_dim=4, head_v_dim=4), "num_heads"),
    # decay_floor lies in (0, 1): 0 would let alpha_t reach 1 (the whole memory erased)
    (dict(decay_floor=0.0), "decay_floor"),
    # eps_attn = 0 needs a positive query_scale (elu1 features, no shift): 0 gives the read 0 / 0
    (dict(rule="1A", shift=False, feature_map="elu1", eps_attn=0.0, query_scale=0.0), "eps_attn"),
    (dict(mup_base_width=0), "mup_base_width"),
    (dict(feature_map="tanh"), "feature_map"),
    (dict(log_gate="decay"), "log_gate"),
]


@pytest.mark.parametrize("kwargs,field", EDGES, ids=[f"{f}-{i}" for i, (_, f) in enumerate(EDGES)])
def test_a_value_just_past_a_bound_is_refused_by_name(kwargs, field):
    with pytest.raises(ValueError, match=f"config field '{field}'"):
        _config(**kwargs)


def test_values_on_the_bounds_are_taken():
    """The other side of each edge: positive head widths of any size, a floor just above 0, a base width of 1,
    eps_attn = 0 with elu1 features and a positive query_scale."""
    cfg = _config(hidden_size=30, num_heads=4, head_k_dim=8, head_v_dim=5)
    assert (cfg.head_k_dim, cfg.head_v_dim) == (8, 5)
    assert _config(decay_floor=1e-12).decay_floor == 1e-12
    assert _config(mup_base_width=1).width_multiplier == 32.0
    assert _config(rule="1A", shift=False, feature_map="elu1", eps_attn=0.0, query_scale=1e-3).eps_attn == 0.0


@pytest.mark.parametrize("field,value", [("rope_theta", "1e4"), ("initializer_range", "0.02"), ("eps_attn", math.nan),
                                         ("eps_attn", math.inf), ("head_k_dim", 0), ("mup_base_width", 0),
                                         ("num_heads", 3)])
def test_a_field_assigned_after_construction_is_checked_by_name(field, value):
    """``validate_fields`` after a field was set on a built config: the error names that field (a text
    number, a non-finite eps_attn, a zero width; three Transformer heads, which do not divide the width 32)."""
    cfg = _config(mixer="transformer") if field == "num_heads" else _config(rule="1A", shift=False, eps_attn=0.1)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=f"config field '{field}'"):
        cfg.validate_fields()


@pytest.mark.parametrize("name,meant", [("num_attention_heads", "num_heads"), ("n_head", "num_heads"),
                                        ("n_layer", "num_hidden_layers"), ("num_layers", "num_hidden_layers"),
                                        ("n_embd", "hidden_size"), ("d_model", "hidden_size")])
def test_another_librarys_field_name_is_refused_with_this_configs_name(name, meant):
    with pytest.raises(ValueError, match=rf"unknown config field '{name}' \(did you mean '{meant}'\?\)"):
        get_preset("tiny-falcon", **{name: 4})
    with pytest.raises(ValueError, match=rf"unknown config field '{name}' \(did you mean '{meant}'\?\)"):
        _config(**{name: 4})


def test_a_preset_override_unlike_any_field_is_refused_naming_the_preset():
    """An override no field resembles (which the constructor would keep unused) is refused by get_preset, with
    the preset's name; every unknown override is named."""
    with pytest.raises(ValueError, match=r"^unknown config field 'colour' for preset 'tiny-falcon'$"):
        get_preset("tiny-falcon", colour="red")
    with pytest.raises(ValueError, match=r"'colour'.*'rul' \(did you mean 'rule'\?\) for preset 'tiny-retnet'$"):
        get_preset("tiny-retnet", rul="3", colour="red")


# ------------------------------------------------------------------------------------------- parameter table
def test_the_recorded_parameter_table_is_what_the_params_command_prints():
    """``benchmarks/results/params.md`` (cited by the presets' docstring) is ``parameter_table`` of every preset;
    its tiny Transformer row adds up by hand: embedding 64 x 32, mixers 2 x 4 x 32^2, MLPs 2 x 3 x 32 x 128,
    norms (2 x 2 + 1) x 32."""
    with open(os.path.join(ROOT, "benchmarks", "results", "params.md")) as f:
        recorded = [line for line in f.read().splitlines() if line.startswith("|")]
    names = list(PRESETS)
    assert parameter_table(names, [get_preset(n) for n in names]).splitlines() == recorded
    row = next(r for r in recorded if r.startswith("| tiny-transformer |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1:7] == ["transformer", "-", "2", "32", "2", "128"]
    parts = [64 * 32, 2 * 4 * 32 ** 2, 2 * 3 * 32 * 128, 5 * 32]
    assert cells[7:11] == [f"{n:,}" for n in parts]
    assert cells[11] == f"{sum(parts):,} (35.0K)"
    assert re.search(r"\| 124,029,696 \(124\.0M\) \|$", recorded[2])
    # below a million the total is shown in thousands
    cfg = get_preset("tiny-falcon", hidden_size=64)
    row = parameter_table(["wide"], [cfg]).splitlines()[-1]
    total = int(row.split("|")[-2].split("(")[0].replace(",", ""))
    assert 1e5 < total < 1e6 and row.endswith(f"({total / 1e3:.1f}K) |")


# ---------------------------------------------------------------------------------------------------- cache
def _filled_cache():
    """Two layers: a recurrent one (state-free, short-conv buffers only) and an attention one; three rows."""
    cache = FalconCache(2)
    rows = torch.arange(3.0)
    cache.layers[0].conv = {"q": rows[:, None, None].expand(3, 2, 4).clone()}
    cache.layers[1] = LayerCache(keys=rows[:, None, None, None].expand(3, 1, 5, 2).clone(),
                                 values=10 + rows[:, None, None, None].expand(3, 1, 5, 2).clone(), lengths=[2, 5, 4])
    return cache


def test_cache_counts_rows_and_columns_apart_and_owns_its_counts():
    cache = FalconCache(2)
    assert cache.empty and cache.get_seq_length() == 0 and len(cache) == 2 and cache.is_linear == [True, True]
    first = torch.tensor([2, 5, 4])
    cache.advance(first, 5)
    first += 100  # the caller's tensor, changed afterwards: the cache keeps its own copy
    cache.advance(torch.tensor([1, 1, 0]), 1)
    assert not cache.empty
    assert cache.seen.tolist() == [3, 6, 4] and cache.get_seq_length() == cache.num_positions == 6


def test_cache_selects_and_repeats_rows_in_every_layer_and_in_seen():
    cache = _filled_cache()
    cache.advance(torch.tensor([2, 5, 4]), 5)
    cache.reorder_cache(torch.tensor([2, 0, 2]))
    assert cache.seen.tolist() == [4, 2, 4]
    assert cache[0].conv["q"][:, 0, 0].tolist() == [2, 0, 2]
    assert cache[1].keys[:, 0, 0, 0].tolist() == [2, 0, 2] and cache[1].values[:, 0, 0, 0].tolist() == [12, 10, 12]
    assert cache[1].lengths == [4, 2, 4]
    cache.batch_repeat_interleave(2)  # each row twice, next to itself: [a, a, b, b, c, c]
    assert cache.seen.tolist() == [4, 4, 2, 2, 4, 4]
    assert cache[1].values[:, 0, 0, 0].tolist() == [12, 12, 10, 10, 12, 12]
    assert cache.num_positions == 5
    empty = FalconCache(1)
    empty.batch_repeat_interleave(3)  # nothing recorded yet: nothing to repeat
    assert empty.empty


def test_cache_detach_cuts_every_tensor_from_the_graph_and_keeps_its_values():
    cache = _filled_cache()
    w = torch.tensor(2.0, requires_grad=True)
    conv, keys, values = cache[0].conv["q"] * w, cache[1].keys * w, cache[1].values * w
    cache[0].conv["q"], cache[1].keys, cache[1].values = conv, keys, values
    assert cache.detach() is cache
    for got, want in ((cache[0].conv["q"], conv), (cache[1].keys, keys), (cache[1].values, values)):
        assert not got.requires_grad and torch.equal(got, want.detach())
