"""Atomic file writes: a reader (or a restart after a crash) finds either the previous
version of a file or the complete new one, never a partial write.

Each write goes to a uniquely named temporary file in the target's folder (two writers
never share it), is flushed to disk, then renamed over the target. The file gets the
permissions a plain ``open(path, "w")`` would give it (``0o666`` less the umask).

A write that fails (a full disk, a folder one may not write to) raises an ``OSError`` naming the
file it was writing (:func:`naming`), not its temporary file, and leaves the previous version.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

PathLike = Union[str, os.PathLike]

__all__ = ["atomic_path", "naming", "synced_write", "write_json", "write_text", "save_torch", "read_json", "replaceable",
           "folder_lock", "Remade", "make_folders", "remove_created", "remove_temporaries", "fsync_folder", "sync_tree"]


def _umask() -> int:
    """The process's umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _written_error(err: BaseException) -> Optional[OSError]:
    """The ``OSError`` behind a failed write: ``err`` itself, or the one ``torch.save`` met (it reports a
    write the disk refused as a ``RuntimeError``, "unexpected pos ...", raised while handling it)."""
    if isinstance(err, OSError):
        return err
    if isinstance(err, RuntimeError) and isinstance(err.__context__, OSError):
        return err.__context__
    return None


@contextlib.contextmanager
def naming(path: PathLike, *stand_ins: PathLike) -> Iterator[None]:
    """Re-raise an ``OSError`` of the block (or ``torch.save``'s ``RuntimeError`` over one) that names no
    file, or names one of ``stand_ins`` (the temporary files behind ``path``), as the same error naming
    ``path``: ``[Errno 28] No space left on device: 'run/summary.json'``. Other errors pass unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        cause = _written_error(err)
        if cause is None or cause.errno is None or (
                cause.filename is not None and os.fspath(cause.filename) not in {os.fspath(p) for p in stand_ins}):
            raise
        # with the original traceback: the error is reported where the write failed
        raise OSError(cause.errno, cause.strerror, os.fspath(path)).with_traceback(err.__traceback__) from err


@contextlib.contextmanager
def atomic_path(path: PathLike) -> Iterator[str]:
    """A temporary path next to ``path`` (same suffix, so writers that infer the format from it
    still work); renamed over ``path`` when the block ends without an exception (the folder then
    flushed to disk, :func:`fsync_folder`), removed if not.
    An ``OSError`` of the writes names ``path`` (:func:`naming`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # an error here names the folder
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}")
    except OSError as err:  # named after a temporary file of a random name: name the file being written
        raise OSError(err.errno, err.strerror, os.fspath(path)) from err
    os.close(fd)
    try:
        with naming(path, tmp):
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it 0o600, readable by its owner only
            yield tmp
            with open(tmp, "rb") as f:  # on disk before the rename, also where the block wrote it by path (savefig)
                os.fsync(f.fileno())
            os.replace(tmp, path)
            fsync_folder(path.parent)  # the rename on disk before returning: a power loss cannot undo it
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def fsync_folder(folder: PathLike) -> None:
    """Flush ``folder``'s entries (a rename into it) to disk. A no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except (IsADirectoryError, PermissionError):
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(folder: PathLike) -> None:
    """Flush every file under ``folder`` to disk, then every folder's entries, deepest first, ``folder``
    last: a folder written by a library that does not sync (``save_pretrained``) is whole on disk before
    it is renamed into place."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                continue
            with naming(path), open(path, "rb") as f:
                os.fsync(f.fileno())
        fsync_folder(root)


def remove_temporaries(folder: PathLike, *names: str) -> None:
    """Remove the temporary files that :func:`atomic_path` writes of ``folder/name`` for each of ``names``:
    those a process killed during the write left behind. Only for the one writer of the folder (its lock
    held): another's write in progress would lose its file."""
    for name in names:
        path = Path(name)
        for stale in Path(folder).glob(f".{path.stem}.*.tmp{path.suffix}"):
            stale.unlink(missing_ok=True)


