"""Sibling commands agree on how they take the same thing: a preset with fields changed
(``params`` as ``throughput --preset``), a dtype's spellings (``train.dtype`` as the ``--dtype`` of
``ppl`` and ``lm-eval``), what reaches the terminal (``throughput``: a table, the JSON rows in
``--out``), and the names in error messages (``lm-eval``: its own options)."""
from __future__ import annotations

import json
import re

import pytest
import torch

from falcon_fwa import cli


def _count(config) -> int:
    """Parameters of the model a config builds, each tensor counted once (tied embeddings too)."""
    from falcon_fwa.models import FalconForCausalLM

    torch.manual_seed(0)
    return sum(p.numel() for p in FalconForCausalLM(config).parameters())


def _total_column(stdout: str, preset: str) -> int:
    """The ``total`` column of ``preset``'s row of ``falcon-fwa params``'s markdown table."""
    header, *rows = [line for line in stdout.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0] == preset:
            return int(cells[columns.index("total")].split()[0].replace(",", ""))
    raise AssertionError(f"no row {preset!r} in {stdout}")


# ---- params takes throughput's NAME:field=value,... form ------------------------------------------------------

def test_params_counts_a_preset_with_fields_changed_as_throughput_names_it(capsys):
    from falcon_fwa.models import get_preset

    spec = "tiny-falcon:num_hidden_layers=1,intermediate_size=64"
    assert cli.main(["params", spec, "tiny-falcon"]) == 0
    out = capsys.readouterr().out
    changed = get_preset("tiny-falcon", num_hidden_layers=1, intermediate_size=64)
    assert _total_column(out, spec) == _count(changed)
    assert _total_column(out, "tiny-falcon") == _count(get_preset("tiny-falcon"))
    assert _count(changed) < _count(get_preset("tiny-falcon"))  # the fields did change the model


def test_params_vocab_size_applies_under_the_specs_own_fields(capsys):
    from falcon_fwa.models import get_preset

    assert cli.main(["params", "tiny-falcon:num_hidden_layers=1", "tiny-falcon:vocab_size=128",
                     "--vocab-size", "100"]) == 0
    out = capsys.readouterr().out
    assert _total_column(out, "tiny-falcon:num_hidden_layers=1") == _count(
        get_preset("tiny-falcon", num_hidden_layers=1, vocab_size=100))
    assert _total_column(out, "tiny-falcon:vocab_size=128") == _count(get_preset("tiny-falcon", vocab_size=128))


def test_params_and_throughput_read_a_spec_with_one_function(monkeypatch, capsys):
    from falcon_fwa.train import throughput

    seen, original = [], throughput.parse_preset
    monkeypatch.setattr(throughput, "parse_preset", lambda spec, *a, **kw: seen.append(spec) or original(spec, *a, **kw))
    assert cli.main(["params", "tiny-falcon:rule=1", "tiny-transformer"]) == 0
    assert seen == ["tiny-falcon:rule=1", "tiny-transformer"]


@pytest.mark.parametrize("spec, message", [
    ("tiny-falcon:rul=1", "PRESET 'tiny-falcon:rul=1': unknown config field 'rul' (did you mean 'rule'?)"),
    ("tiny-falcon:rule", "PRESET 'tiny-falcon:rule': 'rule' is not field=value"),
    ("no-such-preset", "PRESET 'no-such-preset': unknown preset 'no-such-preset'"),
])
def test_params_names_a_bad_spec_as_throughput_does(spec, message, capsys):
    assert cli.main(["params", spec]) == 2
    err = capsys.readouterr().err
    assert "falcon-fwa params: error: " + message in err, err
    # throughput says the same of the same spec, under its own option
    assert cli.main(["throughput", "--preset", spec, "--device", "cpu"]) == 2
    assert "falcon-fwa throughput: error: " + message.replace("PRESET", "--preset") in capsys.readouterr().err


# ---- train.dtype takes the spellings of ppl's and lm-eval's --dtype -------------------------------------------

