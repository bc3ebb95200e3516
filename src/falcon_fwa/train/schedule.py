"""Learning-rate schedule: linear warmup, then cosine decay.

lr(s) = lr_peak * (s + 1) / warmup                                   for s < warmup
lr(s) = lr_peak * (r + (1 - r) * (1 + cos(pi * p)) / 2),  p = (s - warmup) / (steps - warmup)
with r = min_lr_ratio. A pure function of the step: resuming needs only the step.
"""
from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based), by the formula above."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def set_lr(optimizer, base_lr: float) -> None:
    """Every param group runs at ``base_lr * group['lr_multiplier']`` (the model's muP multiplier)."""
    for group in optimizer.param_groups:
        group["lr"] = base_lr * group.get("lr_multiplier", 1.0)
