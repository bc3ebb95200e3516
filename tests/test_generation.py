"""generate() with the recurrent / KV cache: O(1) decoding that reproduces full recomputation."""
import pytest
import torch

from falcon_fwa.models import FalconCache, FalconForCausalLM, get_preset

# the normalized read (z carried in the cache) on nonnegative features
NORMALIZED_READ = {"rule": "3A", "window": 3, "eps_attn": 1e-3, "feature_map": "elu1", "qk_norm": "none"}
CASES = [("falcon", {}), ("falcon", {"rule": "2"}), ("falcon", {"rule": "3", "window": 3}),
         ("transformer", {}), ("deltanet", {}), ("gated_deltanet", {}), ("mamba2", {}), ("retnet", {}),
         ("falcon", NORMALIZED_READ)]
IDS = ["falcon-1A", "falcon-2", "falcon-3", "transformer", "deltanet", "gated_deltanet", "mamba2", "retnet",
       "falcon-3A-normalized-read"]
NEW = 64


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(mixer, overrides):
    """A tiny float64 model whose greedy continuations vary (at the presets' initializer_range of
    0.02 they repeat one token, and a token-by-token comparison would miss most decoding errors)."""
    torch.manual_seed(0)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}", **{"initializer_range": 0.5, **overrides})).double().eval()


def _greedy_uncached(model, prompt, n):
    """Re-run the whole prefix at every step (no cache), argmax of the last logits."""
    seq = prompt
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    return seq


@pytest.mark.parametrize("mixer,overrides", CASES, ids=IDS)
def test_cached_generate_equals_uncached_recomputation(mixer, overrides):
    model = _model(mixer, overrides)
    torch.manual_seed(1)
    prompt = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                             return_dict_in_generate=True)
    assert out.sequences.shape == (2, 7 + NEW)
    assert torch.equal(out.sequences, _greedy_uncached(model, prompt, NEW))
    assert all(len(set(row[7:].tolist())) > 4 for row in out.sequences)  # a varied continuation
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    assert isinstance(cache, FalconCache)
    layer = cache[0]
    if mixer == "transformer":  # a KV cache grows with the context
        assert layer.lengths == [7 + NEW - 1] * 2 and layer.keys.shape[2] >= 7 + NEW - 1
    else:  # the recurrent cache has a constant size: O(1) per token
        assert layer.state.S.shape == (2, 2, 16, 16)
        assert all(b.shape[1] == model.config.conv_size - 1 for b in layer.conv.values())


@pytest.mark.parametrize("mixer,overrides", CASES, ids=IDS)
def test_left_padded_batched_generate_equals_each_prompt_alone(mixer, overrides):
    model = _model(mixer, overrides)
    torch.manual_seed(2)
    prompts = [torch.randint(1, 64, (n,)) for n in (3, 8, 5)]
    T = 8
    ids = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   max_new_tokens=NEW, do_sample=False, pad_token_id=0)
            assert torch.equal(batched[b, T:], alone[0, len(p):]), b


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "3A", "window": 3}), ("transformer", {}),
                                             ("falcon", NORMALIZED_READ)],
                         ids=["falcon-3A", "transformer", "falcon-3A-normalized-read"])
def test_continuing_a_cache_across_calls_equals_one_pass(mixer, overrides):
    """Prefill, then feed chunks of several tokens through the same cache (Falcon: the chunk form with
    initial states; Transformer: the batched cached attention with its causal offset mask)."""
    model = _model(mixer, overrides)
    x = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache, parts = None, []
        for a, b in ((0, 6), (6, 7), (7, 15), (15, 20)):
            out = model(x[:, a:b], past_key_values=cache, use_cache=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            parts.append(out.logits)
    assert float((torch.cat(parts, 1) - full).abs().max()) <= 1e-10
    assert cache.get_seq_length() == 20 and cache.seen.tolist() == [20, 20]


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "3A", "window": 3}), ("transformer", {})],
                         ids=["falcon-3A", "transformer"])
def test_beam_search_reorders_the_cache(mixer, overrides):
    """Beam search reorders cache rows (states, sliding tails, conv buffers, keys); it must match no cache."""
    model = _model(mixer, overrides)
    torch.manual_seed(3)
    x = torch.randint(1, 64, (2, 5))
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=12, num_beams=3, do_sample=False)
    with torch.no_grad():
        assert torch.equal(model.generate(x, **kw), model.generate(x, use_cache=False, **kw))


