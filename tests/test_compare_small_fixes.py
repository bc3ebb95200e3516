"""Small edges of the comparison commands: a table row of a partial or stopped run whose step counts are unknown,
the refused ``--set train.out_dir`` in any spelling the config parser reads as that key, names that become file
names in ``addition-compare``, and the progress bar's count of failed runs."""
import json

import pytest

from falcon_fwa import provenance
from falcon_fwa.train import compare_report


@pytest.mark.parametrize("status", ["partial", "stopped"])
@pytest.mark.parametrize("steps, planned, shown", [(None, 1000, "? of 1,000 steps"), (250, None, "250 of ? steps"),
                                                   (None, None, "? of ? steps")])
def test_a_partial_or_stopped_row_with_an_unknown_step_count_is_written_with_a_question_mark(status, steps, planned,
                                                                                          shown):
    rows = [{"model": "Falcon-1A", "status": status, "steps": steps, "planned_steps": planned, "params": 10,
             "tokens": 640, "val_ppl": 3.5}]
    table = compare_report.markdown_table(rows)
    assert table.splitlines()[2] == f"| Falcon-1A | {status}: {shown} | 10 | 640 | 3.500 | - | - |"


def test_compare_report_writes_the_table_of_a_compare_json_missing_step_counts(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "source_checkout", lambda: None)
    report = {"configs": ["Falcon-1A", "Transformer"],
              "status": {"Falcon-1A": "partial", "Transformer": "stopped"},
              "runs": {"Falcon-1A": {"steps": 3, "params": 10, "tokens": 96, "val_ppl": 3.0},
                       "Transformer": {"params": 12, "tokens": 32}}}
    (tmp_path / "compare.json").write_text(json.dumps(report))
    assert compare_report.main([str(tmp_path / "compare.json"), str(tmp_path / "rep" / "small")]) == 0
    table = (tmp_path / "rep" / "small_table.md").read_text().splitlines()
    assert table[2:4] == ["| Falcon-1A | partial: 3 of ? steps | 10 | 96 | 3.000 | - | - |",
                          "| Transformer | stopped: ? of ? steps | 12 | 32 | - | - | - |"]
    assert "Not in the comparison (fewer or no tokens trained): Falcon-1A, Transformer." in table
    rows = json.loads((tmp_path / "rep" / "small.json").read_text())
    assert [(r["model"], r["steps"], r["planned_steps"]) for r in rows] == [("Falcon-1A", 3, None),
                                                                            ("Transformer", None, None)]
