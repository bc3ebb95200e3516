"""``generate_text`` against independent references: greedy tokens equal the argmax of a full uncached
forward pass re-run over the growing sequence (every mixer, left-padded batches of different prompt
lengths, prompts longer than the chunk size, rows ending at end-of-text while others go on) and Hugging
Face ``generate`` on the same cache; sampled tokens are drawn from the textbook filtered distribution."""
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.serve import generate_text

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 256  # the byte tokenizer's end-of-text token; the models' vocabulary is the tokenizer's 257 ids
CASES = {"falcon-1": ("falcon", {"rule": "1"}), "falcon-1A": ("falcon", {}), "falcon-2": ("falcon", {"rule": "2"}),
         "falcon-2A": ("falcon", {"rule": "2A"}), "falcon-3": ("falcon", {"rule": "3", "window": 3}),
         "falcon-3A": ("falcon", {"rule": "3A", "window": 3}),
         "falcon-3A-normalized-read": ("falcon", {"rule": "3A", "window": 3, "eps_attn": 1e-3, "feature_map": "elu1",
                                                  "qk_norm": "none"}),
         "transformer": ("transformer", {}), "mamba2": ("mamba2", {}), "retnet": ("retnet", {}),
         "deltanet": ("deltanet", {}), "gated_deltanet": ("gated_deltanet", {})}
# 42 bytes: longer than the tiny presets' chunk of 8, and padded against the short ones
PROMPTS = ["fast weight memory and the state of it all", "a", "the online learner reads its keys", "xyz"]


def _model(mixer, overrides, eos_bonus=0.0):
    """A tiny float64 model with varied greedy continuations; ``eos_bonus`` is added to the end-of-text
    logit of every forward pass (a forward hook), so that some rows end early."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(f"tiny-{mixer}", vocab_size=257, initializer_range=0.5, **overrides))
    model = model.double().eval()

    def bonus(module, args, out):
        out.logits[..., EOS] += eos_bonus
        return out

    model.register_forward_hook(bonus)
    return model


def _greedy_reference(model, prompt_ids, n, stop):
    """Argmax of the last logits of an uncached forward pass over the whole sequence, one token at a time."""
    seq, new = list(prompt_ids), []
    with torch.no_grad():
        while len(new) < n and not (stop and new and new[-1] == EOS):
            new.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
            seq.append(new[-1])
    return new


def _hf_generate(model, prompt_ids, n, stop):
    """Hugging Face ``generate`` over one left-padded batch of all the prompts, cut at each row's first end-of-text
    token when ``stop``."""
    width = max(map(len, prompt_ids))
    ids = torch.full((len(prompt_ids), width), EOS)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompt_ids):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=EOS,
                             eos_token_id=EOS if stop else None)
    rows = [r[width:].tolist() for r in out]
    return [r[:r.index(EOS) + 1] if stop and EOS in r else r for r in rows]


@pytest.mark.parametrize("stop", [False, True], ids=["no-stop", "stop-at-eos"])
@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_equal_uncached_recomputation_and_hf_generate(case, stop):
    """Batches of 3 then 1 prompt (left-padded, 2 to 43 tokens); the end-of-text bonus makes rows end at different
    steps in some models, and their batch goes on without them."""
    model, tok = _model(*CASES[case], eos_bonus=3.0), byte_tokenizer()
    out = generate_text(model, tok, PROMPTS, max_new_tokens=16, batch_size=3, stop_at_eos=stop)
    prompt_ids = [c.prompt_ids for c in out.completions]
    assert prompt_ids == [[EOS, *p.encode()] for p in PROMPTS]
    want = [_greedy_reference(model, p, 16, stop) for p in prompt_ids]
    assert [c.token_ids for c in out.completions] == want
    assert _hf_generate(model, prompt_ids, 16, stop) == want
    for c in out.completions:
        assert c.stopped_at_eos == (stop and c.token_ids[-1] == EOS) and c.token_ids.count(EOS) <= (1 if stop else 16)
        assert c.text == tok.decode([t for t in c.token_ids if t != EOS])
    assert any(len(set(w)) > 4 for w in want)  # varied continuations: a drifting cache would change them
    t = out.timing
    assert (t.batches, t.prompt_tokens) == (2, sum(map(len, prompt_ids)))
    assert t.new_tokens == sum(map(len, want)) and t.decode_tokens == t.new_tokens - 4


def test_rows_that_end_at_end_of_text_leave_their_batch_going_on():
    """The end-of-text bonus of the stop test above ends two rows of the first batch of Falcon-3A at different steps
    and leaves the third running to the limit: each row is its own reference's, cut after its end-of-text token."""
    model, tok = _model(*CASES["falcon-3A"], eos_bonus=3.0), byte_tokenizer()
    out = generate_text(model, tok, PROMPTS[:3], max_new_tokens=16, batch_size=3)
    lengths = [len(c.token_ids) if c.stopped_at_eos else None for c in out.completions]
    assert lengths[1] is None and lengths[0] != lengths[2] and None not in (lengths[0], lengths[2]), lengths
    assert len(out.completions[1].token_ids) == 16
    assert out.timing.decode_tokens == sum(len(c.token_ids) - 1 for c in out.completions)


