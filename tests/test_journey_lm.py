"""The language-model pipeline of docs/training.md as a user first walks it: a recipe copied out of
``configs/small`` without the ``base.yaml`` it extends, an ``extends`` that names no file, ``log.wandb_project``
without the package, and ``compare`` on a recipe and a variant that extends it. Each mistake ends the command
with one line that names the recipe or field and what to do (exit status 2), before any data is tokenized."""
import json
import os
import sys

import pytest
import yaml

from falcon_fwa import cli
from falcon_fwa.train import Trainer, config_from_dict, load_config
from falcon_fwa.train.config import recipe_parent

LINES = ["A fast weight memory is written one token at a time.", "The state is a linear model trained online."]


def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(LINES[i % 2] for i in range(200)))  # 200 one-line documents
    return str(path)


def recipe(tmp_path, **train):
    return {
        "model": {"preset": "tiny-falcon", "overrides": {"rule": "3A", "window": 4}},
        "data": {"train_source": corpus(tmp_path), "text_split": "line", "val_every": 10, "seq_len": 16,
                 "out_dir": str(tmp_path / "data")},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": 2, "global_batch": 2, "micro_batch": 2, "dtype": "fp32", "eval_batches": 1,
                  "out_dir": str(tmp_path / "run"), **train},
        "log": {"every": 1, "tensorboard": False, "progress": False, "plot": False},
    }


