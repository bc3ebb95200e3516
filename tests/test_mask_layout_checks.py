"""``FalconForCausalLM.forward``'s ``attention_mask`` against the layout of its inputs, with and without
``cu_seqlens``: ``[B, T_past + T]`` with ``T_past`` the columns a cache has consumed (0 without one, so exactly
``[B, T]``), a continuing call's mask at least ``[B, T]``; with ``cu_seqlens`` (one packed row) a mask of ones of
that shape, which changes nothing. Any other shape is a ``ValueError`` naming ``attention_mask`` and the shape it
needs, with labels or without, before the model runs (a cache is not advanced). The accepted masks are checked
against the same call without a mask, or against one pass over the whole sequence."""
import re

import pytest
import torch

from falcon_fwa.models import FalconCache, FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(seed=0):
    torch.manual_seed(seed)
    return FalconForCausalLM(get_preset("tiny-falcon")).to(torch.float64).eval()


def _shape_error(B, low, high):
    """The refusal's text up to the shape it was given: ``[B, >= low]`` and ``[B, high]`` at most."""
    return re.escape(f"attention_mask must have shape [B, >= T] = [{B}, >= {low}] and at most "
                     f"[B, T_past + T] = [{B}, {high}]")


IDS = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(1))
CU = torch.tensor([0, 3, 6])


@pytest.mark.parametrize("labels", [True, False])
@pytest.mark.parametrize("shape", [(1, 4), (2, 6), (1, 8), (6,), (1, 6, 1), (2, 3)])
def test_cu_seqlens_with_a_mask_of_another_shape_is_refused_by_name(shape, labels):
    """The packed row is ``[1, 6]``: a mask narrower (a torch broadcast error before), of two rows (a
    cross-entropy batch mismatch before), wider, 1-D or 3-D is refused naming ``attention_mask`` and ``[1, 6]``,
    also without labels (silently taken before)."""
    model = _model()
    with torch.no_grad(), pytest.raises(ValueError, match=_shape_error(1, 6, 6)):
        model(IDS, labels=IDS if labels else None, cu_seqlens=CU, attention_mask=torch.ones(shape), use_cache=False)


def test_cu_seqlens_with_a_mask_of_ones_of_the_row_is_the_call_without_one():
    """A mask of ones ``[1, 6]`` (int or float) says nothing beyond ``cu_seqlens``: logits and loss equal the
    call without a mask exactly; a mask of that shape with a zero is refused (it would pad inside documents)."""
    model = _model()
    with torch.no_grad():
        ref = model(IDS, labels=IDS, cu_seqlens=CU, use_cache=False)
        for mask in (torch.ones(1, 6, dtype=torch.int64), torch.ones(1, 6)):
            out = model(IDS, labels=IDS, cu_seqlens=CU, attention_mask=mask, use_cache=False)
            torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
            torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)
        mask = torch.ones(1, 6)
        mask[0, 4] = 0
        with pytest.raises(ValueError, match="cu_seqlens or an attention_mask with padding"):
            model(IDS, cu_seqlens=CU, attention_mask=mask, use_cache=False)


def test_cu_seqlens_with_inputs_embeds_and_a_wrong_mask_is_refused():
    """The same refusal when the packed row comes as ``inputs_embeds`` ``[1, 6, D]``; the mask of ones of
    ``[1, 6]`` equals the call without one."""
    model = _model()
    embeds = model.get_input_embeddings()(IDS)
    with torch.no_grad():
        with pytest.raises(ValueError, match=_shape_error(1, 6, 6)):
            model(inputs_embeds=embeds, cu_seqlens=CU, attention_mask=torch.ones(1, 5), use_cache=False)
        torch.testing.assert_close(
            model(inputs_embeds=embeds, cu_seqlens=CU, attention_mask=torch.ones(1, 6), use_cache=False).logits,
            model(inputs_embeds=embeds, cu_seqlens=CU, use_cache=False).logits, rtol=0, atol=0)


@pytest.mark.parametrize("labels", [True, False])
@pytest.mark.parametrize("shape", [(2, 7), (2, 4), (1, 5), (3, 5), (5,), (2, 5, 1)])
def test_a_mask_that_is_not_the_inputs_shape_without_a_cache_is_refused(shape, labels):
    """Without a cache the mask describes ``input_ids`` ``[2, 5]`` column for column: a wider one (its first
    columns were dropped silently before), a narrower one, other rows or other ranks are refused by name."""
    model = _model()
    x = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), pytest.raises(ValueError, match=_shape_error(2, 5, 5)):
        model(x, labels=x if labels else None, attention_mask=torch.ones(shape), use_cache=False)
    # so is one of the embeddings' [2, 5, D]
    with torch.no_grad(), pytest.raises(ValueError, match=_shape_error(2, 5, 5)):
        model(inputs_embeds=model.get_input_embeddings()(x), attention_mask=torch.ones(shape), use_cache=False)


def test_an_empty_cache_takes_the_mask_of_the_inputs_only():
    """A fresh cache has consumed no column: the first call's mask is ``[B, T]`` exactly; a wider one is refused
    and the cache stays empty."""
    model = _model()
    x = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(4))
    cache = FalconCache(model.config.num_hidden_layers)
    with torch.no_grad(), pytest.raises(ValueError, match=_shape_error(2, 5, 5)):
        model(x, attention_mask=torch.ones(2, 6, dtype=torch.int64), cache=cache, use_cache=True)
    assert cache.empty and cache.num_positions == 0


def test_a_continuing_call_takes_the_past_and_new_columns_and_no_more():
    """After a first call over 4 left-padded columns, the next 3 take a mask of ``[2, 3]`` to ``[2, 7]`` (its
    last 3 columns are read): the logits equal one pass over the 7 columns under the whole mask. A mask of 8
    columns or of 2 is refused naming ``[2, >= 3]`` and ``[2, 7]``, and the cache is not advanced."""
    model = _model()
    x = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 7, dtype=torch.int64)
    mask[1, :2] = 0  # left padding in the second row
    with torch.no_grad():
        whole = model(x, attention_mask=mask, use_cache=False).logits
        for width in (3, 5, 7):
            cache = FalconCache(model.config.num_hidden_layers)
            model(x[:, :4], attention_mask=mask[:, :4], cache=cache, use_cache=True)
            rest = model(x[:, 4:], attention_mask=mask[:, 7 - width:], cache=cache, use_cache=True).logits
            torch.testing.assert_close(rest, whole[:, 4:], rtol=1e-10, atol=1e-10)
            assert cache.num_positions == 7
        cache = FalconCache(model.config.num_hidden_layers)
        model(x[:, :4], attention_mask=mask[:, :4], cache=cache, use_cache=True)
        for bad in (torch.ones(2, 8, dtype=torch.int64), mask[:, 5:], mask[:1]):
            with pytest.raises(ValueError, match=_shape_error(2, 3, 7)):
                model(x[:, 4:], attention_mask=bad, cache=cache, use_cache=True)
        assert cache.num_positions == 4 and cache.seen.tolist() == [4, 2]
