"""``python -m falcon_fwa.train.compare_report`` records where its table came from: the commits the runs trained
at (``small.json``'s ``commit``, a line of ``small_table.md``) and the commit of the code that wrote the table,
with whether that checkout had uncommitted changes (``falcon_fwa.provenance.command_provenance``)."""
import json

import pytest
from conftest import git

from falcon_fwa import provenance
from falcon_fwa.train import compare_report

TRAINED = "a" * 40


def _compare_json(tmp_path):
    report = {"configs": ["Falcon-1A", "Transformer", "later"], "steps": 2,
              "status": {"Falcon-1A": "done", "Transformer": "done", "later": "not_run"},
              "runs": {"Falcon-1A": {"steps": 2, "params": 10, "tokens": 64, "val_ppl": 3.0, "commit": TRAINED},
                       "Transformer": {"steps": 2, "params": 12, "tokens": 64, "val_ppl": 4.0, "commit": TRAINED},
                       "later": {"error": "the deadline passed before this recipe started"}}}
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(report))
    return path


@pytest.mark.parametrize("edited", [False, True])
def test_the_table_names_the_runs_commit_and_the_writers_commit_and_dirty_state(tmp_path, checkout, edited):
    if edited:
        (checkout / "code.py").write_text("x = 2\n")
    head = git(checkout, "rev-parse", "HEAD")
    prefix = tmp_path / "rep" / "small"
    assert compare_report.main([str(_compare_json(tmp_path)), str(prefix)]) == 0
    table = (tmp_path / "rep" / "small_table.md").read_text()
    assert table.splitlines()[-2:] == [
        f"Runs trained at commit `{TRAINED}`.",
        f"Table written at commit `{head}`" + (" with uncommitted changes to tracked files." if edited else ".")]
    rows = json.loads((tmp_path / "rep" / "small.json").read_text())
    assert [(r["model"], r["commit"]) for r in rows] == [("Falcon-1A", TRAINED), ("Transformer", TRAINED),
                                                         ("later", None)]


def test_outside_a_checkout_the_table_says_its_commit_is_unknown(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    assert compare_report.main([str(_compare_json(tmp_path)), str(tmp_path / "small")]) == 0
    table = (tmp_path / "small_table.md").read_text()
    assert table.endswith("Table written outside a git checkout (commit unknown).\n")


def test_runs_of_several_commits_are_all_named_and_a_table_without_provenance_names_no_writer():
    rows = [{"model": "a", "status": "done", "tokens": 1, "val_ppl": 2.0, "commit": "c2"},
            {"model": "b", "status": "done", "tokens": 1, "val_ppl": 3.0, "commit": "c1"},
            {"model": "c", "status": "done", "tokens": 1, "val_ppl": 3.0, "commit": "c2"}]
    table = compare_report.markdown_table(rows)
    assert table.endswith("\n\nRuns trained at commit `c1`, `c2`.\n") and "Table written" not in table
