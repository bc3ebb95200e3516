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


REFUSED_OUT_DIR = "compare trains each recipe in --out's main/NAME folder, not in train.out_dir"


@pytest.mark.parametrize("item", ["train.out_dir=elsewhere", "train.out_dir= elsewhere",
                                  "train={out_dir: elsewhere}", "train={'out_dir': elsewhere, steps: 3}",
                                  'train={"out_dir": "elsewhere"}', "train.out_dir.x=elsewhere"])
def test_compare_refuses_every_spelling_the_loader_reads_as_train_out_dir(item, tmp_path, capsys):
    from falcon_fwa.train import compare
    from falcon_fwa.train.config import apply_overrides

    assert "out_dir" in apply_overrides({}, [item])["train"]  # the loader does take it as that field
    missing = str(tmp_path / "missing.yaml")  # refused before the recipes are read
    assert compare.main(["--configs", missing, "--out", str(tmp_path / "out"), "--set", item]) == 2
    err = capsys.readouterr().err
    assert f"--set {item}: {REFUSED_OUT_DIR}" in err and "missing.yaml" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("item, refused", [(" train.out_dir=elsewhere", "unknown config section ' train'"),
                                           ("train.out_dir =elsewhere", "unknown config field train.out_dir "),
                                           ("train .out_dir=elsewhere", "unknown config section 'train '")])
def test_a_spelling_with_spaces_in_the_key_is_no_field_of_the_recipe_and_the_loader_refuses_it(item, refused,
                                                                                                tmp_path, capsys):
    """The loader takes a key as written: a space makes it name no section or field, so compare leaves it to the
    recipes' load, which refuses it naming the key."""
    from falcon_fwa.train import compare
    from falcon_fwa.train.config import apply_overrides

    assert "out_dir" not in (apply_overrides({}, [item]).get("train") or {})
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text("model: {preset: tiny-falcon}\ntrain: {steps: 2}\n")
    assert compare.main(["--configs", str(recipe), "--out", str(tmp_path / "out"), "--set", item]) == 2
    err = capsys.readouterr().err
    assert f"error: {refused}" in err and REFUSED_OUT_DIR not in err
    assert not (tmp_path / "out").exists()


class _Bar:
    """Stands for tqdm: records the count, the text beside it and the lines written."""
    made = []

    def __init__(self, total=None, **kw):
        self.total, self.n, self.postfix, self.lines = total, 0, "", []
        _Bar.made.append(self)

    def update(self, k=1):
        self.n += k

    def set_postfix_str(self, s="", refresh=True):
        self.postfix = s

    def write(self, line):
        self.lines.append(line)

    def close(self):
        pass


def test_addition_compare_counts_the_failed_runs_apart_from_the_finished_ones_on_its_bar(tmp_path, monkeypatch):
    """Four runs, one at a time, seed-major: the Transformer runs exit 0 with their results, the Mamba-2 runs
    exit 3 without any. The bar ends at 2 of 4 with "2 failed" beside it, not at 4 of 4."""
    import argparse
    import subprocess

    import tqdm.auto

    from falcon_fwa.tasks.addition import compare

    runs = tmp_path / "runs"

    class Run:
        def __init__(self, cmd, **kw):
            self.model, self.seed = cmd[cmd.index("--model") + 1], int(cmd[cmd.index("--seed") + 1])
            self.returncode = None

        def poll(self):
            if self.returncode is None:
                self.returncode = 3 if self.model == "Mamba-2" else 0
                if self.returncode == 0:
                    (compare._run_dir(runs, self.model, self.seed) / "results.json").write_text(json.dumps(
                        {"finished": True, "best": {"val_acc": 90.0, "mean_acc_ood": 50.0}}))
            return self.returncode

        def wait(self):
            return self.poll()

    monkeypatch.setattr(_Bar, "made", [])
    monkeypatch.setattr(subprocess, "Popen", Run)
    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    monkeypatch.setattr(compare.time, "sleep", lambda s: None)
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    args = p.parse_args(["--models", "Transformer", "Mamba-2", "--seeds", "0", "1", "--steps", "2",
                         "--device", "cpu", "--jobs", "1"])
    failed, stopped_by = compare.train_all(args, runs)
    (bar,) = _Bar.made
    assert stopped_by == 0
    assert failed == [f"Mamba-2 seed {s} (exit 3, see {compare._run_dir(runs, 'Mamba-2', s)}/log.txt)" for s in (0, 1)]
    assert (bar.total, bar.n, bar.postfix) == (4, 2, "2 failed")
    assert bar.lines == ["Transformer seed 0: val 90.0% ood mean 50.0%", f"FAILED: {failed[0]}",
                         "Transformer seed 1: val 90.0% ood mean 50.0%", f"FAILED: {failed[1]}"]
