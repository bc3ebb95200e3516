"""The Hugging Face surface of the LM, against references written here: the loss is the shifted
cross-entropy summed by hand, ``logits_to_keep`` the last columns of the full logits, ``save_pretrained``
the same tensors back in every mixer family, ``resize_token_embeddings`` the old rows plus new ones,
activation checkpointing the plain gradients, ``generate(use_cache=False)`` a greedy loop of full passes,
and a bad config field an error that names it, however the config was made."""
import functools
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM

from falcon_fwa.layers.packing import Packing
from falcon_fwa.models import FalconConfig, FalconForCausalLM, get_preset

# Every Falcon rule and the five baselines.
FAMILIES = [("falcon", {"rule": r}) for r in ("1", "2", "3", "1A", "2A", "3A")] + \
           [(m, {}) for m in ("transformer", "deltanet", "gated_deltanet", "mamba2", "retnet")]
FAMILY_IDS = [f"falcon-{o['rule']}" if m == "falcon" else m for m, o in FAMILIES]
# One recurrent mixer with the state kept between calls, one sliding rule, one KV cache, one with decays.
GEN_CASES = [("falcon", {"rule": "1A"}), ("falcon", {"rule": "3A", "window": 3}), ("transformer", {}), ("mamba2", {})]
GEN_IDS = ["falcon-1A", "falcon-3A", "transformer", "mamba2"]

pytestmark = pytest.mark.usefixtures("one_thread")


def _model(mixer, dtype=torch.float64, seed=0, **overrides):
    torch.manual_seed(seed)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}", **overrides)).to(dtype).eval()


