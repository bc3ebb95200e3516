"""What a comparison and a scaling sweep record of runs cut short or timed under other settings: a stopped
recipe's planned step count where the recipes' own ``train.steps`` sets it, a stopped recipe's validation
figures only where they were measured at its last step, and a sweep's rows kept only from runs with the
thread count its table names."""
import json
import signal

import pytest
import torch

from falcon_fwa.train import compare, compare_report
from falcon_fwa.train import trainer as trainer_module
from test_cli_journeys import _compare
from test_compare_tools import load, run_compare
from test_scaling import _fake_sweep
from test_train import recipe

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_concurrent_comparison_stopped_without_steps_records_the_recipes_own_step_count(tmp_path, monkeypatch,
                                                                                        capsys):
    """``--concurrent`` without ``--steps``: the recipes share their own ``train.steps`` (4 in test_train's
    recipe), which is every run's planned count; a run stopped at step 3 by a SIGTERM reads "3 of 4 steps" on the
    console and in the report's table (not a count of None, which the table cannot print)."""
    def run_all(configs, names, out_dir, sets, tag, signals=None):
        yield "a", "running", None
        yield "b", "running", None
        yield "a", "stopped", {"steps": 3, "tokens": 3 * 4 * 24, "params": 10, "tokens_per_s": 40.0,
                               "signal": "SIGTERM"}
        yield "b", "done", {"steps": 4, "tokens": 4 * 4 * 24, "params": 12, "tokens_per_s": 50.0, "val_ppl": 9.0}

    monkeypatch.setattr(compare, "run_all", run_all)
    assert recipe(tmp_path)["train"]["steps"] == 4
    assert _compare(tmp_path, "--concurrent") == 128 + signal.SIGTERM
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["status"] == {"a": "stopped", "b": "done"}
    assert [report["runs"][n]["planned_steps"] for n in "ab"] == [4, 4]
    table = compare_report.markdown_table(compare_report.result_rows(report))
    assert "| a | stopped: 3 of 4 steps |" in table
    assert "[1/2] a: stopped 3/4 steps" in capsys.readouterr().out
