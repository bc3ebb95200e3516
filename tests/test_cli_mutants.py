"""The command-line glue, option by option: each option reaches the function it configures, the
top-level help and version, how ``run_command`` turns a command's outcome into an exit status, the
shared option checks at their edges, and the provenance a command records (commit, dirty, options)
against ``git`` itself on a throwaway repository. The slow parts (model loading, scoring, tokenizing)
are replaced by stand-ins that record what they were given."""
import argparse
import json
import os
import subprocess
import types

import numpy as np
import pytest
import torch

from falcon_fwa import cli

# ----------------------------------------------------------------------------------------------
# falcon-fwa itself: help, version, routing


@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"]])
def test_the_top_level_help_lists_every_command_and_exits_0(argv, capsys):
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: falcon-fwa")
    for name, (_, help_text) in cli.COMMANDS.items():
        assert name in out and help_text.split()[0] in out, name


def test_version_falls_back_to_the_packages_own_outside_an_installed_distribution(monkeypatch, capsys):
    import importlib.metadata

    import falcon_fwa

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"falcon-fwa {falcon_fwa.__version__}\n"


def test_an_unknown_option_of_a_command_is_an_argparse_error_naming_it(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["params", "tiny-falcon", "--no-such-option", "3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: falcon-fwa params") and "unrecognized arguments: --no-such-option 3" in err
    with pytest.raises(SystemExit) as stop:  # --version is falcon-fwa's own, not an option of its commands
        cli.main(["params", "--version"])
    assert stop.value.code == 2 and "unrecognized arguments: --version" in capsys.readouterr().err


def test_a_commands_help_says_what_it_does(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["data", "--help"])
    assert stop.value.code == 0
    assert "tokenize a corpus once into memory-mapped token shards" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_no_help_shows_an_empty_list_a_suppressed_value_or_a_default_it_already_gives(name, capsys):
    """A default of ``[]`` (``--prompt``, ``--set``) says nothing, ``-h`` has no default, and a help that
    already states its default (generate's ``--temperature``: "0: greedy (default)") is not given a second."""
    with pytest.raises(SystemExit) as stop:
        cli.main([name, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "(default: [])" not in text and "SUPPRESS" not in text
    if name == "generate":
        assert "greedy (default)" in text and "(default: 0.0)" not in text


# ----------------------------------------------------------------------------------------------
# run_command: a command's outcome as an exit status


@pytest.mark.parametrize("returned, status", [(None, 0), (0, 0), (1, 1), (3, 3)])
def test_the_status_a_command_returns_is_the_exit_status(returned, status):
    assert cli.run_command("falcon-fwa test", lambda args: returned, None) == status


def test_an_unsupported_combination_is_one_error_line_with_the_place_it_was_raised(capsys, monkeypatch):
    """NotImplementedError (a combination a command does not support) ends it as a bad value does; the
    place named is the function that raised, not the command's entry."""
    def refuse():
        raise NotImplementedError("--foo with --bar is not supported")

    def run(args):
        refuse()

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.run_command("falcon-fwa test", run, None) == 2
    err = capsys.readouterr().err
    line = refuse.__code__.co_firstlineno + 1
    assert err.startswith("falcon-fwa test: error: --foo with --bar is not supported\n"
                          f"  (raised at {__file__}:{line}; "), err


def test_output_left_in_the_buffer_for_a_reader_that_has_gone_ends_quietly():
    """A command whose last short line is still buffered as it returns, the reader gone: run_command
    flushes it itself (where the closed pipe is caught), status 141 and nothing on stderr, rather than
    the interpreter's failed flush at exit ("Exception ignored ...", status 120). cli.py is loaded alone:
    the child needs no package import; it writes once the parent has closed its end."""
    import signal
    import sys

    script = ("import importlib.util, sys\n"
              f"spec = importlib.util.spec_from_file_location('falcon_cli', {cli.__file__!r})\n"
              "cli = importlib.util.module_from_spec(spec); spec.loader.exec_module(cli)\n"
              "def run(args):\n"
              "    print('first', flush=True)\n"
              "    sys.stdin.read()  # until the parent has closed both pipes\n"
              "    print('last')\n"
              "sys.exit(cli.run_command('falcon-fwa test', run, None))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's stdout is buffered
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline() == b"first\n"
        proc.stdout.close()  # the reader stops
        proc.stdin.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    finally:
        proc.kill()
    assert err == "", err


# ----------------------------------------------------------------------------------------------
# shared option checks at their edges


def test_auto_is_cuda_where_cuda_is_available(monkeypatch):
    from falcon_fwa.cli_options import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(ValueError, match=r"^--device cuda:1: this machine has 1 CUDA device"):
        resolve_device("cuda:1")


def test_a_tokenizer_check_takes_any_saved_tokenizer_and_a_hub_id(tmp_path):
    from falcon_fwa.cli_options import check_tokenizer_in

    check_tokenizer_in("--model", "owner/name")  # a hub id: transformers fetches its tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                 "spiece.model", "sentencepiece.bpe.model"):
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        (folder / "config.json").write_text("{}")
        (folder / name).write_text("{}")
        check_tokenizer_in("--model", str(folder))  # any one of a tokenizer's files is a saved tokenizer
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"^--model: model folder .*bare' holds no tokenizer"):
        check_tokenizer_in("--model", str(tmp_path / "bare"))


def test_an_output_file_that_exists_may_be_written_again(tmp_path):
    from falcon_fwa.cli_options import check_output_file, check_output_folder

    (tmp_path / "report.json").write_text("{}")
    check_output_file("--out", str(tmp_path / "report.json"))  # a rerun replaces its report
    check_output_file("--out", str(tmp_path / "new" / "deep" / "report.json"))  # folders made at the write
    check_output_file("--out", None)
    check_output_folder("--out", str(tmp_path / "new" / "run"))
    check_output_folder("--out", None)


def test_an_output_under_a_dangling_link_is_named(tmp_path):
    """A link to nothing is no folder to write under (its target would be made, or the write fail)."""
    from falcon_fwa.cli_options import check_output_file, check_output_folder

    os.symlink(tmp_path / "gone", tmp_path / "link")
    with pytest.raises(ValueError, match=r"^--out .*link/run' lies under .*link', which is a file"):
        check_output_folder("--out", str(tmp_path / "link" / "run"))
    with pytest.raises(ValueError, match=r"^--json .*link/r.json' lies under .*link', which is a file"):
        check_output_file("--json", str(tmp_path / "link" / "r.json"))


def test_dtype_name_takes_any_spelling_and_names_its_argument():
    from falcon_fwa.cli_options import dtype_name, dtype_option

    assert dtype_option(["fp32", "bf16"])(" BFloat16 ") == "bf16"  # in the command's own spelling

    assert dtype_name(" BF16 ", ("fp32", "bf16")) == "bfloat16"
    assert dtype_name("Float32", ("fp32", "bf16")) == "float32"
    assert dtype_name("fp16", ("float16",)) == "float16"
    with pytest.raises(ValueError, match=r"^weights must be one of fp32 \(float32\), bf16 \(bfloat16\), got 'fp16'$"):
        dtype_name("fp16", ("fp32", "bf16"), name="weights")
    with pytest.raises(ValueError, match="^dtype must be one of"):
        dtype_name("int8", ("fp32",))


# ----------------------------------------------------------------------------------------------
# demo: the options reach the op


def _recording_op(monkeypatch, nan_at=None):
    """demo's op, recording each call's inputs; ``nan_at = (rule, form)``: that output is all NaN."""
    from falcon_fwa import demo, falcon_attention

    calls = []

    def op(q, k, v, beta, lam, *, rule, window, form):
        calls.append(types.SimpleNamespace(q=q, beta=beta, rule=rule, window=window, form=form))
        o, state = falcon_attention(q, k, v, beta, lam, rule=rule, window=window, form=form)
        return (torch.full_like(o, float("nan")) if (rule, form) == nan_at else o), state

    monkeypatch.setattr(demo, "falcon_attention", op)
    return calls


def test_demo_passes_its_window_and_seed_to_every_rule(monkeypatch, capsys):
    calls = _recording_op(monkeypatch)
    argv = ["demo", "--seq-len", "5", "--heads", "2", "--head-dim", "3", "--window", "3"]
    inputs = {}
    for seed in ("7", "7", "8"):
        calls.clear()
        assert cli.main([*argv, "--seed", seed]) == 0
        assert {c.window for c in calls} == {3}
        assert {c.rule for c in calls} == {"1", "2", "3", "1A", "2A", "3A"}
        assert {c.form for c in calls} == {"recurrent", "parallel", "chunk"}
        inputs.setdefault(seed, []).append(calls[0].q)
    assert torch.equal(inputs["7"][0], inputs["7"][1])  # one seed, the same inputs
    assert not torch.equal(inputs["7"][0], inputs["8"][0])
    # the per-column rules get one rate per column of the state, the others one per head
    for c in calls:
        assert tuple(c.beta.shape) == ((1, 5, 2, 3) if c.rule in ("2", "2A") else (1, 5, 2)), c.rule


def test_demo_times_a_form_by_its_fastest_call(monkeypatch, capsys):
    """Each form is called CALLS = 3 times; on a clock where its calls take 105, 3 and 7 ms, the row shows 3 ms."""
    from falcon_fwa import demo, falcon_attention

    clock, taken = [0.0], {}

    def op(q, k, v, beta, lam, *, rule, window, form):
        n = taken[rule, form] = taken.get((rule, form), -1) + 1
        clock[0] += (0.105, 0.003, 0.007)[n]
        return falcon_attention(q, k, v, beta, lam, rule=rule, window=window, form=form)

    monkeypatch.setattr(demo, "falcon_attention", op)
    monkeypatch.setattr(demo, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    assert cli.main(["demo", "--seq-len", "4", "--heads", "1", "--head-dim", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert len(rows) == 6 and all([float(t) for t in r[3:]] == [3.0, 3.0, 3.0] for r in rows)
    assert set(taken.values()) == {2}  # three calls of each form of each rule


def test_demo_fails_a_form_whose_output_is_nan(monkeypatch, capsys):
    """NaN compares false with the tolerance both ways: a form that gives NaN disagrees (exit status 1)."""
    _recording_op(monkeypatch, nan_at=("2A", "chunk"))
    assert cli.main(["demo", "--seq-len", "4", "--heads", "1", "--head-dim", "2"]) == 1
    assert capsys.readouterr().err.endswith(": rule 2A chunk nan\n")


# ----------------------------------------------------------------------------------------------
# params


def test_params_counts_every_preset_by_default_and_the_vocabulary_asked(tmp_path, capsys, monkeypatch):
    from falcon_fwa import FalconForCausalLM, get_preset
    from falcon_fwa.models import cli as params_cli
    from falcon_fwa.models.presets import PRESETS

    with monkeypatch.context() as m:  # the names and configs that reach the table (counting them all is slow)
        seen = []
        m.setattr(params_cli, "parameter_table", lambda names, configs: seen.extend(zip(names, configs)) or "table")
        assert cli.main(["params"]) == 0
    assert capsys.readouterr().out.startswith("table\n\nTable written ")  # then the commit (test_params_provenance)
    assert [n for n, _ in seen] == list(PRESETS) and all(c == get_preset(n) for n, c in seen)
    # --vocab-size: the tied embedding is vocab x width; the total is the model's own count of its tensors
    model = FalconForCausalLM(get_preset("tiny-falcon", vocab_size=1000))
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    out = tmp_path / "params.md"
    assert cli.main(["params", "tiny-falcon", "--vocab-size", "1000", "--out", str(out)]) == 0
    cells = [c.strip() for c in capsys.readouterr().out.splitlines()[2].split("|")[1:-1]]
    width = get_preset("tiny-falcon").hidden_size
    assert cells[0] == "tiny-falcon" and cells[7] == f"{1000 * width:,}" and cells[-1].startswith(f"{total:,} (")
    assert "Produced by `falcon-fwa params tiny-falcon --vocab-size 1000`." in out.read_text()


# ----------------------------------------------------------------------------------------------
# data: every option reaches its DataSpec field


def _data_run(monkeypatch, tmp_path, argv):
    from falcon_fwa.data import cli as data_cli

    seen = {}

    def prepare(spec, out, *, overwrite, name):
        seen.update(spec=spec, out=out, overwrite=overwrite, name=name)
        return {"prepared": True}

    monkeypatch.setattr(data_cli, "prepare_dataset", prepare)
    assert cli.main(["data", "--out", str(tmp_path / "out"), *argv]) == 0
    return seen


def test_data_options_reach_the_spec(monkeypatch, tmp_path, capsys):
    from falcon_fwa.data.prepare import DataSpec

    seen = _data_run(monkeypatch, tmp_path, ["--train", "a.jsonl", "--val", "b.jsonl", "--tokenizer", "bpe:300",
                                             "--text-split", "paragraph", "--text-field", "body", "--val-every", "7",
                                             "--max-documents", "11", "--bpe-documents", "13", "--overwrite"])
    assert seen["spec"] == DataSpec(train_source="a.jsonl", val_source="b.jsonl", tokenizer="bpe:300",
                                    text_split="paragraph", text_field="body", val_every=7, max_documents=11,
                                    bpe_documents=13)
    assert seen["out"] == str(tmp_path / "out") and seen["overwrite"] is True
    assert json.loads(capsys.readouterr().out) == {"prepared": True}
    # errors name the options, not the recipe's data fields
    assert [seen["name"](f) for f in ("train_source", "val_source", "val_every", "bpe_documents")] == \
        ["--train", "--val", "--val-every", "--bpe-documents"]


def test_data_defaults_are_the_documented_ones(monkeypatch, tmp_path, capsys):
    """docs/training.md: byte tokens, a text file is one document, every 20th document held out."""
    seen = _data_run(monkeypatch, tmp_path, ["--train", "a.txt"])
    spec = seen["spec"]
    assert (spec.val_source, spec.tokenizer, spec.text_split, spec.text_field) == (None, "byte", "file", "text")
    assert (spec.val_every, spec.max_documents, seen["overwrite"]) == (20, None, False)


# ----------------------------------------------------------------------------------------------
# ppl: every option reaches what it configures (the model, the scoring and the data are stand-ins)


def _ppl_run(monkeypatch, tmp_path, argv, *, eos=7, sources=None):
    """``falcon-fwa ppl --model m --data D ARGV`` (``--data SOURCES`` where given), run in ``tmp_path``, with
    the load, the tokens and the scoring replaced: the tokens are 0, 1, 2, ... (as many as asked), each
    position's summed loss is 1 per window."""
    from falcon_fwa.eval import ppl_cli

    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "tokenizer.json").write_text("{}")
    data = tmp_path / "d.txt"
    data.write_text("held-out text\n")
    tokenizer = types.SimpleNamespace(eos_token_id=eos)
    seen = {}

    def load_model(path, **kwargs):
        seen["load"] = (path, kwargs)
        return "model", tokenizer

    def token_stream(sources, tok, **kwargs):
        seen["stream"] = (sources, tok, kwargs)
        return np.arange(kwargs["max_tokens"] if kwargs.get("max_tokens") else 1000)

    def position_nll(model, rows, **kwargs):
        seen["nll"] = (model, rows, kwargs)
        n, width = rows.shape
        return torch.full((width - 1,), float(n), dtype=torch.float64), torch.full((width - 1,), float(n),
                                                                                   dtype=torch.float64)

    monkeypatch.setattr(ppl_cli, "load_model", load_model)
    monkeypatch.setattr(ppl_cli, "token_stream", token_stream)
    monkeypatch.setattr(ppl_cli, "position_nll", position_nll)
    monkeypatch.setattr(ppl_cli, "plot_buckets", lambda report, path, label: seen.update(plot=(report, path, label)))
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    out = tmp_path / "ppl.json"
    status = cli.main(["ppl", "--model", "m", "--data", *(sources or [str(data)]), "--out", str(out), *argv])
    return status, seen, (json.loads(out.read_text()) if status == 0 else None), folder, data


def test_ppl_options_reach_the_load_the_tokens_and_the_scoring(monkeypatch, tmp_path, capsys):
    status, seen, rep, folder, data = _ppl_run(monkeypatch, tmp_path, [
        "--seq-len", "8", "--max-windows", "2", "--batch-size", "3", "--dtype", "bfloat16", "--text-split",
        "line", "--text-field", "body", "--documents", "carry", "--train-len", "4", "--buckets", "0,4,8",
        "--device", "cpu", "--plot", str(tmp_path / "ppl.png")])
    assert status == 0
    assert seen["load"] == ("m", {"device": "cpu"})
    sources, tok, kwargs = seen["stream"]
    assert sources == [str(data)] and tok.eos_token_id == 7
    # 2 windows of 8 predictions: 2 x 8 + 1 tokens (each window's last token opens the next)
    assert kwargs.pop("name")("text_field") == "--text-field"  # errors name the option
    assert kwargs == {"text_split": "line", "text_field": "body", "max_tokens": 17}
    model, rows, kwargs = seen["nll"]
    assert model == "model" and rows.tolist() == [list(range(0, 9)), list(range(8, 17))]
    assert kwargs == {"batch_size": 3, "device": "cpu", "bf16": True, "eos_id": None}  # carry: no resets
    assert rep["windows"] == 2 and rep["documents"] == "carry" and rep["data"] == [str(data)]
    assert rep["model"] == str(folder)  # --model m, from tmp_path: the report names the folder wherever it is read
    assert [(b["start"], b["end"], b["beyond_train_len"]) for b in rep["buckets"]] == [(0, 4, False), (4, 8, True)]
    opts = rep["provenance"]["options"]
    assert (opts["seq_len"], opts["batch_size"], opts["documents"], opts["dtype"]) == (8, 3, "carry", "bf16")
    assert seen["plot"] == (rep, str(tmp_path / "ppl.png"), "m")  # the plot's line is named by the model folder
    out = capsys.readouterr().out
    assert "documents: carry" in out and "position in window" in out  # carry: positions count from the window


def test_ppl_defaults_reset_documents_fp32_and_doubling_buckets(monkeypatch, tmp_path, capsys):
    """docs/training.md: ``--documents reset`` is the default (each end-of-text restarts the state) and the
    buckets default to 0, 64, 128, ... (powers of two) up to --seq-len; windows run until the data end."""
    status, seen, rep, *_ = _ppl_run(monkeypatch, tmp_path, ["--seq-len", "300", "--device", "cpu"])
    assert status == 0
    assert seen["nll"][2] == {"batch_size": 1, "device": "cpu", "bf16": False, "eos_id": 7}
    assert seen["stream"][2]["max_tokens"] is None and seen["nll"][1].shape == (999 // 300, 301)
    assert [(b["start"], b["end"]) for b in rep["buckets"]] == [(0, 64), (64, 128), (128, 256), (256, 300)]
    assert not any(b["beyond_train_len"] for b in rep["buckets"])  # no --train-len: nothing is marked
    assert rep["documents"] == "reset" and "position in document" in capsys.readouterr().out


def test_ppl_auto_device_is_where_the_model_loads_and_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    status, seen, rep, *_ = _ppl_run(monkeypatch, tmp_path, ["--seq-len", "8", "--max-windows", "1"])
    assert status == 0
    assert seen["load"][1] == {"device": "cuda"} and seen["nll"][2]["device"] == "cuda"
    assert rep["provenance"]["options"]["device"] == "cuda"


def test_ppl_takes_hub_datasets_without_looking_for_files(monkeypatch, tmp_path, capsys):
    """``--data hf:NAME`` is streamed by token_stream: the check for missing files passes it over."""
    status, seen, *_ = _ppl_run(monkeypatch, tmp_path, ["--seq-len", "8", "--max-windows", "1", "--device", "cpu"],
                                    sources=["hf:owner/corpus"])
    assert status == 0 and seen["stream"][0] == ["hf:owner/corpus"]


@pytest.mark.parametrize("argv, message", [
    (["--train-len", "0"], "--train-len must be >= 1, got 0"),
    (["--seq-len", "8", "--buckets", "0,4,9"], "--buckets: "),
    (["--documents", "reset", "--seq-len", "8"], "--documents reset needs a tokenizer with an end-of-text token"),
])
def test_ppl_refuses_before_loading(argv, message, monkeypatch, tmp_path, capsys):
    status, seen, *_ = _ppl_run(monkeypatch, tmp_path, [*argv, "--device", "cpu"], eos=None)
    assert status == 2
    assert capsys.readouterr().err.startswith(f"falcon-fwa ppl: error: {message}")
    assert "nll" not in seen and ("load" not in seen or message.startswith("--documents"))


# ----------------------------------------------------------------------------------------------
# provenance, against git on a throwaway repository


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
                          cwd=cwd, capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git checkout ROOT with one commit, the package taken to live at ROOT/src/falcon_fwa."""
    from falcon_fwa import provenance

    root = tmp_path / "checkout"
    (root / "src" / "falcon_fwa").mkdir(parents=True)
    (root / "src" / "falcon_fwa" / "code.py").write_text("x = 1\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "one")
    monkeypatch.setattr(provenance, "PACKAGE_DIR", (root / "src" / "falcon_fwa").resolve())
    return root


def test_provenance_is_the_full_commit_and_whether_tracked_files_changed(repo):
    from falcon_fwa.provenance import command_provenance, git_commit, source_checkout

    head = _git(repo, "rev-parse", "HEAD")
    assert len(head) == 40 and source_checkout() == str(repo.resolve())
    assert git_commit(short=False) == head
    short = git_commit()
    assert head.startswith(short) and len(short) < 40
    args = argparse.Namespace(seq_len=8, data=["a.txt"])
    rec = command_provenance(args)
    assert rec == {"commit": head, "dirty": False, "options": {"seq_len": 8, "data": ["a.txt"]}}
    (repo / "notes.txt").write_text("untracked\n")  # no part of the code that ran
    assert command_provenance(args)["dirty"] is False
    (repo / "src" / "falcon_fwa" / "code.py").write_text("x = 2\n")
    assert command_provenance(args)["dirty"] is True


def test_provenance_names_no_commit_for_a_copy_in_another_repository_or_without_git(repo, tmp_path, monkeypatch):
    from falcon_fwa import provenance

    other = tmp_path / "other"
    other.mkdir()
    _git(other, "init", "-q")
    (other / "f").write_text("f")
    _git(other, "add", ".")
    _git(other, "commit", "-qm", "other")
    # cwd names the repository asked about; the checkout of the package plays no part then
    assert provenance.git_commit(short=False, cwd=str(other)) == _git(other, "rev-parse", "HEAD")
    # an installed copy inside another repository (site-packages in a project's checkout) has no commit
    (other / "lib" / "falcon_fwa").mkdir(parents=True)
    monkeypatch.setattr(provenance, "PACKAGE_DIR", (other / "lib" / "falcon_fwa").resolve())
    assert provenance.source_checkout() is None and provenance.git_commit() is None
    assert provenance.command_provenance(argparse.Namespace()) == {"commit": None, "dirty": None, "options": {}}
    # a repository with no commit yet: git fails, and its output is no commit
    (tmp_path / "empty").mkdir()
    _git(tmp_path / "empty", "init", "-q")
    assert provenance.git_commit(short=False, cwd=str(tmp_path / "empty")) is None  # git printed "HEAD"
    assert provenance.git_commit(cwd=str(tmp_path / "empty")) is None
    # no git program at all
    monkeypatch.setattr(provenance, "PACKAGE_DIR", (repo / "src" / "falcon_fwa").resolve())
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))
    assert provenance.git_commit(cwd=str(repo)) is None
    assert provenance.command_provenance(argparse.Namespace(a=1)) == {"commit": None, "dirty": None,
                                                                      "options": {"a": 1}}
