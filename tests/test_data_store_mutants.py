"""What the stores of the data pipeline promise, each held to an independent reference: the atomic writes (an error
renamed after the file being written with its errno, traceback and cause, or left as it is; an interrupt that
leaves the previous version; the temporary files a killed write leaves, removed by name and no other writer's; no
file descriptor kept; the bytes on disk before their fsync; JSON as written by hand; the folder lock's refusal and
wait), the tokenizers (bytes a BPE never saw, a Hub name asked of the Hub, a tokenizer's own special tokens kept out
of documents, end-of-text swapped with a byte the probe leaves out) and the token shards (files compared with bytes
written by hand with ``struct``, a folder written by hand read back, every file and the parent folder flushed, the
leftovers of a stopped run, empty documents, and the refusals worded as the docstrings say); and a row order that
is no other seed's shifted by an epoch."""
import errno
import json
import os
import stat
import struct
import threading
import time
import traceback

import numpy as np
import pytest

from falcon_fwa import atomic
from falcon_fwa.atomic import (atomic_path, folder_lock, fsync_folder, naming, remove_temporaries, replaceable,
                               sync_tree, write_json, write_text)

EOS = 256


# --- atomic writes -------------------------------------------------------------------------------------------------

def test_a_write_makes_every_missing_folder_above_its_file(tmp_path):
    path = tmp_path / "a" / "b" / "c" / "r.json"
    write_json(path, {"k": 1})
    assert json.loads(path.read_text()) == {"k": 1}


def test_json_is_written_indented_by_one_space_with_a_final_newline(tmp_path):
    write_json(tmp_path / "r.json", {"a": [1, 2], "b": "x"})
    assert (tmp_path / "r.json").read_bytes() == b'{\n "a": [\n  1,\n  2\n ],\n "b": "x"\n}\n'
    write_text(tmp_path / "t.txt", "no newline added")
    assert (tmp_path / "t.txt").read_bytes() == b"no newline added"


def test_an_interrupt_during_a_write_keeps_the_previous_version_and_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    write_json(path, {"v": 1})
    for stop in (KeyboardInterrupt, SystemExit):
        with pytest.raises(stop):
            with atomic_path(path) as tmp:
                with open(tmp, "w") as f:
                    f.write('{"v": ')
                raise stop()
        assert json.loads(path.read_text()) == {"v": 1}
        assert os.listdir(tmp_path) == ["r.json"]


def test_an_os_error_without_an_errno_passes_unchanged(tmp_path):
    """Only an error of the disk (with an errno) is renamed after the file being written; another ``OSError`` of
    the block is the same object, not a new one of errno None."""
    plain = OSError("the writer's own complaint")
    with pytest.raises(OSError) as caught:
        with atomic_path(tmp_path / "r.json"):
            raise plain
    assert caught.value is plain and os.listdir(tmp_path) == []


def test_a_renamed_error_keeps_its_cause_and_where_the_write_failed(tmp_path):
    path, stand_in = tmp_path / "run" / "summary.json", tmp_path / "run" / ".summary.x.tmp.json"

    def refused_write():
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(stand_in))

    with pytest.raises(OSError) as caught:
        with naming(path, stand_in):
            refused_write()
    err = caught.value
    assert (err.errno, err.filename) == (errno.ENOSPC, str(path))
    assert str(err) == f"[Errno 28] No space left on device: '{path}'"
    assert isinstance(err.__cause__, OSError) and err.__cause__.filename == str(stand_in)
    assert "refused_write" in [frame.name for frame in traceback.extract_tb(err.__traceback__)]


def test_torch_saves_runtime_error_over_a_full_disk_is_named_as_the_disk_error(tmp_path):
    """``torch.save`` reports a write the disk refused as a ``RuntimeError`` raised while handling the
    ``OSError``: it becomes that ``OSError``, naming the file; a ``RuntimeError`` over no ``OSError`` passes."""
    path, stand_in = tmp_path / "c.pt", tmp_path / ".c.x.tmp.pt"
    with pytest.raises(OSError) as caught:
        with naming(path, stand_in):
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert type(caught.value) is OSError and (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(path))
    bug = RuntimeError("a bug, not the disk")
    with pytest.raises(RuntimeError) as caught:
        with naming(path, stand_in):
            raise bug
    assert caught.value is bug


