"""The causal LM's labels, position_ids, masks and generate() at edges the other model tests leave open, and
``position_nll``'s reading of the logits, each against a reference written here: the forward leaves the caller's
``labels`` as they were given; examples flattened into left-padded rows skip each example's first token in the loss
(a float64 cross-entropy of each example run alone); a row whose ``position_ids`` carry on from the row above is
refused by name; a chunked prefill without an ``attention_mask`` takes ``pad_token_id`` for pads (not when it is an
eos id), so each row's logits are those of its prompt alone; ``generate()`` takes ``position_ids`` that continue a
prefilled cache and refuses a row ending in the pad id; an ``attention_mask`` wider than the columns seen is
refused; ``generate()`` reads ``position_ids`` at real tokens only and refuses inputs that lack columns its mask
has; activation checkpointing is off in eval mode; ``position_nll`` works with ``config.return_dict = False`` and
scores bfloat16 logits in float32 (per-position sums computed here in float64)."""
import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from falcon_fwa.eval.perplexity import position_nll
from falcon_fwa.models import FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


# the generate() keyword of the cache: "cache" from transformers 5.2x, "past_key_values" before
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _model(mixer="falcon", seed=0):
    torch.manual_seed(seed)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}")).to(torch.float64).eval()


def _ids(*shape, seed=1):
    return torch.randint(0, 64, shape, generator=torch.Generator().manual_seed(seed))


def _nll_alone(model, examples):
    """Sum of ``-log softmax(logits[t])[e[t + 1]]`` over every example run by itself, and the number of terms."""
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            logp = torch.log_softmax(model(e[None], use_cache=False).logits[0].double(), -1)
            total += float(-logp[torch.arange(len(e) - 1), e[1:]].sum())
            count += len(e) - 1
    return total, count


def test_the_forward_leaves_the_callers_labels_as_given():
    """The loss ignores pads, the token after a pad, and each packed document's first token by setting them to
    ``-100`` in its own copy of ``labels``: int64 labels come back unchanged after a call with ``cu_seqlens``,
    one with a left-padded ``attention_mask`` and one with restarting ``position_ids``."""
    model = _model()
    with torch.no_grad():
        packed = _ids(1, 11)
        labels = packed.clone()
        model(packed, cu_seqlens=torch.tensor([0, 4, 11]), labels=labels, use_cache=False)
        assert torch.equal(labels, packed)

        x = _ids(2, 6, seed=2)
        mask = torch.ones_like(x)
        mask[0, :2] = 0
        labels = x.clone()
        model(x, attention_mask=mask, labels=labels, use_cache=False)
        assert torch.equal(labels, x)

        pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
        labels = x[:1].clone()
        model(x[:1], position_ids=pos, labels=labels, use_cache=False)
        assert torch.equal(labels, x[:1])


def test_left_padded_flattened_rows_skip_each_examples_first_token():
    """Examples flattened into rows padded on the left (positions restart at 0 at each example, any value at a
    pad): the loss is the mean next-token cross-entropy within the examples, each run alone, so no example's
    first token is scored from the one before it, wherever the pads put it in the row."""
    model = _model("gated_deltanet")
    g = torch.Generator().manual_seed(3)
    rows = [[torch.randint(0, 64, (n,), generator=g) for n in lengths] for lengths in ((3, 4), (2, 2, 3))]
    T = 9
    ids = torch.zeros(2, T, dtype=torch.long)
    pos = torch.full((2, T), 5, dtype=torch.long)
    mask = torch.zeros(2, T, dtype=torch.long)
    for r, examples in enumerate(rows):
        n = sum(len(e) for e in examples)
        ids[r, T - n:] = torch.cat(examples)
        pos[r, T - n:] = torch.cat([torch.arange(len(e)) for e in examples])
        mask[r, T - n:] = 1
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, labels=ids, use_cache=False)
    total, count = _nll_alone(model, rows[0] + rows[1])
    assert count == 9  # (3 - 1) + (4 - 1) + (2 - 1) + (2 - 1) + (3 - 1)
    assert float(out.loss) == pytest.approx(total / count, rel=1e-10)


@pytest.mark.parametrize("padded", [False, True])
def test_a_row_whose_positions_carry_on_from_the_row_above_is_refused(padded):
    """Each row's first real token starts a sequence, so its position must be 0: positions ``0..T-1`` in the first
    row and ``T..2T-1`` in the second are neither the model's count nor packed examples, and are refused naming
    ``position_ids`` (the second row is not run as the first one's continuation)."""
    model = _model()
    x = _ids(2, 4, seed=4)
    pos = torch.arange(8).reshape(2, 4)
    mask = None
    if padded:  # right padding of the first row: the second row's positions go on from its last real token
        mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
        pos = torch.tensor([[0, 1, 2, 7], [3, 4, 5, 6]])
    with torch.no_grad(), pytest.raises(ValueError, match=r"position_ids.*\[1, 0\]"):
        model(x, attention_mask=mask, position_ids=pos, use_cache=False)


