"""A file that both sources read (one ``hf:/folder`` for train and validation: each split's files are its own, but
every file of the folder is recorded for both) and that changed since is named once in the refusal."""
import json

from test_data_sources import run_data


def test_a_changed_file_of_a_folder_both_sources_read_is_named_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ds, out = tmp_path / "ds", tmp_path / "out"
    ds.mkdir()
    for split, n in (("train", 12), ("validation", 4)):
        (ds / f"{split}.jsonl").write_text("".join(json.dumps({"text": f"{split} doc {i}"}) + "\n" for i in range(n)))
    argv = ["--train", f"hf:{ds}", "--val", f"hf:{ds}", "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    assert record["counts"]["val"]["n_docs"] == 4
    (ds / "validation.jsonl").write_text((ds / "validation.jsonl").read_text() + json.dumps({"text": "more"}) + "\n")
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and "other source files" in err
    assert err.count(str(ds / "validation.jsonl")) == 1, err