def _padded(T, lengths, side, seed=0):
    """Random ids (real ids under the pads too) and a mask of rows of ``lengths`` padded on ``side``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 64, (len(lengths), T), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, slice(T - n, T) if side == "left" else slice(0, n)] = 1
    return ids, mask


def _hand_loss(logits, labels, mask):
    """Mean over scored positions of ``-log softmax(logits[b, t])[labels[b, t + 1]]``, written as a loop: a
    target is scored when it is not -100 and both it and the column before it are real tokens."""
    total, count = 0.0, 0
    B, T, _ = logits.shape
    for b in range(B):
        for t in range(T - 1):
            y = int(labels[b, t + 1])
            if y == -100 or not (mask[b, t] and mask[b, t + 1]):
                continue
            row = logits[b, t].tolist()
            top = max(row)
            total += top + math.log(sum(math.exp(z - top) for z in row)) - row[y]
            count += 1
    return total / count


# --- loss ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["none", "left", "right"])
def test_loss_is_the_mean_shifted_cross_entropy_of_the_scored_targets(side):
    """``labels``: the mean of ``-log p(labels[t+1] | logits[t])`` over targets that are not -100, not pads
    and not preceded by a pad (left padding: the first real token has no context to be predicted from).
    Whatever ``labels`` holds under the pads is ignored; int32 labels score as int64 ones."""
    model = _model("falcon", rule="3A", window=3, initializer_range=0.3)
    ids, mask = _padded(10, [10, 6, 3], side if side != "none" else "left", seed=1)
    if side == "none":
        mask = torch.ones_like(mask)
    labels = ids.clone()
    labels[0, 4] = labels[1, -1] = labels[2, 5] = -100
    with torch.no_grad():
        out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
        want = _hand_loss(out.logits, labels, mask)
        assert abs(float(out.loss) - want) <= 1e-12 * want
        other = torch.where(mask.bool(), labels, torch.randint_like(labels, 0, 64))  # other ids under the pads
        assert torch.equal(model(ids, attention_mask=mask, labels=other, use_cache=False).loss, out.loss)
        assert torch.equal(model(ids, attention_mask=mask, labels=labels.int(), use_cache=False).loss, out.loss)
        with pytest.raises(ValueError, match="labels"):
            model(ids, attention_mask=mask, labels=labels.double(), use_cache=False)


@pytest.mark.parametrize("keep", [1, 3, 10])
@pytest.mark.parametrize("side", ["none", "left", "right"])
def test_logits_to_keep_returns_the_last_columns_of_the_full_logits(keep, side):
    model = _model("gated_deltanet", initializer_range=0.3)
    ids, mask = _padded(10, [10, 4], "left" if side == "none" else side, seed=2)
    mask = torch.ones_like(mask) if side == "none" else mask
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
        last = model(ids, attention_mask=mask, use_cache=False, logits_to_keep=keep).logits
    assert last.shape == (2, keep, 64)
    torch.testing.assert_close(last, full[:, -keep:], rtol=0, atol=1e-13)


# --- save and load ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("mixer,overrides", FAMILIES, ids=FAMILY_IDS)
def test_save_pretrained_round_trips_every_family_bit_for_bit(mixer, overrides, tied, tmp_path):
    """safetensors only; the tensors in the file and in the loaded model are the saved ones exactly; a tied
    model stores the embedding once and loads with no separate head; the config and AutoConfig agree; the
    bfloat16 load (``dtype`` and the older ``torch_dtype``) holds the weights rounded to bfloat16."""
    model = _model(mixer, initializer_range=0.3, tie_word_embeddings=tied, **overrides)
    model.save_pretrained(tmp_path)
    weights = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    assert weights == ["model.safetensors"]
    saved = model.state_dict()
    stored = load_file(tmp_path / "model.safetensors")
    assert ("lm_head.weight" in stored) is not tied
    assert set(stored) == set(saved)
    for name, tensor in stored.items():
        assert torch.equal(tensor, saved[name]), name

    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is FalconConfig
    drop = {"_name_or_path", "transformers_version"}
    clean = lambda c: {k: v for k, v in c.to_dict().items() if k not in drop}  # noqa: E731
    assert clean(config) == clean(model.config)
    # dtype="auto": the saved dtype (transformers 5's default; 4 loads float32 without it)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype="auto").eval()
    assert type(loaded) is FalconForCausalLM
    assert loaded.state_dict().keys() == saved.keys()
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.float64 and torch.equal(tensor, saved[name]), name
    if tied:
        assert loaded.lm_head is None and loaded.get_output_embeddings() is None
    else:
        assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    x = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(x, use_cache=False).logits
        # the same weights at other memory alignments, where BLAS may sum in another order
        torch.testing.assert_close(loaded(x, use_cache=False).logits, ref, rtol=0, atol=1e-12)
        for kw in ("dtype", "torch_dtype"):
            half = AutoModelForCausalLM.from_pretrained(tmp_path, **{kw: torch.bfloat16}).eval()
            for name, tensor in half.state_dict().items():
                assert torch.equal(tensor, saved[name].to(torch.bfloat16)), (kw, name)
            logits = half(x, use_cache=False).logits  # its accuracy: test_models_configs' low-precision test
            assert logits.dtype == torch.float32 and bool(logits.isfinite().all())


def test_other_auto_classes_refuse_the_config_instead_of_building_another_falcon(tmp_path):
    """transformers' auto classes find a model by the config's class name, and transformers has a Falcon of its
    own whose config is called ``FalconConfig``: a saved folder loaded through ``AutoModel`` (or any auto class
    but the causal LM) must be refused as an unknown config, not handed to that model; the causal LM auto class
    and pickling, through either name of the config, still give this library's classes."""
    import pickle

    from transformers import AutoModel, AutoModelForSequenceClassification

    from falcon_fwa.models import FalconFWAConfig

    assert FalconConfig is FalconFWAConfig
    model = _model("falcon")
    model.save_pretrained(tmp_path)
    for auto in (AutoModel, AutoModelForSequenceClassification):
        with pytest.raises(ValueError, match="Unrecognized configuration class .*FalconFWAConfig"):
            auto.from_pretrained(tmp_path)
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is FalconForCausalLM
    copy = pickle.loads(pickle.dumps(model.config))
    assert type(copy) is FalconConfig and copy.to_dict() == model.config.to_dict()


