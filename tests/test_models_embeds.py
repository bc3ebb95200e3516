"""``inputs_embeds``: the LM fed embeddings instead of ids (soft prompts, continuous inputs).

``inputs_embeds = embed_tokens(ids)`` must give exactly what ``ids`` give in every layout
(dense, padded, packed), with the cache, in ``generate()``, and gradients must reach a soft prompt.
"""
import pytest
import torch
from transformers import GenerationConfig
from transformers.modeling_outputs import CausalLMOutputWithPast

from falcon_fwa.models import FalconCache, FalconForCausalLM, get_preset

CASES = [("falcon", {"rule": "1A"}), ("falcon", {"rule": "1"}), ("falcon", {"rule": "3A", "window": 3}),
         ("transformer", {}), ("deltanet", {}), ("gated_deltanet", {}), ("mamba2", {}), ("retnet", {})]
IDS = ["falcon-1A", "falcon-1", "falcon-3A", "transformer", "deltanet", "gated_deltanet", "mamba2", "retnet"]
# generate()'s name for a cache to continue ("cache" from transformers 5.2x, "past_key_values" before)
CACHE_KW = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
# generate() plumbing is the same for every recurrent mixer: one recurrent cache and the KV cache.
GEN_CASES, GEN_IDS = [CASES[2], CASES[3]], [IDS[2], IDS[3]]


pytestmark = pytest.mark.usefixtures("one_thread")


def _model(mixer, overrides, dtype=torch.float64):
    torch.manual_seed(0)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}", **overrides)).to(dtype).eval()


