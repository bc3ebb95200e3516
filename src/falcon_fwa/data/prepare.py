"""Tokenize a corpus once: ``{out_dir}/tokenizer/``, ``{out_dir}/train/``, ``{out_dir}/val/``.

``prepared.json`` records the settings and the sizes of the source files and of the tokenizer files of a
tokenizer folder (those loading it reads, not a model's beside them), and a stamp of each (:func:`_stamp`: its
modification time and the SHA-256 of its bytes, read again only where the time differs or lies within the
filesystem's timestamp step of the moment the stamps were taken, which the record's own modification time keeps
(:func:`_racy`), and then, the same bytes, kept with its new time); preparing again with the
same settings reuses the folder; with different settings, or once a local source or the tokenizer folder has gained
such a file or one has changed size or bytes (or, the tokenizer's, is gone), it is an error (pass
``overwrite=True`` to rebuild).
A source removed since does not matter: its tokens are in the folder.
Preparations of one folder are serialised by a lock file (``{out_dir}/.prepare.lock``): runs
started together on one shared folder tokenize it once, the others wait and reuse it. A preparation
refused or failed with an error leaves no folder or file of its own behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

from ..atomic import folder_lock, fsync_folder, make_folders, naming, remove_created, remove_temporaries, write_json
from .shards import NoDocuments, TokenShards, check_replaceable, is_shard_folder, write_token_shards
from .sources import (JSON_SUFFIXES, TEXT_SPLITS, TEXT_SUFFIXES, hf_data_files, hf_dataset, hf_split_files,
                      iter_documents, list_files, same_setting, source_folder_files)
from .tokenizer import (CHAT_TEMPLATE_DIR, bpe_vocab_size, canonical_spec, is_tokenizer_file, load_tokenizer,
                        same_spec)


@dataclass
class DataSpec:
    """Where the documents come from and how they become tokens.

    train_source / val_source: see ``sources.iter_documents``; a file that both read is refused. Without
    ``val_source`` every ``val_every``-th training document is held out, counted after ``text_split`` (a ``line``
    split holds out lines whose neighbours of the same file are trained on). tokenizer: ``"byte"``, ``"bpe:<vocab>"``
    or a tokenizer folder. bpe_documents: how many training documents train the BPE.
    """
    train_source: str
    val_source: Optional[str] = None
    tokenizer: str = "byte"
    text_split: str = "file"
    text_field: str = "text"
    val_every: int = 20
    max_documents: Optional[int] = None
    bpe_documents: int = 100_000

    def __post_init__(self) -> None:
        # one tokenizer, one recorded setting: "bpe:0300" or "bpe:" in other digits is "bpe:300" (see canonical_spec)
        if isinstance(self.tokenizer, str):
            self.tokenizer = canonical_spec(self.tokenizer)

    def check(self, name: Callable[[str], str] = lambda field: f"data.{field}") -> None:
        """Raise ``ValueError`` naming the first bad setting, before any document is read.
        ``name`` turns a field name into the name the caller knows it by (default: the recipe's
        ``data.FIELD``; the ``data`` command passes its options, ``--val-every``)."""
        for field in ("train_source", "val_source"):  # (datasets fails on an empty NAME with an IndexError)
            source = getattr(self, field)
            if source is not None and source.startswith("hf:") and not hf_dataset(source)[0]:
                raise ValueError(f"{name(field)} {source!r} names no dataset: give hf:NAME[:CONFIG] (a Hub name or "
                                 "a local dataset folder)")
        if self.text_split not in TEXT_SPLITS:
            raise ValueError(f"{name('text_split')} must be one of {TEXT_SPLITS}, got {self.text_split!r}")
        if self.val_every < 2:
            raise ValueError(f"{name('val_every')} must be >= 2, got {self.val_every}")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError(f"{name('max_documents')} must be >= 1, got {self.max_documents}")
        if self.bpe_documents < 1:
            raise ValueError(f"{name('bpe_documents')} must be >= 1, got {self.bpe_documents}")
        if self.tokenizer.startswith("bpe:"):
            try:
                bpe_vocab_size(self.tokenizer)
            except ValueError as err:
                raise ValueError(f"{name('tokenizer')} {err}") from None


def _docs(spec: DataSpec, which: str, out_dir: str, name: Callable[[str], str] = lambda field: f"data.{field}",
          opener=None):
    """The documents of split ``which`` (``"all"``: every document of the training source, none held out); files
    under ``out_dir`` (the output, should it lie inside a source folder) are no documents. Errors name the settings
    as ``name`` gives them; ``opener``: as in :func:`~falcon_fwa.data.sources.iter_documents`."""
    read = {} if opener is None else {"opener": opener}
    if which == "val" and spec.val_source is not None:
        return iter_documents(spec.val_source, text_split=spec.text_split, text_field=spec.text_field,
                              split="validation", max_documents=spec.max_documents, exclude=out_dir, name=name, **read)
    docs = iter_documents(spec.train_source, text_split=spec.text_split, text_field=spec.text_field,
                          split="train", max_documents=spec.max_documents, exclude=out_dir, name=name, **read)
    if spec.val_source is not None or which == "all":
        return docs
    return (d for i, d in enumerate(docs) if _is_held_out(i, spec.val_every) == (which == "val"))


def _is_held_out(i: int, val_every: int) -> bool:
    """Whether the ``i``-th document (from 0) of a training source is held out for validation (no ``val_source``)."""
    return i % val_every == val_every - 1


def _hold_out(docs, val_every: int, spill, folder: str) -> Iterator[str]:
    """The training documents of ``docs`` (all documents of the training source, in order); every ``val_every``-th,
    held out for validation, is written to the binary file ``spill`` instead (:func:`_held_out`), so that without
    ``val_source`` the source is read once for both splits. A write the disk refuses names ``folder``, the spill's
    (a file of no name)."""
    for i, doc in enumerate(docs):
        if _is_held_out(i, val_every):
            data = doc.encode("utf-8", "surrogatepass")  # (each document as it was, whatever its text)
            with naming(folder):
                spill.write(len(data).to_bytes(8, "little") + data)
        else:
            yield doc


def _held_out(spill) -> Iterator[str]:
    """The documents :func:`_hold_out` wrote to ``spill``, in order."""
    spill.seek(0)
    while True:
        size = spill.read(8)
        if not size:
            return
        yield spill.read(int.from_bytes(size, "little")).decode("utf-8", "surrogatepass")


def source_files(spec: DataSpec, out_dir: str, name: Callable[[str], str] = lambda field: f"data.{field}",
                 gone_ok: bool = False) -> dict:
    """``{"train": {path: bytes}, "val": ...}``: the files each local source names now (an ``hf:`` dataset
    folder: every file in it; a Hub dataset and an unset ``val_source`` give ``None``), and ``"tokenizer"``: the
    tokenizer files of a tokenizer folder (:func:`tokenizer_files`; no key for another tokenizer), so that a reuse
    can tell a corpus or tokenizer that has changed. ``FileNotFoundError`` naming the setting (``name``) of a source
    that names no file; with ``gone_ok``, ``None`` for it instead (a reuse: its tokens are in the folder, and the
    other source is still checked)."""
    def sizes(field: str) -> Optional[dict]:
        source = getattr(spec, field)
        if source is None:
            return None
        if source.startswith("hf:"):
            try:  # (refused before anything is written where the dataset folder holds nothing but a preparation)
                hf_data_files(source, out_dir)
            except FileNotFoundError as err:
                if gone_ok:
                    return None
                raise FileNotFoundError(f"{name(field)}: {err}") from None
            return _folder_files(hf_dataset(source)[0], out_dir)
        try:
            paths = list_files(source, exclude=out_dir, name=name)
        except FileNotFoundError as err:
            if gone_ok:
                return None
            raise FileNotFoundError(f"{name(field)}: {err}") from None
        _refuse_shard_folders(paths, source, name(field))
        return {path: os.path.getsize(path) for path in paths}

    files = {"train": sizes("train_source"), "val": sizes("val_source")}
    tokenizer = tokenizer_files(spec)
    return files if tokenizer is None else {**files, "tokenizer": tokenizer}


def _refuse_shard_folders(paths: list, source: str, option: str) -> None:
    """``ValueError`` naming ``option`` and ``source`` where a file of ``paths`` is the ``meta.json`` of a token shard
    folder (a split that a preparation wrote: ``prep/train`` of ``--out prep``, a glob over it): its tokens are no
    text to tokenize, and its ``meta.json`` no JSON Lines. What a preparation wrote is trained on as it is, by a
    recipe's ``data.out_dir``."""
    for path in paths:
        folder = os.path.dirname(path) or "."
        if os.path.basename(path) != "meta.json" or not is_shard_folder(folder):
            continue
        what = "is a prepared token shard folder" if os.path.normpath(folder) == os.path.normpath(source) else \
            f"names the prepared token shard folder {folder!r}"
        prepared = os.path.dirname(os.path.normpath(folder)) or "."
        if os.path.isfile(os.path.join(prepared, "prepared.json")):
            instead = (f"to train on it, give its preparation {prepared!r} as the recipe's data.out_dir (falcon-fwa "
                       f"train --set data.out_dir={prepared}), with the settings its prepared.json records; to "
                       "tokenize again, give the files it was prepared from")
        else:
            instead = "give the text, JSON or Parquet files it was tokenized from"
        raise ValueError(f"{option} {source!r} {what} (meta.json, tokens-*.bin), no text to tokenize: {instead}")


