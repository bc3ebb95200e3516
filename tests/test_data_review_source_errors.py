"""A source whose every file lies where the output folder is written (``--out DIR`` over ``DIR/train`` of text files:
a preparation writes ``DIR/train``, ``DIR/val``, ``DIR/tokenizer``) is refused naming the files and ``--out``,
rather than as a source that names no files; nothing is written."""
from test_data_sources import run_data


def test_a_source_inside_the_output_s_own_entries_names_the_output(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for split, n in (("train", 3), ("val", 1)):
        (tmp_path / "mydata" / split).mkdir(parents=True)
        for i in range(n):
            (tmp_path / "mydata" / split / f"{i}.txt").write_text(f"{split} document {i}")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    status, _, err = run_data(capsys, "--train", "mydata/train", "--val", "mydata/val", "--out", "mydata")
    assert status == 2
    line = err.splitlines()[0]
    assert line.startswith("falcon-fwa data: error: --train: data source 'mydata/train'"), err
    assert "--out" in line and "'mydata'" in line and "0.txt" in line and "names no" not in line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    # the same corpus with the output beside it: every file is read
    status, record, err = run_data(capsys, "--train", "mydata/train", "--val", "mydata/val", "--out", "out")
    assert status == 0, err
    assert record["counts"]["train"]["n_docs"] == 3 and record["counts"]["val"]["n_docs"] == 1
