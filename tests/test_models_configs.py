"""The LM under unusual but legitimate configurations: head dims that are not powers of two, one head,
one layer, an odd vocabulary, windows and chunks longer than the sequence, more segments than chunks,
one value column; config fields given to ``from_pretrained``; decoding in bfloat16 and float16."""
import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from falcon_fwa.models import FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")

RULES = ["1", "2", "3", "1A", "2A", "3A"]
BASELINES = ["transformer", "deltanet", "gated_deltanet", "mamba2", "retnet"]
CASES = [("falcon", {"rule": r}) for r in RULES] + [(m, {}) for m in BASELINES]
IDS = [f"falcon-{r}" for r in RULES] + BASELINES
T = 9

SHAPES = {
    # head dim 12, one layer, a vocabulary of 61; the window and the chunk longer than the 9 tokens,
    # three segments of a sequence that is one chunk
    "head-dim-12": dict(hidden_size=36, num_heads=3, num_hidden_layers=1, vocab_size=61, window=20, chunk_size=64,
                        segments=3),
    # one head of width 24, chunks of 2 tokens (the last one short) in 7 segments, more than the 5 chunks
    "one-head": dict(hidden_size=24, num_heads=1, chunk_size=2, segments=7, window=2),
}


def _model(mixer, overrides, dtype=torch.float64, **shape):
    torch.manual_seed(0)
    config = get_preset(f"tiny-{mixer}", **{"initializer_range": 0.3, **overrides, **shape})
    return FalconForCausalLM(config).to(dtype).eval()


def _stepwise(model, x, start=0, cache=None):
    """The logits of ``x[:, start:]`` fed one column at a time through ``cache``."""
    logits = []
    for t in range(start, x.shape[1]):
        out = model(x[:, t:t + 1], cache=cache, use_cache=True)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        logits.append(out.logits)
    return torch.cat(logits, 1)


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("mixer,overrides", CASES, ids=IDS)
def test_unusual_shapes_decode_and_continue_as_one_pass(mixer, overrides, shape):
    """float64: token-by-token decoding with the O(1) cache and a prompt prefilled in two pieces give
    the logits of one forward pass over the whole sequence."""
    model = _model(mixer, overrides, **SHAPES[shape])
    x = torch.randint(0, model.config.vocab_size, (2, T))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        assert full.shape == (2, T, model.config.vocab_size)
        assert float((_stepwise(model, x) - full).abs().max()) <= 1e-10
        first = model(x[:, :4], use_cache=True)
        cache = first.cache if hasattr(first, "cache") else first.past_key_values
        rest = model(x[:, 4:], cache=cache, use_cache=True).logits
        assert float((torch.cat([first.logits, rest], 1) - full).abs().max()) <= 1e-10


@pytest.mark.parametrize("per_column,whole", [("2", "1"), ("2A", "1A")])
def test_a_per_column_rule_with_one_value_column_is_its_whole_vector_rule(per_column, whole):
    """With ``head_v_dim=1`` each head's one column is its whole value: Falcon-2 (2A) is then Falcon-1
    (1A), with the same parameters, in one pass and decoding token by token."""
    shape = dict(head_k_dim=4, head_v_dim=1)
    col = _model("falcon", {"rule": per_column}, **shape)
    vec = _model("falcon", {"rule": whole}, **shape)
    vec.load_state_dict(col.state_dict())
    x = torch.randint(0, 64, (2, T))
    with torch.no_grad():
        want = vec(x, use_cache=False).logits
        assert float((col(x, use_cache=False).logits - want).abs().max()) <= 1e-12
        assert float((_stepwise(col, x) - want).abs().max()) <= 1e-12


def test_from_pretrained_takes_config_fields_as_the_constructor_does(tmp_path):
    """Config fields passed to ``from_pretrained`` are converted and checked as ``FalconConfig(...)`` does
    (a rule by its canonical name, an integral float as an int, a bad value refused by the field's name)."""
    model = _model("falcon", {"rule": "3A", "window": 3}, torch.float32)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, rule="3a", window=2.0, chunk_size=4).eval()
    assert (loaded.config.rule, loaded.config.window, loaded.config.chunk_size) == ("3A", 2, 4)
    assert type(loaded.config.window) is int
    direct = FalconForCausalLM(get_preset("tiny-falcon", rule="3A", window=2, chunk_size=4,
                                          initializer_range=0.3)).eval()
    direct.load_state_dict(model.state_dict())
    x = torch.randint(0, 64, (2, T))
    with torch.no_grad():
        assert torch.equal(loaded(x, use_cache=False).logits, direct(x, use_cache=False).logits)
    with pytest.raises(ValueError, match="config field 'window'"):
        AutoModelForCausalLM.from_pretrained(tmp_path, window=0)
    config, unused = AutoConfig.from_pretrained(tmp_path, window=5, other=1, return_unused_kwargs=True)
    assert config.window == 5 and unused == {"other": 1}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mixer,overrides", CASES, ids=IDS)
def test_low_precision_decoding_follows_the_float64_model(mixer, overrides, dtype):
    """``model.to(dtype)``: the forward pass and token-by-token decoding under ``torch.inference_mode()``
    stay within the dtype's rounding of the float64 model with the same (rounded) weights; logits come
    back in float32. (At the presets' initializer_range measured at most 1.3e-2 of the largest logit in
    bfloat16, 2e-3 in float16; decoding without the cache is off by 8e-2 or more.)"""
    model = _model(mixer, overrides, dtype, initializer_range=0.02)
    exact = copy.deepcopy(model).double()
    x = torch.randint(0, 64, (2, T))
    with torch.inference_mode():
        full = model(x, use_cache=False).logits
        steps = _stepwise(model, x)
        want = exact(x, use_cache=False).logits
    assert full.dtype == steps.dtype == torch.float32
    scale = float(want.abs().max())
    tol = 0.03 if dtype == torch.bfloat16 else 0.005
    assert float((full.double() - want).abs().max()) <= tol * scale
    assert float((steps.double() - want).abs().max()) <= tol * scale