def tokenizer_files(spec: DataSpec) -> Optional[dict]:
    """``{path: bytes}`` of the files of a tokenizer folder ``spec.tokenizer`` that loading the tokenizer reads
    (:func:`~falcon_fwa.data.tokenizer.is_tokenizer_file`: ``tokenizer.json``, ``tokenizer_config.json``, a
    vocabulary, chat templates ...): a model's files beside them (a saved run's ``model/`` folder holds both)
    change no token and are left out. ``None`` for ``byte``, ``bpe:N``, a Hub name and a folder gone since."""
    folder = spec.tokenizer
    if spec.tokenizer == "byte" or spec.tokenizer.startswith("bpe:") or not os.path.isdir(folder):
        return None  # (as load_tokenizer reads them)
    return {path: os.path.getsize(path) for path in _tokenizer_paths(folder)}


def _tokenizer_paths(folder: str) -> list:
    """The files of ``folder`` that loading a tokenizer from it reads (:func:`is_tokenizer_file`), sorted."""
    names = os.listdir(folder)
    if os.path.isdir(os.path.join(folder, CHAT_TEMPLATE_DIR)):
        names += [os.path.join(CHAT_TEMPLATE_DIR, n) for n in os.listdir(os.path.join(folder, CHAT_TEMPLATE_DIR))]
    paths = [os.path.join(folder, n) for n in names if is_tokenizer_file(n)]
    return [path for path in sorted(paths) if os.path.isfile(path)]


