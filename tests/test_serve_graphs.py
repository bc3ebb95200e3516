"""Decoding steps replayed from a CUDA graph (``serve.graphs``) give the eager steps' tokens and logits."""
import contextlib
import weakref
from dataclasses import fields

import pytest
import torch
from test_generation import NORMALIZED_READ

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.ops import FalconState
from falcon_fwa.serve import generate_text, generation, graphs
from falcon_fwa.serve.graphs import GraphedDecoder, graphable

CUDA = torch.cuda.is_available()
CASES = {"falcon-1A": ("falcon", {}), "falcon-1": ("falcon", {"rule": "1"}),
         "falcon-3A": ("falcon", {"rule": "3A", "window": 3}), "falcon-2": ("falcon", {"rule": "2"}),
         "falcon-3A-normalized-read": ("falcon", NORMALIZED_READ),
         "mamba2": ("mamba2", {}), "retnet": ("retnet", {}), "gated_deltanet": ("gated_deltanet", {})}


def _model(mixer, overrides, device="cpu"):
    torch.manual_seed(0)
    config = get_preset(f"tiny-{mixer}", vocab_size=320, initializer_range=0.5, **overrides)
    return FalconForCausalLM(config).to(device).eval()


def test_on_a_cpu_steps_are_eager_and_the_reason_is_recorded():
    model = _model("falcon", {})
    assert graphable(model, torch.device("cpu")) == (False, "CUDA graphs need a CUDA device")
    assert graphable(_model("transformer", {}), torch.device("cuda"))[0] is False
    out = generate_text(model, byte_tokenizer(), ["state"], max_new_tokens=4, stop_at_eos=False)
    assert out.timing.decode_mode == "eager" and "CUDA" in out.timing.graph_note
    assert out.timing.graph_capture_s == 0  # nothing was recorded
    with pytest.raises(ValueError, match="cuda_graphs=True is not possible"):
        generate_text(model, byte_tokenizer(), ["state"], max_new_tokens=4, cuda_graphs=True)
    with torch.inference_mode():  # recording itself: refused before the cache is touched
        cache = model(input_ids=torch.tensor([[3, 4]]), use_cache=True, logits_to_keep=1).past_key_values
        seen = cache.seen
        with pytest.raises(NotImplementedError, match="CUDA graphs need a CUDA device"):
            GraphedDecoder(model, cache, 1)
    assert cache.seen is seen and cache.num_positions == 2


def test_command_refuses_cuda_graphs_on_a_cpu(tmp_path, capsys):
    from falcon_fwa.cli import main

    model = _model("falcon", {})
    model.save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "x", "--device", "cpu",
                 "--cuda-graphs", "on"]) == 2
    assert "--cuda-graphs on needs a CUDA device" in capsys.readouterr().err


def test_command_refuses_cuda_graphs_for_a_transformer_before_loading_it(tmp_path, capsys, monkeypatch):
    from falcon_fwa.cli import main

    _model("transformer", {}).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("falcon_fwa.serve.generate_cli.load_model", no_load)
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "x", "--device", "cuda",
                 "--cuda-graphs", "on"]) == 2
    assert capsys.readouterr().err.startswith("falcon-fwa generate: error: --cuda-graphs on: the Transformer")


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_graphed_steps_equal_eager_steps(case, dtype):
    """Step by step over a left-padded prefilled cache: the graph's logits are the eager call's, and
    the cache it updated in place continues eagerly as the eager cache does."""
    mixer, overrides = CASES[case]
    model = _model(mixer, overrides, "cuda").to(dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (3, 9), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :2] = 0
    with torch.inference_mode():
        outs = [model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1) for _ in range(2)]
        eager_cache, graph_cache = (getattr(o, "cache", None) or o.past_key_values for o in outs)
        decoder = GraphedDecoder(model, graph_cache, 3)
        token = outs[0].logits[:, -1].argmax(-1)
        for _ in range(12):
            want = model(input_ids=token[:, None], past_key_values=eager_cache, use_cache=True,
                         logits_to_keep=1).logits[:, -1]
            got = decoder.step(token)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            token = want.argmax(-1)
        assert graph_cache.num_positions == eager_cache.num_positions == 9 + 12
        assert torch.equal(graph_cache.seen, eager_cache.seen)
        nxt = token[:, None]
        a = model(input_ids=nxt, past_key_values=eager_cache, use_cache=True).logits
        b = model(input_ids=nxt, past_key_values=graph_cache, use_cache=True).logits
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_generate_text_with_graphs_equals_eager_and_falls_back_for_the_transformer():
    tok = byte_tokenizer()
    prompts = ["fast weights", "a state", "the online learner reads"]
    model = _model("falcon", {"rule": "3A", "window": 3}, "cuda")
    kw = dict(max_new_tokens=40, batch_size=3, stop_at_eos=False)
    graphed = generate_text(model, tok, prompts, cuda_graphs=True, **kw)
    eager = generate_text(model, tok, prompts, cuda_graphs=False, **kw)
    assert graphed.timing.decode_mode == "cuda graph" and eager.timing.decode_mode == "eager"
    assert [c.token_ids for c in graphed.completions] == [c.token_ids for c in eager.completions]
    assert len(set(graphed.completions[0].token_ids)) > 4
    out = generate_text(_model("transformer", {}, "cuda"), tok, prompts, **kw)
    assert out.timing.decode_mode == "eager" and "key/value" in out.timing.graph_note


