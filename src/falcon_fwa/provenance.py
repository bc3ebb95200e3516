"""Where a result came from: the commit of the code that produced it."""
from __future__ import annotations

import argparse
import os
import subprocess
from typing import Optional

__all__ = ["git_commit", "command_provenance"]


def git_commit(short: bool = True, cwd: Optional[str] = None) -> Optional[str]:
    """The checked-out commit (``git rev-parse [--short] HEAD`` run in ``cwd``), or ``None``
    outside a git checkout or without git."""
    cmd = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha if out.returncode == 0 and sha else None


def command_provenance(args: argparse.Namespace) -> dict:
    """A command's provenance: the full commit of the falcon-fwa code that ran it (``None`` for
    an installed copy or outside a git checkout), whether that checkout had uncommitted changes
    to tracked files (``dirty``; ``None`` when unknown) and the command's options."""
    here = os.path.dirname(os.path.abspath(__file__))
    installed = "site-packages" in here.split(os.sep) or "dist-packages" in here.split(os.sep)
    commit = None if installed else git_commit(short=False, cwd=here)
    dirty = None
    if commit is not None:
        try:
            out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                 capture_output=True, text=True, timeout=10)
            dirty = bool(out.stdout.strip()) if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            pass
    return {"commit": commit, "dirty": dirty, "options": dict(vars(args))}