def _inside(path: str, folder: str) -> str:
    """The path of the file ``path`` inside ``folder``, each as its real path (a folder named by a link to it)."""
    return os.path.relpath(os.path.realpath(path), os.path.realpath(folder))


def _hash_rest(f, digest) -> str:
    """``digest`` updated with the bytes of the open binary file ``f`` from where it stands, as hex."""
    for block in iter(lambda: f.read(1 << 20), b""):
        digest.update(block)
    return digest.hexdigest()


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return _hash_rest(f, hashlib.sha256())


def _stamp(path: str) -> Optional[list]:
    """``[modification time in ns, SHA-256 of the bytes]`` of a file; ``None`` for one gone."""
    try:
        return [os.stat(path).st_mtime_ns, _sha256(path)]
    except OSError:
        return None


class _HashingFile(io.RawIOBase):
    """A file open for reading whose bytes are hashed (SHA-256) as they are read, each once: a read past the
    bytes hashed so far adds those it brings (a seek back, as a ``.json`` file's first look at its head takes,
    reads them again unhashed). Closed, it gives its :class:`_ReadStamps` the hash of the bytes it has read from
    the start, where they are the file's first ones, and its modification time taken when it was opened."""

    def __init__(self, path: str, stamps: "_ReadStamps"):
        super().__init__()
        self._path, self._stamps = path, stamps
        self._file = open(path, "rb", buffering=0)
        self._mtime = os.fstat(self._file.fileno()).st_mtime_ns  # before a byte is read
        self._digest, self._hashed, self._whole = hashlib.sha256(), 0, False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        at = self._file.tell()
        n = self._file.readinto(buffer)
        if n == 0 and at == self._hashed:  # the end, every byte before it hashed
            self._whole = True
        elif at <= self._hashed < at + n:
            with memoryview(buffer) as view:
                self._digest.update(view[self._hashed - at:n])
            self._hashed = at + n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()

    def close(self) -> None:
        if not self.closed:
            try:
                self._stamps.read(self._path, self._mtime, self._digest, None if self._whole else self._hashed)
            finally:
                self._file.close()
        super().close()


class _ReadStamps:
    """The stamps (:func:`_stamp`) of a fresh preparation's source files, taken as they are read to be
    tokenized, so that the corpus is read once: :meth:`open` is the ``opener`` of
    :func:`~falcon_fwa.data.sources.iter_documents`, whose first read of a file hashes it (the modification time
    taken before, as :func:`_stamp` takes it); a file read again (the documents that train a BPE are read again to
    be tokenized) is read plainly. :meth:`stamp` gives a file's stamp: a file whose reading stopped before
    its end (``max_documents``, the documents that train a BPE) is hashed on from there, one no document was read
    from (past ``max_documents``, a Parquet file, which ``pyarrow`` reads in no order) is stamped whole."""

    def __init__(self):
        self._stamps: dict = {}  # path -> stamp of a file read whole, or [mtime, digest, bytes hashed]
        self._reading: set = set()  # paths open now, hashed

    def open(self, path: str):
        if path in self._stamps or path in self._reading:
            return open(path, "rb")
        self._reading.add(path)
        try:
            return io.BufferedReader(_HashingFile(path, self))
        except BaseException:
            self._reading.discard(path)
            raise

    def read(self, path: str, mtime: int, digest, hashed: Optional[int]) -> None:
        """What a :class:`_HashingFile` of ``path`` read, closed: the hash of its first ``hashed`` bytes, or
        (``None``) of them all."""
        self._reading.discard(path)
        self._stamps[path] = [mtime, digest.hexdigest()] if hashed is None else [mtime, digest, hashed]

    def retake(self, paths) -> None:
        """Stamp ``paths`` again now (the files of a tokenizer folder a save has written again)."""
        for path in paths:
            self._stamps[path] = _stamp(path)

    def stamp(self, path: str) -> Optional[list]:
        """The stamp of ``path`` (:func:`_stamp`; ``None`` for a file gone), kept for a later call."""
        held = self._stamps.get(path)
        if held is None:
            self._stamps[path] = _stamp(path)
        elif len(held) == 3:  # read in part: the bytes past those hashed
            mtime, digest, hashed = held
            try:
                with open(path, "rb") as f:
                    f.seek(hashed)
                    self._stamps[path] = [mtime, _hash_rest(f, digest)]
            except OSError:
                self._stamps[path] = None  # gone since
        return self._stamps[path]


