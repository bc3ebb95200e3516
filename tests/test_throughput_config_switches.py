"""``falcon-fwa throughput --config RECIPE`` measures the recipe as its training runs: compiled where its
``train.compile`` is true, with activation checkpointing where its ``train.activation_checkpointing`` is, each
without the command's option; ``--compile`` and ``--activation-checkpointing`` turn them on where the recipe leaves
them off, and a preset measured beside it takes the options alone."""
import json

import pytest
import torch
import yaml
from test_train import recipe

from falcon_fwa import cli
from falcon_fwa.models.modeling import FalconBlock
from falcon_fwa.train import throughput

pytestmark = pytest.mark.usefixtures("one_thread")


def _recipe_file(tmp_path, **train):
    raw = recipe(tmp_path)
    raw["train"].update(train)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


@pytest.mark.parametrize("compile_field", [False, True])
@pytest.mark.parametrize("checkpointing_field", [False, True])
@pytest.mark.parametrize("options", [[], ["--compile"], ["--activation-checkpointing"],
                                     ["--compile", "--activation-checkpointing"]])
def test_the_recipes_fields_and_the_options_reach_the_measurement(tmp_path, monkeypatch, compile_field,
                                                                  checkpointing_field, options):
    path = _recipe_file(tmp_path, compile=compile_field, activation_checkpointing=checkpointing_field)
    seen = []
    monkeypatch.setattr(throughput, "measure", lambda config, **kw: seen.append(
        (kw["compile"], kw["activation_checkpointing"])) or {})
    out = tmp_path / "rows.jsonl"
    assert cli.main(["throughput", "--config", path, "--preset", "tiny-falcon", "--seq-len", "8", "--device", "cpu",
                     "--no-progress", "--out", str(out), *options]) == 0
    by_option = ("--compile" in options, "--activation-checkpointing" in options)
    assert seen == [(compile_field or by_option[0], checkpointing_field or by_option[1]), by_option]


def test_a_recipe_with_activation_checkpointing_runs_each_block_again_in_the_backward(tmp_path, monkeypatch):
    """One step of a real measurement: each block's computation runs once per step without checkpointing and twice
    with (again in the backward), as the recipe's training would; the row says so."""
    calls = []
    real_forward = FalconBlock._forward  # the block's computation, which checkpointing runs again

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real_forward(self, *args, **kwargs)

    monkeypatch.setattr(FalconBlock, "_forward", counted)
    rows = []
    for checkpointing in (False, True):
        folder = tmp_path / str(checkpointing)
        folder.mkdir()
        path = _recipe_file(folder, activation_checkpointing=checkpointing)
        out = folder / "rows.jsonl"
        calls.clear()
        assert cli.main(["throughput", "--config", path, "--steps", "1", "--warmup", "0", "--device", "cpu",
                         "--fp32", "--no-progress", "--out", str(out)]) == 0
        row, = [json.loads(line) for line in out.read_text().splitlines()]
        rows.append((row["activation_checkpointing"], len(calls), all(calls)))
    blocks = throughput.parse_preset("tiny-falcon").num_hidden_layers
    assert blocks > 1 and rows == [(False, blocks, True), (True, 2 * blocks, True)]


def test_a_recipe_with_train_compile_is_compiled(tmp_path, monkeypatch):
    """A real measurement of a recipe with ``train.compile: true``, no ``--compile``: its model is compiled
    (``nn.Module.compile`` is recorded here and the model left eager, to keep the test short) and the row says
    ``compiled``; the same recipe with ``train.compile: false`` is not."""
    compiled = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *args, **kwargs: compiled.append(type(self).__name__))
    seen = []
    for field in (False, True):
        folder = tmp_path / str(field)
        folder.mkdir()
        out = folder / "rows.jsonl"
        compiled.clear()
        assert cli.main(["throughput", "--config", _recipe_file(folder, compile=field), "--steps", "1", "--warmup",
                         "0", "--device", "cpu", "--fp32", "--no-progress", "--out", str(out)]) == 0
        row, = [json.loads(line) for line in out.read_text().splitlines()]
        seen.append((row["compiled"], list(compiled)))
    assert seen == [(False, []), (True, ["FalconForCausalLM"])]
