"""Promises of the tokenizer settings, the graphed decoding step and the stop strings, each checked against a
reference written out here:

- ``same_spec``: a tokenizer folder recorded by its absolute path is the setting its relative spellings name, while
  it is there and once it is deleted whole; a file now at that path is not the folder it was;
- ``is_tokenizer_file``: the files its docstring lists (``*.tiktoken`` among them) and not a model's files beside
  them; of the ``additional_chat_templates`` folder only the ``*.jinja`` files;
- ``graphable``: no device but CUDA (a CPU, ``meta``, ``mps``) is graphable;
- ``GraphedDecoder`` (on the CPU stand-ins of ``test_serve_graphs``): recording runs two eager warm-up steps on a
  copy of the cache, then the step on the cache itself; a recording that fails puts back the cache's own ``seen``
  tensor (its token counts unchanged), its states' and buffers' values and its column count, and the cache
  continues eagerly to the logits of a cache never recorded; a step that changes the shape of a cache tensor is
  refused by name;
- ``StopText``: a decoder that cleans up spaces ("do n't" becomes "don't") can make a stop string appear across
  the space it takes out, before the characters the old and new texts begin with alike; a space at the first
  character of the text is held as one later in it, since the next token may take it out; and a token whose text
  changes the text of the tokens before it, back into the decoded window's context, gives the whole decode. The
  reference is the whole decode of each prefix of the tokens, with ``str.find`` for the stop string.
"""
import os

import pytest
import test_serve_graphs
import torch

from falcon_fwa.data.tokenizer import is_tokenizer_file, same_spec
from falcon_fwa.serve import graphs
from falcon_fwa.serve.graphs import GraphedDecoder
from falcon_fwa.serve.stops import StopText

pytestmark = pytest.mark.usefixtures("one_thread")

cpu_graphs = test_serve_graphs.cpu_graphs  # the stand-ins for the CUDA graph API, as a fixture of this module


# --- tokenizer settings ----------------------------------------------------------------------------------------------

def test_a_recorded_folder_is_its_relative_spellings_while_there_and_once_deleted_not_as_a_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recorded = os.path.join(str(tmp_path), "tok")
    os.mkdir(recorded)
    assert same_spec(recorded, "tok") and same_spec(recorded, "./tok/")  # the folder, spelt from here
    os.rmdir(recorded)
    assert same_spec(recorded, "tok") and same_spec(recorded, "./tok/")  # deleted whole: the setting it was
    assert not same_spec(recorded, "byte") and not same_spec(recorded, "bpe:300") and not same_spec(recorded, "other")
    with open(recorded, "w") as f:  # a file now at the folder's path is no folder, and not the one recorded
        f.write("{}")
    assert not same_spec(recorded, "tok")


@pytest.mark.parametrize("name, read", [
    ("additional_chat_templates/plain.jinja", True),
    ("additional_chat_templates/README.md", False),
    ("additional_chat_templates/plain.json", False),
    ("other/plain.jinja", False),
    ("chat_template.jinja", True),
    ("cl100k_base.tiktoken", True), ("spiece.model", True), ("tokenizer.model.v3", True), ("vocab-src.json", True),
    ("tokenizer.2.json", True), ("merges.txt", True),
    ("model.safetensors", False), ("config.json", False), ("generation_config.json", False), ("README.md", False),
])
def test_the_files_a_tokenizer_folder_load_reads(name, read):
    """The files the docstring of ``is_tokenizer_file`` lists, and a model's files beside them, which it does not;
    of the ``additional_chat_templates`` folder only ``*.jinja`` files."""
    assert is_tokenizer_file(name) is read


# --- graphed decoding ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", "meta", "mps"])
def test_no_device_but_cuda_is_graphable(device):
    model = test_serve_graphs._model("falcon", {})
    assert graphs.graphable(model, torch.device(device)) == (False, "CUDA graphs need a CUDA device")


# --- graphed decoding on the CPU stand-ins ---------------------------------------------------------------------------

def _prompt_cache(model, ids):
    return model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values


@pytest.mark.usefixtures("cpu_graphs")
def test_recording_warms_up_twice_on_a_copy_then_records_on_the_cache():
    model = test_serve_graphs._model("falcon", {})
    ids = torch.randint(1, 256, (2, 5), generator=torch.Generator().manual_seed(0))
    calls = []

    def spy(module, args, kwargs):
        cache = kwargs.get("past_key_values")
        calls.append(("cache" if cache is recorded else "copy", cache.seen.tolist()))

    with torch.inference_mode():
        recorded = _prompt_cache(model, ids)
        hook = model.register_forward_pre_hook(spy, with_kwargs=True)
        try:
            GraphedDecoder(model, recorded, 2)
        finally:
            hook.remove()
    # the first warm-up step starts from the prompt's counts, the second from the first's; the step recorded
    # starts from the cache's own counts, which recording leaves as they were
    assert calls == [("copy", [5, 5]), ("copy", [6, 6]), ("cache", [5, 5])]
    assert recorded.seen.tolist() == [5, 5] and recorded.num_positions == 5