def _read_on_tokenizing(path: str, source: Optional[str]) -> bool:
    """Whether a file of a local ``source`` is read through the opener of ``iter_documents`` (a text or JSON file;
    ``pyarrow`` reads a Parquet one, ``datasets`` an ``hf:`` dataset folder's)."""
    return source is not None and not source.startswith("hf:") and \
        path.lower().endswith(TEXT_SUFFIXES + JSON_SUFFIXES)


RACY_NS = 2 * 10**9  # the coarsest timestamp step of a filesystem kept: FAT's 2 s (ext3, HFS+: 1 s)


def _racy(mtime: int, stamped: Optional[int]) -> bool:
    """Whether a file's modification time ``mtime`` cannot vouch for its bytes as hashed at ``stamped`` (ns, taken
    before the hash), git's "racy clean" entry: a time not clearly older than the hash (within a timestamp step of
    the coarsest filesystems, or later) may be kept by a later write of other bytes of the same size (written,
    stamped and written again in one step). ``stamped`` ``None``: unknown, the time vouches as it is."""
    return stamped is not None and mtime >= stamped - RACY_NS


def _same_bytes(path: str, stamp, retimed: Optional[list] = None, stamped: Optional[int] = None) -> bool:
    """Whether the file at ``path`` (of the recorded size) still holds the bytes its :func:`_stamp` ``stamp`` was
    taken of: so where its modification time is the recorded one and clearly older than ``stamped``, the time the
    stamp was taken (:func:`_racy`; as ``make`` and ``git`` take it, so that a reuse reads no byte of a large
    corpus); else where its SHA-256 is the recorded one (a file written again with the same bytes, a copy, a save
    of the same tokenizer: no change). A stamp of another form counts as none.
    A file found the same by its SHA-256 adds ``(stamp, its time)`` to ``retimed``: the time taken before it was
    read, which the record may keep from then on (a file written while it was read has a later one), with the
    time of this check as the one its stamp was taken at (a file of the recorded time, too near ``stamped``)."""
    if not (isinstance(stamp, list) and len(stamp) == 2):
        return True
    try:
        mtime = os.stat(path).st_mtime_ns
        if mtime == stamp[0] and not _racy(mtime, stamped):
            return True
        if _sha256(path) != stamp[1]:
            return False
    except OSError:
        return False
    if retimed is not None:
        retimed.append((stamp, mtime))
    return True


def _folder_files(folder: str, out_dir: str) -> Optional[dict]:
    """``{path: bytes}`` of every file in a local folder that is read whole (an ``hf:`` source's dataset folder),
    but what a preparation wrote there, the output folder's entries too, should it lie inside, and hidden ones
    (:func:`~falcon_fwa.data.sources.source_folder_files`: ``datasets`` reads no ``.git/`` or ``.cache/`` either,
    nor a broken link); ``None`` where ``folder`` is no local folder (a Hub name)."""
    if not os.path.isdir(folder):
        return None
    return {path: os.path.getsize(path) for path in source_folder_files(folder, out_dir)}


