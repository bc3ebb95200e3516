"""The causal LM's documented contract at the edges the other model tests leave open, each against a reference
written here: the loss of a call that continues a cache reads the mask's last ``T`` columns (a hand-written
cross-entropy), ``use_cache``'s default in eval and training mode and a given cache continued in either (one pass
over the whole sequence), the layouts and labels refused by name, ``config.output_hidden_states`` as the default,
the documented starting values of gates, norms and ``D``, and assisted decoding refused when the generation
config asks for it."""
import math

import pytest
import torch

from falcon_fwa.models import FalconCache, FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(mixer="falcon", dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}", **overrides)).to(dtype).eval()


def _cache(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def _nll(logits, labels, scored):
    """Mean of ``-log softmax(logits[b, t])[labels[b, t + 1]]`` over the pairs ``(b, t + 1)`` in ``scored``,
    in Python floats."""
    total = 0.0
    for b, t1 in scored:
        row = logits[b, t1 - 1].tolist()
        top = max(row)
        total += top + math.log(sum(math.exp(z - top) for z in row)) - row[int(labels[b, t1])]
    return total / len(scored)


def test_the_loss_of_a_continued_cache_reads_the_masks_last_columns():
    """``attention_mask`` ``[B, T_past + T]``: only its last ``T`` columns describe this call's ids, so the loss
    of a call continuing a left-padded prefix scores every pair of its (all real) new columns."""
    model = _model()
    g = torch.Generator().manual_seed(1)
    past, new = torch.randint(0, 64, (2, 5), generator=g), torch.randint(0, 64, (2, 4), generator=g)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # the first row's prefix is padded on the left
    with torch.no_grad():
        cache = _cache(model(past, attention_mask=mask[:, :5], use_cache=True))
        out = model(new, attention_mask=mask, labels=new, cache=cache)
    scored = [(b, t) for b in range(2) for t in range(1, 4)]
    assert float(out.loss) == pytest.approx(_nll(out.logits, new, scored), rel=1e-12)


def test_a_model_makes_a_cache_in_eval_mode_only_and_continues_one_it_is_given_in_either():
    """``use_cache`` left unset: an eval-mode model returns a fresh cache, a training one none (training takes no
    cache); a cache that is passed is continued and returned in either mode, as a second call over the rest of
    the sequence gives the logits of one pass over all of it."""
    model = _model()
    x = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert isinstance(_cache(model(x)), FalconCache)
        whole = model(x, use_cache=False).logits
        model.train()
        assert _cache(model(x)) is None
        cache = FalconCache(model.config.num_hidden_layers)
        first = model(x[:, :4], cache=cache)
        assert _cache(first) is cache
        rest = model(x[:, 4:], cache=cache).logits
        # use_cache=False returns none, even of a cache that is passed
        assert _cache(model(x, use_cache=False)) is None
        model.eval()
        assert _cache(model(x[:, :1], cache=FalconCache(model.config.num_hidden_layers), use_cache=False)) is None
    torch.testing.assert_close(torch.cat([first.logits, rest], 1), whole, rtol=0, atol=1e-10)


def test_refused_layouts_and_labels_are_named():
    """``cu_seqlens`` with an ``attention_mask`` that pads, a mask narrower than the ids, and labels that are not
    integer ids are refused by name, not run."""
    model = _model()
    x = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(x)
    mask[0, :2] = 0
    with torch.no_grad():
        with pytest.raises(ValueError, match="either cu_seqlens or an attention_mask with padding"):
            model(x, attention_mask=mask, cu_seqlens=torch.tensor([0, 2, 6]), use_cache=False)
        # a mask of ones says nothing beyond cu_seqlens and is taken
        torch.testing.assert_close(
            model(x, attention_mask=torch.ones_like(x), cu_seqlens=torch.tensor([0, 2, 6]), use_cache=False).logits,
            model(x, cu_seqlens=torch.tensor([0, 2, 6]), use_cache=False).logits, rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"cu_seqlens needs input_ids of shape \[1, total\], got \(2, 3\)"):
            model(x.reshape(2, 3), cu_seqlens=torch.tensor([0, 2, 6]), use_cache=False)
        with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, >= T\] = \[1, >= 6\]"):
            model(x, attention_mask=mask[:, 1:], use_cache=False)
        for bad in (x.bool(), x.double()):
            with pytest.raises(ValueError, match="labels must hold integer token ids"):
                model(x, labels=bad, use_cache=False)


def test_the_configs_output_hidden_states_is_the_default():
    """``config.output_hidden_states = True`` returns the ``L + 1`` hidden states unasked; an explicit
    ``output_hidden_states=False`` still turns them off."""
    model = _model()
    x = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    model.config.output_hidden_states = True
    with torch.no_grad():
        hs = model(x, use_cache=False).hidden_states
        assert model(x, use_cache=False, output_hidden_states=False).hidden_states is None
    assert hs is not None and len(hs) == model.config.num_hidden_layers + 1
    assert torch.equal(hs[0], model.model.embed_tokens(x))


@pytest.mark.parametrize("mixer", ["mamba2", "falcon"])
def test_a_fresh_model_starts_gates_norms_and_d_at_their_documented_values(mixer):
    """``_init_weights``: gate offsets and decays take ``ContextGates.initial_values``, ``D`` and the norm gains
    are ones."""
    from falcon_fwa.layers.gates import ContextGates
    from falcon_fwa.layers.norms import RMSNorm

    model = _model(mixer, dtype=torch.float32, **({"rule": "1A", "lambda_scale": 0.1} if mixer == "falcon" else {}))
    seen = set()
    for module in model.modules():
        if isinstance(module, ContextGates):
            for name, value in module.initial_values().items():
                torch.testing.assert_close(getattr(module, name).detach(), value, rtol=0, atol=0)
                seen.add(name)
        elif isinstance(module, RMSNorm):
            assert torch.equal(module.weight.detach(), torch.ones_like(module.weight))
        if getattr(module, "D", None) is not None:
            assert torch.equal(module.D.detach(), torch.ones_like(module.D))
            seen.add("D")
    assert seen >= ({"D", "A_log"} if mixer == "mamba2" else {"lam_bias"})


def test_assisted_decoding_asked_through_the_generation_config_is_refused_by_name():
    """Prompt-lookup decoding set in the generation config is refused as when passed to ``generate()``."""
    from transformers import GenerationConfig

    model = _model()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    config = GenerationConfig(prompt_lookup_num_tokens=3, max_new_tokens=2, do_sample=False)
    with pytest.raises(ValueError, match=r"generate\(prompt_lookup_num_tokens=\.\.\.\)"):
        model.generate(ids, generation_config=config)
