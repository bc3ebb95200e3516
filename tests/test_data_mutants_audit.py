"""What a prepared folder's record vouches for, held to hashes and times worked out in the test: a source file's
recorded SHA-256 is that of all its bytes, however large the file (one of 1.5 MiB touched with its bytes unchanged is
reused; one whose last byte past the first MiB changed is refused, whether it was read to be tokenized or stamped
whole past ``max_documents``), and a file's modification time vouches for its bytes only where it is more than the
2 s of the coarsest timestamp step older than the moment the stamps were taken."""
import hashlib
import os
import time

import pytest

from falcon_fwa.data import DataSpec, prepare_dataset

MIB = 1 << 20


def later(path, seconds=5):
    """Give ``path`` a modification time ``seconds`` after its own: its time no longer vouches for its bytes."""
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + seconds * 10**9))


def big_text(size, fill=b"a"):
    """``size`` bytes of text whose last byte differs from the rest, so that an edit there changes the hash."""
    return fill * (size - 1) + b"\n"


def test_a_large_file_touched_with_its_bytes_unchanged_is_reused(tmp_path):
    """A text file of 1.5 MiB, hashed as it is tokenized, then touched (a new time, the same bytes): the
    reuse hashes it whole and finds it the same; the record keeps the SHA-256 of every byte."""
    src = tmp_path / "c"
    src.mkdir()
    data = big_text(MIB + MIB // 2)
    (src / "a.txt").write_bytes(data)
    (src / "b.txt").write_text("a second document")
    spec = DataSpec(train_source=str(src), val_every=2)
    out = str(tmp_path / "out")
    record = prepare_dataset(spec, out)
    assert record["stamps"]["train"][str(src / "a.txt")][1] == hashlib.sha256(data).hexdigest()
    later(src / "a.txt")
    again = prepare_dataset(spec, out)
    assert again["counts"] == record["counts"]


@pytest.mark.parametrize("max_documents", [None, 1])
def test_an_edit_past_the_first_mib_of_a_large_file_is_refused(tmp_path, max_documents):
    """Three files, the last of 1.5 MiB, which gets another last byte (as many bytes, a new time). Tokenized
    (``max_documents`` None) or stamped whole, never opened to be read (``max_documents=1``: the reading stops in
    the second file), its recorded hash covers that byte, and the reuse is refused naming the file."""
    src = tmp_path / "c"
    src.mkdir()
    (src / "a.txt").write_text("the first document")
    (src / "b.txt").write_text("the second document")
    data = big_text(MIB + MIB // 2)
    (src / "z.txt").write_bytes(data)
    (tmp_path / "v.txt").write_text("held out")
    spec = DataSpec(train_source=str(src), val_source=str(tmp_path / "v.txt"), max_documents=max_documents)
    out = str(tmp_path / "out")
    record = prepare_dataset(spec, out)
    assert record["counts"]["train"]["n_docs"] == (3 if max_documents is None else 1)
    assert record["stamps"]["train"][str(src / "z.txt")][1] == hashlib.sha256(data).hexdigest()
    (src / "z.txt").write_bytes(data[:-1] + b"!")
    later(src / "z.txt")
    with pytest.raises(ValueError, match=r"other source files \(.*z\.txt holds other bytes since"):
        prepare_dataset(spec, out)

def test_a_same_size_edit_of_a_file_written_1_4_s_before_the_stamps_is_refused(tmp_path):
    """A file's time vouches for its bytes only where it is more than 2 s older than the moment the stamps were
    taken: one written 1.4 s before, edited after with as many bytes and its time put back, is read again on reuse
    and refused."""
    src = tmp_path / "t.txt"
    src.write_text("alpha beta gamma")
    (tmp_path / "v.txt").write_text("held out")
    then = time.time_ns() - 1_400_000_000
    os.utime(src, ns=(then, then))
    spec = DataSpec(train_source=str(src), val_source=str(tmp_path / "v.txt"))
    out = str(tmp_path / "out")
    prepare_dataset(spec, out)
    if os.stat(os.path.join(out, "prepared.json")).st_mtime_ns - then >= 2 * 10**9:
        pytest.skip("the stamps were taken more than 2 s after the file's time: its time vouches for it")
    src.write_text("ALPHA BETA GAMMA")
    os.utime(src, ns=(then, then))
    with pytest.raises(ValueError, match=r"t\.txt holds other bytes since"):
        prepare_dataset(spec, out)
