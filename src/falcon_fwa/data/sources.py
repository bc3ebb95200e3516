"""Document sources: plain text, JSONL and Parquet files, or a Hugging Face dataset.

``iter_documents(source)`` yields one string per document. ``source`` is
- a file or a folder (searched recursively, into linked folders too, passing over hidden names: ``.git/``,
  ``.ipynb_checkpoints/``, ``.DS_Store``) of ``.txt``/``.md``/``.rst``,
  ``.jsonl``/``.json`` (JSON Lines, or one array of records) and ``.parquet`` files (suffixes in any
  case), or a glob pattern of such files; records whose text is null, empty or blank yield no document; a file
  that is a link to nothing is a ``FileNotFoundError`` naming the link and its target, before a document is read;
- ``hf:NAME`` or ``hf:NAME:CONFIG`` for ``datasets.load_dataset(NAME, CONFIG, split=..., streaming=True)``
  (needs internet or a local cache); a local dataset folder's files but what a preparation wrote there
  (:func:`hf_data_files`).
Text files are split into documents by ``text_split``: ``"file"`` (the whole file is one
document), ``"line"`` (one per non-empty line) or ``"paragraph"`` (separated by blank lines).
Bytes that are no UTF-8 (in a text or JSON file, or a Parquet string) become U+FFFD; a leading
byte-order mark is dropped; a text file's line ends ``\r\n`` and ``\r`` become ``\n`` (Python's text mode). A record
without the ``text_field``, with a non-string text, a line that is no JSON, or a file that is no
Parquet is a ``ValueError`` naming the file and record; a Parquet ``text_field`` column must hold
strings.
"""
from __future__ import annotations

import glob
import io
import itertools
import json
import os
import re
from typing import BinaryIO, Callable, Iterator, List, Optional, Tuple

TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SPLITS = ("file", "line", "paragraph")


# what a preparation writes at the top of its output folder (prepare.py): the record and its temporaries,
# the lock file, the tokenizer and the split folders with their temporary and set-aside names
_OUTPUT_NAMES = ("prepared.json", ".prepare.lock", "tokenizer", "train", "val", "train.tmp", "train.old", "val.tmp",
                 "val.old")


def _is_output_entry(path: str, out: str) -> bool:
    """Whether the real path ``path`` is, or lies in, one of the entries a preparation writes into ``out``."""
    first = os.path.relpath(path, out).split(os.sep)[0]
    return first in _OUTPUT_NAMES or (first.startswith(".prepared.") and first.endswith(".tmp.json"))


def _search_root(source: str) -> Optional[str]:
    """The folder a folder or glob ``source`` is searched from (a glob's part before its first wildcard);
    ``None`` for a file named directly."""
    if os.path.isfile(source):
        return None
    if os.path.isdir(source):
        return source
    fixed = os.sep.join(itertools.takewhile(lambda part: not glob.has_magic(part), source.split(os.sep)))
    return fixed or (os.sep if source.startswith(os.sep) else ".")


def _excluded(files: List[str], source: str, exclude: str) -> List[str]:
    """``files`` without those of the output folder ``exclude``: every file under it, where it lies inside the
    searched folder; where the search starts inside the output folder or at it (``--out .`` beside the corpus),
    only the entries a preparation writes there; a file named directly always counts."""
    root = _search_root(source)
    if root is None:
        return files
    out, top = os.path.realpath(exclude), os.path.realpath(root)
    if top == out or top.startswith(out + os.sep):
        return [f for f in files if not _is_output_entry(os.path.realpath(f), out)]
    return [f for f in files if not os.path.realpath(f).startswith(out + os.sep)]


