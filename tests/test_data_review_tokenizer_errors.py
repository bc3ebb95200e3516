"""A ``--tokenizer`` written as a folder path (a trailing ``/``) that does not exist is named as a missing folder,
at once: it is no Hub name (those never end in ``/``), so the Hub is not asked for it."""
import pytest

from falcon_fwa.data.tokenizer import is_missing_folder, load_tokenizer


@pytest.mark.parametrize("spec", ["nosuchdir/", "owner/nosuch/", "nosuchdir//"])
def test_a_missing_folder_with_a_trailing_slash_is_named_as_a_folder(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert is_missing_folder(spec)
    with pytest.raises(ValueError, match=rf"^--tokenizer folder {spec!r} does not exist"):
        load_tokenizer(spec, name="--tokenizer")


@pytest.mark.parametrize("spec", ["gpt2", "owner/name"])
def test_hub_names_are_no_missing_folders(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    assert not is_missing_folder(spec)