def test_the_temporary_of_a_write_is_removed_by_name_and_no_other_writers(tmp_path):
    """``remove_temporaries(folder, "r.json")`` removes what a killed write of ``r.json`` leaves, and keeps the
    temporaries of ``r-old.json`` and of ``r.jsonl`` (names that share its stem or its suffix's start)."""
    with atomic_path(tmp_path / "r.json") as mine, atomic_path(tmp_path / "r-old.json") as other, \
            atomic_path(tmp_path / "r.jsonl") as longer:
        for tmp in (mine, other, longer):
            with open(tmp, "w") as f:
                f.write("half")
        remove_temporaries(tmp_path, "r.json")
        assert not os.path.exists(mine) and os.path.exists(other) and os.path.exists(longer)
        with open(mine, "w") as f:  # the write goes on: its temporary again, for its rename
            f.write("{}")
    assert sorted(os.listdir(tmp_path)) == ["r-old.json", "r.json", "r.jsonl"]


def _open_descriptors():
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc (Linux)")
def test_writes_and_folder_flushes_keep_no_file_descriptor(tmp_path):
    write_json(tmp_path / "warm.json", {})  # imports and caches opened once
    before = _open_descriptors()
    for n in range(20):
        write_json(tmp_path / "r.json", {"n": n})
        fsync_folder(tmp_path)
    assert _open_descriptors() == before


def test_a_file_is_whole_on_disk_when_it_is_flushed(tmp_path, monkeypatch):
    """At the ``fsync`` of the written file its size is already the text's (Python's buffer was flushed first)."""
    sizes = []
    real = os.fsync

    def fsync(fd):
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode):
            sizes.append(st.st_size)
        return real(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    write_text(tmp_path / "t.txt", "x" * 100)
    assert sizes == [100]


def test_a_folder_that_cannot_be_opened_is_not_flushed(tmp_path, monkeypatch):
    def refused(path, flags):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(atomic.os, "open", refused)
    assert fsync_folder(tmp_path) is None


def test_sync_tree_follows_no_link(tmp_path, monkeypatch):
    """A link (one to nothing, one to a file outside) is not flushed through: the files of the folder are."""
    top = tmp_path / "export"
    top.mkdir()
    (top / "config.json").write_text("{}")
    (tmp_path / "outside.bin").write_text("x")
    os.symlink(tmp_path / "missing", top / "dangling")
    os.symlink(tmp_path / "outside.bin", top / "linked.bin")
    synced = []
    real = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real(fd))
    sync_tree(top)
    assert sorted(synced) == sorted([(top / "config.json").stat().st_ino, top.stat().st_ino])


@pytest.mark.parametrize("content,want", [(None, False), ("[]", False), ("{not json", False), ('"text"', False),
                                          ('{"format": "other"}', False), ('{"format": null}', False),
                                          ('{"format": "mine"}', True)])
def test_a_folder_is_replaceable_only_when_its_marker_names_the_value(tmp_path, content, want):
    folder = tmp_path / "f"
    assert replaceable(folder, "meta.json", "format", "mine")  # absent
    folder.mkdir()
    if content is not None:
        (folder / "meta.json").write_text(content)
    assert replaceable(folder, "meta.json", "format", "mine") is want


def test_the_folder_lock_refuses_or_waits_for_its_holder(tmp_path):
    """A second holder of the lock (another open of the lock file, as another process's) is refused with
    ``wait=False`` and waits with ``wait=True`` until the first leaves; it is free again afterwards."""
    folder = tmp_path / "new" / "run"  # created with the lock
    entered, outcome = threading.Event(), []

    def second(wait):
        try:
            with folder_lock(folder, ".lock", wait=wait):
                entered.set()
                outcome.append("held")
        except BlockingIOError:
            outcome.append("refused")

    with folder_lock(folder, ".lock"):
        assert os.path.exists(folder / ".lock")
        refused = threading.Thread(target=second, args=(False,))
        refused.start()
        refused.join(timeout=10)
        waiting = threading.Thread(target=second, args=(True,))
        waiting.start()
        time.sleep(0.2)
        assert outcome == ["refused"] and not entered.is_set()
    waiting.join(timeout=10)
    refused.join(timeout=10)
    assert outcome == ["refused", "held"]
    with folder_lock(folder, ".lock", wait=False):
        pass


