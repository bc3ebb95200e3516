"""Stop strings of ``generate_text`` (``serve.stops``): a next-token source that writes known texts gives the
expected cut, computed from the text and from whole decodes of the token prefixes (not from the incremental
decoding under test); the streamed pieces add up to the final text and hold back at most ``len(stop) - 1``
characters; with a real model, a prompt's greedy completion is the same alone and in a batch whose other
rows stop earlier, and is its unstopped completion cut where the reference says."""
from types import SimpleNamespace

import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer, train_bpe_tokenizer
from falcon_fwa.serve import generate_text
from falcon_fwa.serve.stops import StopText

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 256  # the byte tokenizer's end-of-text token


class Scripted(torch.nn.Module):
    """A next-token source whose choices are known: a row whose prompt is ``p`` continues with the tokens of
    ``scripts[p]`` (the greedy choice of one-hot logits), then with ``filler``. It keeps what each row was fed
    after its prompt (``fed``) and counts its forward passes (``calls``)."""

    def __init__(self, tokenizer, scripts, filler=ord("~")):
        super().__init__()
        self.tokenizer, self.filler, self.calls = tokenizer, filler, 0
        self.scripts = {tuple(tokenizer(p, add_special_tokens=False)["input_ids"]): list(s)
                        for p, s in scripts.items()}
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # where generate_text finds the device

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True, logits_to_keep=1):
        self.calls += 1
        if past_key_values is None:  # the prompt pass: each row's real tokens, its leading end-of-text left out
            prompts = [tuple(ids[m.bool()].tolist()[1:]) for ids, m in zip(input_ids, attention_mask)]
            past_key_values = SimpleNamespace(prompts=prompts, fed=[[] for _ in prompts])
        else:
            for row, t in zip(past_key_values.fed, input_ids[:, 0].tolist()):
                row.append(t)
        self.fed = past_key_values.fed
        logits = torch.zeros(len(input_ids), 1, len(self.tokenizer))
        for r, (prompt, fed) in enumerate(zip(past_key_values.prompts, past_key_values.fed)):
            script = self.scripts[prompt]
            logits[r, 0, script[len(fed)] if len(fed) < len(script) else self.filler] = 1.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


def _reference(tokenizer, ids, stops, eos=None):
    """The tokens and text a completion of ``ids`` keeps: the shortest prefix whose whole decode holds a stop
    string (or ends with ``eos``), and that decode cut at the earliest occurrence; ``(ids, text, None)``
    when there is none."""
    for n in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:n], skip_special_tokens=True)
        hits = sorted((text.find(s), i) for i, s in enumerate(stops) if s in text)
        if hits:
            return ids[:n], text[:hits[0][0]], stops[hits[0][1]]
        if eos is not None and ids[n - 1] == eos:
            return ids[:n], text, None
    return ids, tokenizer.decode(ids, skip_special_tokens=True), None


BYTE_CASES = {  # continuation, stop strings, the text kept (written out by hand)
    "paragraph": ("Hello, world!\n\nNext part", ["\n\n"], "Hello, world!"),
    "earliest-start-wins": ("xabcde and more", ["cd", "bcd"], "xa"),  # both complete at "d"
    "first-to-complete-wins": ("xabcde and more", ["abcde", "bc"], "xa"),  # "bc" is complete first
    "three-byte-character": ("price: 5\u20ac each", ["\u20ac"], "price: 5"),
    "spans-a-character": ("price: 5\u20ac each", ["5\u20ac e"], "price: "),
    "first-token": ("\nthe rest", ["\n"], ""),
    "not-found": ("no stop here", ["###"], "no stop here~~~~"),
}


@pytest.mark.parametrize("case", list(BYTE_CASES))
def test_a_scripted_completion_is_cut_just_before_its_stop_string(case):
    """The byte tokenizer: every token is one byte, so each stop string spans several tokens (a three-byte
    character too). The completion keeps the tokens up to the stop string's last byte, its text ends just
    before it, and the row is fed nothing past that token."""
    continuation, stops, want = BYTE_CASES[case]
    tok = byte_tokenizer()
    ids = list(continuation.encode())
    model = Scripted(tok, {"prompt": ids})
    out = generate_text(model, tok, ["prompt"], max_new_tokens=len(ids) + 4, stop=stops)
    c = out.completions[0]
    assert c.text == want
    kept, text, stop_string = _reference(tok, ids + [ord("~")] * 4, stops)
    assert (c.token_ids, c.text, c.stop_string) == (kept, text, stop_string)
    if case == "not-found":
        assert c.finish_reason == "length" and len(c.token_ids) == len(ids) + 4 and c.stop_string is None
    else:
        assert c.finish_reason == "stop" and not c.stopped_at_eos
        assert tok.decode(c.token_ids).endswith(stop_string)  # ends with the stop string's last token
        assert model.calls == len(c.token_ids)  # the prompt pass and one step per token after the first
    assert out.timing.new_tokens == len(c.token_ids) and out.timing.decode_tokens == len(c.token_ids) - 1


