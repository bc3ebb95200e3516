"""``generate_text`` and ``falcon-fwa generate`` against their stated contract, with next-token sources whose
logits are written out in the test: the default seed (0) samples reproducibly, the streamed pieces of several
prompts in batches of one add up to each text, the first of several stop strings starting at one character is
named, a token without text keeps the next one's leading space, a stopped text is taken whole, and the
command's defaults, summary line and report are the documented ones."""
import json
from types import SimpleNamespace

import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.serve import generate_text
from falcon_fwa.serve.generation import Timing
from falcon_fwa.serve.stops import StopText

pytestmark = pytest.mark.usefixtures("one_thread")


class Written(torch.nn.Module):
    """Next-token logits over the byte tokenizer's 257 ids: ``logits(prompt, n)`` for the row whose prompt
    text is ``prompt``, at its ``n``-th new token (n = 0 in the prompt pass)."""

    def __init__(self, tokenizer, logits):
        super().__init__()
        self.tokenizer, self.logits = tokenizer, logits
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where generate_text finds the device

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, logits_to_keep=1):
        if past_key_values is None:  # the prompt pass: each row's prompt, its leading end-of-text left out
            rows = [self.tokenizer.decode(ids[m.bool()].tolist()[1:]) for ids, m in zip(input_ids, attention_mask)]
            past_key_values = SimpleNamespace(prompts=rows, n=0)
        else:
            past_key_values.n += 1
        out = torch.tensor([[self.logits(p, past_key_values.n)] for p in past_key_values.prompts])
        assert out.shape == (len(input_ids), 1, 257)
        return SimpleNamespace(logits=out, past_key_values=past_key_values)


def _one_hot(ids):
    """Logits that make ``ids[n]`` (then ``ord("~")``) the greedy choice at the n-th new token."""
    def logits(prompt, n):
        row = [0.0] * 257
        row[ids[n] if n < len(ids) else ord("~")] = 1.0
        return row
    return logits


def test_the_default_seed_samples_reproducibly():
    """``seed=0`` (the default) draws the same tokens on every call, as any other seed does: 24 draws from the
    uniform distribution over 257 tokens, which two unseeded calls could not repeat."""
    tok = byte_tokenizer()
    model = Written(tok, lambda prompt, n: [0.0] * 257)
    kw = dict(max_new_tokens=24, temperature=1.0, stop_at_eos=False)
    first = generate_text(model, tok, ["a"], **kw).completions[0].token_ids
    assert generate_text(model, tok, ["a"], **kw).completions[0].token_ids == first
    assert generate_text(model, tok, ["a"], seed=0, **kw).completions[0].token_ids == first
    other = generate_text(model, tok, ["a"], seed=1, **kw).completions[0].token_ids
    assert other != first and len(set(first)) > 12


def test_on_text_streams_several_prompts_in_batches_of_one():
    """``on_text`` takes one prompt per batch: with two prompts and ``batch_size=1`` the pieces come prompt after
    prompt, and each completion's pieces add up to its text."""
    tok = byte_tokenizer()
    scripts = {"p": list(b"ab\n\ncd"), "q": list(b"xy")}
    model = Written(tok, lambda prompt, n: _one_hot(scripts[prompt])(prompt, n))
    pieces = []
    out = generate_text(model, tok, ["p", "q"], max_new_tokens=6, stop=["\n\n"], batch_size=1,
                        on_text=pieces.append)
    p, q = out.completions
    assert (p.text, p.finish_reason, q.text, q.finish_reason) == ("ab", "stop", "xy~~~~", "length")
    assert "".join(pieces) == "ab" + "xy~~~~"
    first_q = next(i for i, s in enumerate(pieces) if s.startswith("x"))
    assert "".join(pieces[:first_q]) == "ab"


class Words:
    """A tokenizer whose tokens are whole words: ``decode`` joins them."""

    words = ["hello", " world"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids)


@pytest.mark.parametrize("stops, text, named", [
    (["he", "hel"], "", "he"), (["hel", "he"], "", "hel"),  # both start at "h"
    (["llo", "l"], "he", "llo"), (["l", "llo"], "he", "l"),  # both start at the first "l"
    (["lo", "el"], "h", "el"),  # the earliest start wins whatever the order
])
def test_of_stop_strings_found_at_one_character_the_first_given_is_named(stops, text, named):
    """One token ("hello") completes both stop strings at once: the text is cut before the earliest occurrence
    and, when both start at that character, ``stop_string`` is the first of ``stop``."""
    row = StopText(Words(), stops)
    assert row.add(0)
    assert (row.text, row.stop_string, row.ids) == (text, named, [0])


class Pieces:
    """Tokens "hello", " world" and an end-of-text token (2), decoded as SentencePiece does: special tokens
    left out, then the leading space of what is left dropped."""

    words = ["hello", " world", "<eos>"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.words[i] for i in ids if not (skip_special_tokens and i == 2)).removeprefix(" ")


def test_a_token_without_text_leaves_the_next_ones_leading_space():
    """The end-of-text token adds no text; the next token is still decoded with "hello" before it, so its
    leading space stays: the text is the whole decode "hello world" (decoded after the end-of-text token alone,
    " world" would lose its space)."""
    tokenizer = Pieces()
    assert tokenizer.decode([2, 1]) == "world" and tokenizer.decode([0, 2, 1]) == "hello world"
    row = StopText(tokenizer)
    for t in (0, 2, 1):
        assert not row.add(t)
    row.finish()
    assert (row.text, row.ids) == ("hello world", [0, 2, 1])