# --- resize_token_embeddings -----------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_resize_token_embeddings_keeps_the_old_rows_and_the_tie(tied, tmp_path):
    """Grown to 80 rows, the first 64 of the embedding (and of an untied head) are the old ones; the logits
    of the old vocabulary are unchanged and the new columns are the final hidden state times the new rows
    (of the embedding itself when tied); the new ids are accepted; a save and load keep the 80 rows.
    Shrunk to 48, the first 48 rows stay."""
    model = _model("falcon", initializer_range=0.3, tie_word_embeddings=tied)
    old = model.model.embed_tokens.weight.detach().clone()
    old_head = None if tied else model.lm_head.weight.detach().clone()
    x = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(x, use_cache=False).logits
    model.resize_token_embeddings(80)
    E = model.model.embed_tokens.weight
    assert E.shape == (80, 32) and model.config.vocab_size == 80 and torch.equal(E[:64], old)
    head = E if tied else model.lm_head.weight
    if tied:
        assert model.lm_head is None
    else:
        assert head.shape == (80, 32) and torch.equal(head[:64], old_head)
    with torch.no_grad():
        out = model(x, use_cache=False, output_hidden_states=True)
        torch.testing.assert_close(out.logits[..., :64], before, rtol=0, atol=1e-12)
        torch.testing.assert_close(out.logits[..., 64:], out.hidden_states[-1] @ head[64:].T, rtol=0, atol=1e-12)
        assert model(torch.tensor([[70, 79]]), use_cache=False).logits.shape == (1, 2, 80)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.vocab_size == 80 and torch.equal(loaded.model.embed_tokens.weight, E)
    assert (loaded.lm_head is None) is tied
    model.resize_token_embeddings(48)
    assert model.config.vocab_size == 48 and torch.equal(model.model.embed_tokens.weight, old[:48])


# --- activation checkpointing ----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_:FutureWarning")
@pytest.mark.parametrize("switch", ["gradient_checkpointing_enable()", "reentrant", "every_n_layers=2",
                                    "reentrant, blocks only"])
def test_activation_checkpointing_gives_the_plain_gradients_with_a_frozen_embedding(switch):
    """A frozen embedding (adapter fine-tuning): the blocks' gradients are those of the plain backward for
    Hugging Face's default switch, the reentrant checkpoint, and ``every_n_layers=2``, which runs again only
    blocks 0 and 2 of 3 in the backward (``activation_checkpointing_enable``, transformers 5). "Reentrant, blocks
    only" sets the blocks' switch alone, as transformers 4's ``gradient_checkpointing_enable()`` does: without
    transformers 5's hook that makes the embedding's output require a gradient, no block input would need one and
    the reentrant checkpoint would give the blocks' weights none."""
    model = _model("falcon", num_hidden_layers=3, initializer_range=0.3).train()
    every_n = getattr(model, "activation_checkpointing_enable", None)
    if switch == "every_n_layers=2" and every_n is None:
        pytest.skip("activation_checkpointing_enable(every_n_layers=) comes with transformers 5")
    model.model.embed_tokens.weight.requires_grad_(False)
    ids, mask = _padded(11, [11, 7], "left", seed=5)

    def grads():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    plain = grads()
    calls = []
    for i, block in enumerate(model.model.layers):
        block.mixer.register_forward_hook(lambda *_, i=i: calls.append(i))
    if switch == "gradient_checkpointing_enable()":
        model.gradient_checkpointing_enable()
    elif switch == "reentrant":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    elif switch == "reentrant, blocks only":
        model._set_gradient_checkpointing(True, functools.partial(checkpoint, use_reentrant=True))
    else:
        every_n(every_n_layers=2)
    again = grads()
    assert sorted(calls) == ([0, 0, 1, 2, 2] if switch == "every_n_layers=2" else [0, 0, 1, 1, 2, 2])
    assert plain.keys() == again.keys()
    for name in plain:
        assert again[name] is not None, name
        torch.testing.assert_close(again[name], plain[name], rtol=1e-12, atol=1e-14)
    if every_n is not None:
        with pytest.raises(ValueError, match="every_n_layers"):
            every_n(every_n_layers=0)


# --- generate --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mixer,overrides", GEN_CASES, ids=GEN_IDS)
def test_generate_without_the_cache_is_greedy_decoding_by_full_passes(mixer, overrides):
    """Left-padded prompts, greedy: ``use_cache=False`` and ``use_cache=True`` give the tokens and scores of a
    loop that runs the whole sequence through the model for every new token and takes the argmax."""
    model = _model(mixer, initializer_range=0.5, **overrides)
    ids, mask = _padded(7, [7, 4, 2], "left", seed=6)
    n = 6
    seq, m, scores = ids, mask, []
    with torch.no_grad():
        for _ in range(n):
            logits = model(seq, attention_mask=m, use_cache=False).logits[:, -1]
            scores.append(logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
            m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
        assert len(set(seq[:, 7:].flatten().tolist())) > 3  # not a constant continuation
        for use_cache in (False, True):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, use_cache=use_cache,
                                 pad_token_id=0, eos_token_id=None, return_dict_in_generate=True,
                                 output_scores=True)
            assert torch.equal(out.sequences, seq), use_cache
            for got, want in zip(out.scores, scores):  # generate() hands the scores over in float32
                torch.testing.assert_close(got, want.float())