def test_gradients_through_a_transformer_cache_equal_one_pass():
    """Two cached calls under autograd (the second attends to the first's keys) give the gradients of one
    call over the whole sequence: the cache's buffers are not overwritten while backward needs them."""
    model = _model("transformer", {})
    x = torch.randint(0, 64, (2, 12))
    w = torch.randn(2, 12, model.config.vocab_size, dtype=torch.float64)
    (model(x, use_cache=False).logits * w).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    first = model(x[:, :5], use_cache=True)
    cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
    parts = [first.logits]
    for a, b in ((5, 6), (6, 12)):  # one token, then several: both write paths
        out = model(x[:, a:b], past_key_values=cache, use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        parts.append(out.logits)
    (torch.cat(parts, 1) * w).sum().backward()
    for p, g in zip(model.parameters(), want):
        assert float((p.grad - g).abs().max()) <= 1e-10 * max(1.0, float(g.abs().max()))


def test_generate_output_hidden_states_match_a_full_forward():
    """``generate(output_hidden_states=True)`` gives, per step, the hidden states of the tokens fed in that
    step, equal to those of one uncached forward over the whole sequence."""
    model = _model("falcon", {"rule": "3A", "window": 3})
    torch.manual_seed(4)
    x = torch.randint(1, 64, (2, 5))
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False,
                             output_hidden_states=True, return_dict_in_generate=True)
        full = model(out.sequences, use_cache=False, output_hidden_states=True).hidden_states
    steps = out.hidden_states
    assert len(steps) == 4 and steps[0][0].shape == (2, 5, 32) and steps[1][0].shape == (2, 1, 32)
    got = [torch.cat([step[i] for step in steps], 1) for i in range(len(full))]
    for g, f in zip(got, full):
        assert float((g - f[:, :-1]).abs().max()) <= 1e-10


def test_misused_caches_and_empty_inputs_raise_errors_naming_the_argument():
    model = _model("falcon", {})
    x = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        out = model(x, use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        with pytest.raises(ValueError, match="input_ids must have shape"):
            model(x[:, :0], past_key_values=cache)
        with pytest.raises(ValueError, match="past_key_values has consumed 6 columns, but input_ids has 2"):
            model.generate(x[:, 4:], past_key_values=cache, max_new_tokens=2, do_sample=False)
        with pytest.raises(ValueError, match="past_key_values holds 2 sequences, but this call continues 3"):
            model(torch.randint(0, 64, (3, 1)), past_key_values=cache)
        with pytest.raises(ValueError, match=r"input_ids holds token id 64, outside the vocabulary \[0, 64\)"):
            model(torch.tensor([[1, 64]]), use_cache=False)
        with pytest.raises(ValueError, match=r"input_ids holds token id -1, outside"):
            model(torch.tensor([[-1, 3]]), use_cache=False)
        with pytest.raises(ValueError, match="cache and past_key_values are two names of one argument"):
            model(x[:, :1], past_key_values=cache, cache=FalconCache(model.config.num_hidden_layers))
        with pytest.raises(ValueError, match=r"labels must have the shape .* \(2, 6\), got \(2, 5\)"):
            model(x, labels=x[:, 1:], use_cache=False)
        with pytest.raises(ValueError, match="generate\\(\\) does not take cu_seqlens"):
            model.generate(x, cu_seqlens=torch.tensor([0, 3, 6]), max_new_tokens=2, do_sample=False)
        # the cache is untouched by the refused calls: continuing it still equals one pass
        nxt = torch.randint(0, 64, (2, 1))
        step = model(nxt, past_key_values=cache).logits[:, -1]
        assert float((step - model(torch.cat([x, nxt], 1), use_cache=False).logits[:, -1]).abs().max()) <= 1e-10


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "3A", "window": 3}), ("transformer", {}),
                                             ("mamba2", {})], ids=["falcon-3A", "transformer", "mamba2"])