def test_a_waiter_whose_lock_file_its_holder_removed_locks_the_one_made_again(tmp_path):
    """A holder that removes the lock file and its folder before leaving (a failed preparation's clean-up)
    leaves its waiter holding the file at the path, made again, so that a third is refused while the waiter
    is inside (holding the unlinked file alone, the waiter would share the folder with the third)."""
    import shutil

    folder = tmp_path / "data"
    inside, outcome = threading.Event(), []
    release = threading.Event()

    def waiter():
        with folder_lock(folder, ".lock") as remade:
            outcome.append(os.path.exists(folder / ".lock"))
            outcome.append(remade)
            inside.set()
            release.wait(10)

    with folder_lock(folder, ".lock") as remade:
        assert remade == ((str(folder),), True)  # the folder and its lock file, made by this call
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.3)  # the waiter opened the file and waits on it
        shutil.rmtree(folder)
    assert inside.wait(10) and outcome == [True, ((str(folder),), True)]  # the folder and its lock file, made again
    try:
        with pytest.raises(BlockingIOError):
            with folder_lock(folder, ".lock", wait=False):
                pass
    finally:
        release.set()
        thread.join(10)


# --- tokenizers ----------------------------------------------------------------------------------------------------

def test_a_bpe_encodes_bytes_its_corpus_never_held():
    """Byte-level: every byte is in the alphabet from the start, so text of characters absent from the training
    texts decodes back exactly, in ids below the vocabulary size."""
    from falcon_fwa.data import encode_documents
    from falcon_fwa.data.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(["ab ab ab abc"] * 4, 270)
    text = "\u00e9\u20ac\x00 zq\U0001f600"
    ids = encode_documents(tok, [text])[0]
    assert np.all((ids >= 0) & (ids < len(tok))) and tok.eos_token_id not in ids.tolist()
    assert tok.decode(ids.tolist()) == text


def test_a_bpe_size_may_be_written_with_spaces_around_it():
    from falcon_fwa.data.tokenizer import bpe_vocab_size

    assert bpe_vocab_size("bpe: 300") == 300 and bpe_vocab_size("bpe:258 ") == 258
    with pytest.raises(ValueError, match=r"^bpe:N needs N > 257 .*got 'bpe: 257'$"):
        bpe_vocab_size("bpe: 257")


def test_a_bpe_without_texts_is_refused_by_name():
    from falcon_fwa.data import load_tokenizer

    with pytest.raises(ValueError, match=r"^tokenizer 'bpe:N' needs the corpus texts to train on$"):
        load_tokenizer("bpe:300")


@pytest.mark.parametrize("spec", ["gpt2", "openai-community/gpt2", "bpe-lab/tokenizer", "bytedance/tok"])
def test_a_hub_name_is_asked_of_the_hub(spec, tmp_path, monkeypatch):
    """``NAME`` and ``OWNER/NAME`` that name no local folder go to the Hub (online), whatever they start with;
    what the Hub answers is named in the error."""
    import transformers

    from falcon_fwa.data import load_tokenizer

    asked = []

    def hub(name, **kwargs):
        asked.append((name, kwargs.get("local_files_only")))
        raise OSError(f"{name} is not a local folder and is not a valid model identifier")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", hub)
    with pytest.raises(ValueError, match=rf"^tokenizer must be .*loading '{spec}' failed: {spec} is not a local"):
        load_tokenizer(spec)
    assert asked == [(spec, False)]


