"""Stop strings of ``generate_text`` with tokenizers whose decoding rewrites spacing, built here from a few
sentences with the ``tokenizers`` library: a byte-level BPE (GPT-2's "Ġ"), a SentencePiece-style BPE and unigram
(Metaspace "▁", whose decoder drops the leading space of the first token), a WordPiece ("##"). With
``clean_up_tokenization_spaces`` the decoder also takes out spaces ("a ." -> "a.", "do n't" -> "don't"), and
so changes text already decoded when the next token comes. A scripted next-token source forces the generated
ids; the reference is the whole decode of the generated ids, cut at ``str.find`` of the stop string, at the
first token after which it holds one."""
import random
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from falcon_fwa.serve import generate_text
from falcon_fwa.serve.stops import StopText

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = ["User: hello there, how are you? I am fine.", "Assistant: the end is near. Don't stop!",
             "we can't end it , he said . User: what ? end", "two  spaces and\nnew lines\n\nUser: ok"] * 5


def _fast(t, eos, cleanup, **special):
    kw = {"clean_up_tokenization_spaces": cleanup}
    if cleanup:  # transformers leaves a BPE's spaces as they are unless told
        kw["clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"] = True
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token=eos, pad_token=eos, **special, **kw)


def byte_level(cleanup=False):
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return _fast(t, "<eos>", cleanup)


def metaspace_bpe(cleanup=False):
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=200, special_tokens=["<eos>", "<unk>"]))
    return _fast(t, "<eos>", cleanup, unk_token="<unk>")


def metaspace_unigram(cleanup=False):
    t = Tokenizer(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    t.train_from_iterator(SENTENCES, trainers.UnigramTrainer(vocab_size=120, special_tokens=["<eos>", "<unk>"],
                                                              unk_token="<unk>"))
    return _fast(t, "<eos>", cleanup, unk_token="<unk>")


def wordpiece(cleanup=False):
    t = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    t.decoder = decoders.WordPiece()
    t.train_from_iterator(SENTENCES, trainers.WordPieceTrainer(vocab_size=150, special_tokens=["[EOS]", "[UNK]"]))
    return _fast(t, "[EOS]", cleanup, unk_token="[UNK]")


TOKENIZERS = {"byte-level": byte_level, "metaspace-bpe": metaspace_bpe, "unigram": metaspace_unigram,
              "wordpiece": wordpiece}


class Forced(torch.nn.Module):
    """Generates ``ids`` (one-hot logits, greedy), then ``filler``, whatever the prompt."""

    def __init__(self, vocab, ids, filler):
        super().__init__()
        self.vocab, self.ids, self.filler = vocab, list(ids), filler
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, logits_to_keep=1):
        if past_key_values is None:  # the prompt pass; the cache is then changed in place, as a model's is
            past_key_values = SimpleNamespace(n=0)
        else:
            past_key_values.n += 1
        n = past_key_values.n
        logits = torch.zeros(len(input_ids), 1, self.vocab)
        logits[:, 0, self.ids[n] if n < len(self.ids) else self.filler] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