def _generate(model, ids, **kw):
    """Greedy ``generate()``: the new tokens and the logits each was chosen from ``[B, new, vocab]``."""
    out = model.generate(ids, do_sample=False, output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


@pytest.mark.parametrize("eos", [None, 63])
def test_chunked_prefill_without_a_mask_takes_pad_token_id_for_pads(eos):
    """``generate(prefill_chunk_size=n)`` of left-padded prompts given without an ``attention_mask``: the chunks
    get the mask ``generate()`` makes (an id equal to ``pad_token_id``, when that id is no eos id, is a pad), so
    every row generates what its prompt alone does, from the same logits."""
    model = _model()
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 63, (n,), generator=g) for n in (6, 3)]
    ids = torch.zeros(2, 6, dtype=torch.long)  # 0: the pad id
    for b, p in enumerate(prompts):
        ids[b, 6 - len(p):] = p
    kw = dict(max_new_tokens=3, pad_token_id=0, eos_token_id=eos)
    with torch.no_grad():
        got, got_logits = _generate(model, ids, prefill_chunk_size=2, **kw)
        for b, p in enumerate(prompts):
            new, logits = _generate(model, p[None], **kw)
            n = new.shape[1]
            assert torch.equal(got[b, :n], new[0]), b
            torch.testing.assert_close(got_logits[b, :n], logits[0], rtol=0, atol=1e-10)


def test_chunked_prefill_without_a_mask_takes_no_pads_when_the_pad_id_is_the_eos_id():
    """With ``pad_token_id`` also an eos id, ``generate()`` takes no id for a pad (its mask is all ones): the
    chunked prefill then reads every column as a real token too, and generates what one prefill does."""
    model = _model()
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    ids[1, :3] = 5
    kw = dict(max_new_tokens=3, pad_token_id=5, eos_token_id=5)
    with torch.no_grad():
        want, want_logits = _generate(model, ids, attention_mask=torch.ones_like(ids), **kw)
        got, got_logits = _generate(model, ids, prefill_chunk_size=2, **kw)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=1e-10)


def test_generate_takes_position_ids_that_continue_a_prefilled_cache():
    """``position_ids`` given to ``generate()`` with a cache that has consumed 5 columns need not start at 0: the
    new columns' positions (``5, 6, 7``; ``4, 5, 6`` in a row with one pad) continue its count and are taken,
    generating what the same cache continues to without them; positions that skip are refused by name."""
    model = _model()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(x)
    mask[1, 0] = 0  # the second row is padded on the left: its new columns are at positions 4, 5, 6
    kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, attention_mask=mask)

    def prefilled():
        out = model(x[:, :5], attention_mask=mask[:, :5], use_cache=True)
        return getattr(out, "cache", None) or out.past_key_values

    with torch.no_grad():
        want = model.generate(x[:, 5:], **{CACHE: prefilled()}, **kw)
        got = model.generate(x[:, 5:], **{CACHE: prefilled()},
                             position_ids=torch.tensor([[5, 6, 7], [4, 5, 6]]), **kw)
        assert torch.equal(got, want)
        with pytest.raises(ValueError, match="position_ids given to generate"):
            model.generate(x[:, 5:], **{CACHE: prefilled()}, position_ids=torch.tensor([[5, 6, 7], [4, 6, 7]]),
                           **kw)


def test_generate_without_a_mask_refuses_a_row_that_ends_in_the_pad_id():
    """Without an ``attention_mask`` ``generate()`` takes an id equal to ``pad_token_id`` (no eos id) for a pad: a
    row whose last id is the pad id is right padding and is refused naming ``attention_mask``, also when no
    ``prefill_chunk_size`` asks for the mask before the first step; a pad id that is also the eos id is no pad."""
    model = _model()
    x = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(8))
    x[1, -1] = 0
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"attention_mask ends in padding in rows \[1\]"):
            model.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0)
        out = model.generate(x, max_new_tokens=2, do_sample=False, pad_token_id=0, eos_token_id=0)
    assert torch.equal(out[:, :5], x)


