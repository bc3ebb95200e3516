"""Errors of ``falcon-fwa ppl``, ``falcon-fwa data`` and a training recipe name the setting as the user gave it:
``--seq-len``, ``--text-field`` and ``--tokenizer`` for the commands, ``data.text_field`` and
``data.tokenizer`` for a recipe, never the internal field (``seq_len=``, ``text_field``, a bare ``tokenizer``);
the command ends with status 2 and one error line. ``--text-field`` changes nothing for text files (as
documented). No test reaches the network: the Hub is offline (HF_HUB_OFFLINE=1) or its loader replaced."""
import json
import logging
import sys

import pytest
import torch

from falcon_fwa import FalconForCausalLM, get_preset
from falcon_fwa.cli import main
from falcon_fwa.data.prepare import DataSpec, prepare_dataset
from falcon_fwa.data.shards import TokenShards
from falcon_fwa.data.tokenizer import byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def offline(monkeypatch):
    """The Hugging Face Hub offline, as HF_HUB_OFFLINE=1 in the environment makes it (the library reads the
    variable once, on import: its flag is set too)."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    """A tiny Falcon saved with the byte tokenizer (257 ids, end-of-text 256)."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("ppl") / "m"
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320)).eval().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def _run(capsys, *argv):
    """(exit status, the error lines) of ``falcon-fwa ARGV``."""
    for handler in logging.getLogger("datasets").handlers:  # (a handler bound to an earlier test's stderr)
        if type(handler) is logging.StreamHandler:
            handler.stream = sys.stderr
    status = main([str(a) for a in argv])
    err = capsys.readouterr().err
    return status, [line for line in err.replace("\r", "\n").splitlines() if ": error: " in line]


def _write_records(path, key):
    """Three records holding their text under ``key``, as JSON Lines or a Parquet file (by the suffix)."""
    texts = ["first held-out record", "second one", "third record of text"]
    if str(path).endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({key: texts}), str(path))
    else:
        path.write_text("".join(json.dumps({key: t}) + "\n" for t in texts))


# ppl --seq-len -------------------------------------------------------------------------------------------------


def test_ppl_seq_len_longer_than_the_data_names_the_option(tmp_path, capsys, model_folder):
    """``hello world\\n`` is 12 bytes: with its end-of-text 13 tokens, one window of 12 predictions (13 tokens)
    and none of 13 (14 tokens). The refusal names ``--seq-len`` as given, not the field ``seq_len``."""
    text = tmp_path / "held.txt"
    text.write_text("hello world\n")
    common = ["ppl", "--model", model_folder, "--data", text, "--device", "cpu"]
    status, lines = _run(capsys, *common, "--seq-len", 12)
    assert (status, lines) == (0, [])
    status, lines = _run(capsys, *common, "--seq-len", 13)
    assert status == 2 and len(lines) == 1
    assert lines[0] == "falcon-fwa ppl: error: 13 held-out tokens are fewer than one window of --seq-len=13"


def test_ppl_buckets_that_miss_seq_len_name_the_option(tmp_path, capsys, model_folder):
    text = tmp_path / "held.txt"
    text.write_text("hello world\n")
    status, lines = _run(capsys, "ppl", "--model", model_folder, "--data", text, "--seq-len", 8, "--buckets", "0,4")
    assert status == 2 and len(lines) == 1
    assert "--seq-len=8" in lines[0] and "seq_len" not in lines[0] and lines[0].count("--buckets") == 1


# --text-field ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_ppl_records_without_the_field_name_text_field(tmp_path, capsys, model_folder, suffix):
    data = tmp_path / f"held{suffix}"
    _write_records(data, "body")
    common = ["ppl", "--model", model_folder, "--data", data, "--seq-len", 4, "--device", "cpu"]
    status, lines = _run(capsys, *common)
    assert status == 2 and len(lines) == 1
    assert "--text-field 'text'" in lines[0] and "text_field" not in lines[0]
    status, lines = _run(capsys, *common, "--text-field", "body")  # the field the records have
    assert (status, lines) == (0, [])


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_data_records_without_the_field_name_text_field(tmp_path, capsys, suffix):
    data = tmp_path / f"corpus{suffix}"
    _write_records(data, "body")
    status, lines = _run(capsys, "data", "--train", data, "--val-every", 2, "--out", tmp_path / "out")
    assert status == 2 and len(lines) == 1
    assert "--text-field 'text'" in lines[0] and "text_field" not in lines[0]
    assert not (tmp_path / "out").exists()  # a failed preparation leaves nothing behind