def test_a_folder_the_loader_cannot_make_a_tokenizer_of_is_named(tmp_path):
    """A folder holding a ``tokenizer_config.json`` and no tokenizer file: the loader's ``ValueError`` is reported
    as a tokenizer that failed to load, naming the folder and the accepted specs."""
    from falcon_fwa.data import load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match=rf"^tokenizer must be 'byte', 'bpe:<vocab_size>', a local tokenizer folder "
                                         rf"or a Hub name; loading '{tmp_path}' failed: "):
        load_tokenizer(str(tmp_path))

def _word_tokenizer_with_template():
    """Words ``a`` (1) and ``b`` (2), unknown ``w0`` (0), ``<s>`` (3) and end-of-text ``</s>`` (4); its
    post-processor wraps a text as ``<s> ... </s>`` (as many Hub tokenizers do)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"w0": 0, "a": 1, "b": 2}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 3), ("</s>", 4)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def test_a_tokenizers_own_special_tokens_stay_out_of_documents(tmp_path):
    """The template's ``<s>``/``</s>`` are not part of a document: the shards hold end-of-text, then the words."""
    from falcon_fwa.data import TokenShards, encode_documents, write_token_shards

    tok = _word_tokenizer_with_template()
    assert tok("a b")["input_ids"] == [3, 1, 2, 4] and (len(tok), tok.eos_token_id) == (5, 4)
    assert [d.tolist() for d in encode_documents(tok, ["a b", "b c"])] == [[1, 2], [2, 0]]
    write_token_shards(["a b", "b c"], tok, str(tmp_path / "s"))
    assert [d.tolist() for d in TokenShards(str(tmp_path / "s")).documents()] == [[4, 1, 2], [4, 2, 0]]


def test_end_of_text_swapped_with_a_byte_outside_the_probe_is_no_byte_tokenizer(tmp_path):
    """The byte tokenizer's ``tokenizer.json`` with ``z`` at id 256 and end-of-text at 122: 257 ids, every byte
    of the probe where the byte tokenizer has it, yet ``zoo`` is [256, 111, 111], not its UTF-8 bytes."""
    from falcon_fwa.data import TokenShards, byte_tokenizer, encode_documents, load_tokenizer, write_token_shards
    from falcon_fwa.data.tokenizer import is_byte_tokenizer

    spec = json.loads(byte_tokenizer().backend_tokenizer.to_str())
    spec["model"]["vocab"] = {c: 256 if i == ord("z") else i for c, i in spec["model"]["vocab"].items()}
    spec["model"]["vocab"]["<|endoftext|>"] = ord("z")
    spec["added_tokens"][0]["id"] = ord("z")
    folder = tmp_path / "swapped"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    tok = load_tokenizer(str(folder))
    assert (len(tok), tok.eos_token_id) == (257, ord("z")) and not is_byte_tokenizer(tok)
    assert encode_documents(tok, ["zoo"])[0].tolist() == [256, 111, 111]
    write_token_shards(["zoo", "ab"], tok, str(tmp_path / "s"))
    assert [d.tolist() for d in TokenShards(str(tmp_path / "s")).documents()] == [[122, 256, 111, 111], [122, 97, 98]]


# --- token shards --------------------------------------------------------------------------------------------------

def test_the_files_of_a_shard_folder_hold_the_bytes_written_by_hand(tmp_path):
    """Documents "ab" and "\u00e9" with the byte tokenizer: tokens-00000.bin is the little-endian uint16 stream
    [256 97 98 256 0xC3 0xA9], docs-00000.npy the int64 starts [0 3], meta.json names format, sizes and files."""
    from falcon_fwa.data import byte_tokenizer, write_token_shards

    meta = write_token_shards(["ab", "\u00e9"], byte_tokenizer(), str(tmp_path / "s"))
    folder = tmp_path / "s"
    assert sorted(os.listdir(folder)) == ["docs-00000.npy", "meta.json", "tokens-00000.bin"]
    assert (folder / "tokens-00000.bin").read_bytes() == struct.pack("<6H", 256, 97, 98, 256, 0xC3, 0xA9)
    starts = np.load(folder / "docs-00000.npy")
    assert starts.dtype == np.dtype("<i8") and starts.tolist() == [0, 3]
    want = {"format": "falcon-fwa-tokens-1", "vocab_size": 257, "eos_token_id": 256, "dtype": "uint16",
            "n_tokens": 6, "n_docs": 2,
            "shards": [{"tokens": "tokens-00000.bin", "docs": "docs-00000.npy", "n_tokens": 6, "n_docs": 2}]}
    assert json.loads((folder / "meta.json").read_text()) == want and meta == want


