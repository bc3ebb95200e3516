"""A recipe that fails during the calibration, in either mode: the step count is planned from the recipes that
calibrated, every recipe is trained, the broken one is recorded ``failed`` with its error in ``compare.json`` and
marked so in the report's table, and the command ends with status 1."""
import json

import pytest
import yaml

from falcon_fwa.train import compare, compare_report
from test_cli_journeys import compare_recipes

pytestmark = pytest.mark.usefixtures("one_thread")

DDP_ERROR = "train.strategy 'ddp' needs a process group"  # the trainer's refusal outside torchrun


def _compare_with_a_broken_recipe(tmp_path, *extra):
    """``falcon-fwa compare`` of ``a``, ``b`` (:func:`compare_recipes`) and ``broken``, ``b``'s file with
    ``train.strategy: ddp``, into ``tmp_path/cmp``. That recipe loads (``compare`` checks every recipe's fields
    before it starts) but its trainer refuses to start in a process launched without torchrun."""
    import argparse

    paths = compare_recipes(tmp_path)
    with open(paths[1]) as f:
        raw = yaml.safe_load(f)
    raw["train"]["strategy"] = "ddp"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(raw))
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    return compare.run(parser.parse_args(["--configs", *paths, str(broken), "--names", "a", "b", "broken",
                                          "--out", str(tmp_path / "cmp"), *extra]))


@pytest.mark.parametrize("mode", [["--concurrent"], []], ids=["concurrent", "sequential"])
def test_a_recipe_that_fails_its_calibration_is_recorded_failed_and_the_others_train(tmp_path, capsys, mode):
    """Lineup a, b, broken with ``--time-budget`` (so calibrated first): a and b calibrate and train the planned 4
    steps (``--max-steps``), broken fails its calibration and its run and is ``failed`` with the trainer's
    refusal in ``compare.json`` (``--concurrent``: in the run's ``stdout_tail``, its ``error`` the exit code)
    and in the table, listed as out of the comparison; the comparison is finished and the command ends with 1.
    With ``--concurrent`` the broken recipe used to end the command at calibration ("calibration failed"),
    every recipe left pending, as the sequential runs never did."""
    code = _compare_with_a_broken_recipe(tmp_path, *mode, "--time-budget", "5", "--calib-steps", "3",
                                         "--max-steps", "4")
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert code == 1
    assert report["status"] == {"a": "done", "b": "done", "broken": "failed"} and report["finished"] is True
    assert report["steps"] == 4 and [report["runs"][n]["steps"] for n in ("a", "b")] == [4, 4]
    calib = report["calibration"]
    assert all(calib[n].get("tokens_per_s", 0) > 0 for n in ("a", "b")) and "tokens_per_s" not in calib["broken"]
    run = report["runs"]["broken"]
    if mode:  # the launched run's error is its exit code, its output holds the refusal
        assert run["error"].startswith("exit code ") and DDP_ERROR in run["stdout_tail"]
        assert DDP_ERROR in calib["broken"]["stdout_tail"]
    else:
        assert DDP_ERROR in run["error"] and DDP_ERROR in calib["broken"]["error"]
    table = compare_report.markdown_table(compare_report.result_rows(report))
    assert f"| broken | failed: {run['error'][:80]} |" in table
    assert "Not in the comparison (fewer or no tokens trained): broken." in table
    printed = capsys.readouterr()
    assert "failed: broken" in printed.err
    assert ("calibration failed for broken" if mode else f"calibrated broken: ValueError: {DDP_ERROR}") in printed.out

