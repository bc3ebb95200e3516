"""The project's own entry points call the models the same whatever the Hugging Face config says.

``return_dict`` is a ``PretrainedConfig`` attribute a user may set (``from_pretrained(folder, return_dict=False)``,
or a saved ``config.json`` with it): the model's own ``forward`` then returns a tuple. The trainer's loss, ``ppl``'s
``position_nll``, ``generate_text`` and the lm-evaluation-harness model must give the same losses, scores and
tokens for such a folder as for the same weights with the default config."""
import json
import shutil

import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset

pytestmark = pytest.mark.usefixtures("one_thread")


def _folders(tmp_path):
    """One tiny random Falcon (byte tokenizer) saved twice: ``plain`` with the default config and ``tuple`` with
    ``return_dict: false`` in its config.json (as ``save_pretrained`` writes it after ``from_pretrained(...,
    return_dict=False)``). Returns the two folders."""
    from conftest import save_tiny_falcon

    plain = tmp_path / "plain"
    save_tiny_falcon(plain)
    as_tuple = tmp_path / "tuple"
    FalconForCausalLM.from_pretrained(plain, return_dict=False).save_pretrained(as_tuple)
    for f in plain.iterdir():
        if not (as_tuple / f.name).exists():  # the tokenizer's files
            shutil.copy(f, as_tuple / f.name)
    assert json.loads((as_tuple / "config.json").read_text())["return_dict"] is False
    assert json.loads((plain / "config.json").read_text()).get("return_dict", True) is True
    return str(plain), str(as_tuple)


def test_a_config_with_return_dict_false_still_gives_the_user_a_tuple(tmp_path):
    """The user's own call keeps Hugging Face's convention: a tuple whose first field is the logits, the same
    logits as the default config's output object (what the entry points below rely on being different)."""
    from falcon_fwa.eval.perplexity import load_model

    plain, as_tuple = _folders(tmp_path)
    (a, _), (b, _) = load_model(plain), load_model(as_tuple)
    x = torch.tensor([[256, 104, 105, 32, 116]])
    with torch.no_grad():
        out, tup = a(x, use_cache=False), b(x, use_cache=False)
    assert isinstance(tup, tuple) and not hasattr(tup, "logits")
    assert torch.equal(tup[0], out.logits)


@pytest.mark.parametrize("reset", [False, True], ids=["carry", "reset"])
def test_perplexity_is_the_same_with_return_dict_false(tmp_path, reset):
    from falcon_fwa.eval.perplexity import load_model, position_nll

    plain, as_tuple = _folders(tmp_path)
    (a, tok), (b, _) = load_model(plain), load_model(as_tuple)
    rows = torch.randint(0, 256, (3, 13), generator=torch.Generator().manual_seed(0))
    rows[1, 5] = rows[2, 0] = tok.eos_token_id
    eos = tok.eos_token_id if reset else None
    want = position_nll(a, rows, batch_size=2, progress=False, eos_id=eos)
    got = position_nll(b, rows, batch_size=2, progress=False, eos_id=eos)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert float(want[1].sum()) > 0


def test_generate_text_is_the_same_with_return_dict_false(tmp_path):
    """Greedy and sampled completions of a left-padded batch of prompts of different lengths."""
    from falcon_fwa.eval.perplexity import load_model
    from falcon_fwa.serve.generation import generate_text

    plain, as_tuple = _folders(tmp_path)
    (a, tok), (b, _) = load_model(plain), load_model(as_tuple)
    prompts = ["the state", "a", "fast weight memory"]
    for kw in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 3}):
        want = generate_text(a, tok, prompts, max_new_tokens=6, batch_size=3, stop_at_eos=False, **kw)
        got = generate_text(b, tok, prompts, max_new_tokens=6, batch_size=3, stop_at_eos=False, **kw)
        assert [c.token_ids for c in got.completions] == [c.token_ids for c in want.completions]
        assert all(len(c.token_ids) == 6 for c in want.completions)