# by hand: the torch dtype each spelling names
_SPELLINGS = {"fp32": torch.float32, "float32": torch.float32, "FP32": torch.float32,
              "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "BFloat16": torch.bfloat16}


def _dtype_option(command, value):
    """What ``falcon-fwa COMMAND --dtype value`` reads (argparse, the command's own parser)."""
    import argparse
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(cli.COMMANDS[command][0]).add_arguments(parser)
    required = {"ppl": ["--model", "m", "--data", "d"], "lm-eval": ["--model", "m", "--tasks", "t"]}[command]
    return parser.parse_args([*required, "--dtype", value]).dtype


def _train_config(tmp_path, dtype):
    from test_train import recipe

    from falcon_fwa.train import config_from_dict

    raw = recipe(tmp_path)
    raw["train"]["dtype"] = dtype
    return config_from_dict(raw)


@pytest.mark.parametrize("spelling", sorted(_SPELLINGS))
def test_train_dtype_takes_every_spelling_ppl_and_lm_eval_take_as_the_same_dtype(tmp_path, spelling):
    want = _SPELLINGS[spelling]
    for command in ("ppl", "lm-eval"):  # both commands take it, for the same dtype
        read = _dtype_option(command, spelling)
        assert getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}.get(read, read)) == want
    # the recipe's own spelling, which the trainer reads
    assert _train_config(tmp_path, spelling).train.dtype == {torch.float32: "fp32", torch.bfloat16: "bf16"}[want]


def _training_dtype(cfg):
    """The dtype of a matmul under the autocast of a trainer built on ``cfg`` (the training step's)."""
    from falcon_fwa.train import Trainer

    trainer = Trainer(cfg)
    try:
        with trainer.autocast():
            ones = torch.ones(4, 4, device=trainer.info.device)  # (on the device the trainer trains on)
            return (ones @ ones).dtype
    finally:
        trainer.close()


@pytest.mark.parametrize("spelling", ["float32", "bfloat16"])
def test_a_recipe_spelling_dtype_as_torch_does_trains_in_that_dtype(tmp_path, spelling):
    assert _training_dtype(_train_config(tmp_path, spelling)) == _SPELLINGS[spelling]


@pytest.mark.parametrize("spelling", ["float32", "bfloat16", "BFloat16"])
def test_a_dtype_assigned_after_validation_trains_in_that_dtype(tmp_path, spelling):
    # the trainer reads any spelling itself: a field assigned on a built config is not validated again
    cfg = _train_config(tmp_path, "fp32" if _SPELLINGS[spelling] == torch.bfloat16 else "bf16")
    cfg.train.dtype = spelling
    assert _training_dtype(cfg) == _SPELLINGS[spelling]


@pytest.mark.parametrize("value", ["fp16", "float16", "int8"])
def test_train_dtype_refuses_another_value_listing_the_accepted_spellings(tmp_path, value):
    with pytest.raises(ValueError) as err:
        _train_config(tmp_path, value)
    message = str(err.value)
    assert message.startswith("config field train.dtype") and repr(value) in message
    for spelling in ("bf16", "bfloat16", "fp32", "float32"):
        assert spelling in message, message


# ---- throughput --table: a table on standard output, the JSON rows in --out ------------------------------------
# (without --table standard output keeps the JSON rows, which scripts and tests read)

def test_throughput_table_prints_a_table_and_keeps_the_json_rows_in_out(tmp_path, capsys):
    from falcon_fwa.models import get_preset

    out = tmp_path / "rows.jsonl"
    presets = ["tiny-falcon", "tiny-transformer"]
    assert cli.main(["throughput", "--preset", *presets, "--seq-len", "8", "--batch-tokens", "16", "--steps", "1",
                     "--warmup", "0", "--device", "cpu", "--fp32", "--no-progress", "--out", str(out), "--table"]) == 0
    captured = capsys.readouterr()
    stdout = captured.out
    assert captured.err == ""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["preset"] for r in rows] == presets and all("step_s" in r and "launch" in r for r in rows)
    lines = stdout.splitlines()
    for line in lines:  # no JSON on the terminal
        with pytest.raises(ValueError):
            json.loads(line)
    header, *body = lines
    assert header.split()[:2] == ["preset", "seq_len"] and "params" in header and "tokens/s" in header
    assert "peak MiB" in header and "backend" in header
    assert len(body) == len(presets)
    for line, row, preset in zip(body, rows, presets):
        cells = line.split()
        assert cells[0] == preset and cells[1] == "8" and cells[2] == "2"  # batch: 16 tokens // 8
        assert cells[3] == f"{_count(get_preset(preset)):,}"  # the parameters, counted here
        assert cells[4] == f"{2 * 8 / row['step_s']:,.0f}"  # tokens of the step over its seconds
        assert cells[5] == "-"  # no device memory on the CPU
        assert cells[6] == {"tiny-falcon": "torch", "tiny-transformer": "none"}[preset]