def test_prefill_chunk_size_fills_the_cache_in_chunks(mixer, overrides):
    """``generate(prefill_chunk_size=3)`` (or set in the generation config) feeds the prompt 3 columns at a time,
    the first call reaching every row's first real token under left padding, and generates what one prefill
    does, greedy and with beams."""
    model = _model(mixer, overrides)
    widths = []
    model.register_forward_pre_hook(lambda _, args, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    x = torch.randint(1, 64, (2, 10))
    left = torch.ones_like(x)
    left[1, :6] = 0
    with torch.no_grad():
        for mask, first in ((None, [3, 3, 3, 1]), (left, [7, 3])):  # left: one call to column 7, one of 3 real
            for kw in (dict(do_sample=False), dict(num_beams=3, do_sample=False)):
                want = model.generate(x, attention_mask=mask, max_new_tokens=6, **kw)
                widths.clear()
                got = model.generate(x, attention_mask=mask, max_new_tokens=6, prefill_chunk_size=3, **kw)
                assert torch.equal(got, want), (mask is None, kw)
                assert widths[:len(first)] == first and set(widths[len(first):]) == {1}, widths
        model.generation_config.prefill_chunk_size = 4
        widths.clear()
        assert torch.equal(model.generate(x, attention_mask=left, max_new_tokens=6, do_sample=False),
                           model.generate(x, attention_mask=left, max_new_tokens=6, do_sample=False,
                                          prefill_chunk_size=None))
        assert widths[:2] == [7, 3]
        model.generation_config.prefill_chunk_size = None
        for bad in (0, 2.0):
            with pytest.raises(ValueError, match=f"prefill_chunk_size must be an integer >= 1, got {bad}"):
                model.generate(x, max_new_tokens=2, prefill_chunk_size=bad)


@pytest.mark.parametrize("filled_by,used_by", [("transformer", "falcon"), ("falcon", "transformer"),
                                               ("retnet", "deltanet")])
def test_a_cache_of_another_model_is_refused_by_name(filled_by, used_by):
    """A cache filled by a model of another mixer (keys and values for a recurrent layer, a state for an
    attention layer, no convolution buffers for a layer that convolves) or of another depth is an error
    naming past_key_values; taken, it would continue every row from nothing at shifted positions."""
    x = torch.randint(0, 64, (2, 5))
    model = _model(used_by, {})
    with torch.no_grad():
        out = _model(filled_by, {})(x, use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        with pytest.raises(ValueError, match=r"past_key_values was filled by another model: layer 0 holds "):
            model(x[:, :1], past_key_values=cache)
        with pytest.raises(ValueError, match="past_key_values has 3 layers, the model 2"):
            model(x, past_key_values=FalconCache(3))
        with pytest.raises(ValueError, match="past_key_values has 1 layers, the model 2"):
            model.generate(x, past_key_values=FalconCache(1), max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "3A", "window": 3}), ("transformer", {})],
                         ids=["falcon-3A", "transformer"])
def test_beams_and_return_sequences_continue_a_prefilled_cache(mixer, overrides):
    """A cache prefilled on a prompt, continued by generate() with several beams or returned sequences per
    row, gives what generate() gives from the prompt alone."""
    model = _model(mixer, overrides)
    torch.manual_seed(5)
    x = torch.randint(1, 64, (2, 6))
    seq = torch.cat([x, torch.randint(1, 64, (2, 2))], 1)
    for kw in (dict(num_beams=3, do_sample=False), dict(do_sample=True, num_return_sequences=2)):
        with torch.no_grad():
            out = model(x, use_cache=True)
            cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
            torch.manual_seed(6)
            got = model.generate(seq, attention_mask=torch.ones_like(seq), past_key_values=cache, max_new_tokens=6,
                                 **kw)
            torch.manual_seed(6)
            want = model.generate(seq, attention_mask=torch.ones_like(seq), max_new_tokens=6, **kw)
        assert got.shape == want.shape and torch.equal(got, want), kw


