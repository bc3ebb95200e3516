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
    refusal in ``compare.json`` (``--concurrent``: its ``error`` the exit code and the message the run printed,
    the very text of the refusal raised in this process, as the sequential ``error`` holds it after the type;
    the run's output in ``stdout_tail``) and in the table, listed as out of the comparison; the comparison is
    finished and the command ends with 1. With ``--concurrent`` the broken recipe used to end the command at
    calibration ("calibration failed"), every recipe left pending, as the sequential runs never did, and its
    ``error`` was only ``exit code 2``, the table's cell too."""
    from falcon_fwa.train import distributed

    with pytest.raises(ValueError) as refusal:  # the trainer's refusal, raised here as in a sequential run
        distributed.setup("ddp")
    message = str(refusal.value)
    assert DDP_ERROR in message
    code = _compare_with_a_broken_recipe(tmp_path, *mode, "--time-budget", "5", "--calib-steps", "3",
                                         "--max-steps", "4")
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert code == 1
    assert report["status"] == {"a": "done", "b": "done", "broken": "failed"} and report["finished"] is True
    assert report["steps"] == 4 and [report["runs"][n]["steps"] for n in ("a", "b")] == [4, 4]
    calib = report["calibration"]
    assert all(calib[n].get("tokens_per_s", 0) > 0 for n in ("a", "b")) and "tokens_per_s" not in calib["broken"]
    run = report["runs"]["broken"]
    if mode:  # the launched run's error is its exit code (the CLI's 2) and the refusal it printed
        assert run["error"] == calib["broken"]["error"] == f"exit code 2: {message}"
        assert DDP_ERROR in run["stdout_tail"] and DDP_ERROR in calib["broken"]["stdout_tail"]
    else:
        assert run["error"] == calib["broken"]["error"] == f"ValueError: {message}"
    table = compare_report.markdown_table(compare_report.result_rows(report))
    assert f"| broken | failed: {run['error'][:80]} |" in table
    assert DDP_ERROR[:40] in run["error"][:80]  # the cause, in the table's cell
    assert "Not in the comparison (fewer or no tokens trained): broken." in table
    printed = capsys.readouterr()
    assert "failed: broken" in printed.err
    assert ("calibration failed for broken" if mode else f"calibrated broken: ValueError: {DDP_ERROR}") in printed.out



def test_the_printed_error_of_a_launched_run_is_the_cli_message_else_the_tracebacks_last_line():
    """What a ``--concurrent`` run's ``error`` takes from its output, on hand-written outputs: the last
    ``falcon-fwa train: error:`` message (a message of two lines whole, without the ``(raised at ...)`` line),
    else the last line of the last traceback, else nothing."""
    cli = ("step 1 loss 5.0\nfalcon-fwa train: error: first\n  (raised at x.py:1; FALCON_FWA_TRACEBACK=1 shows the "
           "traceback)\nfalcon-fwa train: error: two\nlines\n  (raised at y.py:2; FALCON_FWA_TRACEBACK=1 shows the "
           "traceback)\n")
    assert compare.printed_error(cli) == "two\nlines"
    tb = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    f()\nKeyError: 'x'\n\n"
          "During handling of the above exception, another exception occurred:\n\n"
          "Traceback (most recent call last):\n  File \"a.py\", line 3, in <module>\n    g()\n"
          "RuntimeError: loss is nan\n")
    assert compare.printed_error(tb) == "RuntimeError: loss is nan"
    assert compare.printed_error("step 1 loss 5.0\nKilled\n") is None