def test_a_shard_folder_written_by_hand_is_read(tmp_path):
    """Two shards of uint32 tokens (vocabulary 70000, end-of-text 0) laid out as the module docstring says."""
    from falcon_fwa.data import TokenShards
    from falcon_fwa.data.shards import is_shard_folder

    folder = tmp_path / "hand"
    folder.mkdir()
    streams = [[0, 69999, 5, 0, 7], [0, 65536, 1, 2]]
    starts = [[0, 3], [0]]
    for i, (stream, st) in enumerate(zip(streams, starts)):
        (folder / f"tokens-{i:05d}.bin").write_bytes(struct.pack(f"<{len(stream)}I", *stream))
        np.save(folder / f"docs-{i:05d}.npy", np.asarray(st, dtype=np.int64))
    (folder / "meta.json").write_text(json.dumps({
        "format": "falcon-fwa-tokens-1", "vocab_size": 70000, "eos_token_id": 0, "dtype": "uint32", "n_tokens": 9,
        "n_docs": 3, "shards": [{"tokens": f"tokens-{i:05d}.bin", "docs": f"docs-{i:05d}.npy", "n_tokens": len(s),
                                 "n_docs": len(st)} for i, (s, st) in enumerate(zip(streams, starts))]}))
    assert is_shard_folder(str(folder))
    shards = TokenShards(str(folder))
    assert (shards.vocab_size, shards.eos_token_id, shards.n_tokens) == (70000, 0, 9)
    assert [s.tokens.dtype for s in shards.shards] == [np.uint32, np.uint32]
    assert [d.tolist() for d in shards.documents()] == [[0, 69999, 5], [0, 7], [0, 65536, 1, 2]]


def test_every_shard_file_and_the_folder_holding_the_split_are_flushed(tmp_path, monkeypatch):
    """Each tokens, docs and meta file, then the folder's own entries, are flushed to disk before the folder is
    renamed into place, and the parent folder (which holds the rename) after it."""
    from falcon_fwa.data import byte_tokenizer, write_token_shards

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", os.stat(a).st_ino)) or real_replace(a, b))
    write_token_shards(["abc", "de", "fgh"], byte_tokenizer(), str(tmp_path / "s"), shard_tokens=4)
    folder = tmp_path / "s"
    files = sorted(os.listdir(folder))
    assert files == ["docs-00000.npy", "docs-00001.npy", "docs-00002.npy", "meta.json", "tokens-00000.bin",
                     "tokens-00001.bin", "tokens-00002.bin"]
    rename = events.index(("replace", folder.stat().st_ino))
    flushed = [ino for kind, ino in events[:rename] if kind == "fsync"]
    assert {(folder / f).stat().st_ino for f in files} <= set(flushed)
    assert flushed[-1] == folder.stat().st_ino  # the folder itself, after its last file
    assert events[rename + 1:] == [("fsync", tmp_path.stat().st_ino)]


def test_a_checkpoint_folder_and_its_files_are_flushed_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """``save_checkpoint``: ``state.pt`` and ``meta.json``, then the folder's own entries, reach the disk before
    the temporary folder is renamed to ``step-*``; the checkpoint folder (holding that rename) after it."""
    from falcon_fwa.train import checkpoint

    events = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", os.stat(a).st_ino)) or real_rename(a, b))
    path = checkpoint.save_checkpoint(str(tmp_path / "ckpt"), 3, {"w": [1, 2]})
    folder = tmp_path / "ckpt" / "step-00000003"
    assert path == str(folder) and sorted(os.listdir(folder)) == ["meta.json", "state.pt"]
    rename = events.index(("rename", folder.stat().st_ino))
    flushed = [ino for kind, ino in events[:rename] if kind == "fsync"]
    assert flushed == [(folder / "state.pt").stat().st_ino, (folder / "meta.json").stat().st_ino,
                       folder.stat().st_ino]
    assert events[rename + 1] == ("fsync", (tmp_path / "ckpt").stat().st_ino)