@pytest.mark.parametrize("mixer,overrides", [CASES[0], CASES[3]], ids=[IDS[0], IDS[3]])
def test_logits_to_keep_is_the_last_columns_and_generate_asks_for_one(mixer, overrides):
    """``logits_to_keep=k`` gives the last ``k`` columns of the full logits (dense, padded and packed
    rows); ``generate()`` asks for one column per step, prompt included, and decodes the same tokens."""
    model = _model(mixer, overrides)
    torch.manual_seed(2)
    ids = torch.randint(0, 64, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    with torch.no_grad():
        for kwargs in (dict(), dict(attention_mask=mask)):
            full = model(ids, use_cache=False, **kwargs).logits
            for k in (1, 3, 9):
                part = model(ids, use_cache=False, logits_to_keep=k, **kwargs).logits
                assert part.shape == (3, k, 64)
                assert torch.allclose(part, full[:, -k:], atol=1e-12, rtol=0)
        cu = torch.tensor([0, 4, 9])
        full = model(ids[:1], cu_seqlens=cu, use_cache=False).logits
        assert torch.allclose(model(ids[:1], cu_seqlens=cu, use_cache=False, logits_to_keep=2).logits, full[:, -2:],
                              atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, labels=ids, logits_to_keep=1)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)
    widths = []
    model.register_forward_hook(lambda m, args, out: widths.append(out.logits.shape[1]))
    prompt = ids[:2, :7]
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
    assert widths == [1] * 5
    assert torch.equal(out, _greedy_uncached(model, prompt, 5))


def test_normalized_read_reaches_the_op_and_the_cache():
    """A layer with ``eps_attn`` returns the op's normalized read, and its cache holds ``z``: the
    model's logits differ from those of the same weights with the denominator-free read."""
    from falcon_fwa import falcon_attention
    from falcon_fwa.layers.packing import Packing

    model = _model("falcon", NORMALIZED_READ)
    layer = model.model.layers[0].mixer
    g = torch.Generator().manual_seed(5)
    B, T, H, K = 2, 9, layer.num_heads, layer.head_k_dim
    q, k = (torch.rand(B, T, H, K, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, layer.head_v_dim, generator=g, dtype=torch.float64)
    beta, lam = torch.rand(B, T, H, generator=g, dtype=torch.float64), torch.rand(B, T, H, generator=g,
                                                                                    dtype=torch.float64)
    got = layer._core(q, k, v, beta, lam, None, Packing.dense(B, T, None, q.device), None)
    want, _ = falcon_attention(q, k, v, beta, lam, rule="3A", window=3, scale_ridge=True, eps_attn=1e-3,
                               form=layer.form, chunk_size=layer.chunk_size, eps=layer.eps,
                               decay_floor=layer.decay_floor)
    assert float((got - want).abs().max()) <= 1e-12
    x = torch.randint(0, 64, (2, 6))
    with torch.no_grad():
        out = model(x, use_cache=True)
        plain = FalconForCausalLM(get_preset("tiny-falcon", **dict(NORMALIZED_READ, eps_attn=None))).double()
        plain.load_state_dict(model.state_dict())
        assert not torch.allclose(plain(x, use_cache=False).logits, out.logits)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    assert cache[0].state.z.shape == (2, H, K)


def test_generate_refuses_what_a_recurrent_cache_cannot_do_by_name():
    """Assisted and prompt-lookup decoding (they roll the cache back), attention weights (there are none) and a
    cache of another kind are refused with the option's name, instead of a bare error from inside generate()."""
    from transformers import DynamicCache

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon")).eval()
    ids = torch.randint(0, 64, (1, 6))
    for option, value in (("prompt_lookup_num_tokens", 3), ("assistant_model", model)):
        with pytest.raises(ValueError, match=rf"generate\({option}=\.\.\.\): assisted and prompt-lookup decoding"):
            model.generate(ids, max_new_tokens=2, do_sample=False, **{option: value})
    with pytest.raises(ValueError, match="output_attentions=True: the model returns no attention weights"):
        model.generate(ids, max_new_tokens=2, do_sample=False, return_dict_in_generate=True, output_attentions=True)
    with pytest.raises(ValueError, match="output_attentions=True"):
        model(ids, output_attentions=True)
    with pytest.raises(TypeError, match="past_key_values must be a FalconCache .*got DynamicCache"):
        model(ids, past_key_values=DynamicCache())
    # what stays allowed: output_attentions off, and plain greedy decoding
    assert model(ids, output_attentions=False).logits.shape == (1, 6, model.config.vocab_size)
    assert model.generate(ids, max_new_tokens=2, do_sample=False).shape == (1, 8)


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "3A", "window": 3}), ("transformer", {})],
                         ids=["falcon-3A", "transformer"])