def walk_files(folder: str, prune: Optional[Callable[[str, List[str]], bool]] = None) -> Iterator[str]:
    """Every path below ``folder`` (``os.walk`` order), linked folders searched too and each real folder once
    (a link back to a folder above would nest without end); ``prune(root, names)`` true skips ``root`` and
    what lies below it. Hidden names below ``folder`` (starting with ``.``: ``.git/``, ``.ipynb_checkpoints/``,
    ``.DS_Store``), files and folders, are passed over, as a glob's wildcards pass them; ``folder`` itself may be
    one (``.``, ``~/.corpus``)."""
    seen = set()
    for root, dirs, names in os.walk(folder, followlinks=True):
        if os.path.realpath(root) in seen or (prune is not None and prune(root, names)):
            dirs[:] = []
            continue
        seen.add(os.path.realpath(root))
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        yield from (os.path.join(root, f) for f in names if not f.startswith("."))


def _folder_walk(folder: str, exclude: Optional[str]) -> List[str]:
    """Every path below ``folder`` that a search of it counts, of any suffix (:func:`walk_files`): not what another
    preparation wrote in a folder that holds its record (``prepared.json``, an earlier ``--out``), nor the record;
    the output folder ``exclude``'s own entries are left to :func:`_excluded`."""
    own = None if exclude is None else os.path.realpath(exclude)

    def other_output(root: str, names: List[str]) -> bool:  # (the output itself: see _excluded)
        parent, base = os.path.split(os.path.normpath(root))
        return (root != folder and base in _OUTPUT_NAMES and os.path.realpath(parent or ".") != own
                and os.path.isfile(os.path.join(parent, "prepared.json")))

    return [f for f in walk_files(folder, prune=other_output)
            if os.path.basename(f) != "prepared.json" or os.path.realpath(os.path.dirname(f)) == own]


def source_folder_files(folder: str, exclude: Optional[str] = None) -> List[str]:
    """The files below ``folder`` that a source reads, of any suffix, sorted: those a search of the folder counts
    (:func:`list_files`: hidden names, what a preparation wrote and the output folder ``exclude`` passed over), not
    broken links (an ``hf:`` dataset folder's: ``datasets`` lists none)."""
    files = _folder_walk(folder, exclude)
    if exclude is not None:
        files = _excluded(files, folder, exclude)
    return sorted(f for f in files if os.path.isfile(f))


def _refuse_broken_links(files: List[str], source: str) -> None:
    """``FileNotFoundError`` naming the first of ``files`` that is a link to nothing (its target gone, or a loop of
    links), its target and ``source``: its documents cannot be read, and a corpus of such links (a ``git annex``
    checkout whose content is not fetched) would be tokenized in part."""
    for path in files:
        if os.path.islink(path) and not os.path.exists(path):
            more = sum(1 for f in files if os.path.islink(f) and not os.path.exists(f)) - 1
            also = f" ({more} more like it)" if more else ""
            raise FileNotFoundError(f"data source {source!r} names the link {path!r} to {os.readlink(path)!r}, which "
                                    f"does not exist{also}: restore what it links to, or remove the link")


def list_files(source: str, exclude: Optional[str] = None,
               name: Callable[[str], str] = lambda field: field) -> List[str]:
    """The data files a path, folder or glob names, sorted (stable order = stable token stream).
    ``exclude``: the output folder, whose files never count (see :func:`_excluded`: a search of a folder that
    holds it skips it whole; a search inside it skips only what a preparation writes); in a source folder, or a
    folder below it, that holds the record of another preparation (``prepared.json``, an earlier ``--out``), what
    a preparation writes there does not count either (the record, its split and tokenizer folders), the other
    files do (the corpus beside an earlier ``--out .``). A source whose every file is skipped so is a
    ``FileNotFoundError`` naming them and the output folder (as ``name`` calls ``out_dir``), or naming the
    record, not one that names no files."""
    if os.path.isdir(source):
        files = _folder_walk(source, exclude)
    elif os.path.isfile(source):
        files = [source]
    else:
        files = glob.glob(source, recursive=True)
    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES
    files = sorted(f for f in files if f.lower().endswith(suffixes))  # (A.TXT is a text file too)
    if exclude is not None:
        kept = _excluded(files, source, exclude)
        if files and not kept:
            more = f" and {len(files) - 1} more" if len(files) > 1 else ""
            raise FileNotFoundError(f"data source {source!r} holds files only where {name('out_dir')} {exclude!r} is "
                                    f"written ({files[0]!r}{more}; a preparation writes its train, val and tokenizer "
                                    f"there): give {name('out_dir')} a folder apart from the sources")
        files = kept
    _refuse_broken_links(files, source)
    if not files:
        if not glob.has_magic(source) and not os.path.exists(source):
            raise FileNotFoundError(f"data source {source!r} does not exist")
        if os.path.isfile(source):
            raise FileNotFoundError(f"data source {source!r} is no {'/'.join(suffixes)} file (files are read by "
                                    "their suffix)")
        record = os.path.join(source, "prepared.json")
        if os.path.isfile(record) and (exclude is None or os.path.realpath(source) != os.path.realpath(exclude)):
            raise FileNotFoundError(f"data source {source!r} holds no {'/'.join(suffixes)} files but those of the "
                                    f"preparation {record!r} records (its train, val and tokenizer are no corpus): "
                                    "give the files it was prepared from")
        raise FileNotFoundError(f"data source {source!r} names no {'/'.join(suffixes)} files")
    return files


