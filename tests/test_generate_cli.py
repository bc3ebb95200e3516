"""``falcon-fwa generate``: greedy decoding through the O(1) cache equals recomputing the whole prefix,
left-padded batches equal single prompts, seeded sampling, option checks, streaming."""
import json

import pytest
import torch
from conftest import tiny_lm_recipe

from falcon_fwa import cli
from falcon_fwa.eval.perplexity import load_model
from falcon_fwa.models import FalconForCausalLM


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``trained``: a tiny Falcon trained for 2 steps through the ``train`` command and exported (its next-token
    distributions are close to uniform, and its greedy output one repeated token). ``peaky``: the same folder
    with weights redrawn at ``initializer_range=1.0`` (seed 0), whose greedy continuations vary from token to
    token with a clear margin between the two largest logits, so a cache that drifted would change them."""
    from falcon_fwa.train.cli import main

    tmp = tmp_path_factory.mktemp("gen")
    assert main(["--config", tiny_lm_recipe(tmp), "--set", "train.steps=2"]) == 0
    trained = tmp / "run" / "model"
    model, tok = load_model(str(trained))
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.initializer_range = 1.0
    torch.manual_seed(0)
    FalconForCausalLM(config).save_pretrained(tmp / "peaky")
    tok.save_pretrained(tmp / "peaky")
    return {"trained": str(trained), "peaky": str(tmp / "peaky"), "tmp": tmp}


def _generate(folders, model, *options):
    """Run the command through the ``falcon-fwa`` entry point; its ``--json`` report."""
    out = folders["tmp"] / "out.json"
    assert cli.main(["generate", "--model", folders[model], "--device", "cpu", "--json", str(out), *options]) == 0
    return json.loads(out.read_text())


def _tokens(report):
    return [c["token_ids"] for c in report["completions"]]


PROMPTS = ["the state", "fast weight memory", "a"]


def test_greedy_equals_recomputing_the_whole_prefix_without_a_cache(folders):
    rep = _generate(folders, "peaky", *[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "24",
                    "--no-stop-at-eos")
    model, tok = load_model(folders["peaky"])
    for prompt, c in zip(PROMPTS, rep["completions"]):
        assert c["prompt_ids"] == [tok.eos_token_id, *prompt.encode()]  # the byte tokenizer; end-of-text first
        seq = torch.tensor([c["prompt_ids"]])
        with torch.no_grad():
            for _ in range(24):
                logits = model(input_ids=seq, use_cache=False).logits[:, -1, :len(tok)]
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], 1)
        reference = seq[0, len(c["prompt_ids"]):].tolist()
        assert len(set(reference)) > 4  # a varied continuation, not one repeated token
        assert c["token_ids"] == reference
        assert c["text"] == tok.decode(reference, skip_special_tokens=True)


def test_a_left_padded_batch_equals_each_prompt_alone_and_the_timings_add_up(folders):
    args = [*[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "16", "--no-stop-at-eos"]
    alone = _generate(folders, "peaky", *args)
    batch = _generate(folders, "peaky", *args, "--batch-size", "3")
    assert len({len(c["prompt_ids"]) for c in batch["completions"]}) == 3  # different lengths: padding happened
    assert _tokens(batch) == _tokens(alone)
    t = batch["timing"]
    assert t["batches"] == 1 and alone["timing"]["batches"] == 3
    assert t["prompt_tokens"] == sum(len(c["prompt_ids"]) for c in batch["completions"])
    assert t["new_tokens"] == 48 and t["decode_tokens"] == 45  # the first token of each row comes with the prefill
    assert t["prefill_s"] > 0 and t["decode_s"] > 0
    assert t["decode_tokens_per_s"] == pytest.approx(45 / t["decode_s"])
    assert t["peak_gpu_memory_bytes"] is None  # CPU
    assert batch["settings"]["batch_size"] == 3 and batch["provenance"]["options"]["batch_size"] == 3


def test_sampling_is_reproducible_by_seed(folders):
    args = ["--prompt", "the state", "--prompt", "key", "--temperature", "1.0", "--max-new-tokens", "32",
            "--no-stop-at-eos", "--batch-size", "2"]
    first = _tokens(_generate(folders, "trained", *args, "--seed", "1"))
    again = _tokens(_generate(folders, "trained", *args, "--seed", "1"))
    other = _tokens(_generate(folders, "trained", *args, "--seed", "2"))
    assert first == again
    # near-uniform over 257 tokens: two seeds agreeing on all 64 draws is out of the question
    assert first != other and first[0] != other[0] and first[1] != other[1]
    assert first[0] != first[1]


def test_a_subnormal_temperature_samples_the_argmax_under_flush_to_zero():
    """1e-45 is subnormal in float32: with flush-to-zero on (``torch.set_flush_denormal(True)``, or left on by a
    library such as torch 2.4's compiled CPU code) it divided the logits as 0, and the draw failed on NaN
    probabilities. It is taken in float64 there, and the draw is the argmax, as without the flag."""
    from falcon_fwa.serve.generation import _choose

    logits = torch.randn(3, 257, generator=torch.Generator().manual_seed(0))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        got = _choose(logits, 1e-45, 0, 1.0, torch.Generator().manual_seed(1))
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(got, logits.argmax(-1))


def test_a_tiny_temperature_samples_the_greedy_tokens(folders):
    """``logits / 1e-45`` overflows; taken from the largest logit it leaves the argmax alone."""
    args = ["--prompt", "the state", "--prompt", "gate", "--max-new-tokens", "16", "--no-stop-at-eos"]
    greedy = _tokens(_generate(folders, "peaky", *args))
    assert _tokens(_generate(folders, "peaky", *args, "--temperature", "1e-45", "--seed", "3")) == greedy


def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_tokens(folders):
    args = ["--prompt", "the state", "--prompt", "gate", "--max-new-tokens", "16", "--no-stop-at-eos"]
    greedy = _tokens(_generate(folders, "peaky", *args))
    top_k = _tokens(_generate(folders, "peaky", *args, "--temperature", "1.5", "--top-k", "1", "--seed", "3"))
    top_p = _tokens(_generate(folders, "peaky", *args, "--temperature", "1.5", "--top-p", "1e-6", "--seed", "3"))
    sampled = _tokens(_generate(folders, "peaky", *args, "--temperature", "1.5", "--seed", "3"))
    assert top_k == greedy and top_p == greedy
    assert sampled != greedy  # the two filters, not the temperature, made the draws greedy


@pytest.mark.parametrize("options, named", [
    ([], "--prompt"),
    (["--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["--prompt", "a", "--top-p", "1.5"], "--top-p"),
    (["--prompt", "a", "--top-p", "0"], "--top-p"),
    (["--prompt", "a", "--top-k", "-1"], "--top-k"),
    (["--prompt", "a", "--temperature", "-0.5"], "--temperature"),
    (["--prompt", "a", "--temperature", "inf"], "--temperature"),
    (["--prompt", "a", "--batch-size", "0"], "--batch-size"),
    (["--prompt", "a", "--seed", str(2 ** 64)], "--seed"),
    (["--prompt", "a", "--seed", str(-2 ** 63 - 1)], "--seed"),
    (["--prompts-file", "no/such/file.txt"], "--prompts-file"),
    (["--prompts-file", "."], "--prompts-file '.' is a folder"),
    (["--prompt", "a", "--device", "nope"], "--device"),
    (["--prompt", "a", "--device", "meta"], "--device"),
    (["--prompt", "a", "--stop", "x", "--stop", ""], "--stop: a stop string must not be empty (item 1)"),
])
def test_a_bad_option_ends_the_command_naming_it_before_the_model_loads(folders, capsys, monkeypatch, options, named):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("falcon_fwa.serve.generate_cli.load_model", no_load)
    assert cli.main(["generate", "--model", folders["trained"], *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa generate: error: {named}") and "Traceback" not in err


def test_a_cuda_device_the_machine_lacks_is_named_before_the_model_loads(folders, capsys, monkeypatch):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr("falcon_fwa.serve.generate_cli.load_model", no_load)
    assert cli.main(["generate", "--model", folders["trained"], "--prompt", "a", "--device", "cuda:1"]) == 2
    assert capsys.readouterr().err.startswith("falcon-fwa generate: error: --device cuda:1: this machine has 1")


def test_a_prompts_file_that_is_not_utf8_is_named(folders, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    (tmp_path / "p.txt").write_bytes(b"the state\n\xff\xfe key\n")
    assert cli.main(["generate", "--model", folders["trained"], "--prompts-file", str(tmp_path / "p.txt")]) == 2
    assert capsys.readouterr().err.startswith(f"falcon-fwa generate: error: --prompts-file {str(tmp_path / 'p.txt')!r} "
                                              "is not UTF-8 text")


def _interrupted(folders, monkeypatch, capsys, calls, *options):
    """The command on the peaky model with a Ctrl-C (``KeyboardInterrupt``) in its ``calls``-th forward pass:
    its exit status, stdout and stderr."""
    from falcon_fwa.serve import generate_cli

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    load = generate_cli.load_model

    def load_and_count(*args, **kwargs):
        model, tok = load(*args, **kwargs)
        n = []

        def ctrl_c(module, args, kwargs):
            n.append(1)
            if len(n) == calls:
                raise KeyboardInterrupt

        model.register_forward_pre_hook(ctrl_c, with_kwargs=True)
        return model, tok

    monkeypatch.setattr(generate_cli, "load_model", load_and_count)
    capsys.readouterr()
    status = cli.main(["generate", "--model", folders["peaky"], "--device", "cpu", "--no-stop-at-eos", *options])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_a_ctrl_c_keeps_the_completions_of_the_finished_batches(folders, monkeypatch, capsys):
    """Batches of one prompt and 6 new tokens (6 forward passes each): a Ctrl-C in the second batch's decoding
    leaves the first batch's completion printed, as the uninterrupted run prints it."""
    args = ["--prompt", "the state", "--prompt", "gate", "--max-new-tokens", "6"]
    full = _generate(folders, "peaky", *args)["completions"][0]
    status, out, err = _interrupted(folders, monkeypatch, capsys, 9, *args)
    assert status == 130 and err.splitlines()[-1] == "falcon-fwa generate: interrupted"
    assert out == f"=== completion 1/2 (prompt: 'the state') ===\n{full['text']}\n"


def test_a_ctrl_c_while_streaming_shows_the_tokens_chosen_so_far(folders, monkeypatch, capsys):
    """The streamer holds back text until a word ends; a Ctrl-C in the 7th forward pass still shows the 6 tokens
    chosen before it (the prompt pass's and 5 steps'), then a newline."""
    full = _generate(folders, "peaky", "--prompt", "the state", "--max-new-tokens", "12", "--no-stop-at-eos")
    ids = full["completions"][0]["token_ids"]
    _, tok = load_model(folders["peaky"])
    status, out, err = _interrupted(folders, monkeypatch, capsys, 7, "--prompt", "the state", "--max-new-tokens", "12")
    assert status == 130 and err.splitlines()[-1] == "falcon-fwa generate: interrupted"
    assert out == tok.decode(ids[:6], skip_special_tokens=True) + "\n"


def test_a_missing_model_folder_is_named(folders, capsys, monkeypatch):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    missing = str(folders["tmp"] / "no_model")
    assert cli.main(["generate", "--model", missing, "--prompt", "a"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa generate: error: --model: model folder") and missing in err


def test_one_prompt_streams_exactly_its_completion_and_several_print_after_their_batch(folders, capsys, tmp_path):
    rep = _generate(folders, "peaky", "--prompt", "the state", "--max-new-tokens", "40")
    captured = capsys.readouterr()
    text = rep["completions"][0]["text"]
    assert len(rep["completions"][0]["token_ids"]) > 1 and text.strip()
    assert captured.out == text + "\n"  # TextStreamer ends the stream with a newline
    assert captured.err.splitlines()[-1].startswith("generate: 1 prompt(s)")
    assert "tokens/s" in captured.err

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the state\n\n  \nkey value\n")  # blank lines skipped
    rep = _generate(folders, "peaky", "--prompts-file", str(prompts), "--prompt", "a", "--max-new-tokens", "8",
                    "--batch-size", "2")
    out = capsys.readouterr().out
    assert [c["prompt"] for c in rep["completions"]] == ["a", "the state", "key value"]
    expected = "".join(f"=== completion {i}/3 (prompt: {c['prompt']!r}) ===\n{c['text']}\n"
                       for i, c in enumerate(rep["completions"], 1))
    assert out == expected


@pytest.mark.parametrize("temperature, top_k, top_p, kept", [
    (1.0, 0, 1.0, [0, 1, 2, 3, 4, 5]),
    (0.7, 0, 1.0, [0, 1, 2, 3, 4, 5]),
    (2.0, 3, 1.0, [1, 3, 5]),        # the three largest logits
    (1.0, 0, 0.6, [1, 5]),           # 0.452 < 0.6 <= 0.452 + 0.274
    (1.3, 4, 0.75, [1, 3, 5]),       # top 4 at T=1.3: 0.424, 0.289, 0.196, 0.091: 0.713 < 0.75
    (1.0, 2, 0.3, [1]),              # the largest alone holds 0.62 of the top two
    (1.0, 5, 1.0, [0, 1, 2, 3, 5]),  # top_k one short of the vocabulary drops the smallest logit
    (1.0, 0, 0.99, [0, 1, 2, 3, 5]),  # the five largest hold 0.9917 >= 0.99: the smallest (0.0083) is dropped
])
def test_sampling_draws_from_the_hand_computed_distribution(temperature, top_k, top_p, kept):
    """softmax(logits / T) over the top_k largest, then over the fewest largest whose mass reaches top_p,
    renormalized: the frequencies of 100k draws are within 6 standard errors of it, and no other token comes."""
    import math

    from falcon_fwa.serve.generation import _choose

    logits = [1.0, 3.0, 0.5, 2.0, -1.0, 2.5]
    weights = {i: math.exp(logits[i] / temperature) for i in kept}
    want = torch.tensor([weights.get(i, 0.0) / sum(weights.values()) for i in range(6)], dtype=torch.float64)
    n = 100_000
    draws = _choose(torch.tensor([logits]).expand(n, -1), temperature, top_k, top_p, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=6).double() / n
    assert set(draws.unique().tolist()) == set(kept)
    assert (freq - want).abs().max() <= 6 * math.sqrt(0.25 / n)


def test_sampling_at_the_edges_of_temperature_and_top_p():
    """A tiny temperature still samples when the logits are as close as the temperature is small (a gap of one
    temperature: odds e : 1), and top_p keeps the fewest tokens whose mass reaches it exactly (four equal
    probabilities of 1/4, exact in floating point: top_p = 1/2 keeps two, 3/4 three, 1/2 + 2^-20 three)."""
    import math

    from falcon_fwa.serve.generation import _choose

    n = 100_000
    draws = _choose(torch.tensor([[0.0, -1e-4, -5.0]]).expand(n, -1), 1e-4, 0, 1.0,
                    torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=3).double() / n
    want = torch.tensor([math.e, 1.0, 0.0], dtype=torch.float64) / (math.e + 1)
    assert (freq - want).abs().max() <= 6 * math.sqrt(0.25 / n)
    for top_p, kept in ((0.5, 2), (0.75, 3), (0.5 + 2 ** -20, 3), (1.0, 4)):
        draws = _choose(torch.zeros(n, 4), 1.0, 0, top_p, torch.Generator().manual_seed(1))
        counts = torch.bincount(draws, minlength=4)
        assert int((counts > 0).sum()) == kept, top_p
        assert (counts[counts > 0].double() / n - 1 / kept).abs().max() <= 6 * math.sqrt(0.25 / n)


def test_prompts_come_from_stdin_and_from_a_pipe_as_from_the_command_line(folders, monkeypatch):
    """``--prompts-file -`` reads stdin, and a pipe (``/dev/stdin``, a shell's ``<(...)``) is read like a file
    although it is no regular file: the prompts (a byte-order mark dropped, ``\\r\\n`` and ``\\r`` line ends) and
    the tokens are those of the same prompts given with ``--prompt``."""
    import io
    import os

    args = ["--max-new-tokens", "6", "--no-stop-at-eos", "--batch-size", "2"]
    given = _generate(folders, "peaky", "--prompt", "the state", "--prompt", "gate", *args)
    text = "\ufeffthe state\r\r\ngate\r\n".encode()  # \r\n and a lone \r end lines

    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text)))
    from_stdin = _generate(folders, "peaky", "--prompts-file", "-", *args)

    read, write = os.pipe()
    os.write(write, text)
    os.close(write)
    try:
        from_pipe = _generate(folders, "peaky", "--prompts-file", f"/dev/fd/{read}", *args)
    finally:
        os.close(read)
    for rep in (from_stdin, from_pipe):
        assert [c["prompt"] for c in rep["completions"]] == ["the state", "gate"]
        assert _tokens(rep) == _tokens(given)


