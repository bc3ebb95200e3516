"""More crash-safety checks: a file written through :func:`falcon_fwa.atomic.atomic_path` by a writer that
only knows its path (matplotlib's ``savefig``) is flushed to disk before it is renamed into place, and a
results JSON holding a non-finite number (a diverged validation loss) is strict JSON, as ``log.jsonl`` is."""
import json
import os

import pytest

from falcon_fwa import atomic

from test_train import recipe


def strict_load(path):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    with open(path) as f:
        return json.load(f, parse_constant=refuse)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd (Linux)")
def test_a_file_written_by_path_is_flushed_to_disk_before_its_rename(tmp_path, monkeypatch):
    """The plots (``loss.png``, the comparison plots) are written by ``fig.savefig(tmp)``, which closes the file
    without an fsync: ``atomic_path`` must flush it itself, or a power loss after the rename leaves an empty or
    partial file where the previous version was."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        events.append(("replace", os.path.realpath(src)))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(atomic.os, "fsync", fsync)
    monkeypatch.setattr(atomic.os, "replace", replace)
    target = tmp_path / "plot.png"
    with atomic.atomic_path(target) as tmp:
        with open(tmp, "wb") as f:  # as savefig writes it
            f.write(b"\x89PNG...")
        tmp = os.path.realpath(tmp)
    assert target.read_bytes() == b"\x89PNG..."
    assert ("replace", tmp) in events
    assert ("fsync", tmp) in events[:events.index(("replace", tmp))], events


def test_a_non_finite_validation_loss_leaves_summary_json_strict(tmp_path):
    """The weights a last step leaves may give a non-finite validation loss (the training loss checked is that of
    the step's weights before the update): ``log.jsonl`` writes it as null; ``summary.json`` must too, not
    ``NaN``, which jq and strict JSON parsers refuse."""
    import torch

    from falcon_fwa.train import Trainer, config_from_dict

    raw = recipe(tmp_path, "run", steps=2)
    trainer = Trainer(config_from_dict(raw))
    head = trainer.core.model  # its output: the logits (test_train)
    # the evaluation only (the model in eval mode) diverges: training steps stay finite
    head.register_forward_hook(lambda module, args, out: out if module.training else out * float("nan"))
    try:
        trainer.train()
    finally:
        trainer.close()
    summary = strict_load(tmp_path / "run" / "summary.json")
    assert summary["steps"] == 2 and summary["val_loss"] is None and summary["val_ppl"] is None
    assert torch.isfinite(torch.tensor(summary["tokens"], dtype=torch.float64))