def _split_text(text: str, text_split: str) -> Iterator[str]:
    if text_split == "file":
        parts = [text]
    elif text_split == "line":
        parts = text.split("\n")
    elif text_split == "paragraph":
        parts = re.split(r"\n\s*\n", text)
    else:
        raise ValueError(f"text_split must be one of {TEXT_SPLITS}, got {text_split!r}")
    for part in parts:
        if part.strip():
            yield part


def _split_lines(f, text_split: str) -> Iterator[str]:
    """The documents of an open text file ``f`` split by ``"line"`` or ``"paragraph"``, read a line at a time (a
    file of one document per line may be larger than the memory): those :func:`_split_text` gives of its whole text.
    A paragraph ends at a blank line (all whitespace, as ``\\s`` matches) that ends in a line end: its own last line
    end and the blank lines are the separator ``\\n\\s*\\n``; a blank last line without one is part of it."""
    if text_split == "line":
        for line in f:
            part = line[:-1] if line.endswith("\n") else line
            if part.strip():
                yield part
        return
    lines: List[str] = []
    parted = False  # whether a separator came: a blank first line followed by text is part of the first paragraph
    for line in f:
        if line.strip() or not line.endswith("\n") or not (lines or parted):
            lines.append(line)
        elif lines:  # (the line before it ends in "\n": a line that did not would be the file's last)
            text = "".join(lines)[:-1]
            if text.strip():
                yield text
            lines, parted = [], True
    text = "".join(lines)
    if text.strip():
        yield text


Opener = Callable[[str], BinaryIO]


def _open_binary(path: str) -> BinaryIO:
    return open(path, "rb")


def _open_text(path: str, opener: Opener):
    """``path`` as ``open(path, encoding="utf-8-sig", errors="replace")`` reads it (no UTF-8 -> U+FFFD, no BOM,
    ``\r\n`` and ``\r`` -> ``\n``), its bytes read through ``opener``."""
    return io.TextIOWrapper(opener(path), encoding="utf-8-sig", errors="replace")


def _json_records(path: str, opener: Opener = _open_binary) -> Iterator[Tuple[str, dict]]:
    """``(where, record)`` of a JSON Lines file, or of a ``.json`` file holding one array of records."""
    with _open_text(path, opener) as f:  # as a text file
        if path.lower().endswith(".json"):
            head = f.read(4096).lstrip()
            f.seek(0)
            if head.startswith("["):
                try:
                    records = json.load(f)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: not a JSON array of records ({err})") from None
                for n, record in enumerate(records):
                    yield f"{path}[{n}]", record
                return
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield f"{path}:{n}", json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}:{n}: not a JSON record ({err})") from None


