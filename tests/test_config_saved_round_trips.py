"""A config that saves loads back equal, for every mixer: a field assigned after the config was built that the
constructor refuses (a recurrent switch on a Transformer, a weights' dtype that is no floating-point dtype) is
refused by name when the config is saved or a model is built from it, not first by ``from_pretrained``; and
labels on the meta device against real inputs are named, not a copy error of PyTorch's."""
import json
import os
import re

import pytest
import torch
from transformers import AutoConfig

from falcon_fwa.models import FalconConfig, FalconForCausalLM, get_preset
from falcon_fwa.models.configuration import MIXER_DEFAULTS

pytestmark = pytest.mark.usefixtures("one_thread")

MIXERS = ["falcon", "transformer", "deltanet", "gated_deltanet", "mamba2", "retnet"]

# The recurrent op's settings, which every mixer keeps as given (the Transformer does not read them).
OP_SETTINGS = dict(window=3, form="recurrent", chunk_size=16, segments=2, eps=1e-5, decay_floor=0.01, conv_size=2,
                   backend="torch")

# A value other than the Transformer's own for every switch it refuses (hand-picked; its own are
# MIXER_DEFAULTS["transformer"], v_norm False and query_scale head_dim ** -0.5 = 16 ** -0.5 = 0.25 here).
NOT_THE_TRANSFORMERS = dict(rule="1", shift=True, normalize=True, read="before", gate="sigmoid", log_gate="data",
                            lambda_scale=0.5, qk_norm="rmsnorm", feature_map="elu1", query_scale=1.0,
                            use_short_conv=True, output_gate=True, use_d_skip=True, norm_before_gate=False,
                            v_norm=True)
TRANSFORMERS_OWN = dict(rule="1A", shift=False, normalize=False, read="after", gate="one", log_gate="none",
                        lambda_scale=0.0, qk_norm="none", feature_map="identity", query_scale=0.25,
                        use_short_conv=False, output_gate=False, use_d_skip=False, norm_before_gate=True, v_norm=False)


def _fields(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}


def _transformer():
    return FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, mixer="transformer")


def test_the_switch_lists_cover_every_switch_the_transformer_refuses():
    assert set(NOT_THE_TRANSFORMERS) == set(TRANSFORMERS_OWN) == set(MIXER_DEFAULTS["transformer"]) | {"v_norm"}
    assert {k: v for k, v in _transformer().to_dict().items() if k in TRANSFORMERS_OWN} == TRANSFORMERS_OWN


@pytest.mark.parametrize("mixer", MIXERS)
@pytest.mark.parametrize("settings", [{}, OP_SETTINGS], ids=["defaults", "op-settings"])
def test_a_saved_config_loads_back_equal(mixer, settings, tmp_path):
    config = get_preset(f"tiny-{mixer}", **settings)
    config.save_pretrained(tmp_path)
    for loaded in (FalconConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert type(loaded) is FalconConfig
        assert _fields(loaded) == _fields(config)
    assert {k: getattr(config, k) for k in settings} == settings


@pytest.mark.parametrize("field", sorted(NOT_THE_TRANSFORMERS))
def test_a_recurrent_switch_assigned_on_a_transformer_config_is_refused_when_saved(field, tmp_path):
    """The constructor refuses the switch by name; assigned on the built config, it is refused by name when the
    config is saved (with the value to set), as when a model is built from it, and nothing is written: before,
    the config.json was written and ``from_pretrained`` refused it."""
    value = NOT_THE_TRANSFORMERS[field]
    with pytest.raises(ValueError, match=f"config field '{field}' = .* configures the recurrent mixers only"):
        FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1, mixer="transformer",
                     **{field: value})
    config = _transformer()
    setattr(config, field, value)
    expected = f"config field '{field}' = {value!r} configures the recurrent mixers only; .* set it to " \
               f"{TRANSFORMERS_OWN[field]!r}"
    with pytest.raises(ValueError, match=expected):
        config.save_pretrained(tmp_path)
    assert not os.path.exists(tmp_path / "config.json")
    with pytest.raises(ValueError, match=expected):
        FalconForCausalLM(config)
    # following the message: the config saves and loads back equal to one built without the switch
    setattr(config, field, TRANSFORMERS_OWN[field])
    config.save_pretrained(tmp_path)
    assert _fields(FalconConfig.from_pretrained(tmp_path)) == _fields(_transformer())


