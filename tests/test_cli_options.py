"""Options every command shares (--device, --dtype) and the integer options that a division or
torch would refuse with a traceback: a bad value ends the command with one line naming it."""
import argparse
import importlib
import re

import pytest
import torch

from falcon_fwa import cli
from falcon_fwa.cli_options import at_least, dtype_option, resolve_device

# each command with the least it needs to reach its own checks (no model or data is read)
COMMANDS = {
    "addition": [],
    "addition-compare": [],
    "ppl": ["--model", "no/model", "--data", "no/data.txt"],
    "lm-eval": ["--model", "no/model", "--tasks", "piqa"],
    "throughput": ["--preset", "tiny-falcon"],
    "generate": ["--model", "no/model", "--prompt", "a"],
}


def _fails_naming(capsys, argv, named):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa {argv[0]}: error: {named}") and "Traceback" not in err, err


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("device", ["foo", "meta", "cuda:x"])
def test_a_bad_device_is_named(command, device, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    _fails_naming(capsys, [command, *COMMANDS[command], "--device", device], "--device")


def test_auto_and_the_devices_this_machine_has(monkeypatch):
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="^--device cuda: CUDA is not available here$"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="^--device cuda:2: this machine has 2 CUDA device"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("argv,named", [
    (["addition", "--threads", "-1"], "--threads"),
    (["addition", "--threads", "0"], "--threads"),  # 0 would otherwise mean "the preset's choice"
    (["addition-compare", "--threads", "0"], "--threads"),
    (["throughput", "--preset", "tiny-falcon", "--seq-len", "0"], "--seq-len"),
    (["throughput", "--preset", "tiny-falcon", "--batch-tokens", "0"], "--batch-tokens"),
    (["throughput", "--preset", "tiny-falcon", "--warmup", "-1"], "--warmup"),
    (["throughput", "--preset", "tiny-falcon", "--profile", "-1"], "--profile"),
    (["throughput", "--preset", "tiny-falcon:rule"], "--preset 'tiny-falcon:rule': 'rule' is not field=value"),
    (["throughput", "--preset", "tiny-falcon:rul=3"],
     "--preset 'tiny-falcon:rul=3': unknown config field 'rul' (did you mean 'rule'?)"),
    (["throughput", "--preset", "tiny-falcon:chunk_size=2.5"],
     "--preset 'tiny-falcon:chunk_size=2.5': config field 'chunk_size' must be an integer, got 2.5"),
    (["throughput", "--preset", "tiny-falcon", "--max-seconds", "nan"], "--max-seconds"),
    # inf, as compare's and scaling's --deadline (it passed a lower bound alone)
    (["throughput", "--preset", "tiny-falcon", "--max-seconds", "inf"], "--max-seconds must be a finite number >= 0"),
    (["throughput", "--preset", "tiny-falcon", "--deadline", "inf"], "--deadline must be a finite number > 0, got inf"),
    (["lm-eval", "--model", "no/model", "--tasks", "piqa", "--limit", "inf"], "--limit must be a finite number > 0"),
    # a seed torch.manual_seed cannot take, named as demo and generate name theirs (it was torch's
    # 'Overflow when unpacking long long'; addition-compare started its runs)
    (["addition", "--seed", "18446744073709551616"], "--seed must lie in [-2^63, 2^64), got 18446744073709551616"),
    (["addition-compare", "--seeds", "0", "-9223372036854775809"], "--seeds must lie in [-2^63, 2^64)"),
    (["throughput", "--preset", "tiny-falcon", "--deadline", "0"], "--deadline"),
    (["throughput", "--preset", "tiny-falcon", "--fp32", "--dtype", "bfloat16"], "--fp32 and --dtype bf16"),
    (["lm-eval", "--model", "no/model", "--tasks", "piqa", "--batch-size", "0"], "--batch-size"),
    (["lm-eval", "--model", "no/model", "--tasks", "piqa", "--num-fewshot", "-1"], "--num-fewshot"),
    (["lm-eval", "--model", "no/model", "--tasks", "piqa", "--limit", "0"], "--limit"),
    (["lm-eval", "--model", "no/model", "--tasks", "piqa", "--max-length", "0"], "--max-length"),
    (["lm-eval", "--model", "no/model", "--tasks", " , "], "--tasks"),
    (["ppl", "--model", "no/model", "--data", "no/data.txt", "--batch-size", "0"], "--batch-size"),
    (["ppl", "--model", "no/model", "--data", "no/data.txt", "--train-len", "-5"], "--train-len"),
    (["addition", "--window", "0"], "--window"),
    (["params", "--vocab-size", "0"], "--vocab-size must be >= 1, got 0"),
    (["addition", "--hidden-size", "0"], "--hidden-size"),
    (["addition", "--lr", "0"], "--lr"),
    (["addition", "--curriculum-steps", "-1"], "--curriculum-steps"),
    (["addition-compare", "--steps", "0"], "--steps"),
    (["data", "--train", "no/such.txt", "--out", "no/out", "--val-every", "1"], "--val-every"),
    (["data", "--train", "no/such.txt", "--out", "no/out", "--max-documents", "0"], "--max-documents"),
    (["data", "--train", "no/such.txt", "--out", "no/out", "--bpe-documents", "0"], "--bpe-documents"),
    (["addition", "--rule", "4"], "--rule: rule must be one of ['1', '1A', '2', '2A', '3', '3A'], got '4'"),
    (["throughput", "--preset", "tiny-falcon", "--steps", "0"], "--steps must be >= 1, got 0"),
    (["throughput", "--preset", "tiny-falcon", "--steps", "2", "--min-steps", "3"], "--steps (2) must be >= --min-steps"),
    # a model folder that is not there is named before the data are read or lm-eval is imported
    (["ppl", "--model", "./no/model", "--data", "no/data.txt"], "--model: model folder './no/model' does not exist"),
    (["lm-eval", "--model", "./no/model", "--tasks", "piqa"], "--model: model folder './no/model' does not exist"),
    (["generate", "--model", "./no/model", "--prompt", "a"], "--model: model folder './no/model' does not exist"),
    # a file is no model folder (it was taken for a hub id, then read by transformers as a config.json)
    (["ppl", "--model", "model.bin", "--data", "no/data.txt"], "--model 'model.bin' is a file, not a model folder"),
    (["lm-eval", "--model", "model.bin", "--tasks", "piqa"], "--model 'model.bin' is a file, not a model folder"),
    (["generate", "--model", "model.bin", "--prompt", "a"], "--model 'model.bin' is a file, not a model folder"),
])
def test_integer_options_out_of_range_are_named(argv, named, capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)  # the relative paths above: nothing lands in the checkout if a check is missed
    (tmp_path / "model.bin").write_bytes(b"weights")
    _fails_naming(capsys, argv, named)


@pytest.mark.parametrize("value, low, strict, message", [
    (0, 1, False, "--x must be >= 1, got 0"),
    (float("nan"), 0, False, "--x must be >= 0, got nan"),
    (0.0, 0, True, "--x must be > 0, got 0.0"),
])
def test_at_least_names_the_option_and_fails_nan(value, low, strict, message):
    at_least("--x", None, low, strict=strict)  # an option left out passes
    at_least("--x", low + 1, low, strict=strict)
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        at_least("--x", value, low, strict=strict)


def _parse(command, argv):
    module = importlib.import_module(cli.COMMANDS[command][0])
    parser = argparse.ArgumentParser(prog=f"falcon-fwa {command}")
    module.add_arguments(parser)
    return parser.parse_args([*COMMANDS[command], *argv])


@pytest.mark.parametrize("command,spellings,value", [
    ("addition", ("bf16", "bfloat16", "BF16"), "bfloat16"),
    ("addition", ("fp32", "float32"), "float32"),
    ("ppl", ("bf16", "bfloat16"), "bf16"),
    ("ppl", ("fp32", "float32"), "fp32"),
    ("generate", ("bf16", "bfloat16"), "bf16"),
    ("lm-eval", ("fp16", "float16"), "float16"),
    ("lm-eval", ("bf16", "bfloat16"), "bfloat16"),
    ("throughput", ("bf16", "bfloat16"), "bf16"),
    ("throughput", ("fp32", "float32"), "fp32"),
])
def test_every_command_takes_both_spellings_of_a_dtype(command, spellings, value):
    for text in spellings:
        assert _parse(command, ["--dtype", text]).dtype == value


@pytest.mark.parametrize("argv,bf16", [([], True), (["--dtype", "bf16"], True), (["--dtype", "float32"], False),
                                       (["--fp32"], False), (["--fp32", "--dtype", "fp32"], False)])
def test_throughput_dtype_reaches_the_measurement(argv, bf16, monkeypatch):
    from falcon_fwa.train import throughput
    seen = []
    monkeypatch.setattr(throughput, "measure", lambda config, **kw: seen.append(kw["bf16"]) or {})
    monkeypatch.setattr(throughput, "_append_row", lambda path, row: None)
    assert throughput.run(_parse("throughput", ["--device", "cpu", *argv])) == 0
    assert seen == [bf16]


def test_a_dtype_a_command_lacks_is_refused_naming_its_choices(capsys):
    parse = dtype_option(["fp32", "bf16"])
    for bad in ("fp16", "half", "int8"):
        with pytest.raises(argparse.ArgumentTypeError) as err:
            parse(bad)
        # the choices and only their spellings: fp16 is not offered where it is refused
        assert str(err.value) == f"must be one of fp32 (float32), bf16 (bfloat16), got {bad!r}"
    with pytest.raises(SystemExit) as stop:  # ppl takes fp32 and bf16 only
        _parse("ppl", ["--dtype", "float16"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("falcon-fwa ppl: error: argument --dtype: must be one of "
                                                         "fp32 (float32), bf16 (bfloat16), got 'float16'")


def test_a_bpe_tokenizer_without_an_integer_size_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    (tmp_path / "a.txt").write_text("some text to train on\n")
    argv = ["data", "--train", str(tmp_path / "a.txt"), "--out", str(tmp_path / "out"), "--tokenizer", "bpe:abc"]
    _fails_naming(capsys, argv, "--tokenizer bpe:N needs an integer N (the vocabulary size), got 'bpe:abc'")
    assert not (tmp_path / "out").exists()  # refused before the folder is made


def test_ppl_names_missing_data_before_it_loads_the_model(capsys, monkeypatch, tmp_path):
    """--data that names no file is refused naming the option, before the (slow) model load: the model
    folder here holds only an empty config.json, which loading would refuse."""
    from falcon_fwa.eval import ppl_cli

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.setattr(ppl_cli, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    missing = str(tmp_path / "held-out.txt")
    _fails_naming(capsys, ["ppl", "--model", str(tmp_path / "model"), "--data", missing, "--device", "cpu"],
                  f"--data: data source {missing!r} does not exist")
    (tmp_path / "empty").mkdir()
    _fails_naming(capsys, ["ppl", "--model", str(tmp_path / "model"), "--data", str(tmp_path / "empty"),
                           "--device", "cpu"], f"--data: data source {str(tmp_path / 'empty')!r} names no")


@pytest.mark.parametrize("argv,min_steps", [(["--steps", "1"], 1), (["--steps", "2"], 2), ([], 3),
                                            (["--steps", "8"], 3), (["--steps", "8", "--min-steps", "5"], 5)])
def test_throughput_min_steps_defaults_to_three_or_the_steps_asked(argv, min_steps, monkeypatch):
    """--min-steps left out is 3, or --steps where that is fewer (--steps 1 is a quick check, not an error)."""
    from falcon_fwa.train import throughput
    seen = []
    monkeypatch.setattr(throughput, "measure", lambda config, **kw: seen.append((kw["steps"], kw["min_steps"])) or {})
    monkeypatch.setattr(throughput, "_append_row", lambda path, row: None)
    assert throughput.run(_parse("throughput", ["--device", "cpu", *argv])) == 0
    steps = int(argv[argv.index("--steps") + 1]) if argv else 5
    assert seen == [(steps, min_steps)]


@pytest.mark.parametrize("argv, message", [
    (["data", "--train", "{data}", "--out", "{file}"], "--out '{file}' is a file, not a folder"),
    (["data", "--train", "{data}", "--out", "{file}/sub"], "--out '{file}/sub' lies under '{file}', which is a file"),
    (["train", "--config", "{recipe}", "--set", "train.out_dir={file}"], "train.out_dir '{file}' is a file"),
    (["train", "--config", "{recipe}", "--set", "train.out_dir={dir}/run", "--set", "data.out_dir={file}/data"],
     "data.out_dir '{file}/data' lies under '{file}', which is a file"),
    (["addition", "--out", "{file}"], "--out '{file}' is a file"),
    (["addition-compare", "--runs", "{file}"], "--runs '{file}' is a file"),
    (["addition-compare", "--runs", "{dir}/runs", "--results", "{file}"], "--results '{file}' is a file"),
    (["compare", "--configs", "{recipe}", "--out", "{file}", "--steps", "2"], "--out '{file}' is a file"),
    (["compare", "--configs", "{recipe}", "--out", "{dir}/cmp", "--results", "{dir}", "--steps", "2"],
     "--results '{dir}' is a folder: give the path of a file"),
    (["scaling", "--configs", "{recipe}", "--out", "{file}"], "--out '{file}' is a file"),
    (["scaling", "--configs", "{recipe}", "--out", "{dir}/s", "--results", "{file}/multigpu"],
     "--results '{file}/multigpu.json' lies under '{file}'"),
    (["ppl", "--model", "{model}", "--data", "{data}", "--out", "{dir}"], "--out '{dir}' is a folder"),
    (["ppl", "--model", "{model}", "--data", "{data}", "--plot", "{file}/p.png"], "--plot '{file}/p.png' lies under"),
    (["lm-eval", "--model", "{model}", "--tasks", "piqa", "--out", "{dir}"], "--out '{dir}' is a folder"),
    (["generate", "--model", "{model}", "--prompt", "a", "--json", "{dir}"], "--json '{dir}' is a folder"),
    (["params", "tiny-falcon", "--out", "{dir}"], "--out '{dir}' is a folder"),
    (["throughput", "--preset", "tiny-falcon", "--out", "{file}/rows.jsonl"], "--out '{file}/rows.jsonl' lies under"),
])
def test_an_output_path_of_the_wrong_kind_is_named_before_any_work(argv, message, capsys, monkeypatch, tmp_path):
    """A folder a command fills given as a file (or under one), a file it writes given as a folder: one line
    naming the option, before anything is read, loaded or written (it was a traceback, for ppl after the whole
    evaluation). The model folder holds only an empty config.json, which loading would refuse."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    places = {"file": tmp_path / "taken.txt", "dir": tmp_path / "folder", "model": tmp_path / "model",
              "data": tmp_path / "held.txt", "recipe": tmp_path / "recipe.yaml"}
    places["file"].write_text("not a folder\n")
    places["dir"].mkdir()
    places["model"].mkdir()
    (places["model"] / "config.json").write_text("{}")
    places["data"].write_text("some text\n")
    places["recipe"].write_text(f"model: {{preset: tiny-falcon}}\ndata: {{train_source: {places['data']}}}\n"
                                f"train: {{out_dir: {tmp_path / 'run'}}}\n")
    fill = lambda text: text.format(**{k: str(v) for k, v in places.items()})  # noqa: E731
    before = sorted(p.name for p in tmp_path.iterdir())
    _fails_naming(capsys, [fill(a) for a in argv], fill(message))
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not any(places["dir"].iterdir())
    assert places["file"].read_text() == "not a folder\n"


def test_a_restated_rule_in_any_case_is_the_same_model(monkeypatch):
    """``--model Falcon-3A.3 --rule 3a`` (docs/addition.md) is Falcon-3A.3 itself: its fields, which a resumed
    run is checked against, equal those of ``--model Falcon-3A.3`` (the run of rule '3a' was refused as
    another model's); a mixer's rule is kept by its canonical name too."""
    from falcon_fwa.tasks.addition.cli import model_fields

    plain = model_fields(_parse("addition", ["--model", "Falcon-3A.3"]))
    assert plain["rule"] == "3A"
    assert model_fields(_parse("addition", ["--model", "Falcon-3A.3", "--rule", "3a"])) == plain
    assert model_fields(_parse("addition", ["--model", "falcon", "--rule", "2a"]))["rule"] == "2A"


@pytest.mark.parametrize("argv, message", [
    (["train", "--config", "{missing}"], "--config '{missing}': no such file"),
    (["train", "--config", "{dir}"], "--config '{dir}': a folder, not a file"),
    (["compare", "--configs", "{recipe}", "{missing}", "--out", "{dir}/cmp", "--steps", "2"],
     "--configs '{missing}': no such file"),
    (["scaling", "--configs", "{missing}", "--out", "{dir}/s"], "--configs '{missing}': no such file"),
    (["throughput", "--config", "{missing}"], "--config '{missing}': no such file"),
])
def test_a_recipe_that_is_not_a_file_is_named_by_its_option(argv, message, capsys, monkeypatch, tmp_path):
    """A recipe path that names nothing (or a folder): one line naming the option and the path (it was
    Python's '[Errno 2] No such file or directory', naming no option), before any folder is made."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.chdir(tmp_path)
    places = {"missing": tmp_path / "nope.yaml", "dir": tmp_path / "folder", "recipe": tmp_path / "recipe.yaml"}
    places["dir"].mkdir()
    places["recipe"].write_text("model: {preset: tiny-falcon}\n")
    fill = lambda text: text.format(**{k: str(v) for k, v in places.items()})  # noqa: E731
    before = sorted(p.name for p in tmp_path.iterdir())
    _fails_naming(capsys, [fill(a) for a in argv], fill(message))
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not any(places["dir"].iterdir())