def test_each_row_of_a_batch_ends_on_its_own_and_the_batch_when_all_have():
    """Row p ends at its end-of-text token (before its stop string), q at its stop string, r runs to the
    limit; p and q are fed pads (the end-of-text token) after their last token, and the batch then ends."""
    tok = byte_tokenizer()
    ids = list(b"ab") + [EOS] + list(b"cd\n\n")
    model = Scripted(tok, {"p": ids, "q": list(b"x\n\ny"), "r": list(b"no stop in r")})
    out = generate_text(model, tok, ["p", "q", "r"], max_new_tokens=6, stop=["\n\n"], batch_size=3)
    p, q, r = out.completions
    assert (p.token_ids, p.text, p.finish_reason, p.stopped_at_eos, p.stop_string) == (
        [97, 98, EOS], "ab", "eos", True, None)
    assert (q.token_ids, q.text, q.finish_reason, q.stop_string) == ([120, 10, 10], "x", "stop", "\n\n")
    assert (r.token_ids, r.text, r.finish_reason) == (list(b"no sto"), "no sto", "length")
    assert model.fed == [[97, 98, EOS, EOS, EOS], [120, 10, 10, EOS, EOS], list(b"no st")]
    model = Scripted(tok, {"p": ids, "q": list(b"x\n\ny")})
    out = generate_text(model, tok, ["p", "q"], max_new_tokens=10, stop=["\n\n"], batch_size=2)
    assert [c.finish_reason for c in out.completions] == ["eos", "stop"] and model.calls == 3
    # without stopping at end-of-text the token is text-free and the stop string ends the completion
    out = generate_text(Scripted(tok, {"p": ids}), tok, ["p"], max_new_tokens=10, stop=["\n\n"], stop_at_eos=False)
    assert (out.completions[0].text, out.completions[0].token_ids) == ("abcd", ids)


def test_a_stop_string_across_bpe_tokens_is_found_and_cut():
    """A byte-level BPE whose tokens are words: "o w" and ", the s" each straddle token boundaries (none of
    the tokens holds them); the completion keeps the token that completes the stop string, the text ends just
    before it."""
    tok = train_bpe_tokenizer(["hello world, the fast weight state holds the keys. " * 20] * 5, 290)
    ids = tok("hello world, the state holds", add_special_tokens=False)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[:5] == ["hello", " world", ",", " the", " state"]
    for stops, want_text, want_tokens in ((["o w"], "hell", 2), ([", the s"], "hello world", 5)):
        assert not any(s in p for s in stops for p in pieces)
        out = generate_text(Scripted(tok, {"prompt": ids}), tok, ["prompt"], max_new_tokens=len(ids), stop=stops)
        c = out.completions[0]
        assert (c.text, c.token_ids, c.finish_reason) == (want_text, ids[:want_tokens], "stop")
        assert _reference(tok, ids, stops)[:2] == (c.token_ids, c.text)


def test_streamed_pieces_hold_back_only_what_may_begin_a_stop_string():
    """After each token, ``on_text`` gets the text that is decided: a newline waits while it may begin
    "\\n\\n", and goes out with the next character when that is no newline; the stop string is never passed."""
    tok = byte_tokenizer()
    ids = list(b"ab\ncd\n\nef")
    model = Scripted(tok, {"p": ids})
    pieces = []
    out = generate_text(model, tok, ["p"], max_new_tokens=20, stop=["\n\n"],
                        on_text=lambda s: pieces.append((model.calls, s)))
    assert pieces == [(1, "a"), (2, "b"), (4, "\nc"), (5, "d")]
    assert out.completions[0].text == "ab\ncd"


@pytest.mark.parametrize("case", ["paragraph", "three-byte-character", "spans-a-character", "not-found",
                                  "long-stop"])