def test_harness_model_is_the_same_with_return_dict_false(tmp_path):
    """``loglikelihood``, ``loglikelihood_rolling`` and ``generate_until`` of the ``falcon-fwa`` harness model."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from falcon_fwa.eval.harness import lm_class

    plain, as_tuple = _folders(tmp_path)
    requests = {"loglikelihood": [("the state", " memory"), ("a", " key value")],
                "loglikelihood_rolling": [("the state memory key value",)],
                "generate_until": [("the state", {"until": ["\n\n"], "max_gen_toks": 5}),
                                   ("fast", {"until": ["\n\n"], "max_gen_toks": 5})]}
    results = []
    for folder in (plain, as_tuple):
        lm = lm_class()(pretrained=folder, device="cpu", trust_remote_code=False, batch_size=2)
        results.append({kind: getattr(lm, kind)([Instance(kind, {}, a, i) for i, a in enumerate(args)],
                                                disable_tqdm=True)
                        for kind, args in requests.items()})
    want, got = results
    assert got == want
    assert all(isinstance(s, float) and s < 0 for s, _ in want["loglikelihood"])


def test_trainer_loss_is_the_same_with_return_dict_false(tmp_path):
    """``Trainer(cfg, model_fn=...)`` with the recipe's model, once with ``config.return_dict = False``: the
    same logged losses and final weights."""
    from falcon_fwa.train.config import config_from_dict
    from falcon_fwa.train.logger import read_log
    from falcon_fwa.train.model_factory import build_model
    from falcon_fwa.train.trainer import Trainer
    from conftest import tiny_lm_recipe

    raw = json.loads(open(tiny_lm_recipe(tmp_path)).read())
    raw["train"].update(steps=3, eval_every=3, eval_batches=1, export_model=False)
    raw["log"]["every"] = 1
    runs = []
    for as_tuple in (False, True):
        raw["train"]["out_dir"] = str(tmp_path / f"run-{as_tuple}")
        cfg = config_from_dict(raw)

        def make(vocab_size, eos_token_id, as_tuple=as_tuple, cfg=cfg):
            model = build_model(cfg.model, vocab_size=vocab_size, eos_token_id=eos_token_id)
            model.config.return_dict = not as_tuple
            return model

        trainer = Trainer(cfg, model_fn=make)
        try:
            trainer.train()
        finally:
            trainer.close()
        log = read_log(str(tmp_path / f"run-{as_tuple}" / "log.jsonl"))
        runs.append((trainer, [(r["step"], r[k]) for r in log for k in ("loss", "val_loss") if k in r]))
    (a, want), (b, got) = runs
    assert b.core.config.return_dict is False
    assert got == want and [s for s, _ in want] == [1, 2, 3, 3]
    for p, q in zip(a.core.parameters(), b.core.parameters()):
        assert torch.equal(p, q)


# --- generate() and padding ------------------------------------------------------------------------------

MIXERS = ["falcon", "transformer", "deltanet", "gated_deltanet", "mamba2", "retnet"]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [15, 16, 17, 18, 19]]
PAD = 63


def _tiny(mixer):
    """A tiny float64 model whose greedy continuations vary (initializer_range 0.5)."""
    torch.manual_seed(0)
    return FalconForCausalLM(get_preset(f"tiny-{mixer}", initializer_range=0.5)).double().eval()


def _greedy_alone(model, prompt, n):
    """The row by itself, no padding and no cache: the whole sequence re-run for each new token."""
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, len(prompt):].tolist()


def _batch(side):
    width = max(map(len, PROMPTS))
    ids = torch.full((len(PROMPTS), width), PAD)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(PROMPTS):
        cols = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("mixer", MIXERS)
def test_left_padded_generate_equals_each_row_alone_and_right_padding_is_refused(mixer):
    model = _tiny(mixer)
    n = 6
    want = [_greedy_alone(model, p, n) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(PROMPTS)  # rows that differ: a mixed-up row would show
    ids, mask = _batch("left")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD)
    assert out[:, ids.shape[1]:].tolist() == want
    ids, mask = _batch("right")
    for kw in ({}, {"prefill_chunk_size": 2}):
        with pytest.raises(ValueError, match=r"attention_mask.*rows \[1, 2\].*padding_side='left'"):
            model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=PAD, **kw)
    # without a mask, generate() makes one from pad_token_id: rows ending in it are right-padded too
    with pytest.raises(ValueError, match=r"attention_mask.*rows \[1, 2\].*padding_side='left'.*pad_token_id"):
        model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=PAD)


@pytest.mark.parametrize("mixer", ["falcon", "transformer"])
def test_right_padded_masks_still_run_forward_passes(mixer):
    """Only generation is refused: a forward pass (with or without a cache) and the loss over a right-padded batch
    give each row's real positions the logits of the row alone."""
    model = _tiny(mixer)
    ids, mask = _batch("right")
    with torch.no_grad():
        for use_cache in (False, True):
            out = model(ids, attention_mask=mask, labels=ids, use_cache=use_cache)
            for i, p in enumerate(PROMPTS):
                alone = model(torch.tensor([p]), use_cache=False).logits[0]
                torch.testing.assert_close(out.logits[i, :len(p)], alone, rtol=0, atol=1e-10)
            assert torch.isfinite(out.loss)
    model.train()
    model(ids, attention_mask=mask, labels=ids).loss.backward()
    assert model.model.embed_tokens.weight.grad is not None


