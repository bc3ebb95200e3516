"""Where a result came from: the commit of the code that produced it."""
from __future__ import annotations

import subprocess
from typing import Optional

__all__ = ["git_commit"]


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
