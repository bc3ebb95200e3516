"""Without ``--val``, ``--val-every N`` holds out every N-th document as ``--text-split`` cuts them: with ``line`` or
``paragraph`` that is every N-th line or paragraph, so one file's neighbouring lines fall in train and val alike.
docs/training.md and ``--help`` say so; the splits are checked here against indices counted by hand."""
import argparse
import pathlib
import re

import pytest
from test_data_sources import run_data, stored

from falcon_fwa.data.cli import add_arguments

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("split, sep", [("line", "\n"), ("paragraph", "\n\n")])
def test_every_nth_line_or_paragraph_of_one_file_is_held_out(tmp_path, capsys, split, sep):
    parts = [f"part {n} of the one file" for n in range(1, 12)]  # 11 documents: the 4th and 8th are held out
    (tmp_path / "one.txt").write_text(sep.join(parts) + "\n")
    out = tmp_path / "out"
    status, record, err = run_data(capsys, "--train", tmp_path / "one.txt", "--text-split", split, "--val-every", 4,
                                   "--out", out)
    assert status == 0, err
    val = [parts[3], parts[7]]
    train = parts[:3] + parts[4:7] + parts[8:]
    if split == "paragraph":  # the last paragraph keeps the file's final line end (docs/training.md, --text-split)
        train[-1] += "\n"
    assert stored(out / "val") == [(256, p.encode()) for p in val]
    assert stored(out / "train") == [(256, p.encode()) for p in train]
    assert record["counts"]["val"]["n_docs"] == 2 and record["counts"]["train"]["n_docs"] == 9


def _data_bullet():
    """The ``--train``/``--val`` bullet of the ``data`` command in docs/training.md, one line."""
    text = (ROOT / "docs" / "training.md").read_text()
    bullet = re.search(r"^- `--train`/`--val`:.*?(?=^- )", text, flags=re.S | re.M).group(0)
    return " ".join(bullet.split())


def test_the_docs_say_held_out_documents_are_counted_after_the_text_split():
    bullet = _data_bullet()
    held = re.search(r"every `--val-every`-th document \(20\) is held out(.*?);", bullet)
    assert held, bullet
    said = held.group(1)
    assert "counted after `--text-split`" in said and "`line` or `paragraph`" in said
    assert "train and val alike" in said and "`--val`" in said


def test_the_help_of_val_every_says_it_counts_after_the_text_split():
    parser = argparse.ArgumentParser(prog="falcon-fwa data")
    add_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert re.search(r"--val-every VAL_EVERY without --val: hold out every N-th document \(counted after "
                     r"--text-split: with line, every N-th line\)", text), text
