"""The folders a lock makes are the caller's to remove: a preparation whose lock made its folder again, with
the folders above it, after the preparation before it failed and removed them, fails in turn and removes them
all; the lock reports the folders it made (outermost first, as ``make_folders`` does) and whether the lock file
it holds is one it made."""
import contextlib
import os
import shutil
import threading
import time

import pytest
from test_train import write_corpus

from falcon_fwa import atomic
from falcon_fwa.atomic import folder_lock

pytestmark = pytest.mark.usefixtures("one_thread")


def test_two_failed_preparations_into_new_nested_folders_leave_none_of_them(tmp_path, monkeypatch):
    """``a/b/c`` where ``a`` did not exist: the first preparation makes the three, holds the lock and fails (its
    tokenizer folder does not exist), removing them; the second, waiting on the lock meanwhile, makes the three
    again under the lock and fails the same way: neither ``a`` nor anything under it stays."""
    from falcon_fwa.data import prepare

    corpus = tmp_path / "corpus.jsonl"
    write_corpus(corpus)
    spec = prepare.DataSpec(train_source=str(corpus), tokenizer=str(tmp_path / "no-tokenizer"))
    out = tmp_path / "a" / "b" / "c"
    real_lock, real_prepare = prepare.folder_lock, prepare._prepare
    second_at_lock, yielded, errors = threading.Event(), [], []

    @contextlib.contextmanager
    def watched_lock(folder, name, **kw):
        if threading.current_thread().name == "second":
            second_at_lock.set()
        with real_lock(folder, name, **kw) as remade:
            yielded.append((threading.current_thread().name, remade))
            yield remade

    def first_waits_for_the_second(*args):
        if threading.current_thread().name == "first":
            assert second_at_lock.wait(10)
            time.sleep(0.3)  # the second has opened the lock file and waits on it
        return real_prepare(*args)

    monkeypatch.setattr(prepare, "folder_lock", watched_lock)
    monkeypatch.setattr(prepare, "_prepare", first_waits_for_the_second)

    def prepare_it():
        try:
            prepare.prepare_dataset(spec, str(out))
        except ValueError as err:
            errors.append(str(err))

    first = threading.Thread(target=prepare_it, name="first")
    first.start()
    while not out.exists():  # the first has made the folders (and then takes the lock)
        time.sleep(0.01)
    second = threading.Thread(target=prepare_it, name="second")
    second.start()
    first.join(20)
    second.join(20)
    assert len(errors) == 2 and all("tokenizer folder" in e for e in errors), errors
    assert [name for name, _ in yielded] == ["first", "second"]
    assert yielded[1][1].lock  # the second holds a lock file made again: the first had removed its own
    assert not (tmp_path / "a").exists()
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


def test_a_waiter_reports_the_parent_folders_it_made_again(tmp_path):
    """The holder removes ``a`` (with ``a/b/c`` and the lock file in it) before it lets go: the waiter makes the
    three again and reports them, outermost first, and the lock file as one it made."""
    folder = tmp_path / "a" / "b" / "c"
    got = []
    with folder_lock(folder, ".lock"):
        waiter = threading.Thread(target=lambda: got.append(_hold(folder)))
        waiter.start()
        time.sleep(0.3)  # the waiter opened the file and waits on it
        shutil.rmtree(tmp_path / "a")
    waiter.join(10)
    assert got == [([str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(folder)], True)]


def _hold(folder):
    with folder_lock(folder, ".lock") as remade:
        return list(remade.folders), remade.lock


def test_the_lock_reports_what_it_made_at_its_start(tmp_path):
    """A first lock of a folder that did not exist: the folder and the one above it, and the lock file, are
    this call's; a lock of a folder and lock file that were there made nothing."""
    folder = tmp_path / "x" / "y"
    with folder_lock(folder, ".lock") as remade:
        assert list(remade.folders) == [str(tmp_path / "x"), str(folder)] and remade.lock
    with folder_lock(folder, ".lock") as remade:
        assert list(remade.folders) == [] and not remade.lock
    os.remove(folder / ".lock")  # the folder there, its lock file not: the file alone is this call's
    with folder_lock(folder, ".lock") as remade:
        assert list(remade.folders) == [] and remade.lock
    assert atomic.Remade._fields == ("folders", "lock")
