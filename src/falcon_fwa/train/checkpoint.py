"""Atomic training checkpoints.

``{run_dir}/checkpoints/step-{step:08d}/`` holds ``state.pt`` (model, optimizer, scheduler
step, data position, RNG states, config) and ``meta.json``. A checkpoint is written into
``.tmp-step-*`` and renamed once every file is flushed to disk; ``LATEST`` is then replaced
atomically. A save killed at any point therefore leaves the previous checkpoint (and
``LATEST`` pointing at it) intact; the stale temporary folder is removed by the next save. A save
that fails (a full disk) removes its temporary folder and raises an ``OSError`` naming the checkpoint.
"""
from __future__ import annotations

import json
import os
import random
import shutil
from typing import Optional

import numpy as np
import torch

from ..atomic import fsync_folder, naming, synced_write

LATEST = "LATEST"
PREFIX = "step-"


def rng_state() -> dict:
    """The Python, NumPy, torch and (where present) CUDA random states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(checkpoint_dir: str, step: int, state: dict, *, keep: int = 2) -> str:
    """Write ``state`` as the checkpoint of ``step`` atomically; keep the newest ``keep``. Returns its path."""
    os.makedirs(checkpoint_dir, exist_ok=True)
    for name in os.listdir(checkpoint_dir):
        if name.startswith(".tmp-"):
            shutil.rmtree(os.path.join(checkpoint_dir, name), ignore_errors=True)
    name = f"{PREFIX}{step:08d}"
    final = os.path.join(checkpoint_dir, name)
    tmp = os.path.join(checkpoint_dir, f".tmp-{name}")
    try:
        with naming(final, tmp, *(os.path.join(tmp, n) for n in ("state.pt", "meta.json"))):
            os.makedirs(tmp)
            synced_write(os.path.join(tmp, "state.pt"), lambda f: torch.save(state, f), "wb")
            meta = json.dumps({"step": step, "complete": True}).encode()
            synced_write(os.path.join(tmp, "meta.json"), lambda f: f.write(meta), "wb")
            fsync_folder(tmp)  # its entries on disk before it is renamed into place
    except Exception:  # a full disk, say: its space is given back, the previous checkpoints stay
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    stale = None
    if os.path.exists(final):  # a re-save of this step: move the old one aside (one rename), delete it last
        stale = os.path.join(checkpoint_dir, f".tmp-old-{name}")
        os.rename(final, stale)
    os.rename(tmp, final)
    fsync_folder(checkpoint_dir)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    pointer = os.path.join(checkpoint_dir, f".tmp-{LATEST}")
    synced_write(pointer, lambda f: f.write(name.encode()), "wb")
    os.replace(pointer, os.path.join(checkpoint_dir, LATEST))
    fsync_folder(checkpoint_dir)
    # Keep the newest ``keep`` checkpoints up to this step, this one included. Checkpoints of later
    # steps (left by an earlier run in this folder, or by the trajectory a resume from an earlier
    # step abandoned) must not count: they sort after this one and would get it deleted.
    mine = [p for p in list_checkpoints(checkpoint_dir) if checkpoint_step(p) <= step]
    for old in mine[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def checkpoint_step(path: str) -> int:
    """The step of a ``step-*`` checkpoint folder."""
    return int(os.path.basename(os.path.normpath(path))[len(PREFIX):])


def _complete(path: str) -> bool:
    """A checkpoint folder whose ``meta.json`` is a JSON object with ``"complete": true``, beside ``state.pt``."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and bool(meta.get("complete")) and os.path.isfile(os.path.join(path, "state.pt"))


def is_complete(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint folder (one :func:`load_checkpoint` loads)."""
    return _complete(path)


def list_checkpoints(checkpoint_dir: str) -> list:
    """Complete checkpoints, oldest first (by step: ``step-100000000`` comes after ``step-99999999``)."""
    if not os.path.isdir(checkpoint_dir):
        return []
    paths = [os.path.join(checkpoint_dir, n) for n in os.listdir(checkpoint_dir)
             if n.startswith(PREFIX) and n[len(PREFIX):].isdigit()]
    return [p for p in sorted(paths, key=checkpoint_step) if _complete(p)]


def latest_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The checkpoint ``LATEST`` names, else the newest complete one, else ``None``."""
    pointer = os.path.join(checkpoint_dir, LATEST)
    if os.path.isfile(pointer):
        with open(pointer) as f:
            path = os.path.join(checkpoint_dir, f.read().strip())
        if _complete(path):
            return path
    found = list_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def load_checkpoint(path: str) -> dict:
    """The state dict saved at ``path`` (a ``step-*`` folder), on the CPU; refuses an incomplete one."""
    if not _complete(path):
        raise FileNotFoundError(f"{path!r} is no complete checkpoint")
    return torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
