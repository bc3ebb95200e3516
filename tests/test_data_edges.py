"""Edges of the data pipeline: Parquet strings that are no UTF-8, folders reached through links."""
import os

import numpy as np
import pytest

from falcon_fwa.data import iter_documents


@pytest.mark.parametrize("kind,offsets", [("string", np.int32), ("large_string", np.int64)])
def test_parquet_strings_of_bytes_that_are_no_utf8_become_replacement_characters(tmp_path, kind, offsets):
    """Arrow checks no UTF-8 on reading a Parquet file: such bytes become U+FFFD, as in text and JSON files
    (they were a UnicodeDecodeError naming no file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = b"ok" + b"caf\xc3\xa9 \xff\xfe end" + b"x\x80"  # three strings: valid, two bad bytes, one bad byte
    ends = np.array([0, 2, 2 + 12, 2 + 12 + 2], dtype=offsets)
    column = pa.Array.from_buffers(getattr(pa, kind)(), 3, [None, pa.py_buffer(ends.tobytes()), pa.py_buffer(data)])
    pq.write_table(pa.table({"text": column}), tmp_path / "c.parquet")
    assert list(iter_documents(str(tmp_path / "c.parquet"))) == ["ok", "café \ufffd\ufffd end", "x\ufffd"]


def test_a_folder_reached_through_a_link_is_read_once(tmp_path):
    """A source folder is searched into linked folders (a corpus linked in from elsewhere was silently
    left out); a link back to a folder already searched adds nothing and does not loop."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "b.txt").write_text("linked in")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.txt").write_text("first")
    (src / "sub" / "c.txt").write_text("nested")
    os.symlink(elsewhere, src / "linked")
    os.symlink(src, src / "sub" / "loop")  # back to the top
    assert list(iter_documents(str(src))) == ["first", "linked in", "nested"]