def test_a_model_folder_without_a_tokenizer_is_named_before_the_model_loads(folders, capsys, monkeypatch, tmp_path):
    """``model.save_pretrained`` alone writes no tokenizer; transformers' error came after the model had loaded
    and named neither the folder nor the tokenizer."""
    import shutil

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    folder = tmp_path / "weights_only"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{folders['peaky']}/{name}", folder / name)

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the folder was checked")

    monkeypatch.setattr("falcon_fwa.serve.generate_cli.load_model", no_load)
    assert cli.main(["generate", "--model", str(folder), "--prompt", "a", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa generate: error: --model: model folder {str(folder)!r} holds no tokenizer")


def _stop_cut(tok, ids, stops):
    """The shortest prefix of ``ids`` whose whole decode holds one of ``stops``, and that decode cut at the
    earliest occurrence (``ids`` and their text when none does)."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        at = [text.find(s) for s in stops if s in text]
        if at:
            return ids[:n], text[:min(at)]
    return ids, tok.decode(ids, skip_special_tokens=True)


def test_stop_strings_cut_the_completions_and_the_report_says_what_ended_each(folders, capsys):
    """``--stop`` (twice) on a batch of 3 and on one streamed prompt: each completion is its unstopped greedy
    completion cut where a whole decode of its token prefixes first holds a stop string; ``--json`` says which
    ended it (``finish_reason``, ``stop_string``) and keeps the stop strings among the settings; the streamed
    text is the final text."""
    args = [*[a for p in PROMPTS for a in ("--prompt", p)], "--max-new-tokens", "24", "--no-stop-at-eos"]
    free = _generate(folders, "peaky", *args)
    text = free["completions"][0]["text"]
    stop = next(text[i:i + 2] for i in range(4, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    stops = [stop, "never seen"]
    rep = _generate(folders, "peaky", *args, "--batch-size", "3", "--stop", stop, "--stop", "never seen")
    _, tok = load_model(folders["peaky"])
    assert rep["settings"]["stop"] == stops
    for before, c in zip(free["completions"], rep["completions"]):
        ids, cut = _stop_cut(tok, before["token_ids"], stops)
        assert (c["token_ids"], c["text"]) == (ids, cut)
        stopped = len(ids) < 24 or stop in tok.decode(ids)
        assert (c["finish_reason"], c["stop_string"]) == (("stop", stop) if stopped else ("length", None))
        assert c["stopped_at_eos"] is False
    first = rep["completions"][0]
    assert first["finish_reason"] == "stop" and len(first["token_ids"]) < 24
    capsys.readouterr()
    one = _generate(folders, "peaky", "--prompt", PROMPTS[0], "--max-new-tokens", "24", "--no-stop-at-eos",
                    "--stop", stop)
    assert one["completions"][0]["token_ids"] == first["token_ids"]
    assert capsys.readouterr().out == first["text"] + "\n"
