"""Addition task: the recorded runs and summaries under results/addition stay readable by the commands."""
import copy
import json
from pathlib import Path

import pytest

from falcon_fwa.tasks.addition.compare import check_runs_setup
from falcon_fwa.tasks.addition.lineup import resolve_model
from falcon_fwa.tasks.addition.presets import get_addition_preset, preset_size
from falcon_fwa.tasks.addition.train import check_same_setup

RECORD = Path(__file__).resolve().parents[1] / "results" / "addition" / "paper_runs"
"""The runs of the table of record (results/addition/paper.md), from before the preset field ``fan_in_init``."""


def _wanted(preset, model="Falcon-3A.3"):
    return {"config_fields": resolve_model(model), "eval_seed": 1234, "preset": preset.to_dict(), "seed": 0,
            "dtype": "float32"}


def test_runs_from_before_fan_in_init_match_the_preset_of_the_same_model():
    # the record held its fan-in scale 1/sqrt(256) = 0.0625 in the preset's 'model'; today's preset has
    # fan_in_init and no 'model': the same model config, so the record can be summarized (--no-train) again
    held = json.loads((RECORD / "Falcon-3A.3" / "seed0" / "results.json").read_text())
    assert "fan_in_init" not in held["preset"] and held["preset"]["model"] == {"initializer_range": 0.0625}
    paper = get_addition_preset("paper")
    assert preset_size(held["preset"]) == paper.size() == {"hidden_size": 256, "num_hidden_layers": 4,
                                                           "num_heads": 4, "initializer_range": 0.0625}
    check_same_setup(held, _wanted(paper), RECORD, "advice")
    check_runs_setup(RECORD, ["Falcon-3A.3", "Falcon-1A.3", "Falcon-1.3", "Transformer", "Mamba-2"], [0], paper,
                     1234, "float32")


def test_runs_of_another_initialization_are_still_refused():
    paper = get_addition_preset("paper")
    held = {"config_fields": resolve_model("Falcon-3A.3"), "eval_seed": 1234, "seed": 0, "dtype": "float32",
            "preset": json.loads(json.dumps(paper.to_dict()))}
    old = copy.deepcopy(held)  # the first GPU run: no fan-in scale (the config default 0.02)
    del old["preset"]["fan_in_init"]
    old["preset"]["model"] = {}
    with pytest.raises(ValueError, match=r"^--preset: .*'initializer_range': 0\.0625"):
        check_same_setup(old, _wanted(paper), Path("run"), "advice")
    other = copy.deepcopy(held)  # an explicit scale other than the fan-in one
    other["preset"]["model"] = {"initializer_range": 0.02}
    with pytest.raises(ValueError, match=r"^--preset: .*'initializer_range': 0\.02"):
        check_same_setup(other, _wanted(paper), Path("run"), "advice")
    check_same_setup(held, _wanted(paper), Path("run"), "advice")  # the same preset passes
    wider = _wanted(paper.replace(hidden_size=512))  # a width is named as its own field
    with pytest.raises(ValueError, match=r"^--hidden-size: "):
        check_same_setup(held, wider, Path("run"), "advice")


def test_the_table_of_record_is_rewritten_from_its_runs_keeping_its_notes(tmp_path, monkeypatch, capsys):
    # --no-train on the record's runs gives back paper.json row for row, and paper.md keeps the notes that
    # were written into it by hand (its meta has none): every section from "## Notes" on
    from falcon_fwa.tasks.addition import compare

    results = RECORD.parent
    for name in ("paper.json", "paper.md", "paper_meta.json"):
        (tmp_path / name).write_text((results / name).read_text())
    assert json.loads((results / "paper_meta.json").read_text())["notes"] == ""
    written = compare.written_notes(results / "paper.md")
    assert written.startswith("**Outcome: the paper's Table 3 is not reproduced") and "## The Mamba-2" in written
    monkeypatch.setattr(compare, "_ood_reference", lambda *a: {})  # the scale is tested elsewhere
    argv = ["--preset", "paper", "--device", "cpu", "--models", "Falcon-3A.3", "Falcon-1A.3", "Falcon-1.3",
            "Transformer", "Mamba-2", "--seeds", "0", "--no-train", "--partial", "--runs", str(RECORD),
            "--results", str(tmp_path), "--name", "paper"]
    assert compare.main(argv) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "paper.json").read_text()) == json.loads((results / "paper.json").read_text())
    md = (tmp_path / "paper.md").read_text()
    assert md.endswith("\n## Notes\n\n" + written + "\n") and md.count("\n## Notes\n") == 1
    meta = json.loads((tmp_path / "paper_meta.json").read_text())
    assert meta["notes"] == written and meta["trained_by"].startswith("falcon-fwa addition-compare --preset paper")
    assert compare.main(argv) == 0  # a second rewrite: the notes, now in the meta, once
    assert (tmp_path / "paper.md").read_text() == md
    (tmp_path / "paper.md").write_text(md + "\nA later attempt, added by hand.\n")  # the meta's notes and more
    assert compare.main(argv) == 0
    added = written + "\n\nA later attempt, added by hand."
    assert (tmp_path / "paper.md").read_text().endswith("\n## Notes\n\n" + added + "\n")
    assert json.loads((tmp_path / "paper_meta.json").read_text())["notes"] == added
    # a summary without a notes section, or none at all, has no notes
    (tmp_path / "paper.md").write_text("# a summary\n")
    assert compare.written_notes(tmp_path / "paper.md") == "" and compare.written_notes(tmp_path / "none.md") == ""


def test_a_replaced_summary_with_notes_is_kept_under_the_first_free_name(tmp_path):
    from falcon_fwa.tasks.addition.compare import keep_replaced_notes

    md = tmp_path / "paper.md"
    assert keep_replaced_notes(md) is None  # no summary yet
    md.write_text("| table |\n")
    assert keep_replaced_notes(md) is None  # a summary without notes: nothing to keep
    first = "| table |\n\n## Notes\n\nfirst attempt\n"
    md.write_text(first)
    assert keep_replaced_notes(md) == tmp_path / "paper.before.md"
    md.write_text(first.replace("first", "second"))
    assert keep_replaced_notes(md) == tmp_path / "paper.before-2.md"
    assert (tmp_path / "paper.before.md").read_text() == first  # the earlier copy is not overwritten
    assert "second attempt" in (tmp_path / "paper.before-2.md").read_text()
