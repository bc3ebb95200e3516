"""Atomic writes: a failed write leaves the previous file and no temporary behind."""
import json

import pytest

from falcon_fwa.atomic import atomic_path, read_json, write_json, write_text


def test_a_failed_write_keeps_the_previous_version(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json(path, {"a": 1})
    with pytest.raises(ZeroDivisionError):
        with atomic_path(path) as tmp:
            with open(tmp, "w") as f:
                f.write('{"a": ')  # half a file
            1 / 0
    assert read_json(path) == {"a": 1}
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]


def test_writes_replace_whole_files_and_keep_the_suffix(tmp_path):
    path = tmp_path / "t.md"
    write_text(path, "first\n")
    write_text(path, "second\n")
    assert path.read_text() == "second\n"
    with atomic_path(tmp_path / "p.png") as tmp:
        assert tmp.endswith(".png") and tmp != str(tmp_path / "p.png")  # savefig infers the format from it
        open(tmp, "wb").close()
    write_json(tmp_path / "d.json", {"x": {7}}, default=str)  # a set is no JSON: written through default
    assert json.loads((tmp_path / "d.json").read_text()) == {"x": "{7}"}


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_get_the_permissions_of_a_plain_open(tmp_path, umask):
    # a file written in place would be created 0o666 minus the umask; the temporary file behind an
    # atomic write must not leave it readable by its owner only
    import os
    import stat

    from falcon_fwa.atomic import save_torch

    old = os.umask(umask)
    try:
        write_json(tmp_path / "r.json", {"a": 1})
        write_text(tmp_path / "t.md", "x\n")
        save_torch(tmp_path / "c.pt", {"step": 1})
        with open(tmp_path / "plain.txt", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    want = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    assert want == 0o666 & ~umask
    for name in ("r.json", "t.md", "c.pt"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == want, name


def test_save_torch_flushes_the_file_to_disk_before_renaming_it(tmp_path, monkeypatch):
    import os

    import torch

    from falcon_fwa import atomic

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):  # which file or folder: os.fstat's inode, compared below
        events.append(("fsync", os.fstat(fd).st_ino))
        return real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", lambda a, b: events.append(("replace", os.stat(a).st_ino))
                        or real_replace(a, b))
    atomic.save_torch(tmp_path / "s.pt", {"w": torch.arange(3)})
    file_ino, folder_ino = (tmp_path / "s.pt").stat().st_ino, tmp_path.stat().st_ino
    # the file's bytes on disk, then the rename, then the folder holding the rename
    assert events == [("fsync", file_ino), ("replace", file_ino), ("fsync", folder_ino)]
    assert torch.equal(torch.load(tmp_path / "s.pt")["w"], torch.arange(3))


def test_a_checkpoint_and_its_pointer_are_renamed_then_their_folder_flushed(tmp_path, monkeypatch):
    import os

    from falcon_fwa import atomic
    from falcon_fwa.train import checkpoint

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real_fsync(fd))
    path = checkpoint.save_checkpoint(str(tmp_path / "ckpt"), 3, {"x": 1})
    folder = (tmp_path / "ckpt").stat().st_ino
    assert synced.count(folder) == 2  # after the checkpoint's rename and after LATEST's
    assert synced[-1] == folder and os.path.basename(path) == "step-00000003"


def test_sync_tree_flushes_every_file_before_its_folder_and_the_top_folder_last(tmp_path, monkeypatch):
    import os

    from falcon_fwa import atomic

    top = tmp_path / "export"
    (top / "sub" / "deeper").mkdir(parents=True)
    files = [top / "config.json", top / "sub" / "a.bin", top / "sub" / "deeper" / "b.txt"]
    for i, f in enumerate(files):
        f.write_text("x" * (i + 1))
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: synced.append(os.fstat(fd).st_ino) or real_fsync(fd))
    atomic.sync_tree(top)
    ino = {p: p.stat().st_ino for p in files + [top, top / "sub", top / "sub" / "deeper"]}
    assert sorted(synced) == sorted(ino.values())  # each file and folder once, nothing else
    for f in files:  # a file before the folder that holds it
        assert synced.index(ino[f]) < synced.index(ino[f.parent])
    assert synced.index(ino[top / "sub" / "deeper"]) < synced.index(ino[top / "sub"])
    assert synced[-1] == ino[top]
