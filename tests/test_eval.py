"""Evaluation: perplexity by position bucket, and lm-evaluation-harness on a saved tiny model."""
import json
import math
import random
import shutil

import pytest
import torch
from conftest import tiny_lm_recipe

from falcon_fwa.eval import bucket_report, default_edges, load_model, position_nll, token_stream, windows


def test_bucket_report_by_hand():
    total = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], dtype=torch.float64)  # sums over 2 windows
    rep = bucket_report(total, 2, [0, 2, 4, 8], train_len=4)
    assert rep["tokens"] == 16 and rep["loss"] == pytest.approx(36 / 16)
    assert [b["loss"] for b in rep["buckets"]] == pytest.approx([3 / 4, 7 / 4, 26 / 8])
    assert [b["ppl"] for b in rep["buckets"]] == pytest.approx([math.exp(3 / 4), math.exp(7 / 4), math.exp(26 / 8)])
    assert [b["beyond_train_len"] for b in rep["buckets"]] == [False, False, True]
    assert default_edges(1000, first=64) == [0, 64, 128, 256, 512, 1000]
    with pytest.raises(ValueError, match="buckets"):
        bucket_report(total, 2, [0, 4, 2, 8])


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny Falcon trained for 2 steps through the ``train`` command and exported."""
    from falcon_fwa.train.cli import main

    tmp = tmp_path_factory.mktemp("lm")
    assert main(["--config", tiny_lm_recipe(tmp), "--set", "train.steps=2"]) == 0
    assert json.load(open(tmp / "run" / "summary.json"))["steps"] == 2
    return tmp


def test_perplexity_matches_the_models_own_loss(saved_model):
    model, tok = load_model(str(saved_model / "run" / "model"))
    tokens = token_stream([str(saved_model / "data" / "val")], tok)
    rows = windows(tokens, 48, max_windows=3)
    total, count = position_nll(model, rows, batch_size=2, progress=False)
    assert torch.equal(count, torch.full((48,), 3.0, dtype=torch.float64))
    with torch.no_grad():
        ref = model(input_ids=rows[:, :-1], use_cache=False).logits.log_softmax(-1)
    ref_nll = -ref.gather(-1, rows[:, 1:, None])[..., 0].double().sum(0)
    torch.testing.assert_close(total, ref_nll, rtol=1e-6, atol=1e-6)
    # through the command, on the raw text, with buckets past the training length (32)
    from falcon_fwa.eval.ppl_cli import add_arguments, run
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = saved_model / "ppl.json"
    args = parser.parse_args(["--model", str(saved_model / "run" / "model"), "--data", str(saved_model / "corpus.txt"),
                              "--text-split", "paragraph", "--seq-len", "64", "--train-len", "32", "--buckets",
                              "0,16,32,64", "--max-windows", "2", "--device", "cpu", "--out", str(out)])
    assert run(args) == 0
    rep = json.load(open(out))
    assert rep["windows"] == 2 and [b["beyond_train_len"] for b in rep["buckets"]] == [False, False, True]
    mean = sum(b["loss"] * b["tokens"] for b in rep["buckets"]) / rep["tokens"]
    assert rep["loss"] == pytest.approx(mean)
    # provenance: the commit of the code (as git itself reports it) and the options
    import os
    import subprocess

    here = os.path.dirname(os.path.abspath(run.__code__.co_filename))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True)
    checkout = head.returncode == 0 and "site-packages" not in here.split(os.sep)
    assert rep["provenance"]["commit"] == (head.stdout.strip() if checkout else None)
    if checkout:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                capture_output=True, text=True)
        assert rep["provenance"]["dirty"] == bool(status.stdout.strip())
    assert rep["provenance"]["options"]["seq_len"] == 64 and rep["provenance"]["options"]["buckets"] == "0,16,32,64"


def test_ppl_prints_writes_and_plots_the_same_report_into_new_folders(saved_model, tmp_path, capsys):
    """--out and --plot may name folders that do not exist yet (a plot that failed there would come
    after the whole evaluation); the printed table holds the figures of the JSON."""
    from falcon_fwa.cli import main

    out, plot = tmp_path / "new" / "ppl.json", tmp_path / "other" / "deep" / "ppl.png"
    assert main(["ppl", "--model", str(saved_model / "run" / "model"), "--data", str(saved_model / "corpus.txt"),
                 "--text-split", "paragraph", "--seq-len", "64", "--train-len", "32", "--buckets", "0,16,32,64",
                 "--max-windows", "2", "--device", "cpu", "--out", str(out), "--plot", str(plot)]) == 0
    rep = json.load(open(out))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(plot.parent.glob(".*"))
    printed = capsys.readouterr().out
    assert f"perplexity {rep['ppl']:.4f} (loss {rep['loss']:.4f}) over {rep['tokens']} predictions" in printed
    for b in rep["buckets"]:
        mark = "  (beyond training length)" if b["beyond_train_len"] else ""
        assert f"{b['start']:>11}-{b['end']:<8} {b['tokens']:>10} {b['loss']:>8.4f} {b['ppl']:>10.4f}{mark}" in printed


def test_token_shards_of_another_tokenizer_are_refused(saved_model, tmp_path):
    """Shards tokenized with another tokenizer hold other ids (and another end-of-text id, so
    documents="reset" would never reset): scoring them with the model would be silently wrong."""
    from falcon_fwa.data.shards import write_token_shards
    from falcon_fwa.data.tokenizer import train_bpe_tokenizer

    docs = open(saved_model / "corpus.txt").read().split("\n\n")[:40]
    bpe = train_bpe_tokenizer(docs, 300)
    write_token_shards(docs, bpe, str(tmp_path / "bpe"))
    _, tok = load_model(str(saved_model / "run" / "model"))
    assert bpe.eos_token_id != tok.eos_token_id
    with pytest.raises(ValueError, match="another tokenizer"):
        token_stream([str(tmp_path / "bpe")], tok)
    assert token_stream([str(tmp_path / "bpe")], bpe)[0] == bpe.eos_token_id  # its own tokenizer reads it


def test_ppl_checks_its_options_before_the_work(tmp_path, capsys, monkeypatch):
    """A bad --buckets, --seq-len or --batch-size is reported before the model is loaded (not
    after the whole evaluation); a missing run folder is named, not looked up on the hub."""
    from falcon_fwa.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # loading it would fail: the checks must come first
    (tmp_path / "held.txt").write_text("some held-out text\n")
    base = ["ppl", "--model", str(folder), "--data", str(tmp_path / "held.txt"), "--device", "cpu"]
    cases = [(["--seq-len", "64", "--buckets", "0,a,64"], "--buckets must be comma-separated integers"),
             (["--seq-len", "64", "--buckets", "0,32,16,64"], "--buckets: buckets must rise strictly"),
             (["--seq-len", "64", "--buckets", "0,32"], "--buckets: buckets must rise strictly"),
             (["--seq-len", "0"], "--seq-len must be >= 1"),
             (["--batch-size", "0"], "--batch-size must be >= 1"),
             (["--max-windows", "0"], "--max-windows must be >= 1")]
    for extra, message in cases:
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert "falcon-fwa ppl: error:" in err and message in err, (extra, err)
    # runs/model where ./runs exists is a local path, not the hub id "runs/model"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert main(["ppl", "--model", "runs/model", "--data", "held.txt", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "model folder 'runs/model' does not exist" in err, err


def test_document_reset_equals_each_document_alone(saved_model):
    """documents="reset": every document of a window scored from an empty state, by position in the
    document, boundary predictions left out == running each document piece on its own."""
    model, tok = load_model(str(saved_model / "run" / "model"))
    eos = tok.eos_token_id
    rows = windows(token_stream([str(saved_model / "data" / "val")], tok), 96, max_windows=3)
    assert int((rows[:, 1:-1] == eos).sum()) >= 2  # the windows do cross document boundaries
    total, count = position_nll(model, rows, batch_size=2, progress=False, eos_id=eos)
    ref_total = torch.zeros(96, dtype=torch.float64)
    ref_count = torch.zeros(96, dtype=torch.float64)
    for row in rows:
        inputs, targets = row[:-1], row[1:]
        starts = [0] + [p for p in range(1, 96) if int(inputs[p]) == eos] + [96]
        for a, b in zip(starts[:-1], starts[1:]):
            with torch.no_grad():
                logp = model(input_ids=inputs[None, a:b], use_cache=False).logits[0].log_softmax(-1).double()
            for j in range(b - a):
                if int(targets[a + j]) != eos:
                    ref_total[j] -= logp[j, targets[a + j]]
                    ref_count[j] += 1
    torch.testing.assert_close(count, ref_count, rtol=0, atol=0)
    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-6)
    carry_total, _ = position_nll(model, rows, batch_size=2, progress=False)
    assert not torch.allclose(carry_total, total)  # the two treatments do differ on these windows
    rep = bucket_report(total, count, [0, 16, 96], windows=3)
    assert rep["tokens"] == int(ref_count.sum()) and rep["windows"] == 3
    assert rep["loss"] == pytest.approx(float(ref_total.sum() / ref_count.sum()))


def _write_tasks(folder, data):
    mc, gen = folder / "mc.jsonl", folder / "gen.jsonl"
    rng = random.Random(1)
    words = "the state memory key value write read gate".split()
    with open(mc, "w") as f:
        for i in range(6):
            ctx = " ".join(rng.choice(words) for _ in range(5))
            f.write(json.dumps({"context": ctx, "choices": [" value", " gate", " fast weight"], "label": i % 3}) + "\n")
    with open(gen, "w") as f:
        for i in range(4):  # prompts of different lengths: left padding in a batch
            f.write(json.dumps({"prompt": " ".join(rng.choice(words) for _ in range(2 + 3 * i)), "target": "x"}) + "\n")
    (folder / "local_mc.yaml").write_text(f"""task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""")
    (folder / "local_gen.yaml").write_text(f"""task: local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {gen}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["<|endoftext|>"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return [json.loads(l) for l in open(mc)], [json.loads(l) for l in open(gen)]


def test_lm_eval_harness_end_to_end_with_local_tasks(saved_model, tmp_path):
    pytest.importorskip("lm_eval")
    from falcon_fwa.eval.harness import evaluate

    mc_docs, gen_docs = _write_tasks(tmp_path, saved_model)
    folder = str(saved_model / "run" / "model")
    out = evaluate(folder, ["local_mc", "local_gen"], include_path=str(tmp_path), batch_size=4, log_samples=True)
    model, tok = load_model(folder)

    # multiple choice: the harness's pick equals argmax of the continuation log-likelihood, the
    # context opened by end-of-text as every training document is
    def loglik(context, cont):
        ids = [tok.eos_token_id] + tok(context + cont, add_special_tokens=False)["input_ids"]
        n = 1 + len(tok(context, add_special_tokens=False)["input_ids"])
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].log_softmax(-1)
        return sum(lp[i - 1, ids[i]].item() for i in range(n, len(ids)))

    expected = [max(range(3), key=lambda c: loglik(d["context"], d["choices"][c])) == d["label"] for d in mc_docs]
    assert out["results"]["local_mc"]["acc,none"] == pytest.approx(sum(expected) / len(expected))
    for s in out["samples"]["local_mc"]:  # and each score is that log-likelihood of the request's text
        got = [float(r[0][0]) for r in s["resps"]]
        want = [loglik(context, cont) for context, cont in s["arguments"]]
        assert got == pytest.approx(want, rel=0, abs=1e-4)

    # generation: batched, left-padded, with the recurrent cache == greedy decoding by full forwards
    gens = {s["doc"]["prompt"]: s["resps"][0][0] for s in out["samples"]["local_gen"]}
    assert len(gens) == len(gen_docs) and any(gens.values())
    for d in gen_docs:
        ids = [tok.eos_token_id] + tok(d["prompt"], add_special_tokens=False)["input_ids"]
        new = []
        for _ in range(6):
            with torch.no_grad():
                nxt = int(model(input_ids=torch.tensor([ids + new]), use_cache=False).logits[0, -1].argmax())
            if nxt == tok.eos_token_id:
                break
            new.append(nxt)
        assert gens[d["prompt"]] == tok.decode(new), d["prompt"]


