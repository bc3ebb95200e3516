"""``generate_text(stream=...)`` with the streamers of ``transformers``, and ``stop`` given as a generator.

``transformers.TextStreamer(tokenizer, skip_prompt=True)`` (the usual way to show only the new text) takes the first
``put()`` it gets, and the first after each ``end()``, as the prompt, as ``model.generate`` sends it, and drops it.
``generate_text`` sends each batch's prompt ids first to a streamer with ``skip_prompt``, so that the dropped
``put()`` is the prompt and not the first new token."""
import pytest
from test_serve_stops import Scripted
from transformers import TextStreamer

from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.serve import generate_text

pytestmark = pytest.mark.usefixtures("one_thread")


class Shown(TextStreamer):
    """A ``TextStreamer`` that keeps the text it would print, one string per batch (``end()``)."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **kwargs)
        self.batches, self.current = [], ""

    def on_finalized_text(self, text, stream_end=False):
        self.current += text
        if stream_end:
            self.batches.append(self.current)
            self.current = ""


@pytest.mark.parametrize("skip_prompt", [True, False])
def test_a_text_streamer_shows_each_batchs_whole_completion(skip_prompt):
    """Two prompts in batches of one, each continued by known bytes (the scripted source's one-hot logits): the
    streamer shows each completion whole, its first token included, and no prompt."""
    tok = byte_tokenizer()
    model = Scripted(tok, {"p": list(b"hello world"), "q": list(b"fast state")})
    streamer = Shown(tok, skip_prompt=skip_prompt)
    out = generate_text(model, tok, ["p", "q"], max_new_tokens=10, stream=streamer)
    assert [c.text for c in out.completions] == ["hello worl", "fast state"]
    assert streamer.batches == ["hello worl", "fast state"]
    assert [c.token_ids for c in out.completions] == [list(b"hello worl"), list(b"fast state")]


def test_stop_strings_given_as_a_generator_end_the_completion():
    """``stop`` read once: a generator of stop strings ends the completion as the same strings in a list do."""
    tok = byte_tokenizer()
    model = Scripted(tok, {"p": list(b"hello world")})
    want = generate_text(model, tok, ["p"], max_new_tokens=10, stop=["o w"]).completions[0]
    got = generate_text(model, tok, ["p"], max_new_tokens=10, stop=(s for s in ["o w"])).completions[0]
    assert (got.text, got.finish_reason, got.stop_string) == (want.text, want.finish_reason, want.stop_string)
    assert (got.text, got.finish_reason, got.stop_string) == ("hell", "stop", "o w")
