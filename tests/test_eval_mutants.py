"""Evaluation's documented contract where the other tests leave it open: the default bucket edges of the
docs' table, the window count a single count stands for, the hub-id forms a model name may take, the
model load_model returns (eval mode, float32 weights), shards of a tokenizer that only adds ids, an empty
held-out source, what ``evaluate`` hands the harness, and the options of ``lm-eval`` and ``ppl`` (checked
before any work, their documented defaults)."""
import json
import math

import numpy as np
import pytest
import torch
from conftest import save_tiny_falcon

from falcon_fwa.data.tokenizer import byte_tokenizer
from falcon_fwa.eval import bucket_report, default_edges, load_model, token_stream
from falcon_fwa.eval.perplexity import check_model_folder

pytestmark = pytest.mark.usefixtures("one_thread")

EOS = 256  # the byte tokenizer's end-of-text id


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """(model, folder) of a tiny float32 Falcon saved with the byte tokenizer."""
    path = tmp_path_factory.mktemp("eval") / "m"
    return save_tiny_falcon(path), str(path)


def test_default_edges_are_the_docs_buckets():
    """docs/training.md: ``--seq-len 512`` without ``--buckets`` prints the buckets 0-64, 64-128, 128-256,
    256-512 (edges doubling from 64)."""
    assert default_edges(512) == [0, 64, 128, 256, 512]
    assert default_edges(4096) == [0, 64, 128, 256, 512, 1024, 2048, 4096]
    assert default_edges(100) == [0, 64, 100]


def test_a_single_count_is_the_number_of_windows():
    """``count`` given as one number is the number of windows: every position holds that many predictions,
    and the report's ``windows`` is it (unless ``windows`` is given)."""
    total = torch.arange(1, 7, dtype=torch.float64)  # sums over 3 windows of 6 positions
    rep = bucket_report(total, 3, [0, 2, 6])
    assert rep["windows"] == 3 and rep["tokens"] == 18
    assert rep["loss"] == pytest.approx(21 / 18) and rep["ppl"] == pytest.approx(math.exp(21 / 18))
    assert [b["tokens"] for b in rep["buckets"]] == [6, 12]
    assert bucket_report(total, 3, [0, 6], windows=5)["windows"] == 5
    per_position = bucket_report(total, torch.full((6,), 3.0, dtype=torch.float64), [0, 6])
    assert per_position["windows"] is None and per_position["loss"] == pytest.approx(21 / 18)


@pytest.mark.parametrize("name", ["a/b/c", "owner/name/extra", ".hidden/model", "./model", "/no/such/folder"])
def test_a_model_name_of_no_hub_form_that_is_no_folder_is_refused(name, tmp_path, monkeypatch):
    """A name that is no folder is taken for a hub id only in the form ``owner/name``."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_folder(name)


def test_a_name_under_a_local_folder_is_a_path(tmp_path, monkeypatch):
    """``runs/model`` where ``./runs`` exists is a path that does not exist, not the hub id ``runs/model``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_model_folder("runs/model")