def test_lm_eval_generation_never_picks_the_padding_ids_of_the_vocabulary(saved_model, tmp_path):
    """The embedding has more rows than the tokenizer has ids (rounded up to 64). Rows made to win the
    argmax at the first generated token must not be picked: the harness decodes as ``falcon-fwa generate``
    does, over the tokenizer's ids."""
    pytest.importorskip("lm_eval")
    import shutil

    from falcon_fwa.eval.harness import evaluate

    folder = saved_model / "run" / "model"
    model, tok = load_model(str(folder))
    n = len(tok)
    assert model.config.vocab_size > n
    _, gen_docs = _write_tasks(tmp_path, saved_model)
    ids = [tok.eos_token_id] + tok(gen_docs[0]["prompt"], add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        first = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1, :n]
        best = int(first.argmax())
        assert first[best] > 0  # so that 10x its embedding row gives a padding id the larger logit
        emb = model.get_input_embeddings().weight
        emb[n:] = 10 * emb[best]
        assert int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()) >= n
    shutil.copytree(folder, tmp_path / "padded")
    model.save_pretrained(tmp_path / "padded")
    out = evaluate(str(tmp_path / "padded"), ["local_gen"], include_path=str(tmp_path), batch_size=4,
                   log_samples=True)
    got = {s["doc"]["prompt"]: s["resps"][0][0] for s in out["samples"]["local_gen"]}[gen_docs[0]["prompt"]]
    new = []
    for _ in range(6):  # greedy over the tokenizer's ids, by full forwards
        with torch.no_grad():
            nxt = int(model(input_ids=torch.tensor([ids + new]), use_cache=False).logits[0, -1, :n].argmax())
        if nxt == tok.eos_token_id:
            break
        new.append(nxt)
    assert new and new[0] == best and got == tok.decode(new)


