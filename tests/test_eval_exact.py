"""The harness model ``falcon-fwa`` against direct computations on a tiny random model: log-likelihoods of
requests that split one text differently, rolling windows in batches, and batched generation in which
one row ends at end-of-text before the others (a model folder whose config names no end-of-text id)."""
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
lm_eval = pytest.importorskip("lm_eval")


def _model(**overrides):
    """A tiny Falcon (initializer_range 0.5: varied greedy tokens) with the byte tokenizer; its
    config names no end-of-text id, as that of a model built by hand from a preset. Returns (model, tokenizer)."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5, **overrides)).eval()
    tok = byte_tokenizer()
    assert model.config.eos_token_id is None
    return model, tok


def _save(model, tok, path):
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _log_probs(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].double().log_softmax(-1)


def _lm(folder, **kwargs):
    from falcon_fwa.eval.harness import lm_class

    return lm_class()(pretrained=folder, device="cpu", trust_remote_code=False, **kwargs)


def _requests(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_loglikelihood_of_one_text_split_two_ways_is_each_requests_own(tmp_path):
    """``"the state" + " memory key"`` and ``"the state memory" + " key"`` feed the model the same tokens
    (``context + continuation[:-1]``); each continuation's score is still the sum of its own tokens'
    log-probabilities at their own positions (the harness's shared pass took the leading positions)."""
    model, tok = _model()
    folder = _save(model, tok, tmp_path / "m")
    eos = tok.eos_token_id
    pairs = [("the state", " memory key"), ("the state memory", " key"), ("the state memory ke", "y")]

    def direct(context, continuation):
        ids, cont = [eos, *context.encode()], list(continuation.encode())
        lp = _log_probs(model, ids + cont[:-1])
        return sum(float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(cont))

    want = [direct(*p) for p in pairs]
    assert abs(want[0] - want[1]) > 1  # the three differ: a shared score would show
    for batch_size in (1, 3):
        got = _lm(folder, batch_size=batch_size).loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
        assert [g[0] for g in got] == pytest.approx(want, abs=1e-4)


def test_rolling_windows_score_alike_in_any_batch(tmp_path):
    """A repetitive document has equal rolling windows cut at different places; in a batch they share a
    key, and each document's log-likelihood must still be the sum over its windows, each token predicted
    from the (at most max_length) tokens before it, as computed here directly."""
    model, tok = _model()
    folder = _save(model, tok, tmp_path / "m")
    eos, L = tok.eos_token_id, 16
    docs = ["the state memory key value " * k for k in (1, 3, 7)] + ["x"]

    def direct(doc):
        full = [eos, *doc.encode()]
        total = 0.0
        for a in range(1, len(full), L):  # predict full[a:b] from at most the L tokens before each
            b = min(a + L, len(full))
            lo = max(0, b - 1 - L)
            lp = _log_probs(model, full[lo:b - 1])
            total += sum(float(lp[i - 1 - lo, full[i]]) for i in range(a, b))
        return total

    want = [direct(d) for d in docs]
    for batch_size in (1, 8):
        got = _lm(folder, batch_size=batch_size, max_length=L).loglikelihood_rolling(
            _requests("loglikelihood_rolling", [(d,) for d in docs]), disable_tqdm=True)
        assert got == pytest.approx(want, abs=1e-3), batch_size


def test_a_row_that_ends_at_end_of_text_gets_no_more_text_in_a_batch(tmp_path):
    """generate_until on a batch where one prompt's greedy continuation is end-of-text at once: its
    completion is empty and every completion equals greedy decoding by full forwards over the tokenizer's
    ids, cut at end-of-text, at a stop string or after max_gen_toks, whatever the batch size. The model's
    config names no end-of-text id: the tokenizer's ends the rows."""
    model, tok = _model(tie_word_embeddings=False)
    eos, n = tok.eos_token_id, len(tok)
    prompts = ["fast weight memory", "the state", "a", "gate decay token value read write"]
    # end-of-text's output row: 1.5 x that of the first prompt's greedy token, so it wins there
    ids = [eos, *prompts[0].encode()]
    first = _log_probs(model, ids)[-1, :n]
    best = int(first.argmax())
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1]
        assert logits[best] > 0
        model.lm_head.weight[eos] = 1.5 * model.lm_head.weight[best]
    folder = _save(model, tok, tmp_path / "m")

    def greedy(prompt, max_new, until):
        ids, new = [eos, *prompt.encode()], []
        for _ in range(max_new):
            t = int(_log_probs(model, ids + new)[-1, :n].argmax())
            if t == eos:
                break
            new.append(t)
            if any(u in tok.decode(new) for u in until):
                break
        text = tok.decode(new)
        for u in until:
            text = text.split(u)[0]
        return text

    for until, max_new in (([], 10), (["e"], 12)):
        want = [greedy(p, max_new, until) for p in prompts]
        if not until:  # one row ends at once, the others go on
            assert want[0] == "" and any(len(w) >= 2 for w in want[1:]), want
        for batch_size in (1, 4):
            args = [(p, {"until": until, "max_gen_toks": max_new, "do_sample": False}) for p in prompts]
            got = _lm(folder, batch_size=batch_size).generate_until(_requests("generate_until", args),
                                                                    disable_tqdm=True)
            assert got == want, (until, batch_size)


