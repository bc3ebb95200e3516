"""A paper name is that model, whichever options restate its definition: docs/addition.md says "A paper name is
that model. ``--rule``, ``--window``, ``--qk-norm``, ``--gate`` (and ``--lambda-scale``) may only restate its
definition (``--model Falcon-3A.3 --rule 3a``)". A run so named is recorded as the paper's model, so the same
command without the restating option (or ``addition-compare``, which names the model alone) resumes it, and the
other way round."""
import json

import pytest
import torch

from falcon_fwa.tasks.addition import cli, compare
from falcon_fwa.tasks.addition.lineup import LINEUP

SMALL = ["--preset", "tiny", "--device", "cpu", "--batch-size", "4", "--val-per-width", "2", "--ood-per-width", "2",
         "--train-widths", "1", "3", "--ood-widths", "4", "5", "--threads", "1", "--hidden-size", "16",
         "--num-hidden-layers", "1", "--num-heads", "2", "--eval-every", "1", "--no-progress"]

# each paper name with an option that restates its definition (the lineup table of lineup.py: Falcon-3A.3 is rule
# 3A with the config's window, 4; Mamba-2 and RetNet are the mamba2 and retnet mixers, whose rule is 1A)
RESTATED = [("Falcon-3A.3", ["--window", "4"]), ("Mamba-2", ["--rule", "1a"]), ("RetNet", ["--rule", "1A"])]


@pytest.mark.parametrize("model,restate", RESTATED)
def test_a_restated_paper_name_is_recorded_and_resumed_as_that_model(tmp_path, model, restate):
    out = tmp_path / "run"
    assert cli.main(["--model", model, *restate, "--steps", "1", "--out", str(out), *SMALL]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["config_fields"] == LINEUP[model]
    assert torch.load(out / "best.pt", weights_only=False)["config_fields"] == LINEUP[model]
    # the same model named alone continues it, and the restating command continues that in turn
    assert cli.main(["--model", model, "--steps", "2", "--out", str(out), *SMALL]) == 0
    assert cli.main(["--model", model, *restate, "--steps", "3", "--out", str(out), *SMALL]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["finished"] and [h["step"] for h in res["history"]] == [1, 2, 3]


def _record_fields(run_dir, fields):
    """Rewrite the run's record (results.json and the checkpoint's copy) to hold ``fields``, as a run trained
    with a restating option by an earlier version recorded them."""
    res = json.loads((run_dir / "results.json").read_text())
    res["config_fields"] = fields
    (run_dir / "results.json").write_text(json.dumps(res))
    ckpt = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    ckpt["results"]["config_fields"] = fields
    torch.save(ckpt, run_dir / "checkpoint.pt")


def test_a_run_recorded_with_restated_fields_resumes_and_is_summarized(tmp_path):
    runs = tmp_path / "runs"
    run_dir = runs / "Falcon-3A.3" / "seed0"
    assert cli.main(["--model", "Falcon-3A.3", "--steps", "1", "--out", str(run_dir), *SMALL]) == 0
    _record_fields(run_dir, {**LINEUP["Falcon-3A.3"], "window": 4})
    assert cli.main(["--model", "Falcon-3A.3", "--steps", "2", "--out", str(run_dir), *SMALL]) == 0
    assert json.loads((run_dir / "results.json").read_text())["steps_done"] == 2
    _record_fields(run_dir, {**LINEUP["Falcon-3A.3"], "window": 4})
    assert compare.main(["--models", "Falcon-3A.3", "--seeds", "0", "--steps", "2", "--no-train", "--runs",
                         str(runs), "--results", str(tmp_path / "res"), "--name", "t", *SMALL[:-1]]) == 0
    rows = json.loads((tmp_path / "res" / "t.json").read_text())
    assert [r["model"] for r in rows] == ["Falcon-3A.3"] and rows[0]["seeds"] == [0]
    # a field the paper's model does not have is another model still: refused, naming --model
    _record_fields(run_dir, {**LINEUP["Falcon-3A.3"], "window": 8})
    with pytest.raises(ValueError, match=r"^--model: .* holds a run of Falcon-3A\.3 .*'window': 8"):
        cli.main(["--model", "Falcon-3A.3", "--steps", "3", "--out", str(run_dir), *SMALL])