# --- the Python side of GraphedDecoder on a CPU ------------------------------------------------------------------

def _cache_tensors(cache):
    out = [cache.seen]
    for layer in cache.layers:
        if layer.state is not None:
            out += [t for f in fields(FalconState) if isinstance(t := getattr(layer.state, f.name), torch.Tensor)]
        out += list(layer.conv.values())
    return out


@pytest.fixture
def cpu_graphs(monkeypatch):
    """Stand-ins for the CUDA graph API that ``GraphedDecoder`` calls, so that its Python side (what it records,
    copies back and puts back) runs on a CPU. Recording runs the step's Python and then puts the cache's values
    back, as a capture, which runs no kernel, leaves them; ``replay`` runs the recorded step again on the tensors
    it was recorded with (whatever the cache holds by then), under inference mode, as kernels know no autograd."""
    step_in_place = graphs.GraphedDecoder._step_in_place

    def objects(cache):
        return cache.seen, [(layer.state, dict(layer.conv)) for layer in cache.layers]

    def point(cache, objs):
        cache.seen = objs[0]
        for layer, (state, conv) in zip(cache.layers, objs[1]):
            layer.state, layer.conv = state, dict(conv)

    class Graph:
        def replay(self):
            d = self.decoder
            now, n = objects(d.cache), d.cache.num_positions
            point(d.cache, self.recorded)
            with torch.inference_mode():
                d.logits.copy_(step_in_place(d))
            point(d.cache, now)
            d.cache.num_positions = n

    def record(decoder):
        decoder.graph.decoder, decoder.graph.recorded = decoder, objects(decoder.cache)
        tensors = _cache_tensors(decoder.cache)
        before = [t.clone() for t in tensors]
        try:
            return step_in_place(decoder)
        finally:
            for t, value in zip(tensors, before):
                t.copy_(value)

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(graphs.GraphedDecoder, "_step_in_place", record)
    for module in (graphs, generation):
        monkeypatch.setattr(module, "graphable", lambda model, device: (True, ""))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph: contextlib.nullcontext())


def test_cpu_stand_ins_give_the_eager_tokens(cpu_graphs):
    """The stand-ins themselves: graphed steps (rows ending at end-of-text, a last smaller batch) draw the eager
    tokens."""
    model, tok = _model("falcon", {"rule": "3A", "window": 3}), byte_tokenizer()
    prompts = ["fast weights", "a state", "the online learner reads", "x", "yz"]
    kw = dict(max_new_tokens=24, batch_size=2, temperature=2.0, seed=1)
    graphed = generate_text(model, tok, prompts, cuda_graphs=True, **kw)
    eager = generate_text(model, tok, prompts, cuda_graphs=False, **kw)
    assert graphed.timing.decode_mode == "cuda graph" and graphed.timing.graphed_batches == 3
    assert [c.token_ids for c in graphed.completions] == [c.token_ids for c in eager.completions]
    stopped = [c.stopped_at_eos for c in eager.completions]
    assert any(stopped) and not all(stopped)  # rows that ended while the others of their batch went on


def test_the_graph_keeps_no_prompt_activations_alive(cpu_graphs):
    """A prompt pass without padding leaves the cache's short-convolution buffers and last keys as views of its
    [B, T, ...] activations. The graph writes into the cache's tensors for as long as it is replayed, so these
    views kept the activations of the whole prompt alive through the decoding (eager steps replace them)."""
    model = _model("falcon", {})
    with torch.inference_mode():
        cache = model(input_ids=torch.randint(0, 256, (1, 600)), use_cache=True, logits_to_keep=1).past_key_values
        needed = sum(t.numel() * t.element_size() for t in _cache_tensors(cache))
        assert sum(t.untyped_storage().nbytes() for t in _cache_tensors(cache)) > 50 * needed  # the views
        decoder = GraphedDecoder(model, cache, 1)
        decoder.step(torch.tensor([3]))
    assert sum(t.untyped_storage().nbytes() for t in _cache_tensors(cache)) == needed