def test_is_greedy_is_greedy_decoding_over_the_tokenizers_ids(tmp_path):
    """The embedding pads the vocabulary past the tokenizer's ids, and generation never picks those. A
    continuation that is the argmax over the tokenizer's ids is greedy even where a padding id (made so
    here) has the larger logit; its log-probability stays the one over all ids."""
    model, tok = _model()
    eos, n = tok.eos_token_id, len(tok)
    assert model.config.vocab_size > n
    for context in ("the state", "a", "fast weight", "gate", "key value", "memory"):
        lp = _log_probs(model, [eos, *context.encode()])[-1]
        best = int(lp[:n].argmax())
        if best < 128:  # an ASCII byte: a one-character continuation
            break
    assert best < 128, "no context with an ASCII greedy byte"
    with torch.no_grad():
        emb = model.get_input_embeddings().weight  # tied: the output rows of the padding ids
        assert float(model(input_ids=torch.tensor([[eos, *context.encode()]])).logits[0, -1, best]) > 0
        emb[n:] = 3 * emb[best]
    lp = _log_probs(model, [eos, *context.encode()])[-1]
    assert int(lp.argmax()) >= n and int(lp[:n].argmax()) == best  # a padding id wins over all ids
    other = next(t for t in range(97, 123) if t != best)
    folder = _save(model, tok, tmp_path / "m")
    got = _lm(folder, batch_size=2).loglikelihood(
        _requests("loglikelihood", [(context, chr(best)), (context, chr(other))]), disable_tqdm=True)
    assert [g[1] for g in got] == [True, False]
    assert [g[0] for g in got] == pytest.approx([float(lp[best]), float(lp[other])], abs=1e-4)


def _bos_adding_tokenizer():
    """The byte tokenizer plus a beginning-of-sequence token ``<s>`` (id 257) that its post-processor puts in
    front of every encoded text, as many Hub tokenizers do; training's documents (``encode_documents``,
    without special tokens) are ``[end-of-text] + bytes`` all the same."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = byte_tokenizer().backend_tokenizer
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", 257)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", bos_token="<s>",
                                  pad_token="<|endoftext|>", model_max_length=1 << 30, padding_side="left",
                                  clean_up_tokenization_spaces=False, split_special_tokens=True)
    assert (tok.eos_token_id, tok.bos_token_id, tok("ab")["input_ids"]) == (256, 257, [257, 97, 98])
    return tok


def test_requests_are_tokenized_as_training_documents_with_a_bos_adding_tokenizer(tmp_path):
    """A tokenizer whose encoding adds a beginning-of-sequence token: every request is still end-of-text
    followed by the text's own tokens, as the training documents were. Log-likelihoods (an empty context
    too), rolling log-likelihoods and generation prompts against direct computations on those tokens."""
    from falcon_fwa.data.tokenizer import encode_documents

    model, _ = _model()
    tok = _bos_adding_tokenizer()
    folder = _save(model, tok, tmp_path / "m")
    eos = tok.eos_token_id
    assert encode_documents(tok, ["ab"])[0].tolist() == [97, 98]  # what training puts after end-of-text

    def cont_ll(context_ids, cont_ids):
        lp = _log_probs(model, context_ids + cont_ids[:-1])
        return sum(float(lp[len(context_ids) - 1 + j, t]) for j, t in enumerate(cont_ids))

    pairs = [("the state", " memory"), ("", "gate"), ("a", " b")]
    want = [cont_ll([eos, *c.encode()], list(k.encode())) for c, k in pairs]
    lm = _lm(folder, batch_size=2, max_length=16)
    assert lm.prefix_token_id == eos
    got = lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    assert [g[0] for g in got] == pytest.approx(want, abs=1e-4)

    doc = "fast weight attention"  # 21 bytes: windows of 16 and 5 predictions, the second from 16 inputs
    full = [eos, *doc.encode()]
    want_roll = cont_ll(full[:1], full[1:17]) + cont_ll(full[5:17], full[17:])
    assert lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(doc,)]), disable_tqdm=True) \
        == pytest.approx([want_roll], abs=1e-4)

    ids, mask = lm.tok_batch_encode(["ab", "abc"])
    assert ids.tolist() == [[eos, eos, 97, 98], [eos, 97, 98, 99]] and mask.tolist() == [[0, 1, 1, 1], [1] * 4]


def test_rolling_log_likelihood_is_the_perplexity_commands_sum_on_whole_windows(tmp_path):
    """A document of 3 x 16 tokens after its end-of-text: the harness's rolling windows of max_length 16 are
    the ``ppl`` windows of seq_len 16 (each from an empty state, the first opened by end-of-text), so its
    log-likelihood is minus the summed NLL of ``position_nll`` over them, in either treatment of documents
    and at any batch size (float64, to 1e-9)."""
    from falcon_fwa.eval import position_nll, windows

    model, tok = _model()
    folder = _save(model.double(), tok, tmp_path / "m")
    doc = "the state memory key value write read gate decay"[:48]
    full = torch.tensor([tok.eos_token_id, *doc.encode()])
    rows = windows(full.numpy(), 16)
    assert rows.shape == (3, 17)
    for eos_id in (None, tok.eos_token_id):
        total, count = position_nll(model, rows, batch_size=2, progress=False, eos_id=eos_id)
        assert int(count.sum()) == 48
        for batch_size in (1, 3):
            got = _lm(folder, batch_size=batch_size, max_length=16, dtype="float64").loglikelihood_rolling(
                _requests("loglikelihood_rolling", [(doc,), (doc[:12],)]), disable_tqdm=True)
            assert got[0] == pytest.approx(-float(total.sum()), rel=0, abs=1e-9)
    # a document shorter than a window: one window of its 12 predictions
    total12, _ = position_nll(model, windows(full[:13].numpy(), 12), progress=False)
    assert got[1] == pytest.approx(-float(total12.sum()), rel=0, abs=1e-9)
