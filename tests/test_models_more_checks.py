"""Further checks of the causal LM against independent references (one full forward pass over the whole
sequence): a filled cache passed with ``use_cache=False`` is still the context of the call, as in transformers'
own models (the flag only leaves the cache out of the output), in the forward and in ``generate()``."""
import pytest
import torch

from falcon_fwa.models import FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(mixer, seed=0):
    torch.manual_seed(seed)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}")).to(torch.float64).eval()


def _cache(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "left-padded"])
@pytest.mark.parametrize("mixer", ["falcon", "transformer", "mamba2"])
def test_a_filled_cache_given_with_use_cache_false_is_still_continued(mixer, padded):
    """``model(rest, past_key_values=cache, use_cache=False)`` gives the logits of one pass over the whole
    sequence at ``rest``'s columns (the context is the cache), and returns no cache."""
    model = _model(mixer)
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :2] = 0  # a left-padded row
    if not padded:
        mask = None
    with torch.no_grad():
        whole = model(x, attention_mask=mask, use_cache=False).logits
        cache = _cache(model(x[:, :5], attention_mask=None if mask is None else mask[:, :5], use_cache=True))
        out = model(x[:, 5:], attention_mask=mask, past_key_values=cache, use_cache=False)
    assert _cache(out) is None
    torch.testing.assert_close(out.logits, whole[:, 5:], rtol=0, atol=1e-10)


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_generate_with_a_prefilled_cache_and_use_cache_false_scores_the_whole_sequence(mixer):
    """``generate(ids, past_key_values=prefilled, use_cache=False)``: transformers keeps a cache the user passes,
    so every step's logits must be those of a full forward pass over the sequence so far."""
    model = _model(mixer)
    x = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = _cache(model(x[:, :5], use_cache=True))
        out = model.generate(x, past_key_values=cache, use_cache=False, max_new_tokens=4, do_sample=False,
                             pad_token_id=0, return_dict_in_generate=True, output_logits=True)
        full = model(out.sequences, use_cache=False).logits
    assert len(out.logits) == 4
    for i, step in enumerate(out.logits):  # (generate returns the step logits in float32)
        torch.testing.assert_close(step.double(), full[:, 7 + i], rtol=0, atol=1e-5)