def test_streamed_text_is_the_final_text_and_lags_at_most_len_stop_minus_one(case):
    """Whatever was shown after token ``n`` is a prefix of the final text, and at least the whole decode of
    the first ``n`` tokens less ``len(stop) - 1`` characters (an incomplete character aside)."""
    tok = byte_tokenizer()
    if case == "long-stop":
        continuation, stops = "one two three, two three four", ["two three four", "xyz"]
    else:
        continuation, stops, _ = BYTE_CASES[case]
    ids = list(continuation.encode())
    model = Scripted(tok, {"p": ids})
    shown = []
    out = generate_text(model, tok, ["p"], max_new_tokens=len(ids) + 2, stop=stops,
                        on_text=lambda s: shown.append((model.calls, s)))
    final = out.completions[0].text
    assert "".join(s for _, s in shown) == final
    lag = max(map(len, stops)) - 1
    so_far = ""
    for n, piece in shown:
        so_far += piece
        assert final.startswith(so_far)
        whole = _reference(tok, (ids + [ord("~")] * 2)[:n], stops)[1].rstrip("\ufffd")
        assert len(so_far) >= len(whole) - lag, (n, so_far, whole)


def _byte_ids(g, n):
    """Random bytes (ASCII, the lead and continuation bytes of 2-4 byte characters, bytes no UTF-8 text
    holds) and end-of-text tokens."""
    pool = list(b"ab \n") + [0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80, 0xFF, 0x80, EOS]
    return [pool[int(i)] for i in torch.randint(0, len(pool), (n,), generator=g)]


def test_decoding_token_by_token_equals_decoding_the_whole_completion():
    """``StopText`` without stop strings: after each token its text is a prefix of the whole decode, and
    ``finish()`` leaves it equal (byte tokenizer over random bytes, broken characters included, and a BPE)."""
    g = torch.Generator().manual_seed(0)
    tok = byte_tokenizer()
    bpe = train_bpe_tokenizer(["fast weights hold the state. caf\u00e9 \u20ac5 \U0001F600 " * 20] * 5, 300)
    for tokenizer, draw in ((tok, lambda: _byte_ids(g, 40)),
                            (bpe, lambda: torch.randint(0, len(bpe), (40,), generator=g).tolist())):
        for _ in range(30):
            ids = draw()
            row = StopText(tokenizer)
            whole = tokenizer.decode(ids, skip_special_tokens=True)
            for t in ids:
                assert not row.add(t)
                assert whole.startswith(row.text)
            row.finish()
            assert row.text == whole and row.ids == ids


def _model():
    torch.manual_seed(0)
    return FalconForCausalLM(get_preset("tiny-falcon", vocab_size=257, initializer_range=0.5, rule="3A",
                                        window=3)).double().eval()


def test_a_greedy_completion_is_the_same_alone_and_among_rows_that_stop_earlier():
    """Stop strings taken from the unstopped greedy texts end two rows at different early steps while the
    others go on (fed pads): every row's tokens, text and reason equal the reference cut of its unstopped
    completion, in one batch and alone."""
    model, tok = _model(), byte_tokenizer()
    prompts = ["fast weight memory and the state", "a", "the online learner", "xyz"]
    n = 20
    free = generate_text(model, tok, prompts, max_new_tokens=n, stop_at_eos=False)
    texts = [c.text for c in free.completions]

    def early(text, at):  # two characters of the text from position `at`, away from broken characters
        i = next(i for i in range(at, len(text) - 1) if "\ufffd" not in text[i:i + 2])
        return text[i:i + 2]

    stops = [early(texts[1], 2), early(texts[2], 6)]
    want = [_reference(tok, c.token_ids, stops) for c in free.completions]
    lengths = [len(w[0]) for w in want]
    # two rows end at different steps, and another goes on to the limit
    assert lengths[1] != lengths[2] and max(lengths[1:3]) < n and n in (lengths[0], lengths[3]), lengths
    for batch_size in (4, 1):
        out = generate_text(model, tok, prompts, max_new_tokens=n, stop_at_eos=False, stop=stops,
                            batch_size=batch_size)
        got = [(c.token_ids, c.text, c.stop_string) for c in out.completions]
        assert got == want, batch_size
        assert [c.finish_reason for c in out.completions] == ["length" if w[2] is None else "stop" for w in want]
        assert out.timing.new_tokens == sum(lengths)


def test_bad_stop_strings_are_refused_by_name():
    model, tok = Scripted(byte_tokenizer(), {"p": list(b"abc")}), byte_tokenizer()
    with pytest.raises(ValueError, match=r"stop: a stop string must not be empty \(item 1\)"):
        generate_text(model, tok, ["p"], stop=["\n", ""])
    with pytest.raises(ValueError, match=r"stop: a stop string must not be empty \(item 0\)"):
        generate_text(model, tok, ["p"], stop="")
    with pytest.raises(TypeError, match="stop must hold strings, got int 3"):
        generate_text(model, tok, ["p"], stop=["a", 3])
    with pytest.raises(ValueError, match="on_text needs one prompt per batch"):
        generate_text(model, tok, ["p", "p"], batch_size=2, on_text=print)
    with pytest.raises(ValueError, match="stream gets every token.*on_text"):
        generate_text(model, tok, ["p"], stop=["b"], stream=object())
    assert model.calls == 0  # all refused before any forward pass
    out = generate_text(model, tok, ["p"], max_new_tokens=5, stop="c")  # one string: one stop string
    assert (out.completions[0].text, out.completions[0].stop_string) == ("ab", "c")


