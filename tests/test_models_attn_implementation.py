"""``attn_implementation`` as Hugging Face scripts pass it: the attention of the Transformer mixer runs as
``torch.nn.functional.scaled_dot_product_attention`` (and the recurrent mixers have none), so asking for
``"sdpa"`` (``from_pretrained``, ``from_config``, ``set_attn_implementation``) builds the same model with the same
outputs as asking for nothing or for ``"eager"``, and leaves the config it was given usable."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from falcon_fwa.models import FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mixer", ["transformer", "falcon", "mamba2"])
def test_sdpa_is_accepted_and_gives_the_default_model(mixer, tmp_path):
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(f"tiny-{mixer}")).to(torch.float64).eval()
    model.save_pretrained(tmp_path)
    x = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        for impl in ("sdpa", "eager"):
            loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=impl, dtype="auto").eval()
            assert loaded.config._attn_implementation == impl
            torch.testing.assert_close(loaded(x, use_cache=False).logits, ref, rtol=0, atol=1e-12)

    config = get_preset(f"tiny-{mixer}")
    built = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert type(built) is FalconForCausalLM and built.config._attn_implementation == "sdpa"
    FalconForCausalLM(config)  # the config passed above still builds a model
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"


def test_the_default_stays_eager_and_config_attention_weights_reach_the_models_refusal():
    """Nothing asked: ``"eager"``, where ``config.output_attentions = True`` is stored and the forward refuses it
    by the model's own message (``test_models_config_edges``)."""
    model = FalconForCausalLM(get_preset("tiny-transformer"))
    assert model.config._attn_implementation == "eager"
    loaded = AutoModelForCausalLM.from_config(get_preset("tiny-falcon"))
    assert loaded.config._attn_implementation == "eager"
    model.config.output_attentions = True
    with pytest.raises(ValueError, match="output_attentions=True: the model returns no attention weights"):
        model(torch.randint(0, 64, (1, 5)), use_cache=False)


def test_an_attention_the_model_has_not_is_refused_by_name():
    with pytest.raises(ValueError, match="attn_implementation"):
        AutoModelForCausalLM.from_config(get_preset("tiny-transformer"), attn_implementation="no_such_attention")