# --- hidden states ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mixer,overrides", [("falcon", {"rule": "2A"}), ("transformer", {})], ids=["falcon-2A",
                                                                                                    "transformer"])
def test_output_hidden_states_are_the_embeddings_the_blocks_and_the_final_norm(mixer, overrides):
    """``L + 1`` tensors ``[B, T, D]``: the embeddings, the outputs of blocks ``0 .. L-2`` (each the next
    block's input), and the final normalized output, which times the embedding is the logits."""
    model = _model(mixer, num_hidden_layers=3, initializer_range=0.3, **overrides)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        dense = Packing.dense(2, 8, None, ids.device)  # each block run on its own, on the dense rows
        assert len(hs) == 4 and all(h.shape == (2, 8, 32) for h in hs)
        assert torch.equal(hs[0], model.model.embed_tokens(ids))
        for i, block in enumerate(model.model.layers[:-1]):
            torch.testing.assert_close(hs[i + 1], block(hs[i], dense, None), rtol=0, atol=1e-12)
        torch.testing.assert_close(out.logits, hs[-1] @ model.model.embed_tokens.weight.T, rtol=0, atol=1e-12)
        emb = model(inputs_embeds=hs[0], output_hidden_states=True, use_cache=False)
        assert torch.equal(emb.logits, out.logits)


# --- config validation -----------------------------------------------------------------------------------


BAD_FIELDS = [
    ("vocab_size", 0), ("hidden_size", 0), ("num_hidden_layers", 0), ("num_heads", 0), ("intermediate_size", 0),
    ("mixer", "gpt"), ("rule", "4"), ("window", 0), ("chunk_size", 0), ("conv_size", 0), ("segments", 0),
    ("form", "scan"), ("backend", "cuda"), ("gate", "relu"), ("qk_norm", "ln"), ("read", "during"),
    ("shift", "yes"), ("eps", -1.0), ("decay_floor", 1.0), ("rms_norm_eps", 0.0), ("lambda_scale", float("nan")),
]


@pytest.mark.parametrize("field,value", BAD_FIELDS, ids=[f for f, _ in BAD_FIELDS])
def test_a_bad_field_is_named_however_the_config_was_made(field, value, tmp_path):
    """The constructor, a field set on a built config and then given to the model, a hand-edited
    ``config.json`` and a ``from_pretrained`` keyword: each is a ``ValueError`` naming the field."""
    match = f"config field '{field}'"
    with pytest.raises(ValueError, match=match):
        get_preset("tiny-falcon", **{"rule": "3A", field: value})
    config = get_preset("tiny-falcon", rule="3A")
    setattr(config, field, value)
    with pytest.raises(ValueError, match=match):
        FalconForCausalLM(config)
    get_preset("tiny-falcon", rule="3A").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=match):
        AutoConfig.from_pretrained(tmp_path, **{field: value})
    stored = json.loads((tmp_path / "config.json").read_text())
    stored[field] = value
    (tmp_path / "config.json").write_text(json.dumps(stored))
    with pytest.raises(ValueError, match=match):
        AutoConfig.from_pretrained(tmp_path)


def test_a_misspelt_from_pretrained_keyword_is_refused_by_name(tmp_path):
    """A keyword one letter off a field would otherwise be dropped and leave the model as saved."""
    get_preset("tiny-falcon").save_pretrained(tmp_path)
    for kw, field in (("decay_flor", "decay_floor"), ("num_attention_heads", "num_heads")):
        with pytest.raises(ValueError, match=f"unknown config field '{kw}' \\(did you mean '{field}'\\?\\)"):
            AutoConfig.from_pretrained(tmp_path, **{kw: 1})
    config, unused = AutoConfig.from_pretrained(tmp_path, other=1, return_unused_kwargs=True)
    assert unused == {"other": 1}