def test_a_continued_cache_saves_and_loads_and_goes_on_as_one_pass(mixer, overrides):
    """A cache that has been continued (and so checked against its model) goes through ``torch.save`` and
    ``pickle``; the loaded copy continues as one pass over the whole sequence would, and is checked again
    where it is given: to a model of another mixer it is refused by name."""
    import io
    import pickle

    model = _model(mixer, overrides)
    x = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        want = model(x, use_cache=False).logits[:, 8:]
        out = model(x[:, :6], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        for t in (6, 7):
            model(x[:, t:t + 1], past_key_values=cache)
        buf = io.BytesIO()
        torch.save(cache, buf)
        copies = [torch.load(io.BytesIO(buf.getvalue()), weights_only=False), pickle.loads(pickle.dumps(cache))]
        for copy in copies:
            assert copy.num_positions == 8 and copy.seen.tolist() == [8, 8]
            got = model(x[:, 8:], past_key_values=copy).logits
            assert float((got - want).abs().max()) <= 1e-10
        other = _model("retnet" if mixer == "transformer" else "transformer", {})
        with pytest.raises(ValueError, match="past_key_values was filled by another model"):
            other(x[:, 8:], past_key_values=pickle.loads(pickle.dumps(cache)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize("prefill_autocast", [True, False], ids=["autocast-prefill", "autocast-steps"])
@pytest.mark.parametrize("mixer", ["transformer", "falcon"])
def test_a_cache_filled_under_autocast_continues_without_it_and_the_reverse(mixer, prefill_autocast, device):
    """A float32 model's cache filled under bfloat16 autocast and continued without it (or the reverse), one
    token and several at a time, follows the float64 model within bfloat16's rounding: the Transformer's key
    and value buffers keep the dtype they were filled in (bfloat16 or float32) and take the new keys in it.
    On CUDA the Falcon model runs its Triton kernels (bfloat16 inputs under autocast) and the fused step."""
    import contextlib
    import copy

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(f"tiny-{mixer}")).eval()
    exact = copy.deepcopy(model).double()
    model = model.to(device)
    x = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    autocast = lambda: torch.autocast(device, dtype=torch.bfloat16)  # noqa: E731
    prefill, steps = (autocast, contextlib.nullcontext) if prefill_autocast else (contextlib.nullcontext, autocast)
    with torch.no_grad():
        want = exact(x, attention_mask=mask, use_cache=False).logits
        xd, md = x.to(device), mask.to(device)
        with prefill():
            out = model(xd[:, :6], attention_mask=md[:, :6], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        parts = [out.logits]
        for a, b in ((6, 7), (7, 8), (8, 12)):
            with steps():
                parts.append(model(xd[:, a:b], attention_mask=md[:, :b], past_key_values=cache).logits)
    if mixer == "transformer":
        assert cache[0].keys.dtype == (torch.bfloat16 if prefill_autocast else torch.float32)
        assert cache[0].keys.device.type == device
    got = torch.cat(parts, 1).double().cpu() * mask[..., None]
    assert float((got - want * mask[..., None]).abs().max()) <= 0.03 * float(want.abs().max())


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "3A", "window": 3}), ("transformer", {}),
                                             ("retnet", {})], ids=["falcon-3A", "transformer", "retnet"])
