"""A training run's ``summary.json`` records the commit it trained at and whether that checkout had uncommitted
changes to tracked files (``dirty``, from ``falcon_fwa.provenance.command_provenance``), and the table of
``python -m falcon_fwa.train.compare_report`` says so after the commit of each run trained with changes; a summary
written before ``dirty`` was recorded still reads, with nothing said about changes."""
import json

import pytest
from conftest import git
from test_train import recipe, run_trainer

from falcon_fwa import provenance
from falcon_fwa.train import compare_report


@pytest.mark.parametrize("edited", [False, True])
def test_the_summary_records_the_commit_and_whether_its_checkout_was_edited(tmp_path, checkout, edited):
    if edited:
        (checkout / "code.py").write_text("x = 2\n")
    (checkout / "untracked.py").write_text("y = 1\n")  # an untracked file is no change to tracked files
    run_trainer(recipe(tmp_path, "run", steps=2, save_every=0))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["commit"], summary["dirty"]) == (git(checkout, "rev-parse", "HEAD"), edited)
    report = {"configs": ["Falcon-1A"], "runs": {"Falcon-1A": dict(summary, status="done")}}
    table = compare_report.markdown_table(compare_report.result_rows(report))
    note = f" with uncommitted changes to tracked files (diff_sha256 `{summary['diff_sha256'][:12]}`)" if edited else ""
    assert table.endswith(f"\n\nRuns trained at commit `{summary['commit']}`{note}.\n")


def test_outside_a_checkout_the_summary_has_neither_commit_nor_dirty_state(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    run_trainer(recipe(tmp_path, "run", steps=2, save_every=0))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["commit"], summary["dirty"]) == (None, None)


def test_the_report_notes_each_commit_of_runs_with_changes_and_reads_results_without_dirty(tmp_path, checkout):
    """Runs at ``c1`` clean and edited, at ``c2`` clean and of an older summary (no ``dirty``), at ``c3`` only of
    an older summary: ``c1`` is named twice, ``c2`` and ``c3`` once without a note; ``small.json``'s rows carry
    ``dirty`` (``None`` for the older results)."""
    runs = {"a": {"commit": "c1", "dirty": True}, "b": {"commit": "c1", "dirty": False},
            "c": {"commit": "c2", "dirty": False}, "d": {"commit": "c2"}, "e": {"commit": "c3"}}
    report = {"configs": list(runs), "steps": 2,
              "runs": {name: dict(run, steps=2, params=10, tokens=64, val_ppl=3.0) for name, run in runs.items()}}
    (tmp_path / "compare.json").write_text(json.dumps(report))
    prefix = tmp_path / "rep" / "small"
    assert compare_report.main([str(tmp_path / "compare.json"), str(prefix)]) == 0
    head = git(checkout, "rev-parse", "HEAD")
    assert (tmp_path / "rep" / "small_table.md").read_text().splitlines()[-2:] == [
        "Runs trained at commit `c1`, `c1` with uncommitted changes to tracked files, `c2`, `c3`.",
        f"Table written at commit `{head}`."]
    rows = json.loads((tmp_path / "rep" / "small.json").read_text())
    assert [(r["model"], r["commit"], r["dirty"]) for r in rows] == [
        ("a", "c1", True), ("b", "c1", False), ("c", "c2", False), ("d", "c2", None), ("e", "c3", None)]


def test_runs_of_one_commit_with_different_changes_are_named_once_per_change():
    """Two runs at ``c1`` with different uncommitted changes are not the same code: the closing line names ``c1``
    once per fingerprint (its first 12 hex digits), once for runs of the same changes, and once clean."""
    fp1, fp2 = "a" * 64, "b" * 64
    runs = {"x": {"commit": "c1", "dirty": True, "diff_sha256": fp1},
            "y": {"commit": "c1", "dirty": True, "diff_sha256": fp2},
            "z": {"commit": "c1", "dirty": True, "diff_sha256": fp1},
            "w": {"commit": "c1", "dirty": False}}
    report = {"configs": list(runs), "steps": 2,
              "runs": {name: dict(run, steps=2, params=10, tokens=64, val_ppl=3.0, status="done")
                       for name, run in runs.items()}}
    table = compare_report.markdown_table(compare_report.result_rows(report))
    dirty = " with uncommitted changes to tracked files (diff_sha256 `{}`)"
    assert table.endswith(f"\n\nRuns trained at commit `c1`, `c1`{dirty.format('a' * 12)}, "
                          f"`c1`{dirty.format('b' * 12)}.\n")
