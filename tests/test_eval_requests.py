"""The harness model ``falcon-fwa`` with a tokenizer that reads its end-of-text token's name in a text as that
token (``split_special_tokens`` off, as Hub tokenizers such as GPT-2's): a request that already opens with
end-of-text is left as it is, one end-of-text in front, never two (log-likelihoods against direct
computations, batch prompts by hand)."""
import json

import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import EOS_TOKEN, byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("lm_eval")


def test_a_request_that_opens_with_end_of_text_gets_no_second_one(tmp_path):
    from lm_eval.api.instance import Instance

    from falcon_fwa.eval.harness import lm_class

    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5)).eval()
    tok = byte_tokenizer()
    folder = tmp_path / "m"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["split_special_tokens"] = False
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    lm = lm_class()(pretrained=str(folder), device="cpu", trust_remote_code=False, batch_size=2)
    eos = lm.tokenizer.eos_token_id
    assert lm.tok_encode(EOS_TOKEN + "ab") == [eos, 97, 98]  # the name reads as the token here

    def cont_ll(context_ids, cont_ids):
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([context_ids + cont_ids[:-1]]), use_cache=False).logits[0]
        lp = lp.double().log_softmax(-1)
        return sum(float(lp[len(context_ids) - 1 + j, t]) for j, t in enumerate(cont_ids))

    pairs = [(EOS_TOKEN + "the state", " memory"), ("the state", " memory"), (EOS_TOKEN + "a", " b")]
    want = [cont_ll([eos, *b"the state"], list(b" memory")), cont_ll([eos, *b"the state"], list(b" memory")),
            cont_ll([eos, *b"a"], list(b" b"))]
    got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
    assert [g[0] for g in got] == pytest.approx(want, abs=1e-4)
    ids, mask = lm.tok_batch_encode([EOS_TOKEN + "ab", "abc"])
    assert ids.tolist() == [[eos, eos, 97, 98], [eos, 97, 98, 99]] and mask.tolist() == [[0, 1, 1, 1], [1] * 4]


@pytest.mark.parametrize("max_length", [0, -1])
def test_evaluate_refuses_a_max_length_below_one_naming_it(tmp_path, max_length):
    from falcon_fwa.eval.harness import evaluate

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="max_length must be at least 1"):
        evaluate(str(tmp_path), ["arc_easy"], max_length=max_length)