def _check_disjoint(files: dict, spec: DataSpec, name: Callable[[str], str], out_dir: Optional[str] = None) -> None:
    """``ValueError`` when a file of the val source is also one of the train source (the same file, or
    a folder of training data that holds the validation file): its documents would be in both splits.
    An ``hf:`` dataset folder counts the files of the split it is read for (``train``, ``validation``), as
    ``datasets`` finds them (no network); an ``hf:`` Hub name has no files here. Train and val given as one
    ``hf:NAME[:CONFIG]`` read its two splits, which ``datasets`` gives their own files: one folder may be both.
    (A source names no split, so no two sources read the same split of one dataset.)"""
    if spec.val_source is None:
        return
    hf = [source.startswith("hf:") for source in (spec.train_source, spec.val_source)]
    train = hf_split_files(spec.train_source, "train", out_dir) if hf[0] else files["train"]
    val = hf_split_files(spec.val_source, "validation", out_dir) if hf[1] else files["val"]
    if not train or not val:
        return
    real = {os.path.realpath(path) for path in train}
    shared = [path for path in sorted(val) if os.path.realpath(path) in real]
    if shared:
        more = f" and {len(shared) - 1} more" if len(shared) > 1 else ""
        if not any(hf):
            raise ValueError(f"{name('val_source')} file {shared[0]!r}{more} is also read by {name('train_source')} "
                             f"{spec.train_source!r}: its documents would be in both splits; give "
                             f"{name('train_source')} files, a folder or a glob without the validation files")
        val_reads = f"{spec.val_source!r} (its validation split) reads " if hf[1] else ""
        train_split = " (its train split)" if hf[0] else ""
        raise ValueError(f"{name('val_source')} {val_reads}file {shared[0]!r}{more}, also read by "
                         f"{name('train_source')} {spec.train_source!r}{train_split}: its documents would be in both "
                         "splits; give sources that share no file")


def _check_copies(files: dict, reads: "_ReadStamps", spec: DataSpec, name: Callable[[str], str]) -> None:
    """``ValueError`` when a file of a local val source holds the same bytes (its SHA-256, as ``reads`` stamps it:
    :meth:`_ReadStamps.stamp`) as a file of a local train source under another name, a copy: its documents would be
    in both splits, as those of one file both read would (:func:`_check_disjoint`). Only files of one size in both
    sources are hashed (read) here, before the others are read to be tokenized. A copy that holds no document
    (an empty file, one of blank lines, a JSON ``[]``, as ``text_split`` and ``text_field`` read it) adds none to
    either split, and passes; ``hf:`` sources are left to :func:`_check_disjoint` (one dataset folder may be both, its splits' files
    apart)."""
    if spec.val_source is None or any(s.startswith("hf:") for s in (spec.train_source, spec.val_source)):
        return
    sizes = set(files["train"].values()) & set(files["val"].values()) - {0}
    stamps = {which: {path: reads.stamp(path) for path, size in files[which].items() if size in sizes}
              for which in ("train", "val")}
    train = {stamp[1]: path for path, stamp in stamps["train"].items() if stamp is not None}
    for path, stamp in sorted(stamps["val"].items()):
        if stamp is not None and stamp[1] in train and _holds_document(path, spec, name):
            raise ValueError(f"{name('val_source')} file {path!r} holds the same bytes as {train[stamp[1]]!r}, read "
                             f"by {name('train_source')} {spec.train_source!r}: its documents would be in both "
                             f"splits; give {name('val_source')} files that are no copy of a training file")


def _holds_document(path: str, spec: DataSpec, name: Callable[[str], str]) -> bool:
    """Whether the file at ``path`` yields a document as ``spec`` reads it."""
    docs = iter_documents(path, text_split=spec.text_split, text_field=spec.text_field, max_documents=1, name=name)
    try:
        return next(docs, None) is not None
    finally:
        docs.close()


def _changed_files(held: dict, now: dict, kinds=("train", "val"), stamps: Optional[dict] = None,
                   retimed: Optional[list] = None, stamp_time: Optional[int] = None) -> str:
    """What differs between the ``kinds`` of two :func:`source_files` records, in words ('' if nothing); ``stamps``:
    the stamps (:func:`_stamp`) recorded with ``held``, which a file of the same size must still have (none recorded, by
    a preparation before they were: the sizes alone count; ``retimed``, and ``stamp_time`` as ``stamped``, as in
    :func:`_same_bytes`). A source's files gone since are no change (their tokens are here); a tokenizer folder's
    are, while the folder is there: what it loads now is another tokenizer. A folder gone whole gives none (the
    saved copy is the one)."""
    changes = []
    for which in kinds:
        if held.get(which) is None:  # none recorded (an hf: source, before its dataset folder's files were)
            continue
        # each file by its real path: the record names the files as the source was spelt then (corpus.jsonl),
        # which may be spelt otherwise now (./corpus.jsonl, its absolute path): the same file
        before = {os.path.realpath(path): size for path, size in held[which].items()}
        after = now.get(which) or {}
        stamped = {os.path.realpath(path): stamp for path, stamp in ((stamps or {}).get(which) or {}).items()}
        for path in sorted(after):
            real = os.path.realpath(path)
            if real not in before:
                changes.append(f"{path} is new")
            elif before[real] != after[path]:
                changes.append(f"{path} held {before[real]:,} bytes, now {after[path]:,}")
            elif real in stamped and not _same_bytes(path, stamped[real], retimed, stamp_time):
                changes.append(f"{path} holds other bytes since (as many: {after[path]:,})")
        if which == "tokenizer" and now.get(which) is not None:
            real_after = {os.path.realpath(path) for path in after}
            changes += [f"{path} is gone" for path in sorted(held[which]) if os.path.realpath(path) not in real_after]
    changes = list(dict.fromkeys(changes))  # a file both sources read (one hf: folder) changed once
    if len(changes) > 3:
        changes = changes[:3] + [f"{len(changes) - 3} more"]
    return "; ".join(changes)


