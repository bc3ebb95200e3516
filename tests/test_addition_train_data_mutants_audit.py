"""Pins how a resumed addition run treats ``best.pt`` (:mod:`falcon_fwa.tasks.addition.train`).

* ``best.pt`` counts as holding a step only when both its step and its run id match: a ``best.pt`` that
  another run (``--no-resume``) left at the same step is not taken for this run's.
* A relaunch rewrites ``best.pt`` from the checkpoint only when the checkpoint's step is the best one; where
  the best step is an earlier one, the checkpoint's weights are not those of the best step and nothing is
  written under its name.
"""
import torch
from test_addition_training_mutants import _tiny_transformer_run

from falcon_fwa.tasks.addition import train


def test_best_pt_holds_a_step_only_for_the_run_that_wrote_it(tmp_path):
    best = tmp_path / "best.pt"
    torch.save({"model": {}, "step": 4, "run_id": "a"}, best)
    assert train._holds(best, 4, "a")
    assert not train._holds(best, 4, "b")  # same step, another run's weights
    assert not train._holds(best, 3, "a")
    assert not train._holds(tmp_path / "missing.pt", 4, "a")


def test_a_relaunch_writes_no_best_pt_from_a_checkpoint_past_the_best_step(tmp_path, monkeypatch):
    """Scripted validation accuracies 10, 30, 20: the best step is 2, the checkpoint at step 3. With best.pt
    gone, a relaunch of the finished run has no weights of step 2 to write, and writes none."""
    script = iter([10.0, 30.0, 20.0])
    real_summary = train._summary
    monkeypatch.setattr(train, "_summary", lambda *a: {**real_summary(*a), "val_acc": next(script)})
    out = _tiny_transformer_run(tmp_path, steps=3, eval_every=1, val_per_width=2, train_widths=(1, 3))
    assert torch.load(out / "best.pt", weights_only=False)["step"] == 2
    (out / "best.pt").unlink()
    _tiny_transformer_run(tmp_path, steps=3, eval_every=1, val_per_width=2, train_widths=(1, 3))
    assert not (out / "best.pt").exists()
