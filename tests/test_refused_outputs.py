"""A refused ``falcon-fwa data`` or ``falcon-fwa compare`` leaves no output folder behind: the options and
sources are checked before the folder is made, and a preparation that fails after it was made removes what
it wrote, with the lock file and the folders it made; what was there before the command stays."""
import json
import os

import pytest
from test_cli_journeys import compare_recipes
from test_train import write_corpus

from falcon_fwa import cli

pytestmark = pytest.mark.usefixtures("one_thread")


def _tree(folder):
    """Every path under ``folder``, relative to it."""
    return sorted(os.path.relpath(os.path.join(d, n), folder) for d, dirs, files in os.walk(folder)
                  for n in dirs + files)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.jsonl"
    write_corpus(path)
    return str(path)


def _data(out, *options):
    return cli.main(["data", *options, "--out", str(out)])


# each refusal and the words its error starts with; the first two are found before any folder is made, the
# others after (a tokenizer folder that does not exist, a split with no document)
CASES = {
    "missing source": (lambda c, tmp: ["--train", str(tmp / "nope.txt")], "--train: data source"),
    "val is train": (lambda c, tmp: ["--train", c, "--val", c], "--val file"),
    "missing tokenizer": (lambda c, tmp: ["--train", c, "--tokenizer", str(tmp / "no-tokenizer")],
                          "--tokenizer folder"),
    "empty val split": (lambda c, tmp: ["--train", c, "--val-every", "5000"], "no documents to write"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_data_command_leaves_no_folder_it_made(tmp_path, corpus, capsys, monkeypatch, case):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    options, words = CASES[case]
    out = tmp_path / "new" / "data"  # two folders the command would make
    assert _data(out, *options(corpus, tmp_path)) == 2
    assert f"falcon-fwa data: error: {words}" in capsys.readouterr().err  # (after the progress bars)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("case", list(CASES))
def test_a_refused_data_command_keeps_what_its_folder_held(tmp_path, corpus, capsys, case):
    """A folder that was there, with a file of its own, holds that file alone afterwards; a lock file an
    earlier preparation left there stays."""
    options, _ = CASES[case]
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert _data(out, *options(corpus, tmp_path)) == 2
    assert _tree(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    (out / ".prepare.lock").write_text("")
    assert _data(out, *options(corpus, tmp_path)) == 2
    assert _tree(out) == [".prepare.lock", "notes.txt"]


def test_a_data_command_that_succeeds_after_a_refusal_prepares_the_folder(tmp_path, corpus):
    out = tmp_path / "data"
    assert _data(out, "--train", corpus, "--val-every", "5000") == 2
    assert _data(out, "--train", corpus, "--val-every", "10") == 0
    record = json.loads((out / "prepared.json").read_text())
    assert record["spec"]["val_every"] == 10 and record["counts"]["val"]["n_docs"] == 12  # 120 documents / 10
    assert {"tokenizer", "train", "val", "prepared.json", ".prepare.lock"} <= set(os.listdir(out))


@pytest.mark.parametrize("options, words", [
    (["--set", "train.micro_batch=3"], "train.global_batch = 4 is not a multiple of train.micro_batch = 3"),
    (["--set", "train.stpes=3"], "unknown config field train.stpes"),
    (["--set", "data.train_source=/nonexistent/corpus.txt"], "data.train_source: data source"),
])
def test_a_refused_compare_leaves_no_output_folder(tmp_path, capsys, monkeypatch, options, words):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    out = tmp_path / "cmp"
    status = cli.main(["compare", "--configs", *compare_recipes(tmp_path), "--names", "a", "b", "--out", str(out),
                       "--steps", "2", *options])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("falcon-fwa compare: error: ") and words in err
    assert not out.exists()


# tokenizers that fail only when the preparation loads them, after --out is made: a local folder that does not
# exist, a file, a misspelt built-in; and the words the error names each by
BAD_TOKENIZERS = {
    "missing folder": (lambda tmp: str(tmp / "no-tokenizer"), "tokenizer folder"),
    "a file": (lambda tmp: str(tmp / "a.yaml"), "is a file"),
    "misspelt": (lambda tmp: "bytes", "did you mean 'byte'?"),
}


def _compare_with_tokenizer(tmp_path, out, case):
    spec, words = BAD_TOKENIZERS[case]
    status = cli.main(["compare", "--configs", *compare_recipes(tmp_path), "--names", "a", "b", "--out", str(out),
                       "--steps", "2", "--set", f"data.tokenizer={spec(tmp_path)}"])
    return status, words


@pytest.mark.parametrize("case", list(BAD_TOKENIZERS))
def test_a_compare_whose_tokenizer_fails_leaves_no_output_folder(tmp_path, capsys, monkeypatch, case):
    """The preparation fails after the lock made --out (and the folder above it): neither the results file,
    the lock file, the data folder nor the two folders stay."""
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    status, words = _compare_with_tokenizer(tmp_path, tmp_path / "new" / "cmp", case)
    err = capsys.readouterr().err
    assert status == 2 and "falcon-fwa compare: error: " in err and words in err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("lock", [False, True])
def test_a_compare_whose_tokenizer_fails_keeps_what_its_folder_held(tmp_path, lock):
    """An --out that was there, with an earlier launch's results file and a file of its own (and the lock file
    an earlier launch left, where there was one), holds those alone afterwards, the results file unchanged."""
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    earlier = json.dumps({"configs": {"a": "a.yaml"}, "status": {"a": "done"}, "runs": {"a": {"steps": 2}}})
    (out / "compare.json").write_text(earlier)
    if lock:
        (out / ".compare.lock").write_text("")
    status, _ = _compare_with_tokenizer(tmp_path, out, "missing folder")
    assert status == 2
    assert _tree(out) == [".compare.lock"] * lock + ["compare.json", "notes.txt"]
    assert (out / "compare.json").read_text() == earlier and (out / "notes.txt").read_text() == "mine"


def test_two_preparations_that_fail_one_after_the_other_leave_no_folder(tmp_path, corpus, monkeypatch):
    """The second waits on the first's lock; the first fails and removes its folder and lock file; the second,
    holding the lock file made again, fails too and removes them as its own."""
    import threading
    import time

    from falcon_fwa.data import prepare

    def fail_slowly(*args):  # a tokenizer that does not load, found after some work
        time.sleep(0.6)
        raise OSError("the tokenizer does not load")

    monkeypatch.setattr(prepare, "_prepare", fail_slowly)
    out, errors = tmp_path / "new" / "data", []
    spec = prepare.DataSpec(train_source=str(corpus))

    def prepare_it():
        try:
            prepare.prepare_dataset(spec, str(out))
        except OSError as err:
            errors.append(str(err))

    first = threading.Thread(target=prepare_it)
    first.start()
    time.sleep(0.2)  # the first holds the lock
    second = threading.Thread(target=prepare_it)
    second.start()
    first.join(10)
    second.join(10)
    assert errors == ["the tokenizer does not load"] * 2
    assert not out.exists()