def _record_text(where: str, record, text_field: str,
                 name: Callable[[str], str] = lambda field: field) -> Optional[str]:
    """The text of a JSON record (``None`` for null, empty or blank text, as a text file's blank parts
    give no document), or a ``ValueError`` naming the record and the setting (``name('text_field')``).
    A lone surrogate (``"\\ud800"``, valid JSON but no Unicode text) becomes ``?``, as a text file's
    undecodable bytes become U+FFFD."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    if text_field not in record:
        raise ValueError(f"{where}: record has no {name('text_field')} {text_field!r} (keys: {sorted(record)})")
    text = record[text_field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise ValueError(f"{where}: {name('text_field')} {text_field!r} must hold a string, got {type(text).__name__}")
    if not text.strip():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def _iter_file(path: str, text_split: str, text_field: str, name: Callable[[str], str],
               opener: Opener = _open_binary) -> Iterator[str]:
    lowered = path.lower()  # suffixes in any case
    if lowered.endswith(TEXT_SUFFIXES):
        with _open_text(path, opener) as f:
            yield from (_split_text(f.read(), text_split) if text_split == "file" else _split_lines(f, text_split))
    elif lowered.endswith(JSON_SUFFIXES):
        for where, record in _json_records(path, opener):
            text = _record_text(where, record, text_field, name)
            if text is not None:  # null, empty or blank text: no document (as in Parquet and text files)
                yield text
    else:
        yield from _parquet_texts(path, text_field, name)


def _parquet_texts(path: str, text_field: str, name: Callable[[str], str] = lambda field: field) -> Iterator[str]:
    """The strings of column ``text_field`` of a Parquet file that are not null, empty or blank."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: not a Parquet file ({err})") from None
    schema = pf.schema_arrow
    if text_field not in schema.names:
        raise ValueError(f"{path}: no column {name('text_field')} {text_field!r} (columns: {schema.names})")
    kind = schema.field(text_field).type
    encoded = pa.types.is_dictionary(kind)  # strings stored once each and indexed (pandas' category columns)
    strings = kind.value_type if encoded else kind
    if not (pa.types.is_string(strings) or pa.types.is_large_string(strings) or pa.types.is_string_view(strings)):
        raise ValueError(f"{path}: column {name('text_field')} {text_field!r} must hold strings, got {kind}")
    try:
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            values = batch.column(0)
            if encoded:
                values = values.dictionary_decode()
            try:
                texts = values.to_pylist()
            except UnicodeDecodeError:  # strings of bytes that are no UTF-8 (unchecked on read): U+FFFD
                texts = [None if b is None else b.decode("utf-8", "replace")
                         for b in values.cast(pa.large_binary()).to_pylist()]
            yield from (t for t in texts if t and t.strip())
    except (pa.ArrowException, OSError) as err:
        raise ValueError(f"{path}: unreadable Parquet data ({err})") from None


def hf_dataset(source: str) -> Tuple[str, str]:
    """``(NAME, CONFIG)`` of an ``hf:NAME[:CONFIG]`` source (``CONFIG`` ``""`` where none is given)."""
    name, _, config = source[len("hf:"):].partition(":")
    return name, config


# The data settings that name local paths: compared as the files and folders they name, not as typed (out_dir: a
# recipe's prepared data folder; empty, the run folder's data/, compared as given).
PATH_SETTINGS = ("train_source", "val_source", "tokenizer", "out_dir")


def resolved_setting(field: str, value):
    """The data setting ``field`` (a name of :data:`PATH_SETTINGS`) at ``value`` as it is compared: a local path
    (a source file, folder or glob) as :func:`os.path.realpath` gives it, read from the working folder, as the data
    commands and a training launch open it (a recipe's data paths are not read from the recipe file's folder:
    only its ``extends`` is); so ``corpus.jsonl``, ``./corpus.jsonl``, ``data/../corpus.jsonl``, its absolute
    path and a link to it are one. An ``hf:`` name, ``None`` and an empty setting are compared as given, and so
    is a tokenizer that is no absolute path (``byte``, ``bpe:N``, a Hub name; a local tokenizer folder is kept by
    its absolute path, ``tokenizer.canonical_spec``). Records keep the settings as typed, readable as the recipe
    or command wrote them (records written before this comparison too); they are resolved only to be compared,
    from the working folder then."""
    if not isinstance(value, str) or not value or value.startswith("hf:"):
        return value
    if field == "tokenizer" and not os.path.isabs(value):
        return value
    return os.path.realpath(value)