def test_an_attention_mask_wider_than_the_columns_seen_is_refused():
    """``attention_mask`` covers the columns a cache has consumed and this call's ``T``: ``[B, T]`` exactly without
    a filled cache, ``[B, T_past + T]`` at most with one; a wider mask (columns that belong to no call) is refused
    naming ``attention_mask`` rather than cut to its last ``T`` columns."""
    model = _model()
    x = torch.randint(0, 64, (2, 4), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"attention_mask must have shape .*got \(2, 5\)"):
            model(x, attention_mask=torch.ones(2, 5, dtype=torch.long), use_cache=False)
        out = model(x, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        with pytest.raises(ValueError, match=r"attention_mask must have shape .*\[2, 8\].*got \(2, 9\)"):
            model(x, attention_mask=torch.ones(2, 9, dtype=torch.long), cache=cache)
        # the widest mask allowed is taken, and continues the cache as one pass over the 8 columns does
        step = model(x, attention_mask=torch.ones(2, 8, dtype=torch.long), cache=cache).logits
        whole = model(torch.cat([x, x], 1), use_cache=False).logits[:, 4:]
    torch.testing.assert_close(step, whole, rtol=0, atol=1e-10)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")
def test_activation_checkpointing_is_off_in_eval_mode_even_with_gradients():
    """Activation checkpointing applies when training with gradients: an eval-mode model with it switched on,
    called with gradients enabled, makes and fills its cache as usual (no block runs again), and its logits and
    the gradients of a loss on them are those of the same model with it off."""
    model = _model()
    x = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(10))
    plain = model(x)
    grads = torch.autograd.grad(plain.logits.square().sum(), list(model.parameters()))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.model.layers[0].gradient_checkpointing and not model.training
    out = model(x)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert cache is not None and cache.num_positions == 6
    assert torch.equal(out.logits, plain.logits)
    for g0, g1 in zip(grads, torch.autograd.grad(out.logits.square().sum(), list(model.parameters()))):
        torch.testing.assert_close(g1, g0, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("eos_id", [None, 3])
def test_position_nll_reads_the_logits_of_a_model_whose_config_returns_tuples(eos_id):
    """``position_nll`` asks for the output object whatever the config's ``return_dict``: with
    ``config.return_dict = False`` it gives the per-position sums and counts computed here in float64 from each
    window's logits (``eos_id=None``: one sequence a window, every prediction counted at its column)."""
    model = _model()
    rows = torch.randint(4, 64, (3, 7), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        logp = torch.log_softmax(model(rows[:, :-1], use_cache=False).logits.double(), -1)
    want = -logp.gather(-1, rows[:, 1:, None])[..., 0].sum(0)  # no end-of-text in the rows: one document each
    model.config.return_dict = False
    total, count = position_nll(model, rows, batch_size=2, progress=False, eos_id=eos_id)
    assert torch.equal(count, torch.full((6,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(total, want, rtol=1e-12, atol=1e-12)


def test_generate_reads_position_ids_at_real_tokens_only():
    """``position_ids`` given to ``generate()`` with left-padded prompts are read at the real tokens only (any value
    at a pad, as ``generate()`` itself makes them: ``cumsum(mask) - 1``, 1 at pads): they are taken and generate
    what no ``position_ids`` do; a row whose real tokens are not numbered from 0 is refused by name."""
    model = _model()
    x = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(12))
    mask = torch.ones_like(x)
    mask[1, :2] = 0
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
    assert pos.tolist() == [[0, 1, 2, 3, 4], [1, 1, 0, 1, 2]]
    kw = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(model.generate(x, position_ids=pos, **kw), model.generate(x, **kw))
        with pytest.raises(ValueError, match=r"position_ids given to generate.*row 1 has \[1, 2, 3\]"):
            model.generate(x, position_ids=pos + (mask == 1).long() * torch.tensor([[0], [1]]), **kw)


class _Bf16Logits(torch.nn.Module):
    """A language model (not a transformers one) whose logits come in bfloat16: a fixed table by token."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, input_ids, use_cache=False, **_):
        return type("Out", (), {"logits": self.table[input_ids]})()


@pytest.mark.parametrize("eos_id", [None, 3])
def test_position_nll_scores_bf16_logits_in_float32(eos_id):
    """bfloat16 logits are scored in float32 (``eos_id=None`` and with end-of-text resets alike): the per-position
    sums are the float64 cross-entropy of the bfloat16 logits to float32 accuracy, not bfloat16's."""
    g = torch.Generator().manual_seed(13)
    table = (torch.randn(64, 64, generator=g) * 4).to(torch.bfloat16)
    rows = torch.randint(4, 64, (4, 9), generator=g)
    total, count = position_nll(_Bf16Logits(table), rows, batch_size=2, progress=False, eos_id=eos_id)
    logp = torch.log_softmax(table[rows[:, :-1]].double(), -1)
    want = -logp.gather(-1, rows[:, 1:, None])[..., 0].sum(0)
    assert torch.equal(count, torch.full((8,), 4.0, dtype=torch.float64))
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def test_generation_inputs_that_lack_new_columns_the_mask_has_are_refused():
    """``prepare_inputs_for_generation``: with a cache that has consumed 5 columns and an ``attention_mask`` of 8,
    the inputs need the 3 new columns (the whole sequence or the new ones); ids holding only the last one are
    refused naming both counts, and ids holding the 3 new ones are fed as they are."""
    model = _model()
    x = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(14))
    mask = torch.ones_like(x)
    with torch.no_grad():
        out = model(x[:, :5], attention_mask=mask[:, :5], use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    with pytest.raises(ValueError, match=r"attention_mask has 8 columns .* consumed 5, so input_ids needs at least "
                                         r"the 3 new columns, got 1"):
        model.prepare_inputs_for_generation(x[:, 7:], attention_mask=mask, past_key_values=cache)
    for ids in (x, x[:, 5:]):
        inputs = model.prepare_inputs_for_generation(ids, attention_mask=mask, past_key_values=cache)
        assert torch.equal(inputs["input_ids"], x[:, 5:])
