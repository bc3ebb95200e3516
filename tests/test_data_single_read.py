"""A fresh preparation reads each text or JSON source file once: the SHA-256 that ``prepared.json`` records of it
is taken of the bytes as they are read to be tokenized (the one of ``hashlib`` over the file's bytes), not by a
read of its own before."""
import hashlib
import json
import os
import sys

import pytest

from falcon_fwa.data.prepare import DataSpec, prepare_dataset
from test_data_sources import stored

_OPENED = None  # while a test counts: the paths opened for reading, each time (an audit hook stays for good)


def _audit(event, args):
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = args[1], args[2]
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) or \
            (mode is None and flags & (os.O_WRONLY | os.O_RDWR))
        if not writes:
            _OPENED.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


@pytest.fixture
def opened():
    """The real paths opened for reading from now on (any route: ``open``, ``io.open``, ``os.open``)."""
    global _OPENED
    _OPENED = []
    yield _OPENED
    _OPENED = None


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(tmp_path):
    """Train and val files whose bytes test the decoding: a byte-order mark, CRLF and lone CR line ends, bytes that
    are no UTF-8, a JSON array read again from its start after a look at its head, files larger than a read."""
    src = tmp_path / "train"
    src.mkdir()
    (src / "a.txt").write_bytes(b"\xef\xbb\xbfalpha\r\nbeta\rgamma \xff\xfe delta\n" + b"x" * 70_000 + b"\n")
    (src / "b.jsonl").write_bytes(b"".join(json.dumps({"text": f"line {n} " * 40}).encode() + b"\r\n"
                                           for n in range(300)))
    (src / "c.json").write_bytes(json.dumps([{"text": f"record {n} " * 30} for n in range(200)]).encode())
    (src / "d.md").write_bytes(b"")
    val = tmp_path / "val.txt"
    val.write_bytes(b"held out\nsecond line \xc3\n")
    for path in [*src.iterdir(), val]:  # clearly older than the preparation: a reuse takes them by their time
        os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns - 10 * 10**9))
    return src, val


@pytest.mark.parametrize("text_split", ["file", "line"])
def test_each_source_file_is_opened_once_and_its_hash_is_that_of_its_bytes(tmp_path, opened, text_split):
    src, val = _files(tmp_path)
    sources = sorted(src.iterdir()) + [val]
    record = prepare_dataset(DataSpec(train_source=str(src), val_source=str(val), text_split=text_split),
                             str(tmp_path / "out"))
    for path in sources:
        assert opened.count(os.path.realpath(path)) == 1, (path, opened.count(os.path.realpath(path)))
    for which, paths in (("train", sources[:-1]), ("val", [val])):
        for path in paths:
            mtime, digest = record["stamps"][which][str(path)]
            assert digest == _sha(path) and mtime == os.stat(path).st_mtime_ns, path
    assert record["counts"]["val"]["n_docs"] == (1 if text_split == "file" else 2)
    # the documents as Python's text mode reads the files: no byte-order mark, "\r\n" and "\r" -> "\n", U+FFFD
    with open(src / "a.txt", encoding="utf-8-sig", errors="replace") as f:
        text = f.read()
    assert text.startswith("alpha\nbeta\ngamma \ufffd\ufffd delta\n")
    train = stored(tmp_path / "out" / "train")
    assert train[:1] == [(256, text.encode())] if text_split == "file" else \
        train[:3] == [(256, line.encode()) for line in text.split("\n")[:3]]
    assert stored(tmp_path / "out" / "val") == ([(256, "held out\nsecond line \ufffd\n".encode())]
                                                if text_split == "file" else
                                                [(256, b"held out"), (256, "second line \ufffd".encode())])
    # the record is one that a reuse takes as it is, reading no file
    del opened[:]
    again = prepare_dataset(DataSpec(train_source=str(src), val_source=str(val), text_split=text_split),
                            str(tmp_path / "out"))
    assert again == record and not set(opened) & {os.path.realpath(p) for p in sources}


def test_a_file_read_in_part_is_hashed_whole(tmp_path):
    """max_documents stops in a file, a BPE learns from its first documents: the hash goes on over the rest,
    and a file past the last document read is hashed all the same."""
    src = tmp_path / "c"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": f"document {n} " * 50}) + "\n" for n in range(400)))
    (src / "b.txt").write_text("one\ntwo\n" * 5000)
    (src / "z.txt").write_text("past the last document read")
    (tmp_path / "v.txt").write_text("held out text")
    for spec in (DataSpec(train_source=str(src), val_source=str(tmp_path / "v.txt"), max_documents=300,
                          text_split="line"),
                 DataSpec(train_source=str(src), val_source=str(tmp_path / "v.txt"), tokenizer="bpe:300",
                          bpe_documents=50, text_split="line"),
                 DataSpec(train_source=str(src), max_documents=450, val_every=7, text_split="line")):
        record = prepare_dataset(spec, str(tmp_path / "out"), overwrite=True)
        assert {path: stamp[1] for path, stamp in record["stamps"]["train"].items()} == \
            {str(path): _sha(path) for path in sorted(src.iterdir())}


@pytest.mark.parametrize("text_split", ["file", "line"])
def test_without_val_each_training_file_is_opened_once_for_both_splits(tmp_path, opened, text_split):
    """Without --val the held-out documents are kept aside as the training files are read for the train split: no
    file is read a second time for the val split, and the splits hold what every --val-every-th document gives."""
    src, _ = _files(tmp_path)
    sources = sorted(src.iterdir())
    spec = DataSpec(train_source=str(src), text_split=text_split, val_every=3)
    record = prepare_dataset(spec, str(tmp_path / "out"))
    for path in sources:
        assert opened.count(os.path.realpath(path)) == 1, (path, opened.count(os.path.realpath(path)))
    for path in sources:
        assert record["stamps"]["train"][str(path)][1] == _sha(path), path
    # the documents, read here as Python reads the files, every third held out
    docs = []
    for path in sources:
        if path.suffix in (".txt", ".md"):
            with open(path, encoding="utf-8-sig", errors="replace") as f:
                text = f.read()
            docs += [part for part in ([text] if text_split == "file" else text.split("\n")) if part.strip()]
        elif path.suffix == ".jsonl":
            docs += [json.loads(line)["text"] for line in path.read_text().splitlines()]
        else:
            docs += [r["text"] for r in json.loads(path.read_text())]
    assert len(docs) == (1 if text_split == "file" else 4) + 300 + 200
    assert stored(tmp_path / "out" / "val") == [(256, d.encode()) for d in docs[2::3]]
    assert stored(tmp_path / "out" / "train") == [(256, d.encode()) for i, d in enumerate(docs) if i % 3 != 2]
    assert sorted(os.listdir(tmp_path / "out")) == [".prepare.lock", "prepared.json", "tokenizer", "train", "val"]
