"""A source folder that holds an earlier preparation (``--out .`` beside the text files, then ``--train .`` into
another ``--out``): what that preparation wrote there is no corpus, the text files beside it are; a folder holding
nothing but a preparation is refused naming its record, not as one that names no files."""
from falcon_fwa.data.prepare import DataSpec, prepare_dataset
from falcon_fwa.data.sources import list_files
from test_data_sources import run_data, stored


def test_the_text_beside_an_earlier_out_dot_is_read_into_another_out(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    monkeypatch.chdir(corpus)
    docs = [f"document number {n}" for n in range(6)]
    for n, doc in enumerate(docs):
        (corpus / f"{n}.txt").write_text(doc)
    status, first, err = run_data(capsys, "--train", ".", "--val-every", 3, "--out", ".")
    assert status == 0, err
    status, second, err = run_data(capsys, "--train", ".", "--val-every", 3, "--out", "bpe")
    assert status == 0, err
    assert second["counts"] == first["counts"] == {"train": {"n_docs": 4, "n_tokens": 4 + len("".join(docs[:2] + docs[3:5]))},
                                                   "val": {"n_docs": 2, "n_tokens": 2 + len(docs[2] + docs[5])}}
    assert sorted(second["files"]["train"]) == [f"./{n}.txt" for n in range(6)]
    assert stored(corpus / "bpe" / "val") == [(256, docs[2].encode()), (256, docs[5].encode())]
    # the same below a source folder: the earlier preparation's record, splits and tokenizer are passed over
    assert list_files(str(tmp_path), exclude=str(tmp_path / "o")) == [str(corpus / f"{n}.txt") for n in range(6)]


def test_a_folder_of_nothing_but_a_preparation_names_its_record(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "c.txt").write_text("one\ntwo\nthree\nfour\n")
    prepare_dataset(DataSpec(train_source="c.txt", text_split="line", val_every=2), "old")
    status, _, err = run_data(capsys, "--train", "old", "--out", "new")
    assert status == 2 and not (tmp_path / "new").exists()
    line = [line for line in err.splitlines() if "error:" in line][0]
    assert "data source 'old' holds no" in line and "'old/prepared.json'" in line and "names no" not in line, err