def test_a_call_whose_columns_are_all_pads_leaves_the_cache_and_gives_zero_logits(mixer, overrides):
    """An attention_mask with no real token in any row (a batch of empty rows, or a cached call in which every
    row gets none) gives the zero logits and hidden states of pads, as a pad column of any batch does; the cache
    counts the columns but no token, and continuing it equals one pass over the real tokens."""
    model = _model(mixer, overrides)
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        empty = model(x[:, :4], attention_mask=torch.zeros(2, 4, dtype=torch.long), use_cache=False,
                      output_hidden_states=True)
        assert empty.logits.shape == (2, 4, 64) and not empty.logits.any()
        assert len(empty.hidden_states) == 3 and not any(h.any() for h in empty.hidden_states)
        out = model(x[:, :5], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        mask = torch.cat([torch.ones(2, 5, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long)], 1)
        pads = model(x[:, 5:7], attention_mask=mask, past_key_values=cache)
        assert not pads.logits.any() and cache.seen.tolist() == [5, 5] and cache.get_seq_length() == 7
        mask = torch.cat([mask, torch.ones(2, 2, dtype=torch.long)], 1)
        got = model(x[:, 7:], attention_mask=mask, past_key_values=cache).logits
        want = model(torch.cat([x[:, :5], x[:, 7:]], 1), use_cache=False).logits[:, 5:]
        assert float((got - want).abs().max()) <= 1e-10
        # an empty row among others: a pad row without a cache; refused, naming the row, in a cache's first call
        one_empty = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
        assert not model(x[:, :4], attention_mask=one_empty, use_cache=False).logits[1].any()
        with pytest.raises(ValueError, match=r"every row needs at least one real token in the first call with a "
                                             r"cache, rows \[1\] have none .*use_cache=False"):
            model(x[:, :4], attention_mask=one_empty)  # in eval mode a cache by default


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "3A", "window": 3}), ("transformer", {}),
                                             ("mamba2", {})], ids=["falcon-3A", "transformer", "mamba2"])
def test_a_cached_call_in_which_some_rows_get_only_pads_leaves_those_rows(mixer, overrides):
    """A cached call whose attention_mask gives row 0 two tokens and row 1 none writes the new state, sliding tail,
    convolution buffers and keys of row 0 only: row 1 continues as if the call had not been made. Each row's
    logits equal those of one float64 pass over its real tokens."""
    from falcon_fwa.layers.layer_cache import scatter_rows

    model = _model(mixer, overrides)
    torch.manual_seed(7)
    x = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        out = model(x[:, :4], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[1, 4:] = 0
        middle = model(x[:, 4:6], attention_mask=mask, past_key_values=cache).logits
        assert cache.seen.tolist() == [6, 4]
        last = model(x[:, 6:], attention_mask=torch.ones(2, 9, dtype=torch.long), past_key_values=cache).logits
        whole = model(x[:1], use_cache=False).logits[0]
        skipped = model(torch.cat([x[1:, :4], x[1:, 6:]], 1), use_cache=False).logits[0]
    assert float((middle[0] - whole[4:6]).abs().max()) <= 1e-10 and not middle[1].any()
    assert float((last[0] - whole[6:]).abs().max()) <= 1e-10
    assert float((last[1] - skipped[4:]).abs().max()) <= 1e-10
    # by hand: new rows into the rows named, in the order named
    new = torch.tensor([[1.0], [2.0], [3.0]])
    assert scatter_rows(None, torch.tensor([2, 0, 1]), new).tolist() == [[2.0], [3.0], [1.0]]
    assert scatter_rows(new, torch.tensor([1]), torch.tensor([[9.0]])).tolist() == [[1.0], [9.0], [3.0]]
    assert scatter_rows(new, None, new[:1]).tolist() == [[1.0]]


def test_prefill_chunk_size_continues_a_prefilled_cache_given_only_the_new_ids():
    """A cache prefilled on the first 4 columns of a left-padded prompt, continued by ``generate()`` with only
    the 6 new columns (the mask covers all 10) in chunks of 2: the chunks are the new columns 2 at a time, and the
    tokens are those of one generate() over the whole prompt."""
    model = _model("falcon", {"rule": "3A", "window": 3})
    torch.manual_seed(3)
    x = torch.randint(1, 64, (2, 10))
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    fed = []
    with torch.no_grad():
        want = model.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False)
        out = model(x[:, :4], attention_mask=mask[:, :4], use_cache=True)
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        model.register_forward_pre_hook(lambda _, args, kw: fed.append(kw["input_ids"].clone()), with_kwargs=True)
        got = model.generate(x[:, 4:], attention_mask=mask, past_key_values=cache, max_new_tokens=5, do_sample=False,
                             prefill_chunk_size=2)
    assert torch.equal(got[:, -5:], want[:, -5:]) and len(set(want[:, -5:].flatten().tolist())) > 3
    assert [f.shape[1] for f in fed] == [2, 2, 2, 1, 1, 1, 1]
    assert torch.equal(torch.cat(fed[:3], 1), x[:, 4:])
