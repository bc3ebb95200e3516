"""position_ids in the causal LM: padding-free batches (examples flattened into a row, positions restarting at 0)
equal the examples run one at a time; the positions the model counts itself change nothing; others are refused."""
import pytest
import torch
import torch.nn.functional as F

from falcon_fwa.models import FalconCache, FalconForCausalLM, get_preset

MIXERS = ["falcon", "transformer", "mamba2", "deltanet", "gated_deltanet", "retnet"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(mixer, seed=0):
    torch.manual_seed(seed)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}")).to(torch.float64).eval()


def _examples(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (n,), generator=g) for n in lengths]


def _flat(examples):
    """One row as DataCollatorWithFlattening lays it out: the ids back to back, positions restarting at 0 and
    labels -100 at each example's first token."""
    ids = torch.cat(examples)
    pos = torch.cat([torch.arange(len(e)) for e in examples])
    labels = torch.cat([torch.cat([torch.tensor([-100]), e[1:]]) for e in examples])
    return ids, pos, labels


def _alone(model, examples):
    """Each example's logits from its own forward pass, and the mean next-token cross-entropy over them all."""
    with torch.no_grad():
        logits = [model(e[None], use_cache=False).logits[0] for e in examples]
    nll = sum(F.cross_entropy(lg[:-1], e[1:], reduction="sum") for lg, e in zip(logits, examples))
    count = sum(len(e) - 1 for e in examples)
    return torch.cat(logits), nll / count


@pytest.mark.parametrize("mixer", MIXERS)
def test_a_flattened_row_equals_the_examples_one_at_a_time(mixer):
    model = _model(mixer)
    examples = _examples((6, 1, 9))
    ids, pos, labels = _flat(examples)
    with torch.no_grad():
        out = model(ids[None], position_ids=pos[None], labels=labels[None], use_cache=False)
        unlabelled = model(ids[None], position_ids=pos[None], labels=ids[None], use_cache=False)
    logits, loss = _alone(model, examples)
    assert out.logits.shape == (1, 16, 64)
    torch.testing.assert_close(out.logits[0], logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-12)
    # without the collator's -100s the model itself skips each example's first token
    torch.testing.assert_close(unlabelled.loss, loss, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mixer", ["falcon", "transformer", "mamba2"])
def test_several_flattened_rows_equal_the_examples_one_at_a_time(mixer):
    model = _model(mixer)
    rows = [_examples((4, 7), seed=2), _examples((3, 1, 7), seed=3)]
    flat = [_flat(r) for r in rows]
    ids, pos, labels = (torch.stack(parts) for parts in zip(*flat))
    with torch.no_grad():
        out = model(ids, position_ids=pos, labels=labels, use_cache=False)
    logits, loss = _alone(model, rows[0] + rows[1])
    torch.testing.assert_close(out.logits.reshape(22, 64), logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-12)


def test_flattened_rows_with_padding_equal_the_examples_one_at_a_time():
    model = _model("gated_deltanet")
    rows = [_examples((4, 5), seed=10), _examples((2, 3), seed=11)]
    ids = torch.zeros(2, 9, dtype=torch.long)
    pos = torch.ones(2, 9, dtype=torch.long)  # any value at a pad
    mask = torch.zeros(2, 9, dtype=torch.long)
    for r, examples in enumerate(rows):
        i, p, _ = _flat(examples)
        ids[r, :len(i)], pos[r, :len(i)], mask[r, :len(i)] = i, p, 1
    with torch.no_grad():
        out = model(ids, attention_mask=mask, position_ids=pos, labels=ids, use_cache=False)
    logits, loss = _alone(model, rows[0] + rows[1])
    torch.testing.assert_close(out.logits[mask.bool()], logits, rtol=0, atol=1e-10)
    assert torch.equal(out.logits[~mask.bool()], torch.zeros(4, 64, dtype=out.logits.dtype))
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-12)