def test_each_token_decodes_a_window_of_the_last_tokens_not_the_whole_completion():
    """The cost stated for ``StopText``: per token one decode of the last at most ``2 * WINDOW + 1 + CONTEXT``
    tokens (41) and, every ``WINDOW`` tokens, two more to move the window on; not one of the whole completion
    (300 ASCII bytes), whose text is still the whole decode."""
    tok, lengths = byte_tokenizer(), []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    text = (b"fast weights hold the state of the online learner " * 6)[:300]
    row = StopText(Counting(), ["###"])
    for t in text:
        assert not row.add(t)
    assert row.text == text.decode()
    assert max(lengths) == 2 * StopText.WINDOW + 1 + StopText.CONTEXT == 41
    assert len(lengths) <= len(text) + 2 * (len(text) // StopText.WINDOW) and sum(lengths) < 41 * 2 * len(text)


def test_a_stopped_text_is_taken_whole_before_finish():
    """Stop strings "aab" and "b": after "xa" the "a" is held back (it may begin "aab"); "b" then completes the
    other stop string, the text is "xa", and once stopped nothing is held: ``take`` hands over the "a"."""
    tok = byte_tokenizer()
    row = StopText(tok, ["aab", "b"])
    pieces = []
    for t in b"xab":
        stopped = row.add(t)
        pieces.append(row.take())
    assert stopped and (row.text, row.stop_string, row.held()) == ("xa", "b", 0)
    assert pieces == ["x", "", "a"]


def test_the_summary_line_counts_the_tokens_after_the_first():
    """The decoding speed of the summary line is that of the new tokens after each row's first (45 of 48)."""
    from falcon_fwa.serve.generate_cli import _summary

    t = Timing(batches=1, prompt_tokens=30, new_tokens=48, prefill_s=0.25, decode_tokens=45, decode_s=1.5)
    line = _summary(t, 3, "cpu", "fp32")
    assert line == ("generate: 3 prompt(s), 30 prompt tokens, 48 new tokens in 1 batch(es) on cpu/fp32; prefill "
                    "0.2500 s; decode 45 tokens in 1.5000 s = 30.0 tokens/s (eager steps)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Falcon (vocabulary of the byte tokenizer's 257 ids) saved with its tokenizer."""
    path = tmp_path_factory.mktemp("serve") / "model"
    torch.manual_seed(0)
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=257, initializer_range=0.5)).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def _report(folder, *options):
    from falcon_fwa import cli

    out = folder.parent / "out.json"
    assert cli.main(["generate", "--model", str(folder), "--device", "cpu", "--prompt", "the state",
                     "--max-new-tokens", "12", "--json", str(out), *options]) == 0
    return json.loads(out.read_text())


def test_the_command_greedy_by_default_stopping_at_eos_and_sampling_reproducibly_without_seed(folder, capsys):
    """By default the command is greedy (``--temperature 0``), stops at end-of-text and seeds the sampling with
    0: two sampling runs without ``--seed`` draw the same tokens, those of ``--seed 0``; the report's settings
    are those given."""
    greedy = _report(folder)["settings"]
    assert (greedy["greedy"], greedy["temperature"], greedy["stop_at_eos"], greedy["seed"]) == (True, 0.0, True, 0)
    sampled = [_report(folder, "--temperature", "5", "--no-stop-at-eos") for _ in range(2)]
    seeded = _report(folder, "--temperature", "5", "--no-stop-at-eos", "--seed", "0")
    tokens = [r["completions"][0]["token_ids"] for r in (*sampled, seeded)]
    assert tokens[0] == tokens[1] == tokens[2]
    other = _report(folder, "--temperature", "5", "--no-stop-at-eos", "--seed", "7")
    assert other["completions"][0]["token_ids"] != tokens[0]
    assert (other["settings"]["greedy"], other["settings"]["seed"], other["settings"]["stop_at_eos"]) == (
        False, 7, False)
    capsys.readouterr()


class _WithoutEndOfText:
    """The byte tokenizer without an end-of-text token (pad id 0)."""

    def __init__(self, tokenizer):
        self.inner, self.eos_token_id, self.pad_token_id = tokenizer, None, 0

    def __len__(self):
        return len(self.inner)

    def __call__(self, text, add_special_tokens=False):
        return self.inner(text, add_special_tokens=add_special_tokens)

    def decode(self, ids, skip_special_tokens=True):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_an_empty_prompt_continues_the_end_of_text_token_and_without_one_is_refused_by_index():
    """With an end-of-text token an empty prompt is that token alone, continued like any other; without one,
    an empty prompt is a ``ValueError`` naming its index (an earlier non-empty prompt does not hide it)."""
    tok = byte_tokenizer()
    seen = []

    def logits(prompt, n):
        seen.append(prompt)
        return _one_hot([ord("o"), ord("k")])(prompt, n)

    out = generate_text(Written(tok, logits), tok, [""], max_new_tokens=2, stop_at_eos=False)
    assert out.completions[0].text == "ok" and seen[0] == ""
    bare = _WithoutEndOfText(tok)
    with pytest.raises(ValueError, match=r"^prompt 1 is empty and the tokenizer has no end-of-text token"):
        generate_text(Written(tok, logits), bare, ["ab", ""], max_new_tokens=2)


def test_a_stop_text_takes_no_token_after_its_end():
    """``StopText.add`` after the text met a stop string, or after ``finish()``, is a ``RuntimeError``; the
    text stays cut before the stop string."""
    tok = byte_tokenizer()
    stopped = StopText(tok, ["##"])
    assert [stopped.add(t) for t in b"a##"] == [False, False, True]
    with pytest.raises(RuntimeError, match="already ended"):
        stopped.add(ord("b"))
    assert stopped.text == "a" and stopped.stop_string == "##"
    finished = StopText(tok, ["##"])
    finished.add(ord("x"))
    finished.finish()
    with pytest.raises(RuntimeError, match="already ended"):
        finished.add(ord("y"))
    assert finished.text == "x"
