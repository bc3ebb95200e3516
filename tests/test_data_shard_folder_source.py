"""A token shard folder named as a source (``--train prep/train`` of an earlier ``--out prep``, a glob over it, its
``meta.json``) is refused by the option and the path, as a prepared shard folder, saying what to give instead: its
tokens are no text, and its ``meta.json`` no JSON Lines to read records from."""
import pytest

from falcon_fwa.data.prepare import DataSpec, prepare_dataset
from test_data_sources import run_data


@pytest.fixture
def prep(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("".join(f"line {n}\n" for n in range(8)))
    prepare_dataset(DataSpec(train_source="c.txt", text_split="line", val_every=2), "prep")
    return tmp_path


def _error(err):
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0].split("error: ", 1)[1]


@pytest.mark.parametrize("argv, option, source, named", [
    (["--train", "prep/train"], "--train", "prep/train", "is a prepared token shard folder"),
    (["--train", "c.txt", "--val", "prep/val"], "--val", "prep/val", "is a prepared token shard folder"),
    (["--train", "prep/train/*"], "--train", "prep/train/*", "names the prepared token shard folder 'prep/train'"),
    (["--train", "prep/train/meta.json"], "--train", "prep/train/meta.json",
     "names the prepared token shard folder 'prep/train'"),
])
def test_a_shard_folder_of_a_preparation_is_refused_naming_the_option_and_the_preparation(prep, capsys, argv, option,
                                                                                          source, named):
    status, _, err = run_data(capsys, *argv, "--out", "new")
    assert status == 2 and not (prep / "new").exists(), err
    message = _error(err)
    assert message.startswith(f"{option} {source!r} {named} (meta.json, tokens-*.bin), no text to tokenize: "), message
    assert "give its preparation 'prep' as the recipe's data.out_dir (falcon-fwa train --set data.out_dir=prep)" \
        in message and "not a JSON record" not in message, message


def test_a_shard_folder_apart_from_a_preparation_asks_for_its_text(prep, capsys):
    """A split copied into a corpus folder, no prepared.json beside it: the files it came from are asked for; a
    recipe names the setting as the recipe does."""
    (prep / "corpus").mkdir()
    (prep / "corpus" / "a.txt").write_text("some text")
    (prep / "prep" / "val").rename(prep / "corpus" / "val")
    status, _, err = run_data(capsys, "--train", "corpus", "--out", "new")
    assert status == 2 and not (prep / "new").exists(), err
    assert _error(err) == ("--train 'corpus' names the prepared token shard folder 'corpus/val' (meta.json, "
                           "tokens-*.bin), no text to tokenize: give the text, JSON or Parquet files it was tokenized "
                           "from")
    with pytest.raises(ValueError, match=r"^data\.train_source 'prep/train' is a prepared token shard folder "):
        prepare_dataset(DataSpec(train_source="prep/train"), "new")
    assert not (prep / "new").exists()


def test_a_checkpoint_meta_json_beside_text_is_still_a_json_source(prep, capsys):
    """Only a shard folder's meta.json (its format named) is refused: a JSON Lines file of that name is read."""
    (prep / "d").mkdir()
    (prep / "d" / "meta.json").write_text('{"text": "first"}\n{"text": "second"}\n')
    status, record, err = run_data(capsys, "--train", "d", "--val", "c.txt", "--out", "new")
    assert status == 0, err
    assert record["counts"]["train"] == {"n_docs": 2, "n_tokens": 2 + len("firstsecond")}