@pytest.mark.usefixtures("cpu_graphs")
def test_a_failed_recording_puts_back_the_caches_own_tensors_and_counts(monkeypatch):
    def fails_after_the_step(decoder):  # the cache's objects replaced by the step's, as a failed capture leaves them
        decoder._forward(decoder.cache)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.GraphedDecoder, "_step_in_place", fails_after_the_step)
    model = test_serve_graphs._model("falcon", {"rule": "3A", "window": 3})
    ids = torch.randint(1, 256, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        cache, fresh = _prompt_cache(model, ids[:, :5]), _prompt_cache(model, ids[:, :5])
        seen, before = cache.seen, [t.clone() for t in test_serve_graphs._cache_tensors(cache)]
        with pytest.raises(RuntimeError, match="capturing"):
            GraphedDecoder(model, cache, 2)
        assert cache.seen is seen and cache.seen.tolist() == [5, 5] and cache.num_positions == 5
        after = test_serve_graphs._cache_tensors(cache)
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
        got = model(input_ids=ids[:, 5:], past_key_values=cache, use_cache=True).logits
        want = model(input_ids=ids[:, 5:], past_key_values=fresh, use_cache=True).logits
    assert torch.equal(got, want)
    assert cache.seen.tolist() == fresh.seen.tolist() == [6, 6]


@pytest.mark.usefixtures("cpu_graphs")
def test_a_step_that_changes_a_cache_tensors_shape_is_refused_by_name(monkeypatch):
    """A step that leaves a cache tensor of another shape (here the rows' token counts, doubled) cannot be replayed
    on the recorded tensors: recording refuses it, naming both shapes, and puts the cache back."""
    forward = graphs.GraphedDecoder._forward

    def doubles_seen(self, cache):
        logits = forward(self, cache)
        if cache is self.cache:
            cache.seen = torch.cat([cache.seen, cache.seen])
        return logits

    monkeypatch.setattr(graphs.GraphedDecoder, "_forward", doubles_seen)
    model = test_serve_graphs._model("falcon", {})
    with torch.inference_mode():
        cache = _prompt_cache(model, torch.randint(1, 256, (2, 4), generator=torch.Generator().manual_seed(2)))
        with pytest.raises(NotImplementedError, match=r"^a cache tensor changed in a decoding step \(\(2,\) -> "
                                                      r"\(4,\)\): not graphable$"):
            GraphedDecoder(model, cache, 2)
    assert cache.seen.tolist() == [4, 4] and cache.num_positions == 4


# --- stop strings ----------------------------------------------------------------------------------------------------

class CleansUpSpaces:
    """Pieces of text by id; a decode joins them and takes out the space before "n't" and before ".", as a decoder
    that cleans up spaces does: "do n" then "don't" once "'t" comes, "y x " then "y x." once "." comes."""

    clean_up_tokenization_spaces = True
    PIECES = ["do", " n", "'t", " x", " .", "y", " ", "."]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids).replace(" n't", "n't").replace(" .", ".")


class Shout:
    """Letters a-z (ids 0-25) and a token (26) that writes "!" and turns every letter before it upper-case."""

    clean_up_tokenization_spaces = False

    def decode(self, ids, skip_special_tokens=True):
        out = []
        for i in ids:
            out = [c.upper() for c in out] + ["!"] if i == 26 else out + [chr(ord("a") + i)]
        return "".join(out)


def _reference(tok, ids, stop):
    """(tokens kept, text): the shortest prefix whose whole decode holds ``stop``, cut at its first occurrence."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if stop in text:
            return ids[:n], text[:text.find(stop)]
    return ids, tok.decode(ids)


@pytest.mark.parametrize("ids, stop", [([0, 1, 2, 3], "on"), ([0, 1, 2, 3], "don"), ([5, 3, 6, 7, 3], "x.")])
def test_a_stop_string_across_a_space_the_decoder_takes_out_is_found(ids, stop):
    tok = CleansUpSpaces()
    kept, text = _reference(tok, ids, stop)
    assert len(kept) < len(ids)  # the stop string is there, before the last token
    row = StopText(tok, (stop,))
    ended = [row.add(t) for t in ids[:len(kept)]]
    assert ended == [False] * (len(kept) - 1) + [True]
    assert (row.ids, row.text, row.stop_string) == (kept, text, stop)


def test_a_token_that_changes_the_text_of_the_context_before_the_window_gives_the_whole_decode():
    tok = Shout()
    ids = [i % 26 for i in range(3 * StopText.WINDOW)] + [26] + [23, 24, 26, 25]
    row = StopText(tok)
    for n, token in enumerate(ids, 1):
        assert not row.add(token)
        assert row.text == tok.decode(ids[:n]), n
    assert row.text == "ABCDEFGHIJKLMNOPQRSTUVWXYZABCDEFGHIJKLMNOPQRSTUV!XY!z"


def test_a_space_opening_the_text_is_held_until_the_next_token_leaves_it():
    """The text " " (a space at its first character, among its last three) is held, not handed over: the next
    token "." makes the decode "." (" ." cleaned up), and the streamed pieces add up to the text shown."""
    tok = CleansUpSpaces()
    row, pieces, held = StopText(tok), [], []
    for token in (6, 7, 6, 3):  # " ", ".", " ", " x": ".", ". ", ".  x"
        assert not row.add(token)
        held.append(row.held())
        pieces.append(row.take())
    row.finish()
    pieces.append(row.take())
    assert [tok.decode([6, 7, 6, 3][:n]) for n in (1, 2, 3, 4)] == [" ", ".", ". ", ".  x"]
    assert held == [1, 0, 1, 2]  # the last space among the last three characters, and what follows it
    assert pieces == ["", ".", "", " ", " x"] and "".join(pieces) == row.text == ".  x"