def test_text_held_back_at_the_end_of_a_completion_is_passed_on():
    """A completion that ends (by its length or its end-of-text token) on text that may begin a stop string
    passes that text on as it ends: the pieces add up to its text. ``on_text`` takes one prompt per batch,
    whatever ``batch_size`` is."""
    tok = byte_tokenizer()
    for ids, n, reason in ((list(b"ab\n"), 3, "length"), (list(b"ab\n") + [EOS], 6, "eos")):
        pieces = []
        out = generate_text(Scripted(tok, {"p": ids}), tok, ["p"], max_new_tokens=n, stop=["\n\n"], batch_size=4,
                            on_text=pieces.append)
        c = out.completions[0]
        assert (c.text, c.finish_reason, c.token_ids) == ("ab\n", reason, ids)
        assert pieces == ["a", "b", "\n"]


class Recorder:
    """A ``stream`` (``transformers.TextStreamer``'s methods) that records what it gets."""

    def __init__(self):
        self.events = []

    def put(self, ids):
        self.events.append(ids.tolist())

    def end(self):
        self.events.append("end")


def test_a_streamer_gets_each_new_token_but_the_ending_end_of_text_and_an_end_per_batch():
    """``stream.put`` gets every chosen token of the completion except the end-of-text token that ends it (which
    is no text; without stopping at end-of-text it is an ordinary token), ``stream.end`` is called as each batch
    ends, and also when a Ctrl-C stops the decoding."""
    tok = byte_tokenizer()
    model = Scripted(tok, {"p": list(b"ab") + [EOS] + list(b"cd"), "q": list(b"xyz")})
    streamer = Recorder()
    out = generate_text(model, tok, ["p", "q"], max_new_tokens=5, stream=streamer)
    assert [c.token_ids for c in out.completions] == [[97, 98, EOS], list(b"xyz~~")]
    assert streamer.events == [[97], [98], "end", [120], [121], [122], [126], [126], "end"]
    streamer = Recorder()
    generate_text(model, tok, ["p"], max_new_tokens=4, stream=streamer, stop_at_eos=False)
    assert streamer.events == [[97], [98], [EOS], [99], "end"]

    def ctrl_c(module, args, kwargs):
        if module.calls == 2:  # the third forward pass: the second decoding step
            raise KeyboardInterrupt

    model.register_forward_pre_hook(ctrl_c, with_kwargs=True)
    model.calls, streamer = 0, Recorder()
    with pytest.raises(KeyboardInterrupt):
        generate_text(model, tok, ["q"], max_new_tokens=5, stream=streamer)
    assert streamer.events == [[120], [121], "end"]


def test_rows_that_ended_are_fed_the_pad_token_and_keep_their_text():
    """A tokenizer whose pad token is not its end-of-text token (here an ordinary one, "#"): a row that ended
    is fed pads while the others go on, stays ended, and neither its tokens nor its text take the pads."""
    tok = byte_tokenizer()
    tok.pad_token = "#"
    pad = tok.pad_token_id
    assert pad == ord("#") != EOS
    model = Scripted(tok, {"p": list(b"ab") + [EOS] + list(b"cd"), "q": list(b"wxyz"), "r": list(b"no stop")})
    out = generate_text(model, tok, ["p", "q", "r"], max_new_tokens=6, stop=["yz"], batch_size=3)
    p, q, r = out.completions
    assert (p.token_ids, p.text, p.finish_reason) == ([97, 98, EOS], "ab", "eos")
    assert (q.token_ids, q.text, q.finish_reason) == (list(b"wxyz"), "wx", "stop")
    assert (r.token_ids, r.text, r.finish_reason) == (list(b"no sto"), "no sto", "length")
    assert model.fed == [[97, 98, EOS, pad, pad], list(b"wxyz") + [pad], list(b"no st")]
    model = Scripted(tok, {"p": list(b"ab") + [EOS] + list(b"cd"), "q": list(b"wxyz")})
    out = generate_text(model, tok, ["p", "q"], max_new_tokens=10, stop=["yz"], batch_size=2)
    assert model.calls == 4 and model.fed == [[97, 98, EOS], list(b"wxy")]  # the batch ends at "z"