def test_throughput_table_reads_peak_memory_in_mib_and_says_why_a_row_has_no_speed():
    from falcon_fwa.train.throughput import _table_header, _table_line

    width = len("falcon-1a.3-130m")
    row = {"preset": "falcon-1a.3-130m", "seq_len": 2048, "batch_size": 8, "params": 129_123_456,
           "tokens_per_s": 123_456.7, "peak_mem_bytes": 5 * 2 ** 30 + 2 ** 19, "falcon_op": "triton",
           "stopped": None, "steady": True, "timed_steps": 5}
    cells = _table_line(row, width).split()
    assert cells == ["falcon-1a.3-130m", "2048", "8", "129,123,456", "123,457", "5,120.5", "triton"]
    assert _table_line(row, width).index("129,123,456") + len("129,123,456") == _table_header(width).index(
        "params") + len("params")  # numbers right-aligned under their column's name
    skipped = {"preset": "tiny-falcon", "seq_len": 8, "batch_size": 2, "skipped": "--deadline 1 s passed"}
    assert _table_line(skipped, width).split()[3:] == ["-", "-", "-", "-", "skipped:", "--deadline", "1", "s",
                                                       "passed"]
    stopped = {**row, "stopped": "deadline", "steady": False, "timed_steps": 1}
    assert _table_line(stopped, width).endswith("stopped: deadline after 1 timed step(s), not steady")


def test_throughput_table_without_out_says_the_rows_are_not_kept(capsys):
    assert cli.main(["throughput", "--preset", "tiny-transformer", "--seq-len", "4", "--batch-tokens", "4", "--steps",
                     "1", "--warmup", "0", "--device", "cpu", "--fp32", "--no-progress", "--table"]) == 0
    captured = capsys.readouterr()
    assert "--table without --out keeps no rows" in captured.err
    header, line = captured.out.splitlines()
    assert line.split()[:3] == ["tiny-transformer", "4", "1"]


# ---- lm-eval: errors name the command's options, not the harness's arguments ----------------------------------

def _lm_eval_error(argv, capsys) -> str:
    assert cli.main(["lm-eval", *argv]) == 2
    err = capsys.readouterr().err
    assert "falcon-fwa lm-eval: error: " in err, err
    # no argument name of harness.evaluate or lm-evaluation-harness in place of an option
    assert not re.search(r"(?<![-\w])(include_path|model_dir|tasks|max_length)(?![\w-])", err), err
    return err


def test_lm_eval_errors_name_its_options(tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from test_eval import model_folder_and_tasks

    folder, yaml_dir = model_folder_and_tasks(tmp_path)
    model = ["--model", str(folder)]
    err = _lm_eval_error([*model, "--tasks", "local_mc", "--include-path", str(tmp_path / "nope")], capsys)
    assert f"--include-path {str(tmp_path / 'nope')!r} is not a folder of task YAML files" in err
    err = _lm_eval_error([*model, "--tasks", "local_mc"], capsys)  # a local task, no folder of them
    assert "--tasks: unknown 'local_mc' (local task YAML files need --include-path)" in err
    err = _lm_eval_error([*model, "--tasks", "local_mc", "--include-path", str(yaml_dir)], capsys)
    assert f"--model: model folder {str(folder)!r} holds no tokenizer" in err


@pytest.mark.parametrize("argv, message", [
    (["--tasks", " , "], "--tasks must name at least one task"),
    (["--tasks", "piqa", "--max-length", "0"], "--max-length must be >= 1, got 0"),
    (["--tasks", "piqa", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
])
def test_lm_eval_option_errors_before_the_harness_name_the_option(tmp_path, argv, message, capsys):
    # refused before lm-evaluation-harness is imported: these need no harness
    assert message in _lm_eval_error(["--model", str(tmp_path), *argv], capsys)


def test_evaluate_names_its_own_arguments_when_called_from_python(tmp_path):
    pytest.importorskip("lm_eval")
    from falcon_fwa.eval.harness import evaluate

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"^include_path '.*' is not a folder"):
        evaluate(str(folder), ["local_mc"], include_path=str(tmp_path / "nope"))
