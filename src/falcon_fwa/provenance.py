"""Where a result came from: the commit of the code that produced it."""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
from pathlib import Path
from typing import List, Optional

__all__ = ["git_commit", "source_checkout", "command_provenance", "uncommitted_note", "written_at_line",
           "committed_files", "uncommitted_changes", "CLEAN_TREE", "unlike_code", "recorded_commit"]

PACKAGE_DIR = Path(__file__).resolve().parent
CLEAN_TREE = hashlib.sha256(b"").hexdigest()  # uncommitted_changes of a checkout without any


def _git(args: List[str], cwd: str) -> Optional[str]:
    """``git ARGS`` run in ``cwd``: its stripped output, or ``None`` on failure or without git."""
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_checkout() -> Optional[str]:
    """The root of the git checkout this package is imported from (``ROOT/src/falcon_fwa``, as
    with ``pip install -e .`` or ``PYTHONPATH=ROOT/src``), or ``None`` when it is imported from
    anywhere else (an installed copy, even one inside another repository)."""
    root = _git(["rev-parse", "--show-toplevel"], str(PACKAGE_DIR))
    if not root or (Path(root) / "src" / "falcon_fwa").resolve() != PACKAGE_DIR:
        return None
    return root


def git_commit(short: bool = True, cwd: Optional[str] = None) -> Optional[str]:
    """The checked-out commit (``git rev-parse [--short] HEAD``) of the code that runs: the
    checkout this package is imported from (:func:`source_checkout`), or the repository at
    ``cwd`` when given. ``None`` outside a git checkout or without git; the working directory
    of the process plays no part."""
    where = cwd if cwd is not None else source_checkout()
    if where is None:
        return None
    return _git(["rev-parse", *(["--short"] if short else []), "HEAD"], where) or None


def command_provenance(args: argparse.Namespace) -> dict:
    """A command's provenance: the full commit of the falcon-fwa code that ran it (``None`` for
    an installed copy or outside a git checkout), whether that checkout had uncommitted changes
    to tracked files (``dirty``; ``None`` when unknown) and the command's options."""
    root = source_checkout()
    commit = None if root is None else git_commit(short=False, cwd=root)
    status = None if commit is None else _git(["status", "--porcelain", "--untracked-files=no"], root)
    return {"commit": commit, "dirty": None if status is None else bool(status), "options": dict(vars(args))}


def recorded_commit(given: Optional[str], source: dict) -> dict:
    """The ``commit`` and ``dirty`` a record names, from :func:`command_provenance`'s ``source``: its own, or a
    commit ``given`` by hand (``--commit``, for a machine without git metadata), whose ``dirty`` is the
    checkout's where it names the checkout's commit (in full or a prefix of it) and ``None`` (unknown) where not;
    ``commit`` ``None`` outside a git checkout with none given."""
    commit, dirty = source.get("commit"), source.get("dirty")
    if not given:
        return {"commit": commit, "dirty": dirty}
    return {"commit": given, "dirty": dirty if commit and commit.startswith(given) else None}


def uncommitted_changes(root: Optional[str] = None) -> Optional[str]:
    """The fingerprint of the uncommitted changes to tracked files of the checkout this package is imported from
    (:func:`source_checkout`), or of the repository at ``root`` when given: the SHA-256 (hex) of the output of ``git
    diff HEAD --binary --no-renames`` there (no external diff or textconv filter, whatever the repository's diff
    settings), staged and unstaged changes alike, so :data:`CLEAN_TREE` for a checkout without any. Untracked files do
    not count, as for ``dirty`` (:func:`command_provenance`): a run's own output folder or data inside the checkout
    would otherwise make every run's code differ from the next one's; a new source file counts once it is added (``git
    add -N`` is enough). ``None`` outside a git checkout, or where git cannot tell."""
    where = root if root is not None else source_checkout()
    if where is None:
        return None
    try:  # the diff's bytes as they are (no text decoding), whatever the user's diff settings
        out = subprocess.run(["git", "-c", "core.quotePath=true", "diff", "HEAD", "--binary", "--no-color",
                              "--no-ext-diff", "--no-textconv", "--no-renames", "--diff-algorithm=myers",
                              "--src-prefix=a/", "--dst-prefix=b/"],
                             cwd=where, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return hashlib.sha256(out.stdout).hexdigest() if out.returncode == 0 else None


def unlike_code(summary: dict, commit: Optional[str], changes: Optional[str]) -> Optional[str]:
    """Why the run of ``summary`` (its ``summary.json``: ``commit``, ``dirty`` and ``diff_sha256``, the
    :func:`uncommitted_changes` it trained with) may have trained with other code than the checkout now, at
    ``commit`` with the uncommitted changes ``changes``; ``None`` where both are the same: the same commit, and
    both clean or both with the same changes. A summary written before ``diff_sha256`` was recorded is of a clean
    checkout where its ``dirty`` is false (or absent, as before that was recorded), else of unknown changes.
    Outside a git checkout (``commit`` ``None``) the code that trained a run cannot be told from this one's: the
    reason says so."""
    if commit is None:
        return "this code is outside a git checkout, so the code the run trained with cannot be told from it"
    if summary.get("commit") != commit:
        was = summary.get("commit")
        return f"trained at commit {was[:12] if was else 'unknown'}, this checkout is at {commit[:12]}"
    if changes is None:
        return "the uncommitted changes of this checkout cannot be read (git diff HEAD failed)"
    if "diff_sha256" in summary:
        recorded = summary["diff_sha256"]
    else:
        recorded = CLEAN_TREE if summary.get("dirty", False) is False else None
    if recorded is None:
        return "its summary does not fingerprint the uncommitted changes it trained with"
    if recorded == changes:
        return None
    if recorded == CLEAN_TREE:
        return "trained without uncommitted changes, this checkout has some"
    if changes == CLEAN_TREE:
        return "trained with uncommitted changes to tracked files, this checkout has none"
    return "trained with other uncommitted changes to tracked files than this checkout has"


def uncommitted_note(dirty: Optional[bool]) -> str:
    """What follows a commit named in a record, from :func:`command_provenance`'s ``dirty``: nothing for a clean
    checkout, " with uncommitted changes to tracked files" for a dirty one, " (uncommitted changes unknown)"
    when git could not tell."""
    if dirty is False:
        return ""
    return " with uncommitted changes to tracked files" if dirty else " (uncommitted changes unknown)"


def written_at_line(provenance: dict, what: str = "Table") -> str:
    """The sentence that ends a written table or report, from :func:`command_provenance`'s ``commit`` and
    ``dirty``: "Table written at commit `C`." (with :func:`uncommitted_note` before the full stop), or
    "Table written outside a git checkout (commit unknown)." without a commit; ``what`` names the thing written."""
    commit = provenance.get("commit")
    if not commit:
        return f"{what} written outside a git checkout (commit unknown)."
    return f"{what} written at commit `{commit}`{uncommitted_note(provenance.get('dirty'))}."


def committed_files(paths: List[str]) -> List[str]:
    """Those of ``paths`` that exist and are tracked by the git repository holding them (a results file of record,
    which a benchmark run with its default ``--out`` would write over); ``[]`` without git."""
    found = []
    for path in paths:
        if os.path.isfile(path):
            folder, name = os.path.split(os.path.abspath(path))
            if _git(["ls-files", "--error-unmatch", "--", name], folder) is not None:
                found.append(path)
    return found