def test_leftovers_of_a_stopped_run_are_replaced(tmp_path):
    """A ``s.tmp`` (a run stopped while writing) and a ``s.old`` (stopped while removing the replaced folder)
    do not stop the next write, and are gone after it; a folder named with a final slash is the same folder."""
    from falcon_fwa.data import TokenShards, byte_tokenizer, write_token_shards

    for name in ("s.tmp", "s.old"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokens-00000.bin").write_bytes(b"\x01\x00")
    write_token_shards(["ab"], byte_tokenizer(), str(tmp_path / "s") + "/")
    assert sorted(os.listdir(tmp_path)) == ["s"]
    write_token_shards(["cd"], byte_tokenizer(), str(tmp_path / "s") + "/")  # replaces it whole
    assert sorted(os.listdir(tmp_path)) == ["s"]
    assert [d.tolist() for d in TokenShards(str(tmp_path / "s")).documents()] == [[EOS, 99, 100]]


def test_an_empty_document_is_its_end_of_text_alone(tmp_path):
    from falcon_fwa.data import TokenShards, byte_tokenizer, write_token_shards

    meta = write_token_shards(["", "a", ""], byte_tokenizer(), str(tmp_path / "s"))
    assert (meta["n_docs"], meta["n_tokens"]) == (3, 4)
    assert [d.tolist() for d in TokenShards(str(tmp_path / "s")).documents()] == [[EOS], [EOS, 97], [EOS]]


def test_no_documents_leave_no_folder(tmp_path):
    from falcon_fwa.data import byte_tokenizer, write_token_shards
    from falcon_fwa.data.shards import NoDocuments

    with pytest.raises(NoDocuments, match=rf"^no documents to write into '{tmp_path / 's'}'$"):
        write_token_shards(iter([]), byte_tokenizer(), str(tmp_path / "s"))
    assert os.listdir(tmp_path) == []


def test_an_id_past_the_vocabulary_names_the_shards_dtype(tmp_path):
    from test_data_exact import word_tokenizer

    from falcon_fwa.data import write_token_shards

    tok = word_tokenizer({"w0": 0, "a": 1, "far": 9})  # 4 tokens: ids 0, 1, 9 and end-of-text 2
    with pytest.raises(ValueError) as caught:
        write_token_shards(["a far"], tok, str(tmp_path / "s"))
    assert str(caught.value) == ("tokenizer gave token id 9, outside 0..3 (its len(tokenizer) = 4, which sizes the "
                                 "shards' uint16 and the model)")


def test_a_folder_of_something_else_is_refused_and_kept(tmp_path):
    from falcon_fwa.data import byte_tokenizer, write_token_shards

    folder = tmp_path / "s"
    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps({"format": "falcon-fwa-tokens-0"}))
    with pytest.raises(ValueError, match=r"^'.*s' exists and is no token shard folder: it is not replaced; choose "):
        write_token_shards(["ab"], byte_tokenizer(), str(folder))
    assert os.listdir(folder) == ["meta.json"] and sorted(os.listdir(tmp_path)) == ["s"]


# --- row order -----------------------------------------------------------------------------------------------------

def test_the_order_of_an_epoch_is_not_another_seeds_order_shifted_by_an_epoch():
    """Seeds 0 and 1 over 50 rows: epoch 1 of seed 0 and epoch 0 of seed 1 (which a sum of seed and epoch would
    make one permutation) agree by chance with probability 1/50!."""
    from falcon_fwa.data import RowOrder

    n = 50
    zero, one = RowOrder(n, 0), RowOrder(n, 1)
    second_of_zero = [zero[k] for k in range(n, 2 * n)]
    first_of_one = [one[k] for k in range(n)]
    assert sorted(second_of_zero) == sorted(first_of_one) == list(range(n))
    assert second_of_zero != first_of_one