def test_lm_eval_requests_open_with_end_of_text(saved_model):
    """The falcon-fwa harness model puts end-of-text in front of each context and each prompt of a
    generation batch (left padding before it, left truncation after it), as training does."""
    pytest.importorskip("lm_eval")
    from falcon_fwa.eval.harness import lm_class

    folder = str(saved_model / "run" / "model")
    lm = lm_class()(pretrained=folder, device="cpu", trust_remote_code=False)
    _, tok = load_model(folder)
    eos, pad = tok.eos_token_id, tok.pad_token_id

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    context, cont = lm._encode_pair("the state", " memory")
    assert context == [eos] + enc("the state") and cont == enc(" memory")
    # the token's spelling inside a text is text (split_special_tokens): the real token still opens it
    assert lm._encode_pair(tok.eos_token + "key", " value")[0] == [eos] + enc(tok.eos_token + "key")

    ids, mask = lm.tok_batch_encode(["a", "the gate"])
    long = [eos] + enc("the gate")
    assert ids.tolist() == [[pad] * (len(long) - 2) + [eos] + enc("a"), long]
    assert mask.tolist() == [[0] * (len(long) - 2) + [1, 1], [1] * len(long)]
    ids, mask = lm.tok_batch_encode(["a", "the gate"], left_truncate_len=4)
    assert ids.tolist() == [[pad, pad, eos] + enc("a"), long[-4:]] and mask.tolist() == [[0, 0, 1, 1], [1] * 4]


