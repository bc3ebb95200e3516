"""A text file split by ``line`` or ``paragraph`` is read as a stream, a line at a time: the memory it takes does not
grow with the file (a corpus of one document per line may be larger than the memory), and its documents are those
that splitting the whole text gives (``text.split("\\n")``, ``re.split(r"\\n\\s*\\n", text)``, blank parts dropped),
read as the file's text is (``\\r\\n`` and ``\\r`` ends, a byte-order mark, bytes that are no UTF-8)."""
import random
import re
import tracemalloc

import pytest

from falcon_fwa.data import iter_documents


def reference(path, text_split):
    """The documents of the whole text of ``path``, split as the definition reads."""
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        text = f.read()
    parts = text.split("\n") if text_split == "line" else re.split(r"\n\s*\n", text)
    return [part for part in parts if part.strip()]


PIECES = ["a", "bc", " ", "  ", "\t", "\n", "\n", "\n\n", "\r", "\r\n", "\x0c", "\u2028", "\x85", "\u00a0", "é",
          "\n \n", " \n\t\n "]


@pytest.mark.parametrize("text_split", ["line", "paragraph"])
def test_streamed_documents_are_those_of_the_whole_text(tmp_path, text_split):
    rng = random.Random(7)
    path = tmp_path / "t.txt"
    for n in range(400):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40)))
        raw = text.encode("utf-8")
        if n % 7 == 0:
            raw = b"\xef\xbb\xbf" + raw  # a byte-order mark
        if n % 11 == 0:
            raw = raw + b"\xff\xfe tail"  # bytes that are no UTF-8
        path.write_bytes(raw)
        assert list(iter_documents(str(path), text_split=text_split)) == reference(path, text_split), repr(raw)


@pytest.mark.parametrize("text_split", ["line", "paragraph"])
def test_a_large_file_is_read_in_memory_that_does_not_grow_with_it(tmp_path, text_split):
    path = tmp_path / "big.txt"
    line = "word " * 4 + "end\n"  # 24 bytes
    every = 1 if text_split == "line" else 3
    with open(path, "w") as f:
        for i in range(400_000):  # 9.6 MB
            f.write(line)
            if i % every == every - 1:
                f.write("\n")
    size = path.stat().st_size
    tracemalloc.start()
    try:
        n = sum(1 for _ in iter_documents(str(path), text_split=text_split))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == -(-400_000 // every)  # (a last paragraph of one line)
    assert peak < size / 10, (peak, size)