LOCK_NAME = ".prepare.lock"


def check_sources(spec: DataSpec, out_dir: str, name: Callable[[str], str] = lambda field: f"data.{field}") -> None:
    """The checks of ``spec`` that need no tokenizing, before ``out_dir`` is made: its settings
    (:meth:`DataSpec.check`) and, where ``out_dir`` holds no preparation to reuse, that each local source
    names files and that no file is in both splits. Errors name the settings as ``name`` gives them."""
    spec.check(name)
    if not os.path.isfile(os.path.join(out_dir, "prepared.json")):  # (a reuse takes a corpus gone since)
        _check_disjoint(source_files(spec, out_dir, name), spec, name, out_dir)


def prepare_dataset(spec: DataSpec, out_dir: str, *, overwrite: bool = False,
                    name: Callable[[str], str] = lambda field: f"data.{field}") -> dict:
    """Tokenize ``spec`` into ``out_dir`` (or reuse it); returns the recorded settings + token counts.
    ``name``: as in :meth:`DataSpec.check`, for the settings that errors name. The settings and sources are
    checked before the folder is made (:func:`check_sources`); a preparation that fails after (a tokenizer
    that does not load, an empty split) removes what it wrote, and the folder with its lock file where it
    made them."""
    if not out_dir:
        raise ValueError(f"{name('out_dir')} is empty: give the folder to write the tokenized data into")
    check_sources(spec, out_dir, name)  # before the lock, which creates the folder
    made = make_folders(out_dir)
    before = set(os.listdir(out_dir))  # (the lock file too, where an earlier preparation left it)
    with folder_lock(out_dir, LOCK_NAME) as remade:
        # the folders and lock file the lock made (made again where a preparation that failed while this one
        # waited removed them) are this call's; what another preparation wrote while this one waited is not
        made += [path for path in remade.folders if path not in made]
        before = (before | set(os.listdir(out_dir))) - {LOCK_NAME} | (set() if remade.lock else {LOCK_NAME})
        try:
            remove_temporaries(out_dir, "prepared.json")  # a preparation killed while writing it left its own
            return _prepare(spec, out_dir, overwrite, name)
        except Exception:  # (a stop, Ctrl-C, leaves its temporaries to the next preparation, as a kill does)
            remove_created(out_dir, before, made, LOCK_NAME)
            raise


def _empty_split(spec: DataSpec, which: str, name: Callable[[str], str]) -> str:
    """Why split ``which`` got no document, naming the source and the settings that would give it some."""
    if spec.val_source is not None:
        source = spec.val_source if which == "val" else spec.train_source
        return f"the {which} split is empty: {name(which + '_source')} {source!r} holds no document"
    if which == "train":
        return f"the train split is empty: {name('train_source')} {spec.train_source!r} holds no document"
    return (f"the val split is empty: {name('train_source')} {spec.train_source!r} holds fewer than "
            f"{name('val_every')}={spec.val_every} documents; set {name('val_source')}, or a {name('text_split')} "
            "that yields more documents")