def test_lm_eval_model_is_causal_without_the_harness_guessing(saved_model, caplog):
    """The harness finds ``falcon_fwa`` in none of transformers' model tables: left to guess, it warns that
    the type is neither causal nor seq2seq. The falcon-fwa harness model says causal itself."""
    pytest.importorskip("lm_eval")
    import logging

    from falcon_fwa.eval.harness import lm_class

    with caplog.at_level(logging.INFO, logger="lm_eval"):
        lm = lm_class()(pretrained=str(saved_model / "run" / "model"), device="cpu", trust_remote_code=False)
    assert lm.backend == "causal" and lm.AUTO_MODEL_CLASS.__name__ == "AutoModelForCausalLM"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "CausalLM" in r.getMessage()]
    assert any("Overrode HF model backend type" in r.getMessage() for r in caplog.records)


def test_lm_eval_runs_no_code_from_the_model_folder(saved_model, tmp_path):
    """A folder whose config points AutoModel at a module of its own: the harness must not import it."""
    pytest.importorskip("lm_eval")
    from falcon_fwa.eval.harness import evaluate

    _write_tasks(tmp_path, saved_model)  # a task the harness finds: the failure must come from the model

    folder, marker = _folder_with_its_own_code(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer, so that the model is what is loaded
        shutil.copy(saved_model / "run" / "model" / name, folder / name)
    with pytest.raises(ValueError, match="trust_remote_code"):  # transformers' refusal, not any failure
        evaluate(str(folder), ["local_mc"], include_path=str(tmp_path))
    assert not marker.exists()


def _folder_with_its_own_code(tmp_path):
    """A model folder whose config points AutoConfig / AutoModelForCausalLM at a module of its own, which
    leaves a marker file when imported; returns (folder, marker)."""
    folder = tmp_path / "evil"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evilmodel", "auto_map": {"AutoConfig": "evilmod.EvilConfig",
                                                "AutoModelForCausalLM": "evilmod.EvilLM"}}))
    marker = tmp_path / "imported"
    (folder / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    return folder, marker


def test_load_model_runs_no_code_from_the_model_folder(tmp_path, monkeypatch):
    """ppl and generate load through load_model: a folder's own code must not run, even where transformers would
    ask at a terminal and the answer is yes."""
    folder, marker = _folder_with_its_own_code(tmp_path)
    monkeypatch.setattr("builtins.input", lambda *args, **kwargs: "y")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_model(str(folder))
    assert not marker.exists()


def test_ppl_of_a_tokenizer_without_end_of_text(saved_model, tmp_path):
    """--documents carry needs no end-of-text token: documents then open with nothing; reset names it."""
    from transformers import PreTrainedTokenizerFast

    from falcon_fwa.eval.ppl_cli import add_arguments, run
    import argparse
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(saved_model / "run" / "model", folder)
    _, tok = load_model(str(folder))
    bare = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    assert bare.eos_token_id is None
    for f in folder.glob("*token*"):
        f.unlink()
    bare.save_pretrained(folder)
    text = tmp_path / "doc.txt"
    text.write_text("the state memory key value " * 8)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--model", str(folder), "--data", str(text), "--seq-len", "16",
                                  "--documents", "carry", "--device", "cpu"])) == 0
    tokens = token_stream([str(text)], bare)
    assert tokens.tolist() == list(text.read_bytes())  # no opening token
    with pytest.raises(ValueError, match="--documents reset needs a tokenizer with an end-of-text token"):
        run(parser.parse_args(["--model", str(folder), "--data", str(text), "--seq-len", "16", "--device", "cpu"]))


