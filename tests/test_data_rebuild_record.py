"""A rebuild (``--overwrite``) removes the old ``prepared.json`` before it writes anything new, and flushes that
removal to disk (an fsync of the folder, as an atomic write of a record does) before a new shard or tokenizer file
is written: after a power loss the folder holds no record of the old preparation beside new shards."""
import os

import pytest

from falcon_fwa.data import prepare
from falcon_fwa.data.prepare import DataSpec, prepare_dataset


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an fsynced descriptor by /proc/self/fd")
def test_the_old_record_is_removed_and_the_folder_synced_before_a_new_file_is_written(tmp_path, monkeypatch):
    (tmp_path / "c.txt").write_text("".join(f"line {n}\n" for n in range(8)))
    out = tmp_path / "out"
    prepare_dataset(DataSpec(train_source=str(tmp_path / "c.txt"), text_split="line", val_every=2), str(out))
    old_train = (out / "train" / "meta.json").stat().st_ino

    events = []  # (what was fsynced, whether prepared.json was there then)
    fsync = os.fsync

    def logged(fd):
        events.append((os.readlink(f"/proc/self/fd/{fd}"), (out / "prepared.json").exists()))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", logged)
    save = prepare.save_tokenizer
    monkeypatch.setattr(prepare, "save_tokenizer",
                        lambda tokenizer, folder: (events.append(("save", folder)), save(tokenizer, folder)))
    record = prepare_dataset(DataSpec(train_source=str(tmp_path / "c.txt"), text_split="line", val_every=4),
                             str(out), overwrite=True)
    assert record["counts"]["val"]["n_docs"] == 2
    # the removal synced first, then the tokenizer saved, then the shards written, the record last
    assert events[0] == (str(out), False) and events[1] == ("save", str(out / "tokenizer")), events[:3]
    shard_files = [n for n, (path, _) in enumerate(events) if os.path.dirname(str(path)) == str(out / "train.tmp")]
    assert shard_files and shard_files[0] == 2, events[:4]
    assert events[-1] == (str(out), True)  # the new record's rename, synced
    assert (out / "train" / "meta.json").stat().st_ino != old_train