def test_a_step_after_the_cache_was_continued_eagerly_is_refused(cpu_graphs):
    """An eager call replaces the cache's tensors; the graph would go on reading and writing the old ones."""
    model = _model("falcon", {})
    ids = torch.randint(1, 256, (2, 5))
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        decoder = GraphedDecoder(model, cache, 2)
        decoder.step(ids[:, 0])
        model(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="outside this GraphedDecoder"):
            decoder.step(ids[:, 1])


def test_a_failed_recording_puts_the_cache_back_and_decoding_goes_on_eagerly(cpu_graphs, monkeypatch):
    def fails_after_the_step(decoder):  # the cache's objects replaced by the step's, as a failed capture leaves them
        decoder._forward(decoder.cache)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.GraphedDecoder, "_step_in_place", fails_after_the_step)
    model, tok = _model("falcon", {}), byte_tokenizer()
    prompts = ["fast weights", "a"]
    kw = dict(max_new_tokens=12, batch_size=2, stop_at_eos=False)
    auto = generate_text(model, tok, prompts, **kw)
    eager = generate_text(model, tok, prompts, cuda_graphs=False, **kw)
    assert auto.timing.decode_mode == "eager" and "recording the decoding step failed" in auto.timing.graph_note
    assert [c.token_ids for c in auto.completions] == [c.token_ids for c in eager.completions]
    with pytest.raises(RuntimeError, match="capturing"):
        generate_text(model, tok, prompts, cuda_graphs=True, **kw)


def test_a_batch_cache_is_freed_before_the_next_prompt_pass():
    """generate_text held each batch's cache (and graph) through the next batch's prompt pass: with many batches
    the peak memory held two batches' states."""
    model, tok = _model("falcon", {}), byte_tokenizer()
    forward, caches, alive = model.forward, [], []

    def spy(**kwargs):
        if kwargs.get("past_key_values") is not None:  # a decoding step
            return forward(**kwargs)
        alive.append([ref() is not None for ref in caches])  # as a prompt pass begins
        out = forward(**kwargs)
        caches.append(weakref.ref(generation._cache_of(out)))
        return out

    model.forward = spy
    generate_text(model, tok, ["a", "b", "c"], max_new_tokens=3, stop_at_eos=False)
    assert alive == [[], [False], [False, False]]


def test_stop_strings_end_rows_alike_with_graphed_and_eager_steps(cpu_graphs, monkeypatch):
    """Stop strings are looked for on the host, between the steps: with graphed steps (the CPU stand-ins) the rows
    end at the eager steps' tokens and texts, and a batch whose rows have all ended replays no more steps."""
    model, tok = _model("falcon", {"rule": "3A", "window": 3}), byte_tokenizer()
    prompts = ["fast weights", "a state", "the online learner reads"]
    kw = dict(max_new_tokens=24, batch_size=3, stop_at_eos=False)
    texts = [c.text for c in generate_text(model, tok, prompts, cuda_graphs=False, **kw).completions]
    # two characters of each row's text (none broken), from a different place in each
    stops = [next(t[i:i + 2] for i in range(at, len(t) - 1) if "\ufffd" not in t[i:i + 2])
             for t, at in zip(texts, (2, 5, 8))]
    replays, step = [], graphs.GraphedDecoder.step
    monkeypatch.setattr(graphs.GraphedDecoder, "step", lambda self, t: replays.append(1) or step(self, t))
    graphed = generate_text(model, tok, prompts, cuda_graphs=True, stop=stops, **kw)
    eager = generate_text(model, tok, prompts, cuda_graphs=False, stop=stops, **kw)
    assert graphed.timing.decode_mode == "cuda graph"
    got, want = ([(c.token_ids, c.text, c.finish_reason) for c in out.completions] for out in (graphed, eager))
    assert got == want and all(reason == "stop" for _, _, reason in want)
    longest = max(len(ids) for ids, _, _ in want)
    assert longest < 24 and len(replays) == longest - 1
    assert len({len(ids) for ids, _, _ in want}) > 1  # the rows ended at different steps


