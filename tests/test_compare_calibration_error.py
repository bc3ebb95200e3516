"""A calibration that measures no recipe ends ``falcon-fwa compare`` as the CLI ends a refused command: one
``falcon-fwa compare: error:`` message naming each recipe's error briefly, exit status 2, no traceback, with
``compare.json`` holding every recipe's calibration error. It used to end in a raw ``RuntimeError`` traceback
after the recipes' own errors."""
import json

import pytest
import yaml

from falcon_fwa.train import compare
from test_cli_journeys import compare_recipes

pytestmark = pytest.mark.usefixtures("one_thread")

DDP_ERROR = "train.strategy 'ddp' needs a process group"  # the trainer's refusal outside torchrun


@pytest.mark.parametrize("mode", [["--concurrent"], []], ids=["concurrent", "sequential"])
def test_a_calibration_that_measures_no_recipe_is_a_one_line_error(tmp_path, capsys, mode):
    """Both recipes (a and b with ``train.strategy: ddp``) fail their calibration: the command ends with 2 and
    one error line that names both recipes with the trainer's refusal; nothing trains."""
    paths = compare_recipes(tmp_path)
    for path in paths:
        raw = yaml.safe_load(open(path))
        raw["train"]["strategy"] = "ddp"
        with open(path, "w") as f:
            yaml.safe_dump(raw, f)
    out = tmp_path / "cmp"
    code = compare.main(["--configs", *paths, "--names", "a", "b", "--out", str(out), *mode,
                         "--time-budget", "5", "--calib-steps", "3"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("falcon-fwa compare: error:")]
    assert len(errors) == 1, err
    line = errors[0]
    assert "calibration measured no recipe" in line
    assert line.index("a: ") < line.index(DDP_ERROR) < line.index("b: ") < line.rindex(DDP_ERROR)
    report = json.loads((out / "compare.json").read_text())
    assert set(report["calibration"]) == {"a", "b"}
    assert all(DDP_ERROR in report["calibration"][n]["error"] for n in ("a", "b"))
    assert report["error"] in line and report["runs"] == {}
    assert not (out / "main").exists()
