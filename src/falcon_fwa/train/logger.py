"""Metrics to a JSONL file, TensorBoard (when installed) and Weights & Biases (optional); main rank only."""
from __future__ import annotations

import json
import os
from typing import Optional

from ..atomic import finite_or_none, naming, write_text


class MetricLogger:
    def __init__(self, out_dir: str, *, enabled: bool, tensorboard: bool, wandb_project: Optional[str],
                 config: dict):
        self.enabled = enabled
        self.tb = self.wandb = None
        if not enabled:
            return
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, "log.jsonl")
        self.file = open(self.path, "a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(os.path.join(out_dir, "tensorboard"))
            except ImportError:
                print("log.tensorboard: the tensorboard package is not installed; logging to JSONL only")
        if wandb_project:
            import wandb

            self.wandb = wandb.init(project=wandb_project, config=config, dir=out_dir, resume="allow")

    def drop_after(self, step: int, *, off_cadence: bool = False) -> None:
        """Forget the records of steps after ``step`` (a resumed run logs them again). With
        ``off_cadence``, also the training record of ``step`` itself: one that only a launch stopped
        at ``step`` wrote, where ``log.every`` writes none (the uninterrupted run has no such record)."""
        if not self.enabled:
            return
        path = self.path
        self.file.close()

        def stop_record(r: dict) -> bool:
            return off_cadence and r.get("step") == step and "loss" in r and "event" not in r

        kept = [r for r in read_log(path) if r.get("step", 0) <= step and not stop_record(r)]
        write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
        self.file = open(path, "a")

    def log(self, step: int, **metrics) -> None:
        """One record ``{"step": step, **metrics}``, strict JSON: a non-finite float (the loss of a
        diverged step) is written as ``null``, which every JSON reader takes (``NaN`` is Python's own
        extension, refused by jq and by strict parsers)."""
        if not self.enabled:
            return
        record = finite_or_none({"step": step, **metrics})
        with naming(self.path):  # a full disk: the error names log.jsonl
            self.file.write(json.dumps(record, allow_nan=False) + "\n")
            self.file.flush()
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                if self.tb is not None:
                    self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            with naming(self.path):  # what a failed write left in the buffer is written again
                self.file.close()
        finally:
            if self.tb is not None:
                self.tb.close()
            if self.wandb is not None:
                self.wandb.finish()


def read_log(path: str) -> list:
    """The records of a JSONL log. A last line that is cut short (the process died, or the disk
    filled, while writing it) is left out; a bad line before it is an error naming the file and line
    (a ``log.jsonl`` of something else in ``train.out_dir``, say)."""
    with open(path) as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for i, (n, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if i < len(lines) - 1 or line.endswith("\n"):
                raise ValueError(f"{path}:{n}: not a record of a training log; choose another train.out_dir "
                                 "if the file is not this run's") from None
            continue
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{n}: not a record of a training log (a {type(record).__name__}); choose "
                             "another train.out_dir if the file is not this run's")
        records.append(record)
    return records