def test_graphed_steps_leave_the_cache_counting_what_eager_steps_count(cpu_graphs):
    """Recording runs no step on the cache and each replay is one: after the steps the graphed cache counts the
    columns (``num_positions``, which ``generate()`` slices its inputs by) and each row's tokens as the eager
    cache does, and goes on eagerly to the same logits."""
    model = _model("falcon", {"rule": "3A", "window": 3})
    ids = torch.randint(1, 256, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.inference_mode():
        caches = [model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1).past_key_values
                  for _ in range(2)]
        decoder = GraphedDecoder(model, caches[0], 2)
        assert caches[0].num_positions == 5 and caches[0].seen.tolist() == [5, 3]
        for t in range(3):
            graphed = decoder.step(ids[:, t]).clone()
            eager = model(input_ids=ids[:, t:t + 1], past_key_values=caches[1], use_cache=True).logits[:, -1]
            assert torch.equal(graphed, eager), t
        for cache in caches:
            assert cache.num_positions == 8 and cache.get_seq_length() == 8 and cache.seen.tolist() == [8, 6]
        a, b = (model(input_ids=ids[:, 3:5], past_key_values=cache, use_cache=True).logits for cache in caches)
    assert torch.equal(a, b)


def test_decoding_time_leaves_out_the_recording_and_one_new_token_records_nothing(cpu_graphs, monkeypatch):
    """On a clock that advances one second per forward pass: ``prefill_s`` is the prompt pass, ``decode_s`` the
    decoding steps (one replay per token after the first), ``graph_capture_s`` the rest (warm-up and recording).
    With ``max_new_tokens=1`` there is no step to replay, and nothing is recorded."""
    model, tok = _model("falcon", {}), byte_tokenizer()
    clock = [0.0]
    model.register_forward_pre_hook(lambda *args: clock.__setitem__(0, clock[0] + 1.0))
    monkeypatch.setattr(generation, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: clock[0])}))
    records, init = [], graphs.GraphedDecoder.__init__
    monkeypatch.setattr(graphs.GraphedDecoder, "__init__", lambda self, *a: records.append(1) or init(self, *a))
    t = generate_text(model, tok, ["fast", "weights"], max_new_tokens=5, stop_at_eos=False).timing
    assert (t.batches, t.graphed_batches, t.decode_mode, len(records)) == (2, 2, "cuda graph", 2)
    assert (t.prefill_s, t.decode_s, t.decode_tokens) == (2.0, 8.0, 8)
    assert t.graph_capture_s == clock[0] - 10.0 > 0
    records.clear()
    clock[0] = 0.0
    out = generate_text(model, tok, ["fast", "weights"], max_new_tokens=1, stop_at_eos=False)
    assert records == [] and out.timing.graphed_batches == 0 and out.timing.graph_capture_s == 0
    assert (out.timing.prefill_s, out.timing.decode_s, clock[0]) == (2.0, 0.0, 2.0)


def test_command_graphs_the_steps_unless_told_off_and_reports_its_settings(tmp_path, cpu_graphs):
    """``falcon-fwa generate`` with the CPU stand-ins: ``--cuda-graphs auto`` replays the steps from a graph,
    ``off`` runs them eagerly, with the same sampled tokens; ``--json`` keeps the option and says whether the
    tokens were greedy."""
    import json

    from falcon_fwa.cli import main

    _model("falcon", {"rule": "3A", "window": 3}).save_pretrained(tmp_path / "m")
    byte_tokenizer().save_pretrained(tmp_path / "m")
    reports = {}
    for option, temperature in (("auto", "1.5"), ("off", "1.5"), ("off", "0")):
        out = tmp_path / f"{option}{temperature}.json"
        assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "fast", "--device", "cpu", "--seed", "1",
                     "--max-new-tokens", "6", "--no-stop-at-eos", "--temperature", temperature, "--cuda-graphs", option,
                     "--json", str(out)]) == 0
        reports[option, temperature] = json.loads(out.read_text())
    for (option, temperature), rep in reports.items():
        assert rep["timing"]["decode_mode"] == ("cuda graph" if option == "auto" else "eager")
        assert rep["settings"]["cuda_graphs"] == option and rep["settings"]["greedy"] == (temperature == "0")
    sampled = [reports[key]["completions"][0]["token_ids"] for key in (("auto", "1.5"), ("off", "1.5"))]
    assert sampled[0] == sampled[1] != reports["off", "0"]["completions"][0]["token_ids"]