@pytest.mark.parametrize("mixer", ["falcon", "transformer", "mamba2"])
def test_prefill_in_chunks_without_a_mask_reads_pads_as_generate_does(mixer):
    """Without an ``attention_mask``, ``generate()`` takes the ids equal to ``pad_token_id`` for pads (where it
    differs from eos): a chunked prefill reads the same pads. A left-padded batch then gives each row's tokens
    alone, as without chunks; a right-padded one is refused, as without chunks."""
    model = _tiny(mixer)
    n = 4
    want = [_greedy_alone(model, p, n) for p in PROMPTS]
    ids, _ = _batch("left")
    with torch.no_grad():
        for chunk in (None, 1, 2, 3):
            out = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=PAD, prefill_chunk_size=chunk)
            assert out[:, ids.shape[1]:].tolist() == want, chunk
    ids, _ = _batch("right")
    for chunk in (1, 2):
        with pytest.raises(ValueError, match=r"attention_mask.*rows \[1, 2\].*padding_side='left'.*pad_token_id"):
            model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=PAD, prefill_chunk_size=chunk)
    # a pad id that is also eos is no pad to generate(): the rows are read whole, with or without chunks
    row = [[5, 6, 7, PAD]]
    with torch.no_grad():
        got = [model.generate(torch.tensor(row), max_new_tokens=n, do_sample=False, pad_token_id=PAD,
                              eos_token_id=PAD, prefill_chunk_size=chunk)[0, 4:].tolist() for chunk in (None, 2)]
    alone = _greedy_alone(model, row[0], n)
    assert [g == alone[:len(g)] and len(g) >= 1 for g in got] == [True, True]


def test_the_keyword_reaches_a_model_inside_its_wrappers():
    """``output_object`` looks through DDP's ``.module`` and ``torch.compile``'s ``._orig_mod`` (each alone and
    nested), so a wrapped transformers model is still asked for its output object; a module that is no transformers
    model (the tests' stand-ins, a bare layer) is called without the keyword, which it would not take."""
    from torch import nn

    from falcon_fwa.models.modeling import output_object

    class DataParallelLike(nn.Module):  # the attribute DistributedDataParallel holds its model in
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = FalconForCausalLM(get_preset("tiny-falcon"))
    wanted = {"return_dict": True}
    for wrapped in (model, DataParallelLike(model), torch.compile(model), DataParallelLike(torch.compile(model)),
                    torch.compile(DataParallelLike(model))):
        assert output_object(wrapped) == wanted, type(wrapped).__name__
    for other in (nn.Linear(2, 2), DataParallelLike(nn.Linear(2, 2)), torch.compile(nn.Linear(2, 2))):
        assert output_object(other) == {}, other