def _cache(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def _padded(lengths, T, side, seed):
    """Rows of random ids (junk under the pads) and their mask, padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, slice(T - n, T) if side == "left" else slice(0, n)] = 1
    return ids, mask


def _assert_same_outputs(a, b):
    assert torch.equal(a.logits, b.logits)
    if a.loss is not None:
        assert torch.equal(a.loss, b.loss)
    if a.hidden_states is not None:
        assert len(a.hidden_states) == len(b.hidden_states)
        for x, y in zip(a.hidden_states, b.hidden_states):
            assert torch.equal(x, y)


@pytest.mark.parametrize("mixer,overrides", CASES, ids=IDS)
def test_embeddings_of_the_ids_give_exactly_the_outputs_of_the_ids(mixer, overrides):
    """fp32, bit for bit: dense, left- and right-padded, packed; loss, hidden states, logits_to_keep, tuples."""
    model = _model(mixer, overrides, torch.float32)
    embed = model.get_input_embeddings()
    calls = []
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    calls.append((ids, dict(labels=ids, output_hidden_states=True)))
    calls.append((ids, dict(logits_to_keep=3)))
    for side in ("left", "right"):
        ids, mask = _padded([9, 4, 6], 9, side, seed=2)
        calls.append((ids, dict(attention_mask=mask, labels=ids, output_hidden_states=True)))
        calls.append((ids, dict(attention_mask=mask, logits_to_keep=2)))
    packed = torch.randint(0, 64, (1, 18), generator=torch.Generator().manual_seed(3))
    cu = torch.tensor([0, 6, 7, 18])
    calls.append((packed, dict(cu_seqlens=cu, labels=packed, output_hidden_states=True)))
    with torch.no_grad():
        for ids, kw in calls:
            want = model(ids, use_cache=False, **kw)
            got = model(inputs_embeds=embed(ids), use_cache=False, **kw)
            _assert_same_outputs(got, want)
            if "output_hidden_states" in kw and "attention_mask" not in kw:
                assert torch.equal(got.hidden_states[0], embed(ids))  # the blocks' first input
        ids, mask = calls[2][0], calls[2][1]["attention_mask"]
        tup = model(inputs_embeds=embed(ids), attention_mask=mask, labels=ids, use_cache=False, return_dict=False)
        assert isinstance(tup, tuple) and len(tup) == 2
        assert torch.equal(tup[0], model(ids, attention_mask=mask, labels=ids, use_cache=False).loss)


@pytest.mark.parametrize("mixer,overrides", CASES, ids=IDS)
def test_prefill_with_embeddings_then_ids_token_by_token_equals_one_pass(mixer, overrides):
    """The cache written from ``inputs_embeds`` (left-padded rows) continues with ids one token at a time."""
    model = _model(mixer, overrides)
    embed = model.get_input_embeddings()
    prompt, mask = _padded([6, 3], 6, "left", seed=4)
    new = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(5))
    full_ids = torch.cat([prompt, new], 1)
    full_mask = torch.cat([mask, torch.ones_like(new)], 1)
    with torch.no_grad():
        want = model(full_ids, attention_mask=full_mask, use_cache=False).logits
        out = model(inputs_embeds=embed(prompt), attention_mask=mask, use_cache=True)
        cache, parts = _cache(out), [out.logits]
        for t in range(new.shape[1]):
            out = model(new[:, t:t + 1], attention_mask=full_mask[:, :prompt.shape[1] + t + 1], past_key_values=cache)
            cache = _cache(out)
            parts.append(out.logits)
    assert float((torch.cat(parts, 1) - want).abs().max()) <= 1e-10
    assert cache.seen.tolist() == [11, 8] and cache.get_seq_length() == 11


def _generate(model, *args, seed=7, **kw):
    """``generate()``'s tokens and the raw logits of every step ``[B, new, vocab]``."""
    torch.manual_seed(seed)
    out = model.generate(*args, return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("mixer,overrides", GEN_CASES, ids=GEN_IDS)
def test_generate_from_embeddings_returns_the_new_tokens_of_generate_from_ids(mixer, overrides):
    """Left-padded batch: the new tokens and every step's logits equal those from the ids; with ids
    alongside the output starts with them (Hugging Face's decoder-only convention); greedy, beams,
    sampled return sequences and a cache prefilled from embeddings work the same. (A larger init than
    the default makes the tiny model's continuations depend on the context.)"""
    model = _model(mixer, dict(overrides, initializer_range=0.5))
    embed = model.get_input_embeddings()
    ids, mask = _padded([3, 8, 5], 8, "left", seed=6)
    kw = dict(attention_mask=mask, max_new_tokens=10, pad_token_id=0)
    with torch.no_grad():
        modes = (dict(do_sample=False), dict(num_beams=3, do_sample=False),
                 dict(do_sample=True, num_return_sequences=2))
        for extra in modes:
            want, want_logits = _generate(model, ids, **kw, **extra)
            got, logits = _generate(model, inputs_embeds=embed(ids), **kw, **extra)
            assert got.shape == (want.shape[0], 10) and torch.equal(got, want[:, 8:]), extra
            assert torch.equal(logits, want_logits), extra
            both, logits = _generate(model, ids, inputs_embeds=embed(ids), **kw, **extra)
            assert torch.equal(both, want) and torch.equal(logits, want_logits), extra
        assert len(set(want[0, 8:].tolist())) > 3  # not a constant continuation
        # a cache prefilled from the embeddings of a prefix, continued by generate() over the whole sequence
        # (beams and return sequences repeat its rows)
        for extra in modes:
            cache = _cache(model(inputs_embeds=embed(ids[:, :6]), attention_mask=mask[:, :6], use_cache=True))
            got, logits = _generate(model, inputs_embeds=embed(ids), **{CACHE_KW: cache}, **kw, **extra)
            want, want_logits = _generate(model, ids, **kw, **extra)
            assert torch.equal(got, want[:, 8:]) and float((logits - want_logits).abs().max()) <= 1e-10, extra


@pytest.mark.parametrize("mixer,overrides", [CASES[0], CASES[6]], ids=[IDS[0], IDS[6]])
def test_soft_prompt_gradient_matches_finite_differences(mixer, overrides):
    """A learnable prefix ``P`` before the embedded ids of left-padded rows of a frozen model: ``P.grad``
    from backward equals the central difference of the loss in float64."""
    model = _model(mixer, overrides).requires_grad_(False)
    embed = model.get_input_embeddings()
    n, D = 3, model.config.hidden_size
    P = (0.02 * torch.randn(1, n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(8))).requires_grad_()
    ids, mask = _padded([7, 4], 7, "left", seed=9)

    def loss_of(prefix):
        B, T = ids.shape
        rows, full_mask, labels = [], torch.zeros(B, n + T, dtype=torch.long), torch.full((B, n + T), -100)
        for b in range(B):  # each row: its pads, then the prefix, then its real ids
            real = ids[b][mask[b].bool()]
            k = real.numel()
            rows.append(torch.cat([torch.zeros(T - k, D, dtype=torch.float64), prefix[0], embed(real)], 0))
            full_mask[b, T - k:] = 1
            labels[b, n + T - k:] = real
        return model(inputs_embeds=torch.stack(rows), attention_mask=full_mask, labels=labels, use_cache=False).loss

    loss_of(P).backward()
    grad = P.grad
    assert grad is not None and float(grad.abs().max()) > 0
    assert all(p.grad is None for p in model.parameters())  # frozen model: only the prompt is trained
    eps = 1e-6
    for i, j in ((0, 0), (1, 5), (2, 17), (2, D - 1)):
        e = torch.zeros_like(P)
        e[0, i, j] = eps
        with torch.no_grad():
            fd = (loss_of(P + e) - loss_of(P - e)) / (2 * eps)
        assert abs(float(fd) - float(grad[0, i, j])) <= 1e-8, (i, j)  # observed: about 2e-10


def test_inputs_embeds_errors_name_the_argument():
    model = _model("falcon", {})
    ids = torch.randint(0, 64, (2, 5))
    e = model.get_input_embeddings()(ids)
    with torch.no_grad():
        with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds, got both"):
            model(ids, inputs_embeds=e)
        with pytest.raises(ValueError, match="exactly one of input_ids and inputs_embeds, got neither"):
            model(attention_mask=torch.ones_like(ids))
        for bad in (e[..., :-1], e[0], e[None], e[:, :0]):  # hidden size, rank 2, rank 4, T = 0
            with pytest.raises(ValueError, match=r"inputs_embeds must have shape \[B, T, hidden_size\]"):
                model(inputs_embeds=bad)
        with pytest.raises(ValueError, match="inputs_embeds must be a floating-point tensor"):
            model(inputs_embeds=ids[..., None].expand(2, 5, 32))
        with pytest.raises(ValueError, match=r"cu_seqlens needs inputs_embeds of shape \[1, total, hidden_size\]"):
            model(inputs_embeds=e, cu_seqlens=torch.tensor([0, 2, 5]))
        cache = _cache(model(inputs_embeds=e, use_cache=True))
        with pytest.raises(ValueError, match=r"past_key_values holds 2 sequences, but this call continues 3 "
                                             r"\(inputs_embeds of shape \(3, 1, 32\)\)"):
            model(inputs_embeds=torch.zeros(3, 1, 32, dtype=e.dtype), past_key_values=cache)
        with pytest.raises(ValueError, match="past_key_values has consumed 5 columns, but inputs_embeds has 3"):
            model.generate(inputs_embeds=e[:, :3], max_new_tokens=2, do_sample=False, **{CACHE_KW: cache})


@pytest.mark.parametrize("mixer,overrides", GEN_CASES, ids=GEN_IDS)
def test_generate_continues_a_cached_soft_prefix_with_only_the_new_ids(mixer, overrides):
    """A prefix cached from embeddings (a soft prompt has no ids) continued by generate() with only the ids
    after it and an attention_mask over the whole sequence (Hugging Face's convention for a prefilled cache):
    every id is fed, and the output equals generate() over the whole sequence of ids. Also a prefill in chunks
    (``prefill_chunk_size``), which hands generate() the new ids only, chunk by chunk. (Padded rows: transformers
    5.2x drops a mask of ones before the first step, and without one only the whole sequence can be fed.)"""
    model = _model(mixer, dict(overrides, initializer_range=0.5))
    embed = model.get_input_embeddings()
    ids, mask = _padded([6, 8, 7], 8, "left", seed=6)
    kw = dict(max_new_tokens=6, pad_token_id=0, do_sample=False)
    with torch.no_grad():
        want, want_logits = _generate(model, ids, attention_mask=mask, **kw)
        for n in (5, 2):  # more and fewer new ids than the cache has consumed
            cache = _cache(model(inputs_embeds=embed(ids[:, :8 - n]), attention_mask=mask[:, :8 - n], use_cache=True))
            got, logits = _generate(model, ids[:, 8 - n:], attention_mask=mask, **{CACHE_KW: cache}, **kw)
            assert torch.equal(got[:, n:], want[:, 8:]), n
            assert float((logits - want_logits).abs().max()) <= 1e-10, n
            assert cache.num_positions == 8 + 6 - 1
        if hasattr(GenerationConfig(), "prefill_chunk_size"):  # transformers 5; a chunked prefill needs a cache
            got, logits = _generate(model, ids, attention_mask=mask, prefill_chunk_size=3,
                                    **{CACHE_KW: FalconCache(model.config.num_hidden_layers)}, **kw)
            assert torch.equal(got, want) and float((logits - want_logits).abs().max()) <= 1e-10


@pytest.mark.parametrize("mixer,overrides", GEN_CASES, ids=GEN_IDS)
def test_the_prompt_step_over_a_prefilled_cache_is_recognised_without_is_first_iteration(mixer, overrides):
    """transformers 4 passes no ``is_first_iteration``: the prompt step over a cache prefilled on a prefix still
    consumes the embeddings past the cached columns (with or without ids beside them), later steps the new id
    only; and generate() from ids and embeddings over a prefilled cache returns what it returns without it."""
    model = _model(mixer, dict(overrides, initializer_range=0.5))
    embed = model.get_input_embeddings()
    ids, mask = _padded([3, 8, 5], 8, "left", seed=6)
    with torch.no_grad():
        for ids_too in (False, True):  # the prompt step, then a decoding step
            cache = _cache(model(inputs_embeds=embed(ids[:, :6]), attention_mask=mask[:, :6], use_cache=True))
            step = model.prepare_inputs_for_generation(ids if ids_too else ids[:, :0], attention_mask=mask,
                                                       inputs_embeds=embed(ids), **{CACHE_KW: cache})
            assert step.get("input_ids") is None and torch.equal(step["inputs_embeds"], embed(ids[:, 6:])), ids_too
            model(**step)
            nxt = torch.full((3, 1), 7)
            step = model.prepare_inputs_for_generation(torch.cat([ids, nxt], 1) if ids_too else nxt,
                                                       attention_mask=torch.cat([mask, torch.ones_like(nxt)], 1),
                                                       inputs_embeds=embed(ids), **{CACHE_KW: cache})
            assert step.get("inputs_embeds") is None and torch.equal(step["input_ids"], nxt), ids_too
        kw = dict(attention_mask=mask, max_new_tokens=6, pad_token_id=0, do_sample=False)
        want, want_logits = _generate(model, ids, **kw)
        cache = _cache(model(inputs_embeds=embed(ids[:, :6]), attention_mask=mask[:, :6], use_cache=True))
        got, logits = _generate(model, ids, inputs_embeds=embed(ids), **{CACHE_KW: cache}, **kw)
        assert torch.equal(got, want) and float((logits - want_logits).abs().max()) <= 1e-10


@pytest.mark.parametrize("mixer,overrides", [CASES[0], CASES[3], CASES[6]], ids=[IDS[0], IDS[3], IDS[6]])
def test_embeddings_of_another_dtype_are_cast_to_the_model_dtype(mixer, overrides):
    """fp32 (or fp64) embeddings, e.g. a soft prompt kept in fp32, into a bf16 model: cast like
    ``embed_tokens(ids)``, so they give the outputs of the ids, and the gradient reaches them in their dtype."""
    model = _model(mixer, overrides, torch.bfloat16)
    embed = model.get_input_embeddings()
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        want = model(ids, use_cache=False)
        for dtype in (torch.float32, torch.float64):
            got = model(inputs_embeds=embed(ids).to(dtype), use_cache=False, output_hidden_states=True)
            _assert_same_outputs(got, model(ids, use_cache=False, output_hidden_states=True))
            assert got.hidden_states[0].dtype == torch.bfloat16
        kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(inputs_embeds=embed(ids).float(), **kw), model.generate(ids, **kw)[:, 6:])
    soft = embed(ids).detach().float().requires_grad_()
    model(inputs_embeds=soft, labels=ids, use_cache=False).loss.backward()
    assert soft.grad is not None and soft.grad.dtype == torch.float32 and float(soft.grad.abs().max()) > 0
    assert torch.equal(want.logits, model(ids, use_cache=False).logits)
