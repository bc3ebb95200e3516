"""Memory-mapped token shards with document boundaries.

A shard folder holds ``meta.json`` and, per shard ``i``, ``tokens-{i:05d}.bin`` (raw uint16 when
the vocabulary fits, else uint32) and ``docs-{i:05d}.npy`` (int64 start offset of every document
in that shard). Every document is stored as ``[eos] + tokens``: the end-of-text token opens each
document, so the last position of a document predicts end-of-text and no target ever crosses a
document boundary once sequences are cut there (``cu_seqlens`` packing).

The folder is written (and synced to disk) under a temporary name and renamed when complete; a
folder it replaces is first renamed aside, then removed: an interrupted preparation never leaves a
folder that looks finished, nor a half-removed one.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Iterable, List, Optional

import numpy as np
from tqdm.auto import tqdm

from ..atomic import fsync_folder, naming, replaceable, synced_write
from .tokenizer import encode_documents, is_byte_tokenizer


def token_dtype(vocab_size: int):
    """uint16 when every id fits in 16 bits, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


class _ShardWriter:
    def __init__(self, folder: str, dtype, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: List[dict] = []
        self._open()

    def _open(self):
        i = len(self.shards)
        self.name = f"tokens-{i:05d}.bin"
        self.path = os.path.join(self.folder, self.name)
        self.file = open(self.path, "wb")
        self.n_tokens, self.starts = 0, []

    def _close(self):
        with naming(self.path):
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        docs = f"docs-{len(self.shards):05d}.npy"
        starts = np.asarray(self.starts, dtype=np.int64)
        synced_write(os.path.join(self.folder, docs), lambda f: np.save(f, starts), "wb")
        self.shards.append({"tokens": self.name, "docs": docs, "n_tokens": self.n_tokens, "n_docs": len(self.starts)})

    def add(self, ids: np.ndarray):
        if self.n_tokens and self.n_tokens + len(ids) > self.shard_tokens:
            self._close()
            self._open()
        self.starts.append(self.n_tokens)
        with naming(self.path):  # a full disk: the error names the shard
            self.file.write(ids.astype(self.dtype).tobytes())
        self.n_tokens += len(ids)

    def finish(self) -> List[dict]:
        self._close()
        return self.shards


class NoDocuments(ValueError):
    """The documents to tokenize into a shard folder were none."""


FORMAT = "falcon-fwa-tokens-1"


def check_replaceable(folder: str) -> None:
    """``ValueError`` unless ``folder`` is absent or a shard folder (its ``meta.json`` of this format):
    a rebuild replaces it whole, and must not delete a folder of something else."""
    if replaceable(folder, "meta.json", "format", FORMAT):
        return
    raise ValueError(f"{folder!r} exists and is no token shard folder: it is not replaced; choose another output "
                     "folder, or remove it")


def write_token_shards(documents: Iterable[str], tokenizer, folder: str, *,
                       shard_tokens: int = 1 << 28, batch_documents: int = 64, desc: str = "tokenize") -> dict:
    """Tokenize ``documents`` once into a shard folder at ``folder`` (which must be absent or an
    earlier shard folder, :func:`check_replaceable`); returns its metadata. :class:`NoDocuments` if
    there are none."""
    check_replaceable(folder)
    eos = tokenizer.eos_token_id
    vocab_size = len(tokenizer)
    if eos is None or not 0 <= eos < vocab_size:
        raise ValueError(f"tokenizer eos_token_id {eos} is no token id of 0..{vocab_size - 1}: every document "
                         "opens with it")
    dtype = token_dtype(vocab_size)
    tmp, old = folder.rstrip("/") + ".tmp", folder.rstrip("/") + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)  # an earlier run stopped while removing it
    os.makedirs(tmp)
    writer = _ShardWriter(tmp, dtype, shard_tokens)
    byte_level = is_byte_tokenizer(tokenizer)
    batch: List[str] = []
    bar = tqdm(desc=desc, unit="doc")

    def flush():
        for ids in encode_documents(tokenizer, batch, byte_level=byte_level):
            if len(ids) and not 0 <= ids.min() <= ids.max() < vocab_size:  # else cut to the shard's dtype
                bad = int(ids.max() if ids.max() >= vocab_size else ids.min())
                raise ValueError(f"tokenizer gave token id {bad}, outside 0..{vocab_size - 1} (its len(tokenizer) "
                                 f"= {vocab_size}, which sizes the shards' {np.dtype(dtype).name} and the model)")
            writer.add(np.concatenate([np.asarray([eos], dtype=np.int64), ids]))
        bar.update(len(batch))
        batch.clear()

    for doc in documents:
        batch.append(doc)
        if len(batch) >= batch_documents:
            flush()
    flush()
    bar.close()
    shards = writer.finish()
    meta = {"format": FORMAT, "vocab_size": vocab_size, "eos_token_id": eos,
            "dtype": np.dtype(dtype).name, "n_tokens": sum(s["n_tokens"] for s in shards),
            "n_docs": sum(s["n_docs"] for s in shards), "shards": shards}
    if meta["n_docs"] == 0:
        shutil.rmtree(tmp)
        raise NoDocuments(f"no documents to write into {folder!r}")
    synced_write(os.path.join(tmp, "meta.json"), lambda f: json.dump(meta, f, indent=1))
    fsync_folder(tmp)  # its entries on disk before it is renamed into place
    if os.path.exists(folder):  # set aside whole first: a stop while removing it leaves no half folder here
        os.replace(folder, old)
    os.replace(tmp, folder)
    fsync_folder(os.path.dirname(os.path.abspath(folder)))
    shutil.rmtree(old, ignore_errors=True)
    return meta


@dataclass
class Shard:
    tokens: np.ndarray  # memory-mapped [n_tokens]
    doc_starts: np.ndarray  # int64 [n_docs], ascending, doc_starts[0] == 0


def _shard_meta(path: str) -> Optional[dict]:
    """The ``meta.json`` of a token shard folder at ``path`` (one that names this format: a training
    checkpoint's ``meta.json`` does not), else ``None``."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):  # no file, not JSON
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def is_shard_folder(path: str) -> bool:
    """Whether ``path`` is a token shard folder (its ``meta.json`` names this format), rather than text files."""
    return _shard_meta(path) is not None


class TokenShards:
    """Read-only view of a shard folder: ``shards[i].tokens`` (memmap) and ``.doc_starts``."""

    def __init__(self, folder: str):
        meta = _shard_meta(folder)
        if meta is None:
            raise FileNotFoundError(f"{folder!r} is no token shard folder (no meta.json of format {FORMAT!r})")
        self.meta = meta
        self.folder = folder
        self.vocab_size = int(self.meta["vocab_size"])
        self.eos_token_id = int(self.meta["eos_token_id"])
        dtype = np.dtype(self.meta["dtype"])
        self.shards = [Shard(np.memmap(os.path.join(folder, s["tokens"]), dtype=dtype, mode="r", shape=(s["n_tokens"],)),
                             np.load(os.path.join(folder, s["docs"])))
                       for s in self.meta["shards"]]

    @property
    def n_tokens(self) -> int:
        return int(self.meta["n_tokens"])

    def documents(self):
        """Yield every document's token array (end-of-text first), in order."""
        for shard in self.shards:
            ends = np.append(shard.doc_starts[1:], len(shard.tokens))
            for a, b in zip(shard.doc_starts, ends):
                yield np.asarray(shard.tokens[a:b])