def test_a_hub_id_passes_the_check(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check_model_folder("owner/name")
    check_model_folder("gpt2")


def test_load_model_gives_the_model_in_eval_mode_with_float32_weights(folder):
    """``load_model``: the model in eval mode; ``dtype`` defaults to fp32 (``ppl`` loads without one, its
    ``--dtype bf16`` is autocast over these float32 weights)."""
    _, path = folder
    model, tok = load_model(path)
    assert not model.training and not any(m.training for m in model.modules())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert tok.eos_token_id == EOS


def test_shards_of_a_tokenizer_with_more_ids_are_refused(tmp_path):
    """Shards written by a tokenizer with the same end-of-text id but more ids (one token added) come from
    another tokenizer: their ids past the model's tokenizer would be scored as whatever the model has there."""
    from falcon_fwa.data.shards import write_token_shards

    wider = byte_tokenizer()
    wider.add_tokens(["<x>"])
    assert (wider.eos_token_id, len(wider)) == (EOS, 258)
    write_token_shards(["the state", "memory <x> key"], wider, str(tmp_path / "wide"))
    with pytest.raises(ValueError, match="another tokenizer"):
        token_stream([str(tmp_path / "wide")], byte_tokenizer())
    assert token_stream([str(tmp_path / "wide")], wider)[0] == EOS


def test_a_source_without_documents_is_named(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="no held-out documents"):
        token_stream([str(empty)], byte_tokenizer(), text_split="paragraph")


class _Bigram(torch.nn.Module):
    """A model whose logits at each position are row ``input_id`` of a fixed table, in bfloat16 (as a model
    run under bf16 autocast may return them)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.table = (3 * torch.randn(EOS + 1, EOS + 1, generator=g, dtype=torch.float64)).to(torch.bfloat16)

    def forward(self, input_ids, use_cache=False, cu_seqlens=None):
        return type("Out", (), {"logits": self.table[input_ids]})()


@pytest.mark.parametrize("reset", [False, True])
def test_bfloat16_logits_are_scored_in_float(reset):
    """``position_nll`` scores bf16 logits in float32 and sums in float64: each prediction's NLL is that of
    the bf16 logits taken exactly (float64 log-softmax here), not a bf16 one (about 1e-2 off)."""
    from falcon_fwa.eval import position_nll, windows

    model = _Bigram()
    rng = np.random.default_rng(0)
    tokens = np.concatenate([[EOS, *rng.integers(97, 123, 9)], [EOS, *rng.integers(97, 123, 14)]]).astype(np.int64)
    rows = windows(tokens, 8)
    total, count = position_nll(model, rows, batch_size=2, progress=False, eos_id=EOS if reset else None)
    want = torch.zeros(8, dtype=torch.float64)
    want_count = torch.zeros(8, dtype=torch.float64)
    logp = model.table.double().log_softmax(-1)
    for row in rows.tolist():
        start = 0
        for j in range(8):
            if reset and row[j] == EOS:
                start = j
            if reset and row[j + 1] == EOS:
                continue
            want[j - start] -= logp[row[j], row[j + 1]]
            want_count[j - start] += 1
    torch.testing.assert_close(count, want_count, rtol=0, atol=0)
    torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)


def _stand_in_harness(monkeypatch):
    """``lm_eval.simple_evaluate`` replaced by a recorder (returns no results); local tasks only."""
    import functools

    import lm_eval
    import lm_eval.tasks

    monkeypatch.setattr(lm_eval.tasks, "TaskManager",
                        functools.partial(lm_eval.tasks.TaskManager, include_defaults=False))
    calls = []
    monkeypatch.setattr(lm_eval, "simple_evaluate", lambda **kwargs: calls.append(kwargs) or {"results": {}})
    return calls


def _task(folder):
    (folder / "docs.jsonl").write_text(json.dumps({"context": "a", "choices": ["b", "c"], "label": 0}) + "\n")
    (folder / "local_mc.yaml").write_text(f"""task: local_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {folder / "docs.jsonl"}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list: [{{metric: acc}}]
""")
    return str(folder)


def test_evaluate_passes_its_arguments_to_the_harness(folder, tmp_path, monkeypatch):
    """``--num-fewshot``, ``--limit``, ``--batch-size`` pass through; ``dtype`` sets the weights', ``max_length``
    the context; the model is ``falcon-fwa`` and no code of the folder runs (``trust_remote_code`` off)."""
    pytest.importorskip("lm_eval")
    from falcon_fwa.eval.harness import evaluate

    calls = _stand_in_harness(monkeypatch)
    _, path = folder
    tasks = _task(tmp_path)
    evaluate(path, ["local_mc"], include_path=tasks, num_fewshot=3, batch_size=5, limit=0.5, device="cpu",
             dtype="bf16", max_length=24)
    evaluate(path, ["local_mc"], include_path=tasks)
    full, default = calls
    assert full["model"] == "falcon-fwa" and full["tasks"] == ["local_mc"]
    assert (full["num_fewshot"], full["batch_size"], full["limit"], full["device"]) == (3, 5, 0.5, "cpu")
    assert full["model_args"] == {"pretrained": path, "dtype": "bfloat16", "trust_remote_code": False,
                                  "max_length": 24}
    assert default["model_args"] == {"pretrained": path, "dtype": "float32", "trust_remote_code": False}
    assert (default["num_fewshot"], default["batch_size"], default["limit"]) == (None, 1, None)


def _lm_eval_cli(monkeypatch, folder, *extra):
    """``falcon-fwa lm-eval`` with ``evaluate`` replaced by a recorder; (exit status, recorded calls)."""
    import lm_eval.utils

    from falcon_fwa.cli import main
    from falcon_fwa.eval import harness

    calls = []
    monkeypatch.setattr(harness, "evaluate", lambda *a, **k: calls.append((a, k)) or {"results": {}})
    monkeypatch.setattr(lm_eval.utils, "make_table", lambda r: "harness table")
    return main(["lm-eval", "--model", folder, "--tasks", " local_mc, ,x ", "--device", "cpu", *extra]), calls


def test_lm_eval_takes_zero_shot_and_names_bad_options_first(folder, monkeypatch, capsys):
    """``--num-fewshot 0`` (the paper's command) reaches the harness; ``--max-length``, ``--limit`` and
    ``--num-fewshot`` out of range are named before the harness is called."""
    pytest.importorskip("lm_eval")
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    _, path = folder
    rc, calls = _lm_eval_cli(monkeypatch, path, "--num-fewshot", "0", "--limit", "0.25", "--max-length", "1")
    assert rc == 0 and len(calls) == 1
    (model, tasks), kwargs = calls[0]
    assert (model, tasks) == (path, ["local_mc", "x"])
    assert (kwargs["num_fewshot"], kwargs["limit"], kwargs["max_length"]) == (0, 0.25, 1)
    capsys.readouterr()
    for extra, message in ((["--max-length", "0"], "--max-length must be >= 1"),
                           (["--num-fewshot", "-1"], "--num-fewshot must be >= 0"),
                           (["--limit", "0"], "--limit must be > 0"),
                           (["--limit", "nan"], "--limit must be a finite number > 0")):
        rc, calls = _lm_eval_cli(monkeypatch, path, *extra)
        err = capsys.readouterr().err
        assert rc == 2 and not calls and message in err, (extra, err)


def _ppl(path, text, *extra):
    from falcon_fwa.cli import main

    return main(["ppl", "--model", path, "--data", str(text), "--seq-len", "16", "--buckets", "0,4,16",
                 "--max-windows", "2", "--device", "cpu", *extra])


def test_ppl_defaults_reset_documents_and_one_document_per_file(folder, tmp_path, capsys):
    """``ppl`` without ``--documents`` and ``--text-split``: documents reset (the header says positions in
    the document), and a text file is one document (its blank lines split nothing), so every one of the
    2 x 16 predictions is scored, by its position in the window; ``carry`` prints positions in the window."""
    model, path = folder
    text = tmp_path / "held.txt"
    text.write_text("the state\n\nmemory key value\n\nfast weight attention reads the gate\n")
    reports = {}
    for name, extra in (("default", []), ("reset", ["--documents", "reset", "--text-split", "file"]),
                        ("carry", ["--documents", "carry"]), ("paragraph", ["--text-split", "paragraph"])):
        out = tmp_path / f"{name}.json"
        assert _ppl(path, text, "--out", str(out), *extra) == 0
        reports[name] = json.load(open(out))
        header = capsys.readouterr().out.splitlines()[1]
        assert header.split() == ["position", "in", "window" if name == "carry" else "document", "tokens", "loss",
                                  "ppl"], (name, header)
    default = reports["default"]
    assert default["documents"] == "reset" and default["tokens"] == 32
    assert [b["tokens"] for b in default["buckets"]] == [8, 24]
    assert {k: default[k] for k in ("loss", "tokens", "buckets")} == \
        {k: reports["reset"][k] for k in ("loss", "tokens", "buckets")}
    # one document from an empty state at each window: the stream [eos] + bytes, scored by hand
    ids = [EOS, *text.read_bytes()]
    nll = 0.0
    for w in range(2):
        with torch.no_grad():
            lp = model(input_ids=torch.tensor([ids[16 * w:16 * w + 16]]), use_cache=False).logits[0]
        lp = lp.double().log_softmax(-1)
        nll -= sum(float(lp[j, ids[16 * w + j + 1]]) for j in range(16))
    assert default["loss"] == pytest.approx(nll / 32, rel=1e-5)
    assert reports["paragraph"]["tokens"] < 32  # paragraphs: end-of-text targets are left out


def test_ppl_names_a_bad_train_len_or_missing_data_before_loading(tmp_path, capsys, monkeypatch):
    """``--train-len`` below 1 and a ``--data`` file that does not exist are named before the model loads
    (the folder here holds a config.json that loading would fail on)."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    held = tmp_path / "held.txt"
    held.write_text("some held-out text\n")
    for data, extra, message in ((held, ["--train-len", "0"], "--train-len must be >= 1"),
                                 (tmp_path / "nothing.txt", [], "--data: ")):
        assert _ppl(str(model), data, *extra) == 2
        err = capsys.readouterr().err
        assert "falcon-fwa ppl: error:" in err and message in err, (extra, err)


def test_ppl_windows_are_1024_tokens_unless_told_and_the_help_says_so():
    import argparse

    from falcon_fwa.eval import ppl_cli

    parser = argparse.ArgumentParser()
    ppl_cli.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--data", "d"])
    assert args.seq_len == 1024 and args.train_len is None and args.batch_size == 1
    assert "default 1024" in " ".join(parser.format_help().split())