def test_the_gradients_of_a_flattened_row_are_those_of_the_examples():
    examples = _examples((5, 8, 3), seed=4)
    ids, pos, labels = _flat(examples)
    model = _model("falcon").train()
    model(ids[None], position_ids=pos[None], labels=labels[None]).loss.backward()
    packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    nll = sum(F.cross_entropy(model(e[None]).logits[0, :-1], e[1:], reduction="sum") for e in examples)
    (nll / sum(len(e) - 1 for e in examples)).backward()
    for a, b in zip(packed, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mixer", ["transformer", "gated_deltanet"])
def test_the_batch_of_data_collator_with_flattening(mixer):
    collator_module = pytest.importorskip("transformers.data.data_collator")
    if not hasattr(collator_module, "DataCollatorWithFlattening"):
        pytest.skip("this transformers has no DataCollatorWithFlattening")
    examples = _examples((5, 2, 8), seed=5)
    batch = collator_module.DataCollatorWithFlattening()([{"input_ids": e.tolist()} for e in examples])
    assert "position_ids" in batch and batch["input_ids"].shape == (1, 15)
    model = _model(mixer)
    with torch.no_grad():
        out = model(**batch)
    logits, loss = _alone(model, examples)
    torch.testing.assert_close(out.logits[0], logits, rtol=0, atol=1e-10)
    torch.testing.assert_close(out.loss, loss, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mixer", ["transformer", "falcon"])
def test_the_positions_the_model_counts_change_nothing(mixer):
    model = _model(mixer)
    x = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = model(x, labels=x, use_cache=False)
        for pos in (torch.arange(7)[None], torch.arange(7)[None].expand(2, 7)):
            given = model(x, labels=x, position_ids=pos, use_cache=False)
            assert torch.equal(given.logits, plain.logits) and torch.equal(given.loss, plain.loss)
        # left padding: generate()'s positions (cumsum of the mask - 1), any value at a pad
        mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
        pos = (mask.cumsum(1) - 1).masked_fill(mask == 0, 1)
        padded = model(x, attention_mask=mask, use_cache=False)
        given = model(x, attention_mask=mask, position_ids=pos, use_cache=False)
        assert torch.equal(given.logits, padded.logits)
        # a cache: the second call's positions continue the first's
        cache = model(x[:, :4], use_cache=True).past_key_values
        step = model(x[:, 4:], cache=cache, use_cache=True, position_ids=torch.arange(4, 7)[None].expand(2, 3))
        torch.testing.assert_close(step.logits, plain.logits[:, 4:], rtol=0, atol=1e-10)


def test_position_ids_that_agree_with_cu_seqlens_are_taken():
    model = _model("transformer")
    examples = _examples((3, 6), seed=7)
    ids, pos, _ = _flat(examples)
    cu = torch.tensor([0, 3, 9])
    with torch.no_grad():
        both = model(ids[None], cu_seqlens=cu, position_ids=pos[None], use_cache=False).logits
        packed = model(ids[None], cu_seqlens=cu, use_cache=False).logits
    assert torch.equal(both, packed)


@pytest.mark.parametrize("pos,match", [
    ([1, 2, 3, 4, 5, 6], r"position_ids\[0, 0\] = 1"),        # not from 0
    ([0, 1, 3, 4, 5, 6], r"position_ids\[0, 2\] = 3"),        # a gap
    ([0, 1, 2, 2, 3, 4], r"position_ids\[0, 3\] = 2"),        # a repeat
    ([0, 1, 2, 0, 5, 6], r"position_ids\[0, 4\] = 5"),        # a restart that does not rise by 1
])
def test_other_positions_are_refused_by_name(pos, match):
    model = _model("falcon")
    x = torch.randint(0, 64, (1, 6))
    with pytest.raises(ValueError, match=match) as info:
        model(x, position_ids=torch.tensor([pos]), use_cache=False)
    assert "restart at 0" in str(info.value)


def test_malformed_or_conflicting_position_ids_are_refused_by_name():
    model = _model("falcon")
    x = torch.randint(0, 64, (2, 6))
    with pytest.raises(ValueError, match=r"position_ids must have shape \[B, T\] = \[2, 6\]"):
        model(x, position_ids=torch.arange(5)[None], use_cache=False)
    with pytest.raises(TypeError, match="position_ids must hold integers"):
        model(x, position_ids=torch.arange(6.0)[None], use_cache=False)
    with pytest.raises(ValueError, match="position_ids disagree with cu_seqlens"):
        model(x[:1], cu_seqlens=torch.tensor([0, 2, 6]), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]),
              use_cache=False)
    cache = model(x, use_cache=True).past_key_values
    with pytest.raises(ValueError, match="position_ids must continue the positions of past_key_values"):
        model(x[:, :3], cache=cache, position_ids=torch.tensor([[6, 0, 1]]).expand(2, 3))


def test_a_restart_in_a_fresh_cache_keeps_one_cache_row_per_example():
    model = _model("falcon")
    examples = _examples((4, 5), seed=8)
    ids, pos, _ = _flat(examples)
    nxt = torch.tensor([[7], [11]])
    cache = FalconCache(model.config.num_hidden_layers)
    with torch.no_grad():
        model(ids[None], position_ids=pos[None], cache=cache, use_cache=True)
        assert cache.seen.tolist() == [4, 5]
        step = model(nxt, cache=cache, use_cache=True).logits[:, -1]
        alone = torch.stack([model(torch.cat([e, n])[None], use_cache=False).logits[0, -1]
                             for e, n in zip(examples, nxt)])
    torch.testing.assert_close(step, alone, rtol=0, atol=1e-10)


def test_generate_takes_its_own_positions_and_refuses_packed_ones():
    model = _model("falcon")
    x = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(9))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    plain = model.generate(x, **kw)
    given = model.generate(x, position_ids=torch.arange(5)[None].expand(2, 5), **kw)
    assert torch.equal(plain, given)
    with pytest.raises(ValueError, match="position_ids given to generate"):
        model.generate(x, position_ids=torch.tensor([[0, 1, 0, 1, 2]]).expand(2, 5), **kw)
