"""The harness model ``falcon-fwa`` on a ``loglikelihood`` request whose continuation's first characters
merge with the context's last into one token of a BPE tokenizer (``"the cat" + "s sat"``: ``" cats"`` is one
token). The harness's ``hf`` model cuts ``tokenize(context + continuation)`` at ``len(tokenize(context))``,
which scores ``" sat"`` alone (the ``"s"`` lost) or leaves ``"hello wor" + "ld"`` no tokens (a bare
AssertionError). Scores against direct float64 log-softmax sums over ``[end-of-text] + context tokens +
continuation tokens``."""
import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import train_bpe_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("lm_eval")


def test_a_continuation_that_merges_with_the_context_is_scored_whole(tmp_path):
    from lm_eval.api.instance import Instance

    from falcon_fwa.eval.harness import lm_class

    tok = train_bpe_tokenizer(["the cats sat on the mat, hello world " * 50], 300)
    assert tok.tokenize("the cats sat") == ["the", "Ġcats", "Ġsat"] and tok.tokenize("the cat") == ["the", "Ġcat"]
    assert tok.tokenize("hello world")[-1] == "Ġworld" and tok.tokenize("hello wor")[-1] == "Ġwor"
    torch.manual_seed(0)
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320, initializer_range=0.5)).eval()
    assert len(tok) <= model.config.vocab_size
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    eos = tok.eos_token_id

    def encode(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    def direct(context_ids, cont_ids):
        ids = [eos, *context_ids]
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([ids + cont_ids[:-1]]), use_cache=False).logits[0].double()
        lp = lp.log_softmax(-1)
        return sum(float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(cont_ids))

    # merged joins: the continuation's own tokens after the context's; a clean join: the whole text's split
    pairs = [("the cat", "s sat"), ("hello wor", "ld"), ("the cats", " sat")]
    want = [direct(encode("the cat"), encode("s sat")), direct(encode("hello wor"), encode("ld")),
            direct(encode("the cats"), encode(" sat"))]
    assert tok.decode(encode("s sat")) == "s sat" and abs(want[0] - direct(encode("the cat"), encode(" sat"))) > 0.1
    for batch_size in (1, 2):
        lm = lm_class()(pretrained=str(tmp_path / "m"), device="cpu", trust_remote_code=False, batch_size=batch_size)
        got = lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)
        assert [g[0] for g in got] == pytest.approx(want, abs=1e-4), batch_size