def _prepare(spec: DataSpec, out_dir: str, overwrite: bool, name: Callable[[str], str]) -> dict:
    record_path = os.path.join(out_dir, "prepared.json")
    wanted = asdict(spec)
    if os.path.isfile(record_path) and not overwrite:
        record = _read_record(record_path)
        held = dict(record["spec"])
        if isinstance(held.get("tokenizer"), str):  # a record written before a bpe:N was spelt one way, or a
            # folder gone since, which the spec given names by a relative path (see same_spec)
            held["tokenizer"] = spec.tokenizer if same_spec(held["tokenizer"], spec.tokenizer) else \
                canonical_spec(held["tokenizer"])
        # the sources and tokenizer as the paths they name (./corpus.jsonl and corpus.jsonl are one source): the
        # record keeps them as the preparation that wrote it was given them (sources.resolved_setting)
        differ = ", ".join(f"{k} {held.get(k)!r} there, {wanted.get(k)!r} here"
                           for k in sorted(set(held) | set(wanted))
                           if not same_setting(k, held.get(k), wanted.get(k)))
        if differ:
            raise ValueError(f"data folder {out_dir!r} was prepared with other settings ({differ}): choose another "
                             "folder (falcon-fwa data --out, or a recipe's data.out_dir) or rebuild this one "
                             "(falcon-fwa data --overwrite)")
        retimed: list = []  # files of a time other than the recorded one (or one too near the time the stamps were
        # taken to vouch for them), found the same bytes by their SHA-256
        checked = time.time_ns()  # before a file is read: the time the stamps of the files read now are taken at
        stamped = os.stat(record_path).st_mtime_ns  # the time the stamps were taken at (_keep_record); a record
        # written before it was kept: the time it was written, no earlier
        if "files" in record:  # (folders prepared before the files were recorded are reused as they are)
            now = source_files(spec, out_dir, gone_ok=True)  # a source gone: its tokens are here; the other is checked
            stamps = record.get("stamps") if isinstance(record.get("stamps"), dict) else None
            changed = _changed_files(record["files"], now, stamps=stamps, retimed=retimed, stamp_time=stamped)
            if changed:
                raise ValueError(f"data folder {out_dir!r} was prepared from other source files ({changed}): "
                                 "rebuild it (falcon-fwa data --overwrite) or choose another folder")
            held = record["files"]
            if held.get("tokenizer"):  # (a record that held every file of the folder: its tokenizer files count;
                # one that held them relative, as the folder was named then: from the working folder, as it was)
                held = {**held, "tokenizer": {os.path.abspath(path): size for path, size in held["tokenizer"].items()
                                              if is_tokenizer_file(_inside(path, spec.tokenizer))}}
            changed = _changed_files(held, now, ("tokenizer",), stamps, retimed, stamped)
            if changed:
                raise ValueError(f"data folder {out_dir!r} was prepared with another {name('tokenizer')} "
                                 f"{spec.tokenizer!r}: its files have changed since ({changed}): rebuild it "
                                 "(falcon-fwa data --overwrite) or choose another folder")
        for which in ("train", "val"):  # removed by hand since: the folder is no longer what it records
            if not is_shard_folder(os.path.join(out_dir, which)):
                raise ValueError(f"data folder {out_dir!r} has lost its {which} split ({os.path.join(out_dir, which)!r}"
                                 " is no token shard folder): rebuild it (falcon-fwa data --overwrite)")
        copy = os.path.join(out_dir, "tokenizer")  # (exported with a trained model: found gone now, not then)
        if not os.path.isdir(copy) or not _tokenizer_paths(copy):
            raise ValueError(f"data folder {out_dir!r} has lost its tokenizer ({copy!r} holds no tokenizer files): "
                             "rebuild it (falcon-fwa data --overwrite)")
        # (touched, or written again with the same bytes: read once, not each reuse; of the recorded time, read
        # again until that time is clearly older than this reuse, which a record kept then lets the next one see)
        retimed = [(stamp, mtime) for stamp, mtime in retimed if stamp[0] != mtime or not _racy(mtime, checked)]
        if retimed:
            _retime(record_path, record, retimed, checked)
        return record
    files = source_files(spec, out_dir, name)
    stamped = time.time_ns()  # before a file is hashed (see _racy)
    _check_disjoint(files, spec, name, out_dir)
    # each file stamped before a document of it is read (a file written while it is tokenized counts as changed):
    # the text and JSON files of a local source as they are read to be tokenized (the corpus is read once), the
    # others (Parquet, an hf: dataset folder's, the tokenizer folder's) now
    reads, sources = _ReadStamps(), {"train": spec.train_source, "val": spec.val_source}
    for which, paths in files.items():
        for path in paths or ():
            if not _read_on_tokenizing(path, sources.get(which)):
                reads.stamp(path)
    _check_copies(files, reads, spec, name)
    for which in ("train", "val"):  # before the tokenizer is trained or saved into a folder of something else
        check_replaceable(os.path.join(out_dir, which))
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(record_path):  # a rebuild: until it completes, the folder holds no prepared dataset
        os.remove(record_path)
        fsync_folder(out_dir)  # the removal on disk before a new shard is: a power loss leaves no stale record
    texts = bpe_docs = None
    if spec.tokenizer.startswith("bpe:"):  # the training documents only: none held out for validation
        bpe_docs = _docs(spec, "train", out_dir, name, reads.open)
        texts = itertools.islice(bpe_docs, spec.bpe_documents)
    tokenizer = load_tokenizer(spec.tokenizer, texts=texts, name=name("tokenizer"))
    if bpe_docs is not None:
        bpe_docs.close()  # the file it stopped in: its hash goes on from there (_ReadStamps)
    save_tokenizer(tokenizer, os.path.join(out_dir, "tokenizer"))
    if files.get("tokenizer") is not None and os.path.samefile(spec.tokenizer, os.path.join(out_dir, "tokenizer")):
        # the tokenizer was loaded from the folder it is saved into (tokenized again with the copy an earlier
        # preparation saved): the folder as this save left it, which the next run finds
        files["tokenizer"] = tokenizer_files(spec)
        reads.retake(files["tokenizer"])
    counts = {}
    # without val_source the documents held out are kept aside (a file of no name in out_dir) as the training source
    # is read for the train split, and tokenized from there: the source is read once
    with contextlib.ExitStack() as stack:
        spill = None if spec.val_source is not None else stack.enter_context(tempfile.TemporaryFile(dir=out_dir))
        for which in ("train", "val"):
            if spill is None:
                docs = _docs(spec, which, out_dir, name, reads.open)
            elif which == "train":
                docs = _hold_out(_docs(spec, "all", out_dir, name, reads.open), spec.val_every, spill, out_dir)
            else:
                docs = _held_out(spill)
            try:
                meta = write_token_shards(docs, tokenizer, os.path.join(out_dir, which), desc=f"tokenize {which}")
            except NoDocuments as err:
                raise ValueError(f"{err}: {_empty_split(spec, which, name)}") from None
            counts[which] = {"n_tokens": meta["n_tokens"], "n_docs": meta["n_docs"]}
    stamps = {which: None if paths is None else {path: reads.stamp(path) for path in paths}
              for which, paths in files.items()}
    record = {"spec": wanted, "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "counts": counts,
              "files": files, "stamps": stamps}
    _keep_record(record_path, record, stamped)
    return record