def same_setting(field: str, was, now) -> bool:
    """Whether the data setting ``field`` at ``was`` (a record's) and at ``now`` name the same thing: the same
    value, or, for a local path (:data:`PATH_SETTINGS`), another spelling of the same path
    (:func:`resolved_setting`). Any other field is compared as given."""
    return was == now or (field in PATH_SETTINGS and resolved_setting(field, was) == resolved_setting(field, now))


def hf_data_files(source: str, exclude: Optional[str] = None) -> Optional[dict]:
    """``{split: [path, ...]}`` for ``datasets.load_dataset(..., data_files=...)`` of an ``hf:FOLDER[:CONFIG]``
    source whose folder holds what a preparation wrote (the output folder ``exclude``, ``--out`` inside the dataset
    folder or the folder itself, or an earlier preparation's record): the files ``datasets`` finds in the folder
    without those (:func:`source_folder_files`), by its own split patterns (or the config's ``data_files`` of the
    folder's ``README.md``), so that no record, token shard or temporary of a preparation is read as data. ``None``
    where the folder holds none of them (``datasets`` then lists it itself), for a Hub name and without ``datasets``.
    ``FileNotFoundError`` naming the source where nothing else is left."""
    folder, config = hf_dataset(source)
    if not os.path.isdir(folder):
        return None
    passed = {os.path.realpath(f) for f in walk_files(folder) if os.path.isfile(f)}
    passed -= {os.path.realpath(f) for f in source_folder_files(folder, exclude)}
    if not passed:
        return None
    try:
        from datasets.data_files import _get_data_files_patterns, resolve_pattern, sanitize_patterns
    except ImportError:  # (no datasets, or one that finds its files otherwise: the load says what is wrong)
        return None
    from pathlib import Path

    base = Path(folder).expanduser().resolve().as_posix()

    def resolve(pattern: str) -> List[str]:
        return [path for path in resolve_pattern(pattern, base_path=base) if os.path.realpath(path) not in passed]

    patterns = _card_patterns(folder, config)
    try:
        patterns = sanitize_patterns(patterns) if patterns is not None else _get_data_files_patterns(resolve)
        files = {str(split): sorted({path for pattern in split_patterns for path in _resolved(resolve, pattern)})
                 for split, split_patterns in patterns.items()}
    except FileNotFoundError:
        files = {}
    files = {split: paths for split, paths in files.items() if paths}
    if not files:
        raise FileNotFoundError(f"data source {source!r} holds no data files but what a preparation writes "
                                f"({sorted(passed)[0]!r}: a record, token shards, a tokenizer): give the dataset "
                                "folder apart from the output")
    return files


def _resolved(resolve: Callable[[str], List[str]], pattern: str) -> List[str]:
    try:
        return resolve(pattern)
    except FileNotFoundError:  # (a split pattern that names no file: as datasets, none for it)
        return []


def _card_patterns(folder: str, config: str):
    """The ``data_files`` that the dataset card (``README.md``, ``.huggingface.yaml``) of ``folder`` gives config
    ``config`` (its default config where ``""``), as ``datasets`` reads them; ``None`` where it gives none."""
    try:
        import yaml
        from datasets.utils.metadata import MetadataConfigs
        from huggingface_hub import DatasetCard, DatasetCardData
    except ImportError:
        return None
    readme, standalone = os.path.join(folder, "README.md"), os.path.join(folder, ".huggingface.yaml")
    data = DatasetCard.load(readme).data.to_dict() if os.path.isfile(readme) else {}
    if os.path.isfile(standalone):
        with open(standalone, encoding="utf-8") as f:
            data.update(yaml.safe_load(f.read()) or {})
    configs = MetadataConfigs.from_dataset_card_data(DatasetCardData(**data))
    chosen = configs.get(config or configs.get_default_config_name() or "")
    return None if chosen is None else chosen.get("data_files")


