"""A recipe's ``model.overrides.vocab_size`` is checked with the rest of the recipe, before the data are tokenized."""
import json

import pytest
import yaml

from falcon_fwa import cli
from falcon_fwa.train.config import config_from_dict
from falcon_fwa.train.model_factory import build_model


def _raw(tmp_path, **overrides):
    return {"model": {"preset": "tiny-falcon", "overrides": overrides},
            "data": {"train_source": str(tmp_path / "corpus.jsonl"), "out_dir": str(tmp_path / "data"),
                     "seq_len": 16, "val_every": 4},
            "optim": {"warmup_steps": 0},
            "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "dtype": "fp32", "out_dir": str(tmp_path / "run"),
                      "save_every": 0, "eval_every": 0, "export_model": False},
            "log": {"every": 1, "progress": False, "tensorboard": False, "plot": False}}


@pytest.mark.parametrize("value", [0, -3, 2.5, "320", "abc", True, None, [320]])
def test_an_invalid_vocab_size_override_is_refused_by_the_recipe_check(tmp_path, value):
    with pytest.raises(ValueError) as err:
        config_from_dict(_raw(tmp_path, vocab_size=value))
    message = str(err.value)
    assert message.startswith("config field model.overrides.vocab_size must be an integer >= 1")
    assert message.endswith(f"got {value!r}")


def test_the_train_command_refuses_it_before_the_data_are_prepared(tmp_path, capsys):
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for n in range(40):
            f.write(json.dumps({"text": f"document {n} of the corpus"}) + "\n")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(_raw(tmp_path)))
    assert cli.main(["train", "--config", str(path), "--set", "model.overrides.vocab_size=0"]) == 2
    err = capsys.readouterr().err
    assert "model.overrides.vocab_size must be an integer >= 1" in err and "got 0" in err
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, expected", [
    ({}, 320),  # tiny-falcon's 64 grows to the byte tokenizer's 257, rounded up to a multiple of 64
    ({"vocab_size": 300}, 300),  # a given size is kept as it is
    ({"vocab_size": 512.0}, 512),  # a number of integral value, as a JSON recipe may write it
])
def test_a_valid_or_absent_vocab_size_still_builds(tmp_path, overrides, expected):
    cfg = config_from_dict(_raw(tmp_path, **overrides))
    assert build_model(cfg.model, vocab_size=257, eos_token_id=256).config.vocab_size == expected


def test_a_vocab_size_below_the_tokenizers_is_still_refused_when_the_model_is_built(tmp_path):
    cfg = config_from_dict(_raw(tmp_path, vocab_size=200))  # a valid size: the tokenizer is not known yet
    with pytest.raises(ValueError, match="model.overrides.vocab_size = 200 is smaller than the tokenizer's 257"):
        build_model(cfg.model, vocab_size=257, eos_token_id=0)  # (an end-of-text id within the 200)


def test_a_vocab_size_below_the_tokenizers_is_named_even_where_the_end_of_text_id_falls_outside_it(tmp_path):
    # the byte tokenizer's end-of-text id 256 lies outside a vocabulary of 200: the refusal still names the override
    cfg = config_from_dict(_raw(tmp_path, vocab_size=200))
    with pytest.raises(ValueError, match="model.overrides.vocab_size = 200 is smaller than the tokenizer's 257"):
        build_model(cfg.model, vocab_size=257, eos_token_id=256)


def test_build_model_refuses_an_end_of_text_override_by_its_name(tmp_path):
    # the recipe check refuses it; a section built without that check (a caller of build_model) is refused alike,
    # by the field's name, rather than with get_preset's TypeError for a keyword given twice
    cfg = config_from_dict(_raw(tmp_path))
    cfg.model.overrides["eos_token_id"] = 3
    with pytest.raises(ValueError, match=r"model\.overrides\.eos_token_id: the end-of-text id is the tokenizer's"):
        build_model(cfg.model, vocab_size=257, eos_token_id=256)
    with pytest.raises(ValueError, match=r"model\.overrides\.eos_token_id: the end-of-text id is the tokenizer's"):
        config_from_dict(_raw(tmp_path, eos_token_id=3))


def test_lm_eval_help_states_the_batch_size_default_it_uses():
    import argparse
    import re

    from falcon_fwa.eval.lm_eval_cli import add_arguments

    parser = argparse.ArgumentParser(prog="lm-eval", formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    stated = re.search(r"--batch-size BATCH_SIZE requests per forward pass \(default: (\d+)\)", help_text)
    assert stated is not None, help_text
    assert int(stated.group(1)) == parser.parse_args(["--model", "m", "--tasks", "t"]).batch_size
