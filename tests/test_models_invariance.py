"""What a row's logits may not depend on, for the paper's Falcon variants and every baseline (float64): how
the cache is fed (calls of 1, 3 and 7 tokens, rows given different numbers of new tokens or none through
attention_mask), how documents are packed (cu_seqlens with a cache, documents shorter than the window and
the short convolution, continued packed or one token per row), ``segments`` on padded and packed batches,
and a save/load round trip of configs with non-default switches."""
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM
from conftest import padded_and_packed_loss

from falcon_fwa.models import FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")

# The paper's variants (Tables 1-3) on the tiny scaffold, and the baselines. Falcon-1.3: rule 1 with
# Falcon-1A.3's features and gates; Falcon-3A.3 with a window of 4 (longer than some documents below).
VARIANTS = {
    "falcon-1A.1": ("falcon", dict(rule="1A", qk_norm="l2", gate="ctx-beta")),
    "falcon-1A.2": ("falcon", dict(rule="1A", qk_norm="l2", gate="ctx-eta")),
    "falcon-1A.3": ("falcon", dict(rule="1A")),
    "falcon-3A.3": ("falcon", dict(rule="3A", window=4)),
    "falcon-1.3": ("falcon", dict(rule="1")),
    "falcon-2": ("falcon", dict(rule="2")),
    "falcon-2A": ("falcon", dict(rule="2A")),
    "falcon-3": ("falcon", dict(rule="3", window=4)),
    **{m: (m, {}) for m in ("transformer", "deltanet", "gated_deltanet", "mamba2", "retnet")},
}
TOL = 1e-10


def _model(name, **fields):
    mixer, overrides = VARIANTS[name]
    torch.manual_seed(0)
    # chunks of 4 tokens, so calls and documents start and end inside chunks
    config = get_preset(f"tiny-{mixer}", **{"initializer_range": 0.4, "chunk_size": 4, **overrides, **fields})
    return FalconForCausalLM(config).double().eval()


def _cache(out):
    return getattr(out, "cache", None) or getattr(out, "past_key_values", None)


def _err(a, b):
    return float((a - b).abs().max())


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_cache_continues_rows_fed_unevenly_as_one_pass(name):
    """Calls of 1, 3 and 7 columns continue the cache as one forward over the whole sequence; through
    attention_mask the rows of a call get different numbers of new tokens (pads after or before them, a row
    with none), and each row still continues its own sequence at its own position."""
    model = _model(name)
    x = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(3, 1, dtype=torch.long)
    with torch.no_grad():
        full = model(x, use_cache=False).logits
        cache, parts, t = None, [], 0
        for n in (1, 3, 7):
            out = model(x[:, t:t + n], past_key_values=cache, use_cache=True)
            cache, t = _cache(out), t + n
            parts.append(out.logits)
        assert _err(torch.cat(parts, 1), full[:, :11]) <= TOL
        # one call of 4 columns: row 0 takes 4 tokens, row 1 two then two pads, row 2 a pad then three
        ids = torch.randint(0, 64, (3, 4), generator=torch.Generator().manual_seed(2))  # junk under the pads
        new = torch.ones(3, 4, dtype=torch.long)
        ids[0], (ids[1, :2], new[1, 2:]), (ids[2, 1:], new[2, 0]) = x[0, 11:15], (x[1, 11:13], 0), (x[2, 11:14], 0)
        mask = torch.cat([torch.ones(3, 11, dtype=torch.long), new], 1)
        out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        assert _err(out.logits[0], full[0, 11:15]) <= TOL
        assert _err(out.logits[1, :2], full[1, 11:13]) <= TOL
        assert _err(out.logits[2, 1:], full[2, 11:14]) <= TOL
        # a call in which row 1 gets no token, then one token per row
        ids = torch.stack([x[0, 15], x[1, 0], x[2, 14]])[:, None]
        mask = torch.cat([mask, torch.tensor([[1], [0], [1]])], 1)
        out = model(ids, attention_mask=mask, past_key_values=_cache(out), use_cache=True)
        assert _err(out.logits[0, 0], full[0, 15]) <= TOL and _err(out.logits[2, 0], full[2, 14]) <= TOL
        cache = _cache(out)
        assert cache.seen.tolist() == [16, 13, 15] and cache.get_seq_length() == 16  # real tokens; columns
        nxt = torch.randint(0, 64, (3, 1), generator=torch.Generator().manual_seed(3))
        out = model(nxt, attention_mask=torch.cat([mask, ones], 1), past_key_values=cache, use_cache=True)
        for b, n in enumerate((16, 13, 15)):
            want = model(torch.cat([x[b:b + 1, :n], nxt[b:b + 1]], 1), use_cache=False).logits[0, -1]
            assert _err(out.logits[b, 0], want) <= TOL, b