def _reference(tok, ids, stops):
    """The tokens kept and the text: the shortest prefix whose whole decode (not ending in an incomplete
    character) holds a stop string, cut at the earliest occurrence; all of ``ids`` when none does."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = sorted((text.find(s), i) for i, s in enumerate(stops) if s in text)
        if hits and not text.endswith("\ufffd"):
            return ids[:n], text[:hits[0][0]], stops[hits[0][1]]
    return ids, tok.decode(ids, skip_special_tokens=True), None


def _run(tok, ids, stops, filler_text="ok"):
    filler = tok.convert_tokens_to_ids(tok.tokenize(filler_text))[0]
    shown = []
    out = generate_text(Forced(len(tok), ids, filler), tok, ["hi"], max_new_tokens=len(ids) + 2, stop=stops,
                        on_text=shown.append)
    c = out.completions[0]
    assert "".join(shown) == c.text
    return c, _reference(tok, ids + [filler] * 2, stops)


@pytest.mark.parametrize("cleanup", [False, True])
@pytest.mark.parametrize("name", list(TOKENIZERS))
@pytest.mark.parametrize("stop", ["\nUser:", "t end", ": wh"])
def test_a_stop_string_with_a_space_across_tokens_ends_where_the_whole_decode_has_it(name, cleanup, stop):
    """The completion "... he said . User: what ? end ..." (encoded by the tokenizer): the stop string spans
    tokens and holds a space (or a newline) that the decoder writes from a marker; the completion keeps the
    tokens up to the one after which the whole decode holds it, and its text is that decode cut before it."""
    if name == "wordpiece" and stop == "\nUser:":
        pytest.skip("a WordPiece decode writes no newline")
    tok = TOKENIZERS[name](cleanup)
    text = "Assistant: we can't end it , he said .\nUser: what ? end"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert stop in tok.decode(ids) and not any(stop in tok.decode([i]) for i in ids)  # no token holds it
    c, (kept, want, stop_string) = _run(tok, ids, [stop])
    assert stop_string == stop
    assert (c.token_ids, c.text, c.stop_string, c.finish_reason) == (kept, want, stop, "stop")
    assert want == tok.decode(c.token_ids, skip_special_tokens=True).split(stop)[0]


@pytest.mark.parametrize("name", ["unigram", "wordpiece", "metaspace-bpe"])
def test_a_space_the_decoder_cleans_up_later_is_not_in_the_text(name):
    """Forced tokens "a", "▁" (or "'"), "." ...: decoded token by token the text would keep the space that the
    whole decode takes out when the "." comes ("a ." -> "a."); the stop string "a." is then found and the text
    is the whole decode before it, and without a stop string the text is the whole decode."""
    tok = TOKENIZERS[name](True)
    words = tok(" said . end .", add_special_tokens=False)["input_ids"]
    whole = tok.decode(words, skip_special_tokens=True)
    assert "d." in whole and "d ." not in whole
    c, (kept, want, stop_string) = _run(tok, words, ["d.", "end"])
    assert (c.token_ids, c.text, c.stop_string) == (kept, want, stop_string) == (kept, whole.split("d.")[0], "d.")
    c, (kept, want, _) = _run(tok, words, ["###"])
    assert c.text == want and want.startswith(whole)


def test_rows_of_a_batch_stop_on_their_own_with_a_metaspace_tokenizer():
    """Two rows of one batch with different forced continuations: each ends at its own stop string, at the
    token and text the whole decode gives."""
    tok = metaspace_unigram(True)
    scripts = {"a": "Assistant: the end is near .\nUser: ok", "b": "we can't end it , he said . User: what"}
    encoded = {p: tok(s, add_special_tokens=False)["input_ids"] for p, s in scripts.items()}
    prompt_key = {tuple(tok(p, add_special_tokens=False)["input_ids"]): p for p in scripts}

    class PerRow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.anchor = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, logits_to_keep=1):
            if past_key_values is None:
                rows = [prompt_key[tuple(i[m.bool()].tolist()[1:])] for i, m in zip(input_ids, attention_mask)]
                past_key_values = SimpleNamespace(rows=rows, n=0)
            else:
                past_key_values.n += 1
            logits = torch.zeros(len(input_ids), 1, len(tok))
            for r, p in enumerate(past_key_values.rows):
                ids = encoded[p]
                logits[r, 0, ids[past_key_values.n] if past_key_values.n < len(ids) else 0] = 1.0
            return SimpleNamespace(logits=logits, past_key_values=past_key_values)

    stops = ["\nUser:", "d. User"]  # the whole decode has "said. User": the space before "." is cleaned up
    out = generate_text(PerRow(), tok, ["a", "b"], max_new_tokens=40, stop=stops, batch_size=2)
    for c, p in zip(out.completions, ["a", "b"]):
        kept, want, stop_string = _reference(tok, encoded[p], stops)
        assert (c.token_ids, c.text, c.stop_string, c.finish_reason) == (kept, want, stop_string, "stop")
    assert [c.finish_reason for c in out.completions] == ["stop", "stop"]


@pytest.mark.parametrize("name", list(TOKENIZERS))
def test_random_tokens_give_the_whole_decode_and_its_cut(name):
    """Random token ids (past the decoded window: up to 120 tokens) through ``StopText``: with no stop string
    the text is the whole decode; with one it ends at the reference token and text, and the streamed pieces add
    up to the text."""
    rng = random.Random(0)
    for cleanup in (False, True):
        tok = TOKENIZERS[name](cleanup)
        for _ in range(60):
            ids = [rng.randrange(1, len(tok)) for _ in range(rng.randrange(1, 120))]
            stops = rng.choice([[], [" ."], ["e "], [" e", "?"], ["\n", " a"]])
            row, shown = StopText(tok, stops), ""
            for t in ids:
                stopped = row.add(t)
                shown += row.take()
                if stopped:
                    break
            row.finish()
            shown += row.take()
            kept, want, stop_string = _reference(tok, ids, stops)
            assert (row.ids, row.text, row.stop_string) == (kept, want, stop_string), (ids, stops)
            assert shown == row.text