def synced_write(path: PathLike, write: Callable[[Any], None], mode: str = "w") -> None:
    """``write(f)`` on ``path`` opened in ``mode``, then flushed to disk (not atomic by itself: the
    callers write into a temporary path, :func:`atomic_path`, or a temporary folder). An ``OSError``
    of the write names ``path`` (:func:`naming`)."""
    with naming(path), open(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _write_file(path: PathLike, write: Callable[[Any], None], mode: str = "w") -> None:
    with atomic_path(path) as tmp, open(tmp, mode) as f:  # closed, then flushed to disk by atomic_path
        write(f)


def write_text(path: PathLike, text: str) -> None:
    """``text`` into ``path``, atomically."""
    _write_file(path, lambda f: f.write(text))


def write_json(path: PathLike, obj: Any, *, default: Optional[Callable[[Any], Any]] = None) -> None:
    """``obj`` as indented JSON (and a final newline) into ``path``, atomically; ``default`` as in
    ``json.dump`` (e.g. ``str`` for values JSON cannot encode). Strict JSON: a float that is NaN or infinite (a
    diverged loss) is written as ``null``, as ``log.jsonl`` writes it (``NaN`` is refused by jq and strict parsers)."""
    _write_file(path, lambda f: f.write(json.dumps(finite_or_none(obj), indent=1, default=default) + "\n"))


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float in its dicts, lists and tuples replaced by ``None`` (strict JSON:
    ``write_json`` and the training log)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def save_torch(path: PathLike, obj: Any) -> None:
    """``torch.save(obj)`` into ``path``, atomically."""
    import torch

    _write_file(path, lambda f: torch.save(obj, f), "wb")


def read_json(path: PathLike) -> Any:
    with open(path) as f:
        return json.load(f)


def replaceable(folder: PathLike, marker: str, key: str, value: Any) -> bool:
    """Whether ``folder`` may be replaced whole: it is absent, or its JSON file ``marker`` is an object whose
    ``key`` is ``value`` (a folder this library wrote), not a folder of something else."""
    if not os.path.exists(folder):
        return True
    try:
        return read_json(os.path.join(folder, marker)).get(key) == value
    except (OSError, ValueError, AttributeError):
        return False


def make_folders(folder: PathLike) -> list:
    """Make ``folder`` and the folders above it that do not exist; the ones this call made, outermost first
    (one that another process made meanwhile is not among them), for :func:`remove_created`."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        missing.append(path)
        path = os.path.dirname(path)
    made = []
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except FileExistsError:
            continue
        made.append(path)
    return made


def remove_created(folder: PathLike, before: set, made: list, lock: str) -> None:
    """After work that failed in ``folder`` under its lock file ``lock``: remove what it wrote there (the
    entries not in ``before``, the lock file among them where the work made it), then the folders it made
    (:func:`make_folders`), each while empty. Nothing that was there before is touched. Best effort: an
    ``OSError`` ends it quietly (the error that ended the work is the one to report)."""
    import shutil

    try:
        for entry in sorted(set(os.listdir(folder)) - before - {lock}):
            path = os.path.join(folder, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
        if lock not in before:
            os.remove(os.path.join(folder, lock))
        for path in reversed(made):
            os.rmdir(path)  # not empty (something else is in it now): OSError, and the rest stays
    except OSError:
        pass


class Remade(NamedTuple):
    """What :func:`folder_lock` made for its block, which a clean-up of the caller's own should remove with what
    it wrote (:func:`remove_created`).

    folders: the folders it made, outermost first (:func:`make_folders`): ``folder`` and those above it that were
    missing when it started, or that the holder before it removed while it waited (a failed preparation's
    clean-up), made again. Empty where they were all there.
    lock: whether the lock file it holds is one it made (missing, or removed by the holder before it), rather
    than one that was there before it.
    """
    folders: tuple
    lock: bool


def _open_lock_file(path: str) -> tuple:
    """A descriptor of the file ``path`` opened for appending (created with ``0o666`` less the umask, as
    ``open(path, "a")`` does), and whether this call created it. ``FileNotFoundError`` where its folder is gone.
    A link at ``path`` to a file not there yet is opened as ``open(path, "a")`` opens it (its target made; the
    link, there before, is not this call's); where its target cannot be made, ``FileNotFoundError``."""
    while True:
        try:
            return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            pass
        try:
            return os.open(path, os.O_WRONLY | os.O_APPEND), False
        except FileNotFoundError:
            if os.path.islink(path):  # (O_EXCL finds the link there, the plain open no file behind it)
                return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666), False
            if not os.path.isdir(os.path.dirname(path) or "."):
                raise
            # removed between the two opens: create it


@contextlib.contextmanager
def folder_lock(folder: PathLike, name: str, *, wait: bool = True) -> Iterator[Remade]:
    """Hold an exclusive lock on ``folder`` (the lock file ``folder/name``, created with the folder)
    for the block: another holder makes it wait, or with ``wait=False`` raise ``BlockingIOError``.
    The lock goes with the process (a killed holder frees it). A holder may remove the lock file (and
    the folder, and the folders above it that it made) before it lets go, as a preparation that fails cleans
    up: a waiter then finds the file it locked gone or replaced, and locks the one at the path, made again
    with the folders it needs. The block gets a :class:`Remade`: the folders this call made and whether it
    made the lock file it holds (what a clean-up of its own should then remove). Without ``flock`` (not
    POSIX) the block runs unlocked, with no lock file."""
    made: list = []

    def make() -> None:
        made.extend(path for path in make_folders(folder) if path not in made)

    make()
    try:
        import fcntl
    except ImportError:
        yield Remade(tuple(made), False)
        return
    path = os.path.join(folder, name)
    while True:
        try:
            fd, created = _open_lock_file(path)
        except FileNotFoundError:  # the folder removed since it was made: make it again
            if os.path.islink(path):  # a link to a file in a folder that does not exist: not this call's to make
                raise
            make()
            if not os.path.isdir(folder):  # one that cannot be made (a link to nothing): makedirs names it
                os.makedirs(folder, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            try:
                held = os.fstat(fd)
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    now = None
                if now is not None and (now.st_ino, now.st_dev) == (held.st_ino, held.st_dev):
                    yield Remade(tuple(made), created)
                    return
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
        # removed while this waited (another may hold the file at the path now): lock the one at the path
        make()
