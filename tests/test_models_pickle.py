"""A whole model pickles (``torch.save(model)``, multiprocessing, ``copy.deepcopy`` by pickle) for every mixer
and feature map, and the unpickled model computes the same logits."""
from __future__ import annotations

import io
import pickle

import pytest
import torch

from falcon_fwa.layers.falcon_attention import FEATURE_MAPS
from falcon_fwa.models import FalconForCausalLM, get_preset

CASES = [("tiny-falcon", dict(feature_map=f)) for f in FEATURE_MAPS] + [
    (f"tiny-{m}", {}) for m in ("transformer", "deltanet", "gated_deltanet", "mamba2", "retnet")]


@pytest.mark.parametrize("preset,overrides", CASES, ids=[f"{p}-{o.get('feature_map', '')}" for p, o in CASES])
def test_a_model_pickles_and_computes_the_same_logits(preset, overrides):
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(preset, **overrides)).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 11))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    again = torch.load(buffer, weights_only=False).eval()
    copy = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        want = model(ids).logits
        assert torch.equal(again(ids).logits, want)
        assert torch.equal(copy(ids).logits, want)
