"""The harness model ``falcon-fwa`` against direct computations on a tiny random model: a ``prefix_token_id``
given in the model arguments opens empty contexts and rolling windows in place of end-of-text, and a
continuation is not greedy where end-of-text (an id generation picks) has the larger log-probability."""
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("lm_eval")


def _folder(tmp_path, **overrides):
    """(model, folder) of a tiny Falcon saved with the byte tokenizer."""
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5, **overrides)).eval()
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return model, str(folder)


def _lm(folder, **kwargs):
    from falcon_fwa.eval.harness import lm_class

    return lm_class()(pretrained=folder, device="cpu", trust_remote_code=False, **kwargs)


def _requests(kind, args):
    from lm_eval.api.instance import Instance

    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def _score(model, opening, text):
    """Summed float64 log-probability of the bytes of ``text``, each predicted from ``[opening] + bytes before``."""
    ids = [opening, *text.encode()]
    with torch.no_grad():
        lp = model(input_ids=torch.tensor([ids[:-1]]), use_cache=False).logits[0].double().log_softmax(-1)
    return sum(float(lp[j, t]) for j, t in enumerate(ids[1:]))


def test_a_prefix_token_id_given_opens_empty_contexts_and_rolling_windows(tmp_path):
    model, folder = _folder(tmp_path)
    eos, x = 256, ord("x")
    text = "the state"
    assert abs(_score(model, eos, text) - _score(model, x, text)) > 1e-3  # the opening shows in the score
    for opening, kwargs in ((eos, {}), (x, {"prefix_token_id": x})):
        lm = _lm(folder, batch_size=1, **kwargs)
        assert lm.prefix_token_id == opening
        ll = lm.loglikelihood(_requests("loglikelihood", [("", text)]), disable_tqdm=True)[0][0]
        rolling = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,)]), disable_tqdm=True)[0]
        assert (ll, rolling) == pytest.approx((_score(model, opening, text),) * 2, abs=1e-4)


def test_a_continuation_is_not_greedy_where_end_of_text_leads(tmp_path):
    """End-of-text's output row (untied from its input embedding) made to outscore every byte after the context:
    the byte that leads among the others is no greedy continuation, since generation would end there."""
    model, before = _folder(tmp_path, tie_word_embeddings=False)
    eos = 256
    with torch.no_grad():
        for context in ("the state", "a", "fast weight", "gate", "key value", "memory"):
            logits = model(input_ids=torch.tensor([[eos, *context.encode()]]), use_cache=False).logits[0, -1]
            best = int(logits[:eos].argmax())
            if best < 128:  # an ASCII byte: a one-character continuation
                break
        assert best < 128 and float(logits[best]) > 0, "no context with an ASCII greedy byte"
        head = model.get_output_embeddings().weight
        assert head.data_ptr() != model.get_input_embeddings().weight.data_ptr()
        head[eos] = 3 * head[best]
        lp = model(input_ids=torch.tensor([[eos, *context.encode()]]), use_cache=False).logits[0, -1]
        lp = lp.double().log_softmax(-1)
    assert int(lp[:257].argmax()) == eos and int(lp[:eos].argmax()) == best
    folder = tmp_path / "eos_leads"
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    request = _requests("loglikelihood", [(context, chr(best))])
    assert _lm(before, batch_size=1).loglikelihood(request, disable_tqdm=True)[0][1] is True  # as saved first
    got = _lm(str(folder), batch_size=1).loglikelihood(request, disable_tqdm=True)
    assert got[0][1] is False and got[0][0] == pytest.approx(float(lp[best]), abs=1e-4)
