"""An ``--out`` folder whose ``train`` or ``val`` is something else than token shards (a folder of the user's text
files) is refused before anything is written into it: its ``tokenizer`` folder, if it has one, is left as it was."""
import os

from test_data_sources import run_data

from falcon_fwa.data.tokenizer import train_bpe_tokenizer


def snapshot(folder):
    return {os.path.relpath(os.path.join(d, f), folder): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(folder) for f in names}


def test_a_foreign_train_folder_in_out_is_refused_before_the_tokenizer_is_written(tmp_path, capsys):
    corpus = tmp_path / "c"
    corpus.mkdir()
    for i in range(10):
        (corpus / f"{i}.txt").write_text(f"document {i} of the corpus")
    out = tmp_path / "mydata"
    (out / "train").mkdir(parents=True)
    (out / "train" / "notes.txt").write_text("my own notes")
    train_bpe_tokenizer(["other words entirely"] * 20, 270).save_pretrained(out / "tokenizer")
    (out / "tokenizer" / "vocab.txt").write_text("other\nwords\n")
    before = snapshot(out)
    status, _, err = run_data(capsys, "--train", corpus, "--val-every", 5, "--tokenizer", "byte", "--out", out)
    assert status == 2
    assert f"{str(out / 'train')!r} exists and is no token shard folder" in err, err
    assert snapshot(out) == before