def _filtered(logits, temperature, top_k, top_p):
    """The textbook sampling distribution, in float64: softmax(logits / T), the top_k largest renormalized, then the
    fewest largest whose mass reaches top_p renormalized."""
    p = torch.softmax(logits.double() / temperature, -1).tolist()
    order = sorted(range(len(p)), key=lambda i: -p[i])[:top_k or len(p)]
    total = sum(p[i] for i in order)
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += p[i] / total
    out = torch.zeros(len(p), dtype=torch.float64)
    out[kept] = torch.tensor([p[i] for i in kept], dtype=torch.float64)
    return out / out.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.8, 0, 1.0), (1.3, 20, 1.0), (0.7, 0, 0.9), (1.5, 40, 0.8)])
def test_sampling_draws_from_the_textbook_distribution_of_the_uncached_logits(monkeypatch, temperature, top_k, top_p):
    """At every step of a left-padded batch, the distribution handed to ``torch.multinomial`` is the textbook one of
    an uncached float64 forward pass over the sequence drawn so far (same support, probabilities within float32
    rounding), the drawn token lies in its support, and a seed gives the same draws again (another seed, others)."""
    model, tok = _model(*CASES["falcon-3A"]), byte_tokenizer()
    seen, multinomial = [], torch.multinomial

    def spy(probs, n, generator=None):
        seen.append(probs.clone())
        return multinomial(probs, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", spy)
    kw = dict(max_new_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, batch_size=2, stop_at_eos=False)
    out = generate_text(model, tok, PROMPTS[:2], seed=5, **kw)
    assert len(seen) == 8
    for row, c in enumerate(out.completions):
        seq = c.prompt_ids
        for step, token in enumerate(c.token_ids):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            want, got = _filtered(logits, temperature, top_k, top_p), seen[step][row].double()
            assert torch.equal(got > 0, want > 0), (row, step)
            assert float((got / got.sum() - want).abs().max()) <= 1e-5, (row, step)
            assert want[token] > 0
            seq = seq + [token]
        if top_k or top_p < 1:
            assert (seen[0][row] > 0).sum() < 257  # the filters removed tokens
    again = generate_text(model, tok, PROMPTS[:2], seed=5, **kw)
    other = generate_text(model, tok, PROMPTS[:2], seed=6, **kw)
    assert [c.token_ids for c in again.completions] == [c.token_ids for c in out.completions]
    assert [c.token_ids for c in other.completions] != [c.token_ids for c in out.completions]


def test_one_new_token_is_the_prompt_pass_argmax_and_zero_is_refused():
    model, tok = _model(*CASES["mamba2"]), byte_tokenizer()
    calls = []
    model.register_forward_pre_hook(lambda m, args, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    out = generate_text(model, tok, PROMPTS[:3], max_new_tokens=1, batch_size=2)
    assert calls == [(2, 43), (1, 34)]  # one prompt pass per batch, no decoding step
    assert [c.token_ids for c in out.completions] == [_greedy_reference(model, c.prompt_ids, 1, False)
                                                      for c in out.completions]
    assert out.timing.decode_tokens == 0 and out.timing.decode_tokens_per_s is None
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1, got 0"):
        generate_text(model, tok, PROMPTS, max_new_tokens=0)
    with pytest.raises(TypeError, match="prompts must be a sequence of strings, got one str"):
        generate_text(model, tok, "xyz", max_new_tokens=2)  # else 3 prompts: "x", "y", "z"


def test_each_batch_is_handed_over_before_the_next_prompt_pass():
    """``on_batch`` gets each batch's completions as the batch ends: ``falcon-fwa generate`` prints them then, so
    that a long run shows its results as they come and a Ctrl-C keeps them."""
    model, tok = _model(*CASES["retnet"]), byte_tokenizer()
    events = []
    model.register_forward_pre_hook(
        lambda m, args, kw: events.append("prompt pass") if kw.get("past_key_values") is None else None,
        with_kwargs=True)
    out = generate_text(model, tok, PROMPTS, max_new_tokens=3, batch_size=3, stop_at_eos=False,
                        on_batch=lambda batch: events.append([c.prompt for c in batch]))
    assert events == ["prompt pass", PROMPTS[:3], "prompt pass", PROMPTS[3:]]
    assert [c.prompt for c in out.completions] == PROMPTS