def test_lm_eval_max_length_sets_the_rolling_windows(saved_model, tmp_path, monkeypatch):
    """--max-length reaches the harness: a document longer than it is scored in windows of
    max_length tokens (each with the tokens before it as context), as computed here directly."""
    pytest.importorskip("lm_eval")
    import functools

    import lm_eval.tasks

    from falcon_fwa.cli import main

    # the task is local: skip indexing the harness's own task library (most of the run time)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    doc = "the state memory key value write read gate decay token fast weight " * 3
    (tmp_path / "roll.jsonl").write_text(json.dumps({"text": doc}) + "\n")
    (tmp_path / "local_roll.yaml").write_text(f"""task: local_roll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / "roll.jsonl"}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
""")
    folder = str(saved_model / "run" / "model")
    out = tmp_path / "res.json"
    assert main(["lm-eval", "--model", folder, "--tasks", "local_roll", "--include-path", str(tmp_path),
                 "--max-length", "16", "--batch-size", "4", "--device", "cpu", "--out", str(out)]) == 0
    res = json.load(open(out))
    model, tok = load_model(folder)
    full = [tok.eos_token_id] + tok(doc, add_special_tokens=False)["input_ids"]
    ll = 0.0
    for a in range(1, len(full), 16):  # predict full[a:b] from at most the 16 tokens before each
        b = min(a + 16, len(full))
        lo = max(0, b - 17)
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([full[lo:b - 1]]), use_cache=False).logits[0].log_softmax(-1)
        ll += sum(float(lp[i - 1 - lo, full[i]]) for i in range(a, b))
    bpb = -ll / len(doc.encode("utf-8")) / math.log(2)
    assert res["results"]["local_roll"]["bits_per_byte,none"] == pytest.approx(bpb, rel=1e-5)
    assert res["provenance"]["options"]["max_length"] == 16


def test_load_model_names_a_missing_or_empty_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "runs" / "nothing" / "model"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_load_model_takes_either_spelling_of_its_dtype(saved_model):
    folder = str(saved_model / "run" / "model")
    for spelling in ("bf16", "bfloat16"):
        model, _ = load_model(folder, dtype=spelling)
        assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"^dtype must be one of fp32 \(float32\), bf16 \(bfloat16\), got 'int8'"):
        load_model(folder, dtype="int8")


