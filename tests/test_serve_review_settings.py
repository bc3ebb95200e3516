"""``generate_text``'s counts are integers: a ``max_new_tokens`` of 2.5 or infinity was taken by the range check
and never reached by the decoding loop, which counts its steps and so ran until the process was stopped; a
fractional ``top_k``, ``batch_size`` or ``seed`` failed deep in torch with a message naming none of them. Each is
refused naming the setting before the model runs; numpy's integers are taken as the same count."""
import numpy as np
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.serve import generate_text
from falcon_fwa.serve.generation import check_settings

pytestmark = pytest.mark.usefixtures("one_thread")

MAX_CALLS = 40  # forward passes a call of this file may make: 1 prompt pass and at most 5 decoding steps per batch


def _model():
    """A tiny float64 Falcon whose forward passes are counted; past ``MAX_CALLS`` a pass fails the test (a decoding
    loop that would not end)."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=257, initializer_range=0.5)).double().eval()
    model.calls = 0

    def count(module, args, kwargs):
        module.calls += 1
        assert module.calls <= MAX_CALLS, "the decoding loop did not end"

    model.register_forward_pre_hook(count, with_kwargs=True)
    return model


@pytest.mark.parametrize("setting, value", [
    ("max_new_tokens", 2.5), ("max_new_tokens", float("inf")), ("max_new_tokens", "3"), ("max_new_tokens", True),
    ("top_k", 2.5), ("batch_size", 1.5), ("seed", 1.5), ("temperature", "0.5"), ("top_p", "0.9"),
])
def test_a_count_that_is_no_integer_is_refused_by_name_before_the_model_runs(setting, value):
    model, tok = _model(), byte_tokenizer()
    settings = {**dict(max_new_tokens=3, temperature=0.7, seed=0), setting: value}
    with pytest.raises(ValueError, match=rf"^{setting} must be an? (integer|real number), got {value!r}"):
        generate_text(model, tok, ["ab", "c"], stop_at_eos=False, **settings)
    assert model.calls == 0
    with pytest.raises(ValueError, match=rf"^--{setting.replace('_', '-')} must be"):  # the command's names
        check_settings(**{**dict(max_new_tokens=3, temperature=0.7, top_k=0, top_p=1.0, batch_size=1), setting: value},
                       name=lambda n: "--" + n.replace("_", "-"))


def test_numpy_integers_are_the_same_counts():
    """max_new_tokens, top_k, batch_size and seed as numpy integers give the tokens of the Python ints: 4 new tokens
    per prompt (no end-of-text stop), drawn among the 5 likeliest, in batches of 2, from seed 3."""
    tok = byte_tokenizer()
    prompts = ["fast weights", "a", "the state"]
    runs = []
    for kind in (int, np.int64):
        model = _model()
        out = generate_text(model, tok, prompts, max_new_tokens=kind(4), top_k=kind(5), batch_size=kind(2),
                            seed=kind(3), temperature=0.9, stop_at_eos=False)
        assert [len(c.token_ids) for c in out.completions] == [4, 4, 4]
        assert model.calls == 2 * 4  # two batches: a prompt pass and 3 decoding steps each
        runs.append([c.token_ids for c in out.completions])
    assert runs[0] == runs[1]
