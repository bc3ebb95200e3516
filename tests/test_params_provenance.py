"""``falcon-fwa params`` records where its table came from: the printed table and the ``--out`` file end with the
commit of the code that counted, and whether that checkout had uncommitted changes to tracked files
(``falcon_fwa.provenance.command_provenance``, worded by ``written_at_line``); the record
``benchmarks/results/params.md`` names a commit of this repository, written from a clean checkout."""
import os
import re
import subprocess

import pytest
from conftest import git

from falcon_fwa import cli, provenance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("edited", [False, True])
def test_the_table_printed_and_written_ends_with_the_commit_that_counted(tmp_path, checkout, capsys, edited):
    if edited:
        (checkout / "code.py").write_text("x = 2\n")
    (checkout / "untracked.py").write_text("y = 1\n")  # an untracked file is no uncommitted change
    head = git(checkout, "rev-parse", "HEAD")
    out = tmp_path / "params.md"
    assert cli.main(["params", "tiny-transformer", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    line = f"Table written at commit `{head}`" + (" with uncommitted changes to tracked files." if edited else ".")
    for text in (printed, out.read_text()):
        lines = text.splitlines()
        assert lines[-1] == line and lines[-2] == ""
        assert lines[-3].startswith("| tiny-transformer | transformer |")  # the table's last row, then the line
    assert out.read_text().endswith("`. Tied input/output embeddings are counted once.\n\n" + printed)


def test_outside_a_checkout_the_table_says_its_commit_is_unknown(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    out = tmp_path / "params.md"
    assert cli.main(["params", "tiny-falcon", "--out", str(out)]) == 0
    assert capsys.readouterr().out.endswith("|\n\nTable written outside a git checkout (commit unknown).\n")
    assert out.read_text().endswith("|\n\nTable written outside a git checkout (commit unknown).\n")


def test_the_written_at_line_by_hand():
    assert provenance.written_at_line({"commit": "c", "dirty": False}) == "Table written at commit `c`."
    assert provenance.written_at_line({"commit": "c", "dirty": True}, "Report") == \
        "Report written at commit `c` with uncommitted changes to tracked files."
    assert provenance.written_at_line({"commit": "c", "dirty": None}) == \
        "Table written at commit `c` (uncommitted changes unknown)."
    assert provenance.written_at_line({"commit": None, "dirty": None}) == \
        "Table written outside a git checkout (commit unknown)."


def test_the_recorded_table_names_a_commit_of_this_repository_written_clean():
    """The table lines themselves are checked against ``parameter_table`` in test_models_config_mutants."""
    if subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    with open(os.path.join(ROOT, "benchmarks", "results", "params.md")) as f:
        lines = f.read().splitlines()
    assert "Produced by `falcon-fwa params`." in lines[2]  # the command that made it, every preset
    found = re.fullmatch(r"Table written at commit `([0-9a-f]{40})`\.", lines[-1])
    assert found, lines[-1]
    assert lines[-3].startswith("| ") and lines[-2] == ""
    commit = found.group(1)
    known = subprocess.run(["git", "-C", ROOT, "cat-file", "-t", commit], capture_output=True, text=True)
    if known.returncode and git(ROOT, "rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("a shallow clone: the recorded commit may lie outside its history")
    assert known.stdout.strip() == "commit", known.stderr
    # the code of that commit printed this table: the params command there writes the line
    assert "written_at_line" in git(ROOT, "show", f"{commit}:src/falcon_fwa/models/cli.py")
