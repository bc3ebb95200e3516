"""Serving properties checked against references written out here: a completion's text is the whole decode of its
tokens, also for a decoder whose text of a token depends on a token far before it (a caps-lock token: the decoded
window is moved on only where the text before it decodes as in the whole run); streamed text is never taken back
nor repeated by a decoder that cleans up spaces, where the space is the third character from the end ("I 'v"
becomes "I've" when "e" comes) and where a space taken out moves the held text back ("a b " then "a b,");
greedy decoding is the argmax (the first of tied largest logits) and draws no random number; ``falcon-fwa generate``
refuses ``--top-k`` and ``--top-p`` with greedy decoding, which would ignore them; and a ``top_p`` outside (0, 1] is
refused by name at a sampling temperature too."""
from types import SimpleNamespace

import pytest
import torch
from test_serve_stop_tokenizers import Forced, byte_level

from falcon_fwa import FalconForCausalLM, cli, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.serve import generate_text
from falcon_fwa.serve.stops import StopText

pytestmark = pytest.mark.usefixtures("one_thread")


class CapsLock:
    """Letters a-z (ids 0-25), a caps-lock token (26) that writes nothing and switches the case of every letter
    after it, and the end-of-text token (27)."""

    CAPS, eos_token_id, pad_token_id = 26, 27, 27
    clean_up_tokenization_spaces = False

    def __len__(self):
        return 28

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - ord("a") for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        text, upper = [], False
        for i in ids:
            if i == self.CAPS:
                upper = not upper
            elif i < 26:
                text.append(chr(ord("A" if upper else "a") + i))
        return "".join(text)


def _letters(s):
    return [ord(c) - ord("a") for c in s]


def test_the_text_is_the_whole_decode_when_a_token_far_back_changes_the_text_after_it():
    """The caps-lock token opens the completion, more than ``2 * WINDOW + CONTEXT`` tokens before the end: every
    letter after it decodes upper-case, which a decode of the last tokens alone would not show."""
    tok = CapsLock()
    ids = [CapsLock.CAPS] + _letters("abcdefghij" * 4 + "xyz")
    assert len(ids) > 2 * StopText.WINDOW + StopText.CONTEXT
    row = StopText(tok)
    for n, token in enumerate(ids, 1):
        assert not row.add(token)
        assert row.text == tok.decode(ids[:n]), n

    shown = []
    out = generate_text(Forced(len(tok), ids, 0), tok, ["q"], max_new_tokens=len(ids) + 5, stop="XYZ",
                        on_text=shown.append)
    c = out.completions[0]
    assert (c.text, c.finish_reason, c.stop_string) == ("ABCDEFGHIJ" * 4, "stop", "XYZ")
    assert c.token_ids == ids and "".join(shown) == c.text


@pytest.mark.parametrize("chars, text", [
    (["I", "Ġ", "'", "v", "e", "Ġ", "d", "o", "Ġ", "n", "'", "t"], "I've don't"),  # "I 'v": space third from the end
    (["a", "Ġ", "b", "Ġ", ",", "Ġ", "c"], "a b, c"),  # "a b " then "a b,": the held space moves back one word
])
def test_streamed_text_is_never_taken_back_nor_repeated_by_a_decoder_that_cleans_up_spaces(chars, text):
    """A byte-level BPE with ``clean_up_tokenization_spaces``, fed one character a token: "I 'v" decodes as
    such, "I 've" as "I've", "do n'" then "do n't" as "don't", "a b ," as "a b,". Each streamed piece extends
    what was shown into a prefix of the final text, which is the whole decode."""
    tok = byte_level(cleanup=True)
    ids = tok.convert_tokens_to_ids(chars)
    assert tok.decode(ids, skip_special_tokens=True) == text
    # the decode of fewer tokens is no prefix of the whole: a later token takes out a space already decoded
    assert any(not text.startswith(tok.decode(ids[:n], skip_special_tokens=True)) for n in range(len(ids)))
    shown = []
    out = generate_text(Forced(len(tok), ids, ids[0]), tok, ["hi"], max_new_tokens=len(ids), on_text=shown.append)
    c = out.completions[0]
    assert c.token_ids == ids and c.text == text
    so_far = ""
    for piece in shown:
        so_far += piece
        assert c.text.startswith(so_far), shown
    assert so_far == c.text


@pytest.mark.parametrize("options, named", [
    (["--top-k", "5"], "--top-k"),
    (["--top-p", "0.9"], "--top-p"),
    (["--top-k", "5", "--top-p", "0.9", "--temperature", "0"], "--top-k and --top-p"),
])
def test_the_command_refuses_sampling_filters_with_greedy_decoding(tmp_path, capsys, monkeypatch, options, named):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    torch.manual_seed(0)
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320)).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    capsys.readouterr()  # the progress of saving
    argv = ["generate", "--model", str(tmp_path / "m"), "--prompt", "a", "--device", "cpu", "--max-new-tokens", "2"]
    assert cli.main(argv + options) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa generate: error: {named} shape a sampled draw, but --temperature 0") and \
        "Traceback" not in err
    assert cli.main(argv + options + ["--temperature", "0.5"]) == 0  # sampling takes them


@pytest.mark.parametrize("top_p", [0, 0.0, -0.1, 1.01])
def test_a_top_p_outside_zero_to_one_is_refused_by_name_when_sampling(tmp_path, capsys, monkeypatch, top_p):
    """``top_p`` is in (0, 1]: at 0 no token would hold the mass, at a sampling temperature too."""
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320)).eval()
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got "):
        generate_text(model, byte_tokenizer(), ["a"], max_new_tokens=2, temperature=0.7, top_p=top_p)
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    capsys.readouterr()  # the progress of saving
    assert cli.main(["generate", "--model", str(tmp_path / "m"), "--prompt", "a", "--device", "cpu",
                     "--temperature", "0.7", "--top-p", str(top_p)]) == 2
    assert capsys.readouterr().err.startswith(r"falcon-fwa generate: error: --top-p must be in (0, 1], got ")


class Tied(torch.nn.Module):
    """The same next-token logits at every position: ids 5 and 9 tie for the largest, id 7 is next."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, logits_to_keep=1):
        logits = torch.zeros(len(input_ids), 1, self.vocab)
        logits[..., 5] = logits[..., 9] = 4.0
        logits[..., 7] = 3.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values or SimpleNamespace())


def test_greedy_decoding_takes_the_first_of_tied_largest_logits_and_draws_nothing():
    """``temperature=0`` is the argmax (its first index among ties) at every step, whatever the seed, and leaves
    torch's random state as it was."""
    tok = byte_tokenizer()
    for seed in (0, 1, None):
        torch.manual_seed(3)
        state = torch.get_rng_state()
        out = generate_text(Tied(len(tok)), tok, ["ab", "c"], max_new_tokens=12, batch_size=2, seed=seed)
        assert [c.token_ids for c in out.completions] == [[5] * 12, [5] * 12]
        assert torch.equal(torch.get_rng_state(), state)
