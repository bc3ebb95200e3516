"""A file's modification time vouches for its recorded bytes only where it is clearly older than the moment its
stamp was taken (the record's own modification time): a file written, stamped and written again with other bytes
of the same size within one timestamp step of its filesystem (1 s on ext3 or HFS+, 2 s on FAT) keeps its time,
and is found changed by its SHA-256; a file stamped long after its last write is reused by its time, none of its
bytes read."""
import hashlib
import json
import os
import time

from test_data_followups_retime import hashed
from test_data_sources import run_data


def set_mtime(path, ns):
    os.utime(path, ns=(os.stat(path).st_atime_ns, ns))


def corpus(tmp_path, age_s=0):
    """A train folder of two files and a val file, their times ``age_s`` seconds before now."""
    src, val = tmp_path / "c", tmp_path / "v.txt"
    src.mkdir()
    (src / "a.txt").write_text("alpha beta gamma delta")
    (src / "b.txt").write_text("epsilon zeta eta")
    val.write_text("theta iota kappa")
    if age_s:
        then = time.time_ns() - age_s * 10**9
        for path in (src / "a.txt", src / "b.txt", val):
            set_mtime(path, then)
    return src, val


def recorded(out, which, path):
    return json.loads((out / "prepared.json").read_text())["stamps"][which][str(path)]


def test_a_same_size_edit_in_the_tick_of_the_stamp_is_refused(tmp_path, capsys):
    # a filesystem of whole-second times: the file written, stamped and written again in that second
    src, val = corpus(tmp_path)
    edited = src / "b.txt"
    tick = time.time_ns() // 10**9 * 10**9
    set_mtime(edited, tick)
    out = tmp_path / "out"
    argv = ["--train", src, "--val", val, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    mtime, digest = recorded(out, "train", edited)
    assert mtime == tick and digest == hashlib.sha256(b"epsilon zeta eta").hexdigest()

    edited.write_bytes(b"EPSILON ZETA ETA")  # other bytes, as many
    set_mtime(edited, mtime)  # the same time step: the time kept as recorded
    assert os.stat(edited).st_mtime_ns == mtime and os.path.getsize(edited) == 16
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and "other source files" in err and str(edited) in err, err


def test_a_same_size_edit_of_a_val_file_in_the_tick_of_the_stamp_is_refused(tmp_path, capsys):
    src, val = corpus(tmp_path)
    out = tmp_path / "out"
    argv = ["--train", src, "--val", val, "--out", out]
    status, _, err = run_data(capsys, *argv)
    assert status == 0, err
    mtime, _ = recorded(out, "val", val)
    val.write_bytes(b"THETA IOTA KAPPA")
    set_mtime(val, mtime)
    status, _, err = run_data(capsys, *argv)
    assert status == 2 and str(val) in err, err


def test_a_racy_file_found_the_same_is_read_until_its_time_is_clearly_older(tmp_path, capsys, monkeypatch):
    src, val = corpus(tmp_path)
    out = tmp_path / "out"
    argv = ["--train", src, "--val", val, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    calls = hashed(monkeypatch)
    status, again, err = run_data(capsys, *argv)  # the same bytes, written a moment before the stamps: each read
    assert status == 0 and again["counts"] == record["counts"], err
    assert sorted(calls) == sorted(map(str, (src / "a.txt", src / "b.txt", val)))

    # the same files, their times now an hour before the last stamp time kept (as once they are that old)
    kept = json.loads((out / "prepared.json").read_text())
    hour_before = time.time_ns() - 3600 * 10**9
    for which, path in (("train", src / "a.txt"), ("train", src / "b.txt"), ("val", val)):
        set_mtime(path, hour_before)
        kept["stamps"][which][str(path)][0] = hour_before
    (out / "prepared.json").write_text(json.dumps(kept))  # (a record written now: stamps taken now)
    calls.clear()
    status, _, err = run_data(capsys, *argv)
    assert status == 0 and calls == [], err


def test_a_file_stamped_long_after_its_last_write_is_reused_unread(tmp_path, capsys, monkeypatch):
    src, val = corpus(tmp_path, age_s=3600)
    out = tmp_path / "out"
    argv = ["--train", src, "--val", val, "--out", out]
    status, record, err = run_data(capsys, *argv)
    assert status == 0, err
    calls = hashed(monkeypatch)
    for _ in range(2):
        status, again, err = run_data(capsys, *argv)
        assert status == 0 and again == record, err
    assert calls == []
