"""``falcon-fwa throughput --config RECIPE`` measures the model that training the recipe builds: the preset's
vocabulary grown to the recipe's tokenizer (rounded up to a multiple of 64), so its parameter count is the
trained model's; where the tokenizer is not here without a download, the row says the preset's is used."""
import json

import pytest
import yaml
from test_train import recipe

from falcon_fwa import cli
from falcon_fwa.models import FalconForCausalLM, get_preset
from falcon_fwa.train import Trainer, config_from_dict

pytestmark = pytest.mark.usefixtures("one_thread")


def _rows(tmp_path, raw):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "rows.jsonl"
    assert cli.main(["throughput", "--config", str(path), "--steps", "1", "--warmup", "0", "--device", "cpu",
                     "--fp32", "--no-progress", "--out", str(out)]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def _trained_params(raw):
    trainer = Trainer(config_from_dict(raw))
    try:
        return trainer.n_params, trainer.core.config.vocab_size
    finally:
        trainer.close()


def test_a_byte_recipe_is_measured_with_the_vocabulary_training_grows_it_to(tmp_path):
    raw = recipe(tmp_path)  # tiny-falcon (a 64-token preset vocabulary), byte tokenizer: 257 tokens
    assert get_preset("tiny-falcon").vocab_size == 64
    row, = _rows(tmp_path, raw)
    params, vocab = _trained_params(raw)
    assert row["params"] == params and vocab == 320  # 257 rounded up to a multiple of 64
    assert row["vocab_size"] == 320 and "byte" in row["vocabulary"] and "257" in row["vocabulary"]
    # the embedding rows (tied to the output's) of the 256 tokens beyond the preset's: 256 x hidden_size 32
    preset = get_preset("tiny-falcon")
    assert preset.tie_word_embeddings and preset.hidden_size == 32
    preset_params = sum(p.numel() for p in FalconForCausalLM(preset).parameters())
    assert row["params"] == preset_params + (320 - 64) * 32


def test_a_prepared_bpe_recipe_is_measured_with_its_trained_vocabulary(tmp_path):
    raw = recipe(tmp_path)
    raw["data"]["tokenizer"] = "bpe:400"
    params, vocab = _trained_params(raw)  # prepares the data folder: the BPE as trained
    record = json.loads((tmp_path / "data" / "prepared.json").read_text())
    assert vocab == 64 * -(-record["vocab_size"] // 64)
    row, = _rows(tmp_path, raw)
    assert row["params"] == params
    assert row["vocab_size"] == vocab and str(tmp_path / "data") in row["vocabulary"]


def test_an_untrained_bpe_recipe_is_measured_with_its_largest_vocabulary(tmp_path):
    raw = recipe(tmp_path)
    raw["data"]["tokenizer"] = "bpe:400"
    raw["data"]["out_dir"] = str(tmp_path / "not-prepared")
    row, = _rows(tmp_path, raw)
    assert row["vocab_size"] == 448 and "not trained yet" in row["vocabulary"]  # 400 rounded up to 64s
    assert not (tmp_path / "not-prepared").exists()


def test_a_tokenizer_that_is_not_here_leaves_the_preset_vocabulary_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = recipe(tmp_path)
    raw["data"]["tokenizer"] = "nobody-here/no-such-tokenizer"
    row, = _rows(tmp_path, raw)
    assert row["vocab_size"] == 64 and row["vocabulary"].startswith("the preset's")
    assert "nobody-here/no-such-tokenizer" in row["vocabulary"]


def test_an_untrained_bpe_names_its_size_once_with_end_of_text_first(tmp_path):
    from falcon_fwa.train.config import config_from_dict
    from falcon_fwa.train.throughput import recipe_vocabulary

    raw = recipe(tmp_path)
    raw["data"].update(tokenizer="bpe:400", out_dir=str(tmp_path / "not-prepared"))
    size, eos, source = recipe_vocabulary(config_from_dict(raw))
    assert (size, eos) == (400, 0)  # the BPE trainer's one special token, end-of-text, is its first id
    row, = _rows(tmp_path, raw)
    assert row["vocabulary"] == "tokenizer bpe:400, not trained yet: its most tokens (400 tokens), as training sizes it"


def test_a_missing_tokenizer_folder_is_named_as_a_folder(tmp_path):
    raw = recipe(tmp_path)
    raw["data"]["tokenizer"] = str(tmp_path / "no-such-folder")
    row, = _rows(tmp_path, raw)
    assert row["vocab_size"] == 64 and f"tokenizer folder {tmp_path / 'no-such-folder'} does not exist" in row["vocabulary"]


@pytest.mark.parametrize("recipe_dtype,argv,bf16", [
    ("fp32", [], False), ("bf16", [], True), ("float32", [], False), ("bfloat16", [], True),
    ("fp32", ["--dtype", "bf16"], True), ("bf16", ["--fp32"], False), ("bf16", ["--dtype", "float32"], False)])
def test_a_recipe_is_measured_in_its_training_dtype_unless_dtype_is_given(tmp_path, monkeypatch, recipe_dtype, argv,
                                                                          bf16):
    """Training a recipe runs its train.dtype (bf16 autocast or none); without --dtype its measurement does the
    same, and a preset beside it keeps bf16; --dtype / --fp32 set both."""
    from falcon_fwa.train import throughput
    raw = recipe(tmp_path)
    raw["train"]["dtype"] = recipe_dtype
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    seen = []
    monkeypatch.setattr(throughput, "measure", lambda config, **kw: seen.append(kw["bf16"]) or {})
    out = tmp_path / "rows.jsonl"
    assert cli.main(["throughput", "--config", str(path), "--preset", "tiny-falcon", "--seq-len", "8", "--device",
                     "cpu", "--no-progress", "--out", str(out), *argv]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    preset_bf16 = bf16 if argv else True
    assert seen == [bf16, preset_bf16]
    assert [row["dtype"] for row in rows] == ["bf16" if b else "fp32" for b in (bf16, preset_bf16)]


def test_a_record_spelling_its_bpe_otherwise_is_measured_as_training_builds_it(tmp_path):
    """A data folder whose record spells the BPE ``bpe:0400`` (as preparations wrote it before the record held one
    spelling) is the recipe's ``bpe:400``: training reuses it, and the row measures the model training builds from
    its trained vocabulary, not the untrained BPE's largest one."""
    raw = recipe(tmp_path)
    raw["data"]["tokenizer"] = "bpe:400"
    path = tmp_path / "data" / "prepared.json"
    _trained_params(raw)  # prepares the data folder
    record = json.loads(path.read_text())
    record["spec"]["tokenizer"] = "bpe:0400"
    path.write_text(json.dumps(record))
    params, vocab = _trained_params(raw)  # trains on the folder as it is
    assert json.loads(path.read_text())["spec"]["tokenizer"] == "bpe:0400"  # reused, not prepared again
    assert vocab == 64 * -(-record["vocab_size"] // 64) < 448  # fewer tokens than 400 (rounded: 448) on this corpus
    row, = _rows(tmp_path, raw)
    assert row["params"] == params and row["vocab_size"] == vocab
    assert row["vocabulary"] == f"tokenizer bpe:400, as prepared in {tmp_path / 'data'} ({record['vocab_size']} tokens), " \
                                "as training sizes it"
