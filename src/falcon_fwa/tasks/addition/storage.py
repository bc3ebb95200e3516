"""Atomic writes: a file is either its previous version or the complete new one."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Union

import torch

PathLike = Union[str, os.PathLike]


def _atomic(path: PathLike, write: Callable[[str], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_json(path: PathLike, obj: Any) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())

    _atomic(path, write)


def write_text(path: PathLike, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write(text)

    _atomic(path, write)


def save_torch(path: PathLike, obj: Any) -> None:
    _atomic(path, lambda tmp: torch.save(obj, tmp))


def read_json(path: PathLike) -> Any:
    with open(path) as f:
        return json.load(f)
