"""A switch that a mixer does not read is refused when set to another value than the mixer's own, and a field that
a saved config.json holds and the constructor refuses is refused naming the file and how to change it."""
import json

import pytest
import torch
from transformers import AutoConfig

from falcon_fwa.models import FalconConfig, FalconForCausalLM
from falcon_fwa.models.configuration import MIXER_DEFAULTS, RECURRENT_MIXERS
from falcon_fwa.models.presets import PRESETS, get_preset

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2)


# --- norm_before_gate without the output gate --------------------------------------------------------------------
@pytest.mark.parametrize("mixer", RECURRENT_MIXERS)
def test_norm_before_gate_other_than_the_mixers_own_is_refused_without_the_output_gate(mixer):
    """Without the output gate the output RMSNorm has nothing to order itself against (RMSNorm(o) * SiLU(g) against
    RMSNorm(o * SiLU(g))), so the other value of norm_before_gate would be saved with a model that ignores it."""
    own = MIXER_DEFAULTS[mixer]["norm_before_gate"]
    with pytest.raises(ValueError, match=rf"config field 'norm_before_gate' = {not own}.*{mixer!r} mixer has no "
                                         rf"output gate.*output_gate=True.*leave it unset \(the mixer's own is {own}\)"):
        FalconConfig(mixer=mixer, output_gate=False, norm_before_gate=not own, **SMALL)
    # the mixer's own value, given or left unset, builds without the gate; with the gate both values build
    for value in (None, own):
        config = FalconConfig(mixer=mixer, output_gate=False, norm_before_gate=value, **SMALL)
        assert config.norm_before_gate is own
    for value in (True, False):
        assert FalconConfig(mixer=mixer, output_gate=True, norm_before_gate=value, **SMALL).norm_before_gate is value
    # assigned on a built config: refused when it is saved or a model is built from it
    config = FalconConfig(mixer=mixer, output_gate=False, **SMALL)
    config.norm_before_gate = not own
    with pytest.raises(ValueError, match=rf"'norm_before_gate' = {not own}.*set it to {own}$"):
        config.validate_fields()
    with pytest.raises(ValueError, match="'norm_before_gate'"):
        FalconForCausalLM(config)


def test_norm_before_gate_is_read_only_with_the_output_gate():
    """The premise of the refusal, against the layer: without the gate both values give the same logits, with it
    they differ."""
    x = torch.randint(0, 64, (2, 7))
    for gate, same in ((False, True), (True, False)):
        logits = []
        for value in (True, False):
            config = FalconConfig(mixer="falcon", output_gate=gate, **SMALL)
            torch.manual_seed(0)
            model = FalconForCausalLM(config).double().eval()
            model.model.layers[0].mixer.norm_before_gate = value  # the switch the layer reads, past the config
            with torch.no_grad():
                logits.append(model(x).logits)
        assert torch.equal(logits[0], logits[1]) is same


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_builds_and_reloads(name, tmp_path):
    config = get_preset(name)
    config.save_pretrained(tmp_path)
    assert FalconConfig.from_pretrained(tmp_path).to_dict() == config.to_dict()


# --- a refused field of a saved config.json ----------------------------------------------------------------------
def _saved_transformer(tmp_path, **stored):
    """A Transformer's config.json holding ``stored`` as written before the save refused them."""
    FalconConfig(mixer="transformer", **SMALL).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    fields = json.loads(path.read_text())
    fields.update(stored)
    path.write_text(json.dumps(fields))
    return fields


def test_a_saved_transformer_switch_is_refused_naming_the_file_and_the_fix(tmp_path):
    _saved_transformer(tmp_path, qk_norm="rmsnorm")
    message = (rf"config field 'qk_norm' = 'rmsnorm' configures the recurrent mixers only.*the config.json of "
               rf"'{tmp_path}': remove 'qk_norm' from it or set it to 'none' there, or pass qk_norm='none' to "
               rf"from_pretrained")
    with pytest.raises(ValueError, match=message) as info:
        FalconConfig.from_pretrained(tmp_path)
    assert "leave it unset" not in str(info.value)
    with pytest.raises(ValueError, match=message):  # the model's from_pretrained reads the config through it
        FalconForCausalLM.from_pretrained(tmp_path)
    # through the auto classes, which call from_dict without the folder: the file by name
    with pytest.raises(ValueError, match=r"'qk_norm' = 'rmsnorm'.*the saved config \(config.json\): remove 'qk_norm'"):
        AutoConfig.from_pretrained(tmp_path)
    # the fixes the message names each load
    assert FalconConfig.from_pretrained(tmp_path, qk_norm="none").qk_norm == "none"
    fields = json.loads((tmp_path / "config.json").read_text())
    del fields["qk_norm"]
    (tmp_path / "config.json").write_text(json.dumps(fields))
    assert FalconConfig.from_pretrained(tmp_path).qk_norm == "none"


def test_a_saved_head_dim_and_norm_before_gate_are_refused_naming_the_file(tmp_path):
    fields = _saved_transformer(tmp_path, head_k_dim=8)
    with pytest.raises(ValueError, match=r"'head_k_dim' = 8 differs.*the saved config \(config.json\): remove "
                                         r"'head_k_dim' from it or set it to 16 there"):
        FalconConfig.from_dict(fields)
    config = FalconConfig(mixer="deltanet", **SMALL)
    stored = {**config.to_dict(), "norm_before_gate": False}
    with pytest.raises(ValueError, match=r"'norm_before_gate' = False.*output_gate=True, or the saved value comes from "
                                         r"the saved config \(config.json\): remove 'norm_before_gate' from it or set "
                                         r"it to True there, or pass norm_before_gate=True to from_pretrained"):
        FalconConfig.from_dict(stored)
    assert FalconConfig.from_dict(stored, norm_before_gate=True).to_dict() == config.to_dict()


def test_the_constructor_and_a_built_config_keep_their_own_fixes_after_a_failed_load(tmp_path):
    """The load's wording holds during the load only: a config built afterwards by hand says "leave it unset", and
    one assigned on a built config "set it to"."""
    _saved_transformer(tmp_path, qk_norm="rmsnorm")
    with pytest.raises(ValueError, match="config.json"):
        FalconConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"'qk_norm' = 'rmsnorm'.*: leave it unset$"):
        FalconConfig(mixer="transformer", qk_norm="rmsnorm", **SMALL)
    config = FalconConfig(mixer="transformer", **SMALL)
    config.qk_norm = "l2"
    with pytest.raises(ValueError, match=r"'qk_norm' = 'l2'.*: set it to 'none'$"):
        config.validate_fields()