def hf_split_files(source: str, split: str, exclude: Optional[str] = None) -> Optional[List[str]]:
    """The files that split ``split`` of an ``hf:FOLDER[:CONFIG]`` source reads, as ``datasets`` finds them in
    the local folder (no network; what a preparation wrote there passed over, :func:`hf_data_files`); ``None`` for a
    Hub name, without ``datasets``, or where it finds none (the load itself then names what is wrong)."""
    name, config = hf_dataset(source)
    if not os.path.isdir(name):
        return None
    try:
        data_files = hf_data_files(source, exclude)
        if data_files is None:
            from datasets import load_dataset_builder

            data_files = load_dataset_builder(name, config or None).config.data_files or {}
    except Exception:  # (no datasets, no such config, a folder it cannot read: the load says so, by name)
        return None
    files = data_files.get(split)
    return None if files is None else [str(path) for path in files]


def _hf_records(source: str, split: str, exclude: Optional[str] = None):
    """The streamed records of split ``split`` of ``hf:NAME[:CONFIG]`` (a local folder's files but what a
    preparation wrote there: :func:`hf_data_files`); ``ValueError`` naming the source."""
    from datasets import load_dataset

    name, config = hf_dataset(source)
    try:
        data_files = hf_data_files(source, exclude)
        files = {} if data_files is None else {"data_files": data_files}
        return load_dataset(name, config or None, split=split, streaming=True, **files)
    except (ValueError, OSError) as err:  # no such dataset, config or split; the Hub out of reach
        raise ValueError(f"data source {source!r} ({split} split): {err}") from None


def _hf_texts(source: str, split: str, text_field: str,
              name: Callable[[str], str] = lambda field: field, exclude: Optional[str] = None) -> Iterator[str]:
    """The texts of the records of ``hf:NAME[:CONFIG]`` that are not null, empty or blank. A streamed
    dataset reads its files as it goes: one that cannot be read (bad JSON, no Parquet) is a ``ValueError``
    naming the source, as one that cannot be opened is."""
    import pyarrow as pa

    records = iter(_hf_records(source, split, exclude))
    for n in itertools.count():
        try:
            record = next(records)
        except StopIteration:
            return
        except (ValueError, OSError, pa.ArrowException) as err:
            raise ValueError(f"data source {source!r} ({split} split), after {n} records: {err}") from None
        text = _record_text(f"{source} ({split}) record {n}", record, text_field, name)
        if text is not None:
            yield text


def iter_documents(source: str, *, text_split: str = "file", text_field: str = "text",
                   split: str = "train", max_documents: Optional[int] = None,
                   exclude: Optional[str] = None, name: Callable[[str], str] = lambda field: field,
                   opener: Opener = _open_binary) -> Iterator[str]:
    """Yield the documents of ``source`` (see the module docstring); ``exclude`` as in :func:`list_files`.
    ``name`` turns a setting into the name the caller knows it by, for errors (``text_field`` -> a command's
    ``--text-field``, a recipe's ``data.text_field``). ``opener(path)`` opens a local text or JSON file for
    reading, as ``open(path, "rb")`` (a preparation hashes the bytes as they are read); Parquet files and
    ``hf:`` datasets are read by ``pyarrow`` and ``datasets``."""
    if text_split not in TEXT_SPLITS:
        raise ValueError(f"{name('text_split')} must be one of {TEXT_SPLITS}, got {text_split!r}")
    if source.startswith("hf:"):
        stream = _hf_texts(source, split, text_field, name, exclude)
    else:
        stream = (doc for path in list_files(source, exclude, name)
                  for doc in _iter_file(path, text_split, text_field, name, opener))
    for n, doc in enumerate(stream):
        if max_documents is not None and n >= max_documents:
            return
        yield doc