def test_a_recipe_copied_without_its_base_names_the_recipe_and_its_extends(tmp_path, capsys):
    """configs/small/falcon-1a.3.yaml copied alone: its ``extends: base.yaml`` is read next to the copy, where
    no base.yaml is. The error names the copy, the ``extends`` value and the path it was looked for at, as a
    ValueError (the command's one-line error, exit status 2), not a bare file-not-found."""
    src = os.path.join(os.path.dirname(__file__), "..", "configs", "small", "falcon-1a.3.yaml")
    copy = tmp_path / "mine.yaml"
    copy.write_text(open(src).read())
    assert yaml.safe_load(copy.read_text())["extends"] == "base.yaml"
    missing = str(tmp_path / "base.yaml")
    with pytest.raises(ValueError) as err:
        load_config(str(copy))
    assert "mine.yaml" in str(err.value) and "extends 'base.yaml'" in str(err.value)
    assert repr(missing) in str(err.value) and "does not exist" in str(err.value)
    with pytest.raises(ValueError, match="extends 'base.yaml'"):  # compare reads the parent the same way
        recipe_parent(str(copy))

    assert cli.main(["train", "--config", str(copy)]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert err_lines[0].startswith("falcon-fwa train: error: recipe ") and "extends 'base.yaml'" in err_lines[0]
    assert "Traceback" not in "\n".join(err_lines)
    assert not (tmp_path / "run").exists()

    (tmp_path / "base.yaml").write_text(open(os.path.join(os.path.dirname(src), "base.yaml")).read())
    cfg = load_config(str(copy))  # with the base beside it, the chain merges: the base's fields, the copy's model
    assert cfg.data.seq_len == 512 and cfg.train.steps == 1500 and cfg.model.overrides["hidden_size"] == 384


@pytest.mark.parametrize("value", ["3", "[a.yaml, b.yaml]", "{file: a.yaml}", "''"])
def test_an_extends_that_is_no_file_name_is_refused_by_name(tmp_path, value):
    """``extends: 3`` or a list is no file name: a ValueError naming the recipe and the value, not a TypeError
    from joining paths."""
    path = tmp_path / "r.yaml"
    path.write_text(f"extends: {value}\n")
    with pytest.raises(ValueError, match=r"r\.yaml': extends must name a recipe file") as err:
        load_config(str(path))
    assert repr(yaml.safe_load(value)) in str(err.value)


def test_an_extends_naming_a_folder_is_refused_by_name(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "r.yaml"
    path.write_text("extends: sub\n")
    with pytest.raises(ValueError, match=r"extends 'sub', but .*sub' is a folder, not a file"):
        load_config(str(path))


def test_wandb_project_without_the_package_is_refused_before_the_data_is_tokenized(tmp_path, monkeypatch):
    """``log.wandb_project`` set where ``wandb`` does not import: a ValueError naming the field and the package,
    raised before the corpus is tokenized and before the run folder is made (no traceback after the data work)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # ``import wandb`` raises ImportError, installed or not
    with pytest.raises(ImportError):
        import wandb  # noqa: F401
    cfg = config_from_dict(recipe(tmp_path))
    cfg.log.wandb_project = "journey"
    with pytest.raises(ValueError, match=r"log\.wandb_project='journey' needs the wandb package"):
        Trainer(cfg)
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


def test_compare_on_a_recipe_and_a_variant_that_extends_it(tmp_path, capsys):
    """Listing a recipe and a variant that extends it is refused (the recipe is taken for their shared base);
    the error says how to compare both, and the way it gives (a file holding only ``extends: RECIPE``)
    trains the two models: the same recipe but for the rule, so 3A and 2A at their own parameter counts."""
    base = tmp_path / "tiny.yaml"
    base.write_text(yaml.safe_dump(recipe(tmp_path)))
    variant = tmp_path / "tiny-2a.yaml"
    variant.write_text("extends: tiny.yaml\nmodel: {overrides: {rule: '2A'}}\n")
    out = tmp_path / "cmp"
    assert cli.main(["compare", "--configs", str(base), str(variant), "--out", str(out), "--steps", "2"]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert "tiny.yaml is the base that" in line and "holds only 'extends: tiny.yaml'" in line
    assert not out.exists()

    alone = tmp_path / "tiny-3a.yaml"
    alone.write_text("extends: tiny.yaml\n")
    assert cli.main(["compare", "--configs", str(alone), str(variant), "--names", "F3A", "F2A",
                     "--out", str(out), "--steps", "2"]) == 0
    report = json.loads((out / "compare.json").read_text())
    runs = report["runs"]
    assert [runs[n]["status"] for n in ("F3A", "F2A")] == ["done", "done"]
    configs = {n: json.loads((out / "main" / n / "model" / "config.json").read_text()) for n in ("F3A", "F2A")}
    assert configs["F3A"]["rule"] == "3A" and configs["F2A"]["rule"] == "2A"
    assert configs["F3A"]["window"] == configs["F2A"]["window"] == 4  # the base's overrides reach both

    capsys.readouterr()
    # the compare folder given where a model folder belongs: the error lists the models inside it
    assert cli.main(["generate", "--model", str(out), "--prompt", "x"]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert "it is a compare folder" in line
    assert str(out / "main" / "F3A" / "model") in line and str(out / "main" / "F2A" / "model") in line


def test_the_model_of_a_run_stopped_before_its_end_is_named_as_not_exported_yet(tmp_path, capsys):
    """``--stop-at 1`` of a 2-step run leaves a checkpoint and no ``model/``: ``ppl --model RUN/model`` says the
    run has not reached ``train.steps`` and that the same train command finishes it; a folder that is no run
    gets no such hint."""
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path)))
    assert cli.main(["train", "--config", str(path), "--stop-at", "1"]) == 0
    assert (tmp_path / "run" / "checkpoints").is_dir() and not (tmp_path / "run" / "model").exists()
    capsys.readouterr()
    assert cli.main(["ppl", "--model", str(tmp_path / "run" / "model"), "--data", corpus(tmp_path),
                     "--seq-len", "8"]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert "does not exist" in line and "has not reached train.steps" in line
    assert cli.main(["ppl", "--model", str(tmp_path / "elsewhere" / "model"), "--data", corpus(tmp_path),
                     "--seq-len", "8"]) == 2
    line = capsys.readouterr().err.splitlines()[0]
    assert "does not exist" in line and "train.steps" not in line


def _error_lines(err: str, prog: str):
    """The lines of ``err`` (carriage returns, as a progress bar redraws, split too) that hold ``PROG: error:``."""
    return [line for line in err.replace("\r", "\n").splitlines() if f"{prog}: error:" in line]


def test_an_error_inside_the_tokenizing_bar_is_printed_on_a_line_of_its_own(tmp_path, capsys):
    """``data`` on JSONL whose records lack ``--text-field`` fails inside the tokenizing loop: the progress bar's
    line ends before the one-line error, which starts its own line (not run on after the bar)."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i}", "id": i}) + "\n" for i in range(40)))
    assert cli.main(["data", "--train", str(path), "--text-field", "txt", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "tokenize train" in err  # the bar was drawn
    lines = _error_lines(err, "falcon-fwa data")
    assert len(lines) == 1 and lines[0].startswith("falcon-fwa data: error: ") and "'txt'" in lines[0]
    assert not (tmp_path / "d").exists()


def test_a_non_finite_loss_under_the_training_bar_is_printed_on_a_line_of_its_own(tmp_path, capsys):
    """A learning rate of 1e30 without clipping makes the gradient norm non-finite within a few steps: exit
    status 3, and the error starts a line of its own after the progress bar's."""
    raw = recipe(tmp_path, steps=8, save_every=100)
    raw["optim"] = {"lr": 1e30, "warmup_steps": 1, "clip_grad_norm": 0}
    raw["log"]["progress"] = True
    path = tmp_path / "nan.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["train", "--config", str(path)]) == 3
    err = capsys.readouterr().err
    assert "train:" in err
    lines = _error_lines(err, "falcon-fwa train")
    assert len(lines) == 1 and lines[0].startswith("falcon-fwa train: error: non-finite")