def test_a_config_turned_into_a_transformer_after_it_was_built_is_refused_when_saved(tmp_path):
    """Built as Falcon (shift=True among its switches), then ``mixer`` assigned: the first switch the Transformer
    does not take is named at the save."""
    config = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1)
    config.mixer = "transformer"
    with pytest.raises(ValueError, match="config field 'shift' = True configures the recurrent mixers only"):
        config.save_pretrained(tmp_path)
    assert not os.path.exists(tmp_path / "config.json")


@pytest.mark.parametrize("field", ["dtype", "torch_dtype"])
@pytest.mark.parametrize("value", ["int64", torch.int32, "float77", 5])
def test_a_weight_dtype_assigned_after_the_config_was_built_is_refused_by_name(field, value, tmp_path):
    """The constructor refuses a dtype that is no floating-point torch dtype; assigned on the built config
    (transformers 5 stores ``torch_dtype`` as ``dtype``), it is refused by name when a model is built from it or the
    config is saved (before, the model was built and the saved config.json no longer loaded)."""
    import warnings

    config = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        setattr(config, field, value)
    expected = re.escape("' must be None or a floating-point torch dtype or its name")
    with pytest.raises(ValueError, match="config field '(torch_)?dtype" + expected):
        FalconForCausalLM(config)
    with pytest.raises(ValueError, match="config field '(torch_)?dtype" + expected):
        config.validate_fields()
    with pytest.raises(ValueError, match="config field '(torch_)?dtype" + expected):
        config.save_pretrained(tmp_path)
    assert not os.path.exists(tmp_path / "config.json")


@pytest.mark.parametrize("value,dtype", [("bfloat16", torch.bfloat16), (torch.float16, torch.float16)])
def test_a_floating_point_dtype_assigned_after_the_config_was_built_is_kept(value, dtype, tmp_path):
    config = FalconConfig(vocab_size=64, hidden_size=32, num_heads=2, num_hidden_layers=1)
    config.dtype = value
    FalconForCausalLM(config)
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype).split(".")[1]
    assert FalconConfig.from_pretrained(tmp_path).dtype == dtype


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_labels_on_the_meta_device_against_real_inputs_are_named(mixer):
    """A real model and input_ids on the CPU, labels on the meta device: the loss needs the labels' values, which
    the meta device does not hold; the error names labels and both devices (before: PyTorch's "Cannot copy out of
    meta tensor" from the loss)."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(f"tiny-{mixer}"))
    ids = torch.randint(0, 64, (2, 5))
    with pytest.raises(ValueError, match="labels are on the meta device, which holds no values to score, and "
                                         "input_ids on cpu: pass labels on cpu"):
        model(ids, labels=ids.to("meta"), use_cache=False)
    embeds = model.get_input_embeddings()(ids).detach()
    with pytest.raises(ValueError, match="labels are on the meta device, .* and inputs_embeds on cpu"):
        model(inputs_embeds=embeds, labels=ids.to("meta"), use_cache=False)
    # labels on the inputs' device score as before
    loss = model(ids, labels=ids, use_cache=False).loss
    assert loss.device.type == "cpu" and torch.isfinite(loss)
    # everything on the meta device (a shape call): a loss of the real call's shape, still taken
    with torch.device("meta"):
        meta_model = FalconForCausalLM(get_preset(f"tiny-{mixer}"))
    meta_loss = meta_model(ids.to("meta"), labels=ids.to("meta"), use_cache=False).loss
    assert meta_loss.is_meta and meta_loss.shape == ()
