"""A data source named by another spelling of the same local path (``corpus.jsonl``, ``./corpus.jsonl``,
``sub/../corpus.jsonl``, its absolute path, a link to it) is the same source: a run folder trained on one is
resumed by a recipe that names the other, ``falcon-fwa compare`` and ``scaling`` keep a finished run of one for the
other (``compare.kept_result``), and a prepared data folder of one is reused for the other. Another file, even one of
the same bytes, is still another source, refused and named as before; ``hf:`` names are compared as text."""
import os
import re
import shutil

import pytest
from test_resume_same_model_spelled_twice import finished_run, kept
from test_train import recipe, run_trainer

from falcon_fwa.data import DataSpec, prepare_dataset
from falcon_fwa.train.config import config_from_dict
from falcon_fwa.train.trainer import ResumeRefused, Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def finished(tmp_path):
    """A finished run of the tiny recipe (its source by its absolute path): :func:`finished_run`."""
    return finished_run(tmp_path)


def spellings(tmp_path, name="corpus.jsonl"):
    """Other spellings of ``tmp_path / name`` from the working folder ``tmp_path``: relative, ``./``, through a
    folder and back, and a link to the file."""
    (tmp_path / "sub").mkdir(exist_ok=True)
    link = tmp_path / f"link-{name}"
    if not link.exists():
        os.symlink(tmp_path / name, link)
    return [name, f"./{name}", f"sub/../{name}", link.name]


def with_source(raw: dict, source: str) -> dict:
    return {**raw, "data": {**raw["data"], "train_source": source}}


def test_resume_takes_another_spelling_of_the_source_and_refuses_another_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_trainer(recipe(tmp_path, "run"), stop_at=2)  # data.train_source: the absolute path
    shutil.copy(tmp_path / "corpus.jsonl", tmp_path / "other.jsonl")  # the same bytes, another file
    for source in spellings(tmp_path):
        trainer = Trainer(config_from_dict(with_source(recipe(tmp_path, "run"), source)))
        try:
            assert trainer.step == 2, source
        finally:
            trainer.close()
    named = re.escape(f"(data.train_source {str(tmp_path / 'corpus.jsonl')!r} there, 'other.jsonl' here)")
    with pytest.raises(ResumeRefused, match=r"holds a run of other settings than this recipe's " + named):
        Trainer(config_from_dict(with_source(recipe(tmp_path, "run"), "other.jsonl")))




def test_compare_keeps_a_run_whose_source_is_spelt_otherwise_and_trains_another_file_again(tmp_path, finished,
                                                                                           capsys, monkeypatch):
    run_dir, earlier = finished
    monkeypatch.chdir(tmp_path)
    for source in spellings(tmp_path):
        assert kept(earlier, run_dir, with_source(recipe(tmp_path, "run"), source), capsys) == (earlier, ""), source
    raw = with_source(recipe(tmp_path, "run"), "./corpus.jsonl")
    raw["data"]["out_dir"] = "sub/../data/"  # the data folder, spelt otherwise too
    assert kept(earlier, run_dir, raw, capsys) == (earlier, "")
    shutil.copy(tmp_path / "corpus.jsonl", tmp_path / "other.jsonl")
    assert kept(earlier, run_dir, with_source(recipe(tmp_path, "run"), "other.jsonl"), capsys) == (
        None, f"a: trained again, not kept from the earlier launch: its summary.json holds another recipe than this "
              f"launch trains (data.train_source {str(tmp_path / 'corpus.jsonl')!r} there, 'other.jsonl' here)\n")


def test_a_prepared_folder_is_reused_for_another_spelling_of_its_sources(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    for i in range(12):
        (tmp_path / "docs" / f"{i:02d}.txt").write_text(f"document {i} " * (i + 1))
    (tmp_path / "held.txt").write_text("a validation document")
    first = prepare_dataset(DataSpec(train_source="docs", val_source="held.txt"), "prep")
    shard = os.stat(tmp_path / "prep" / "prepared.json").st_mtime_ns
    spelt = [("./docs/", "./held.txt"), (str(tmp_path / "docs"), str(tmp_path / "held.txt")),
             ("sub/../docs", "sub/../held.txt"), *zip(spellings(tmp_path, "docs"), spellings(tmp_path, "held.txt"))]
    for train, val in spelt:
        again = prepare_dataset(DataSpec(train_source=train, val_source=val), "prep")
        assert again["counts"] == first["counts"] == {"train": {"n_tokens": first["counts"]["train"]["n_tokens"],
                                                                "n_docs": 12},
                                                      "val": {"n_tokens": 22, "n_docs": 1}}, (train, val)
        assert again["spec"]["train_source"] == "docs"  # the record, as it was written: not prepared again
        assert os.stat(tmp_path / "prep" / "prepared.json").st_mtime_ns == shard
    shutil.copytree(tmp_path / "docs", tmp_path / "copy")  # the same files, in another folder
    with pytest.raises(ValueError, match=re.escape("data folder 'prep' was prepared with other settings "
                                                   "(train_source 'docs' there, 'copy' here)")):
        prepare_dataset(DataSpec(train_source="copy", val_source="./held.txt"), "prep")
    # a file of the folder changed since is still found, under the folder's other spelling too
    (tmp_path / "docs" / "00.txt").write_text("document 0 and more")
    with pytest.raises(ValueError, match=re.escape("was prepared from other source files (./docs/00.txt held 11 "
                                                   "bytes, now 19)")):
        prepare_dataset(DataSpec(train_source="./docs", val_source="held.txt"), "prep")


def test_same_setting_by_hand(tmp_path, monkeypatch):
    from falcon_fwa.data.sources import same_setting

    monkeypatch.chdir(tmp_path)
    here = str(tmp_path)
    assert same_setting("train_source", "corpus.jsonl", f"{here}/x/../corpus.jsonl")
    assert same_setting("val_source", "./a/*.txt", f"{here}/a/*.txt")  # a glob, from the working folder
    assert not same_setting("train_source", "corpus.jsonl", "other.jsonl")
    assert not same_setting("val_source", None, "corpus.jsonl")
    # hf: names, and tokenizers that are no local folder, as text
    assert not same_setting("train_source", "hf:./ds", "hf:ds")
    assert not same_setting("tokenizer", "gpt2", "./gpt2")
    assert same_setting("tokenizer", f"{here}/tok", f"{here}/sub/../tok")
    # a field that names no path, as given
    assert not same_setting("text_field", "text", "./text")