def test_a_recipe_names_data_text_field(tmp_path, capsys):
    """A training recipe's corpus of records without the field: the error names ``data.text_field`` (the
    recipe's setting), both where a recipe prepares its data and through ``falcon-fwa train``."""
    from conftest import tiny_lm_recipe

    data = tmp_path / "corpus.jsonl"
    _write_records(data, "body")
    with pytest.raises(ValueError, match=r"corpus\.jsonl:1: record has no data\.text_field 'text' "
                                         r"\(keys: \['body'\]\)$"):
        prepare_dataset(DataSpec(train_source=str(data), val_every=2), str(tmp_path / "out"))
    recipe = tiny_lm_recipe(tmp_path)
    status, lines = _run(capsys, "train", "--config", recipe, "--set", f"data.train_source={data}")
    assert status == 2 and len(lines) == 1 and "data.text_field 'text'" in lines[0]


def test_text_field_changes_nothing_for_text_files(tmp_path, capsys):
    """Documented: text files have no fields, so ``--text-field`` leaves their documents as they are."""
    text = tmp_path / "corpus.txt"
    text.write_text("one\n\ntwo\n\nthree\n")
    for out, extra in (("plain", []), ("field", ["--text-field", "nowhere"])):
        status, lines = _run(capsys, "data", "--train", text, "--text-split", "paragraph", "--val-every", 3,
                             *extra, "--out", tmp_path / out)
        assert (status, lines) == (0, [])
    for split, want in (("train", [b"one", b"two"]), ("val", [b"three\n"])):
        for out in ("plain", "field"):
            docs = TokenShards(str(tmp_path / out / split)).documents()
            assert [bytes(d[1:].astype("uint8")) for d in docs] == want


# --tokenizer -----------------------------------------------------------------------------------------------------


def _two_files(tmp_path):
    (tmp_path / "train.txt").write_text("some training text\n")
    (tmp_path / "val.txt").write_text("held out\n")
    return ["--train", tmp_path / "train.txt", "--val", tmp_path / "val.txt", "--out", tmp_path / "out"]


def test_data_hub_tokenizer_offline_names_the_option(tmp_path, capsys, offline):
    """A Hub name (``--tokenizer gpt2`` in form) with the Hub offline and no cached copy: one line naming
    ``--tokenizer``, and no folder left behind."""
    status, lines = _run(capsys, "data", *_two_files(tmp_path), "--tokenizer", "nobody-here-tokenizer")
    assert status == 2 and len(lines) == 1
    assert lines[0].startswith("falcon-fwa data: error: --tokenizer must be 'byte', 'bpe:<vocab_size>'")
    assert "loading 'nobody-here-tokenizer' failed" in lines[0]
    assert "HF_HUB_OFFLINE=1 is set" not in lines[0]  # already set: no advice to set it
    assert not (tmp_path / "out").exists()


def test_a_hub_tokenizer_that_fails_to_load_names_the_option_and_the_offline_setting(tmp_path, capsys, monkeypatch):
    """Without HF_HUB_OFFLINE the loader would go to the network (here replaced, refusing as the library does
    offline): the line names ``--tokenizer`` and says that HF_HUB_OFFLINE=1 reads the cache alone."""
    import huggingface_hub.constants
    import transformers

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # (should the replacement be bypassed)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)

    def unreachable(name, **kwargs):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable)
    status, lines = _run(capsys, "data", *_two_files(tmp_path), "--tokenizer", "owner/some-tokenizer")
    assert status == 2 and len(lines) == 1
    assert lines[0].startswith("falcon-fwa data: error: --tokenizer must be ")
    assert "HF_HUB_OFFLINE=1" in lines[0] and "loading 'owner/some-tokenizer' failed" in lines[0]


def test_a_recipe_hub_tokenizer_offline_names_data_tokenizer(tmp_path, offline):
    (tmp_path / "train.txt").write_text("some training text\n")
    (tmp_path / "val.txt").write_text("held out\n")
    spec = DataSpec(train_source=str(tmp_path / "train.txt"), val_source=str(tmp_path / "val.txt"),
                    tokenizer="nobody-here/no-such-tokenizer")
    with pytest.raises(ValueError, match=r"^data\.tokenizer must be 'byte'.*"
                                         r"loading 'nobody-here/no-such-tokenizer' failed"):
        prepare_dataset(spec, str(tmp_path / "out"))


@pytest.mark.parametrize("spec, words", [
    ("./no-such-folder", "--tokenizer folder './no-such-folder' does not exist (a Hub name is NAME or OWNER/NAME)"),
    ("bite", "--tokenizer 'bite' is no tokenizer (did you mean 'byte'?)")])
def test_data_tokenizer_refusals_name_the_option(tmp_path, capsys, monkeypatch, spec, words):
    monkeypatch.chdir(tmp_path)
    status, lines = _run(capsys, "data", *_two_files(tmp_path), "--tokenizer", spec)
    assert status == 2 and lines == [f"falcon-fwa data: error: {words}"]
