"""A ``--tokenizer`` folder deleted whole is no obstacle to reusing the folder prepared with it (``tokenizer/`` holds
the copy the shards were written with), whichever spelling names it: ``prepared.json`` records the folder by its
absolute path, and a relative spelling of a folder that is gone names that path from the working folder. ``byte``
stays the byte tokenizer even where a folder named ``byte`` was prepared with and is gone."""
import json
import shutil

from test_data_sources import run_data, words

from falcon_fwa.data.tokenizer import train_bpe_tokenizer


def _corpus(tmp_path):
    src = tmp_path / "corpus"
    src.mkdir()
    for i, doc in enumerate(words(30, 3)):
        (src / f"{i:02d}.txt").write_text(doc)
    return src


def test_a_relative_tokenizer_folder_deleted_whole_reuses_the_prepared_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path)
    train_bpe_tokenizer(words(80, 4), 300).save_pretrained(tmp_path / "tok")
    argv = ["--train", "corpus", "--val-every", 5, "--out", "out"]
    status, record, err = run_data(capsys, *argv, "--tokenizer", "tok")
    assert status == 0 and record["spec"]["tokenizer"] == str(tmp_path / "tok"), err
    shutil.rmtree(tmp_path / "tok")
    for spelling in ("tok", "./tok/", str(tmp_path / "tok")):  # each names the folder that is gone
        status, again, err = run_data(capsys, *argv, "--tokenizer", spelling)
        assert (status, again) == (0, record), (spelling, err)
    # another folder that is gone, and the byte tokenizer, are other settings
    for other in ("./other", "byte"):
        status, _, err = run_data(capsys, *argv, "--tokenizer", other)
        assert status == 2 and "prepared with other settings" in err, (other, err)


def test_byte_is_no_deleted_folder_named_byte(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path)
    train_bpe_tokenizer(words(80, 4), 300).save_pretrained(tmp_path / "byte")
    argv = ["--train", "corpus", "--val-every", 5, "--out", "out"]
    status, record, err = run_data(capsys, *argv, "--tokenizer", "./byte")
    assert status == 0 and record["spec"]["tokenizer"] == str(tmp_path / "byte") and record["vocab_size"] == 300, err
    shutil.rmtree(tmp_path / "byte")
    status, again, err = run_data(capsys, *argv, "--tokenizer", "./byte")
    assert (status, again) == (0, record), err
    status, _, err = run_data(capsys, *argv, "--tokenizer", "byte")  # the byte tokenizer: 257 tokens, not these
    assert status == 2 and "prepared with other settings" in err, err


def test_throughput_finds_the_record_of_a_recipe_whose_relative_tokenizer_folder_is_gone(tmp_path, monkeypatch):
    """``throughput --config`` sizes the vocabulary from the recipe's prepared folder, as its training reuses it:
    also where ``data.tokenizer`` names, by a relative path, a folder deleted since."""
    from test_train import recipe

    from falcon_fwa.train import Trainer, config_from_dict
    from falcon_fwa.train.throughput import recipe_vocabulary

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    train_bpe_tokenizer(words(80, 4), 300).save_pretrained(tmp_path / "tok")
    raw = recipe(tmp_path)
    raw["data"]["tokenizer"] = "tok"
    Trainer(config_from_dict(raw)).close()  # prepares the data folder with the tokenizer of 300 tokens
    record = json.loads((tmp_path / "data" / "prepared.json").read_text())
    assert record["vocab_size"] == 300 and record["spec"]["tokenizer"] == str(tmp_path / "tok")
    shutil.rmtree(tmp_path / "tok")
    size, eos, where = recipe_vocabulary(config_from_dict(raw))
    assert (size, eos) == (300, record["eos_token_id"]) and str(tmp_path / "data") in where, where