def _keep_record(record_path: str, record: dict, stamped: int) -> None:
    """Write ``record`` to ``record_path`` atomically, its modification time set to ``stamped``, the time taken
    before the stamps it holds were (:func:`_racy`: a file whose time is not clearly older is read on reuse).
    A time the disk refuses to set leaves the one of the write, later."""
    write_json(record_path, record)
    try:
        os.utime(record_path, ns=(stamped, stamped))
    except OSError:
        pass


def _retime(record_path: str, record: dict, retimed: list, checked: int) -> None:
    """Keep in ``record`` (written to ``record_path`` atomically, as a preparation writes it) the times of the
    ``retimed`` files (:func:`_same_bytes`) and ``checked``, the time taken before the reuse read them, as the one
    the stamps were taken at (each file either read since, or vouched for by a time older than the earlier one):
    the next reuse takes them by their time, without reading them again, once that time is clearly older
    (:func:`_racy`). A record the disk refuses to write is left as it was (the reuse needs none: it reads those
    files again)."""
    held = [stamp[0] for stamp, _ in retimed]
    for stamp, mtime in retimed:
        stamp[0] = mtime
    try:
        _keep_record(record_path, record, checked)
    except OSError:
        for (stamp, _), mtime in zip(retimed, held):  # the record returned is the one kept
            stamp[0] = mtime


def save_tokenizer(tokenizer, folder: str) -> None:
    """``tokenizer.save_pretrained(folder)``; a write the disk refuses is an ``OSError`` naming ``folder``
    (the fast tokenizers report it as a plain ``Exception``, "No space left on device (os error 28)").
    The files loading a tokenizer reads (:func:`_tokenizer_paths`) that the save did not write are removed: those
    an earlier preparation saved of another tokenizer (a chat template, a vocabulary) would be read with this one.
    Files of other kinds stay."""
    earlier = _tokenizer_paths(folder) if os.path.isdir(folder) else []
    try:
        with naming(folder):
            saved = tokenizer.save_pretrained(folder)
    except Exception as err:
        if type(err) is not Exception or "os error" not in str(err):
            raise
        raise OSError(f"cannot write the tokenizer into {folder!r}: {err}") from err
    written = {os.path.realpath(path) for path in saved}
    for path in earlier:
        if os.path.realpath(path) not in written:
            with naming(path):
                os.remove(path)


def _read_record(path: str) -> dict:
    """The ``prepared.json`` at ``path``; ``ValueError`` naming it if it is no record this module wrote."""
    try:
        with open(path) as f:
            record = json.load(f)
    except ValueError as err:  # not JSON (edited or damaged by hand: the module writes it atomically)
        record, why = None, str(err)
    else:
        why = "no \"spec\" of settings"
    if not isinstance(record, dict) or not isinstance(record.get("spec"), dict):
        raise ValueError(f"{path!r} is no record of a preparation ({why}): rebuild the folder "
                         "(falcon-fwa data --overwrite) or choose another folder")
    return record


def open_split(out_dir: str, which: str) -> TokenShards:
    """The token shards of split ``which`` (``"train"`` or ``"val"``) of a folder that
    :func:`prepare_dataset` wrote (memory-mapped; each document is stored as ``[eos] + tokens``)."""
    return TokenShards(os.path.join(out_dir, which))