def model_folder_and_tasks(tmp_path):
    """A model folder whose ``config.json`` is empty (the lm-eval command's checks come before the model is
    loaded) and a folder of the local tasks of :func:`_write_tasks`, under ``tmp_path``."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _write_tasks(tasks, None)
    return folder, tasks


def test_lm_eval_cli_names_a_missing_model_folder_include_path_or_task(tmp_path, capsys):
    # before: a transformers "Repo id must be in the form ..." OSError, or a KeyError traceback from the harness;
    # a folder without a tokenizer is named after the options, before the harness loads the model
    pytest.importorskip("lm_eval")
    from falcon_fwa.cli import main

    folder, tasks = model_folder_and_tasks(tmp_path)
    cases = [(["--model", str(tmp_path / "runs" / "model"), "--tasks", "local_mc", "--include-path", str(tasks)],
              "does not exist"),
             (["--model", str(folder), "--tasks", "local_mc", "--include-path", str(tmp_path / "nope")],
              "--include-path"),
             (["--model", str(folder), "--tasks", "local_mc,nope_task", "--include-path", str(tasks)],
              "--tasks: unknown 'nope_task'"),
             (["--model", str(folder), "--tasks", "local_mc", "--include-path", str(tasks)],  # the model's turn
              f"--model: model folder {str(folder)!r} holds no tokenizer")]
    for args, message in cases:
        assert main(["lm-eval", *args]) == 2
        err = capsys.readouterr().err
        assert "falcon-fwa lm-eval: error:" in err and message in err, err


def test_paper_columns_take_each_tasks_metric_and_average_the_eight(tmp_path, monkeypatch, capsys):
    """Table 2 takes acc, acc_norm for HellaSwag, ARC-c and OpenBookQA, and the unweighted mean of the eight;
    Table 1 the harness's wikitext word perplexity and lambada_openai perplexity. The CLI prints and saves them."""
    pytest.importorskip("lm_eval")
    import lm_eval.utils

    from falcon_fwa.cli import main
    from falcon_fwa.eval import harness

    accs = {"piqa": (0.60, 0.90), "hellaswag": (0.90, 0.30), "winogrande": (0.50, 0.90), "arc_easy": (0.55, 0.90),
            "arc_challenge": (0.90, 0.25), "openbookqa": (0.90, 0.30), "social_iqa": (0.40, 0.90), "sciq": (0.80, 0.10)}
    results = {"results": {t: {"acc,none": a, "acc_norm,none": n} for t, (a, n) in accs.items()}}
    results["results"]["wikitext"] = {"word_perplexity,none": 33.25, "bits_per_byte,none": 1.0}
    results["results"]["lambada_openai"] = {"perplexity,none": 47.43, "acc,none": 0.3}
    want = [60.0, 30.0, 50.0, 55.0, 25.0, 30.0, 40.0, 80.0]  # by hand: acc, acc_norm where the paper marks it
    cols = harness.paper_columns(results)
    assert list(cols["table2"]) == ["PIQA", "Hella.", "Wino.", "ARC-e", "ARC-c", "OBQA", "Social IQA", "SciQ", "Avg."]
    assert list(cols["table2"].values()) == pytest.approx(want + [46.25])
    assert cols["table1"] == {"Wiki.": 33.25, "LMB.": 47.43}
    del results["results"]["sciq"], results["results"]["wikitext"]
    partial = harness.paper_columns(results)
    assert "Avg." not in partial["table2"] and len(partial["table2"]) == 7 and partial["table1"] == {"LMB.": 47.43}
    assert harness.paper_columns({"results": {"local_mc": {"acc,none": 0.5}}}) == {}

    results["results"]["sciq"] = {"acc,none": 0.8, "acc_norm,none": 0.1}
    monkeypatch.setattr(harness, "evaluate", lambda *a, **k: results)
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda r: "harness table")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    out = tmp_path / "res.json"
    assert main(["lm-eval", "--model", str(folder), "--tasks", "piqa", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| 60.00 | 30.00 | 50.00 | 55.00 | 25.00 | 30.00 | 40.00 | 80.00 | 46.25 |" in printed
    assert "| 47.43 |" in printed
    assert json.load(open(out))["paper_tables"]["table2"]["Avg."] == pytest.approx(46.25)
