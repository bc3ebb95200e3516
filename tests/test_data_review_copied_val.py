"""A ``--val`` file that holds the same bytes as a ``--train`` file (a copy, under another name) is refused as the
same file is: every document of it would be in both splits, and the validation loss would score training text.
Files that share no bytes, and empty files (no document), pass."""
import shutil

from test_data_sources import run_data


def test_a_validation_file_copied_from_the_training_corpus_is_refused(tmp_path, capsys):
    train = tmp_path / "train"
    train.mkdir()
    for i in range(4):
        (train / f"{i}.txt").write_text(f"training document number {i}")
    (train / "empty.txt").write_text("")
    val = tmp_path / "val"
    val.mkdir()
    (val / "a.txt").write_text("held-out document")
    (val / "empty.txt").write_text("")
    status, record, err = run_data(capsys, "--train", train, "--val", val, "--out", tmp_path / "ok")
    assert status == 0, err
    assert record["counts"]["val"]["n_docs"] == 1

    shutil.copy(train / "2.txt", val / "b.txt")
    status, _, err = run_data(capsys, "--train", train, "--val", val, "--out", tmp_path / "bad")
    assert status == 2
    assert f"--val file {str(val / 'b.txt')!r} holds the same bytes as {str(train / '2.txt')!r}" in err, err
    assert "--train" in err and not (tmp_path / "bad").exists()