@pytest.mark.parametrize("name", list(VARIANTS))
def test_packed_documents_with_a_cache_continue_each_on_its_own(name):
    """A packed prefill with a cache (documents of 1 and 2 tokens, shorter than the window of 4 and the short
    convolution of 3) gives each document's logits alone; the cache then continues the documents packed again
    (cu_seqlens of other lengths), then one token per document as dense rows."""
    model = _model(name)
    g = torch.Generator().manual_seed(4)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in (1, 6, 2, 1)]
    more = [torch.randint(0, 64, (n,), generator=g) for n in (3, 1, 5, 2)]
    last = torch.randint(0, 64, (4, 1), generator=g)

    def cu(seqs):
        return torch.tensor([0, *itertools.accumulate(len(s) for s in seqs)])

    with torch.no_grad():
        whole = [model(torch.cat([d, m, e])[None], use_cache=False).logits[0] for d, m, e in zip(docs, more, last)]
        out = model(torch.cat(docs)[None], cu_seqlens=cu(docs), use_cache=True)
        assert _err(out.logits[0], torch.cat([w[:len(d)] for w, d in zip(whole, docs)])) <= TOL
        out = model(torch.cat(more)[None], cu_seqlens=cu(more), past_key_values=_cache(out), use_cache=True)
        want = torch.cat([w[len(d):len(d) + len(m)] for w, d, m in zip(whole, docs, more)])
        assert _err(out.logits[0], want) <= TOL
        out = model(last, past_key_values=_cache(out), use_cache=True)
        assert _err(out.logits[:, 0], torch.stack([w[-1] for w in whole])) <= TOL
        assert _cache(out).seen.tolist() == [len(d) + len(m) + 1 for d, m in zip(docs, more)]


@pytest.mark.parametrize("name", ["falcon-1A.3", "falcon-3A.3", "falcon-1.3", "deltanet", "gated_deltanet",
                                  "mamba2", "retnet"])
def test_segments_on_padded_and_packed_batches_change_nothing(name):
    """``segments=3`` (each layer's op in pieces recomputed in the backward, packed batches cut between
    documents) gives the loss and the gradients of one piece, on a left-padded batch and a packed one."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 64, (2, 11), generator=g)
    mask = torch.ones_like(x)
    mask[0, :4] = 0
    packed, cu = torch.randint(0, 64, (1, 13), generator=g), torch.tensor([0, 1, 3, 10, 13])
    loss1, grads1 = padded_and_packed_loss(_model(name).train(), x, mask, packed, cu)
    loss3, grads3 = padded_and_packed_loss(_model(name, segments=3).train(), x, mask, packed, cu)
    torch.testing.assert_close(loss3, loss1, rtol=1e-13, atol=0)
    for a, b in zip(grads3, grads1):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)


# Configs far from their mixer's defaults; deltanet also takes values that are Falcon's defaults (those of
# FalconConfig()), which a diff against the class defaults would drop from the saved file.
SAVED = {
    "falcon": ("falcon", dict(rule="3", window=5, shift=False, read="before", gate="ctx-beta", log_gate="data",
                              lambda_scale=0.3, qk_norm="none", feature_map="elu1", v_norm=True, query_scale=0.9,
                              conv_size=2, output_gate=False, use_d_skip=True, chunk_size=5,
                              segments=2, eps=1e-5, decay_floor=0.01, head_k_dim=6, head_v_dim=4)),
    "falcon-normalized-read": ("falcon", dict(rule="2A", eps_attn=1e-2, feature_map="relu", form="parallel",
                                              use_short_conv=False, tie_word_embeddings=False)),
    "deltanet": ("deltanet", dict(qk_norm="rmsnorm", shift=True, normalize=True, gate="ctx-eta", lambda_scale=1.0,
                                  output_gate=True, query_scale=1.0)),
    "mamba2": ("mamba2", dict(norm_before_gate=True, use_d_skip=False, mup_base_width=16)),
    "transformer": ("transformer", dict(rope_theta=500.0, tie_word_embeddings=False, rms_norm_eps=1e-5)),
}


@pytest.mark.parametrize("name", list(SAVED))
def test_save_and_load_keep_every_field_and_the_logits(name, tmp_path):
    mixer, fields = SAVED[name]
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset(f"tiny-{mixer}", initializer_range=0.4, **fields)).double().eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").eval()  # the saved dtype (4.x: float32)
    assert type(loaded) is FalconForCausalLM and next(loaded.parameters()).dtype == torch.float64
    for field, value in fields.items():
        assert getattr(loaded.config, field) == value, field
    saved, back = model.config.to_dict(), loaded.config.to_dict()
    assert {k: v for k, v in back.items() if k != "_name_or_path"} == {k: v for k, v in saved.items()
                                                                        if k != "_name_or_path"}
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        # the same weights; the loaded ones lie at other memory alignments, where BLAS may sum in another
        # order (float64: a few units of 1e-16)
        torch.testing.assert_close(loaded(x, use_cache=False).logits, model(x, use_cache=False).logits,
                                   rtol=0, atol=1e-12)
