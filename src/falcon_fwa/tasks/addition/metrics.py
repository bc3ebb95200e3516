"""Teacher-forced accuracy on the target suffix.

The model reads the whole gold sequence once; the prediction for token ``t`` is
``argmax logits[t - 1]``. On the ``n + 1`` sum digits of each sample we count

* **digit accuracy**: the fraction of sum digits predicted correctly (pooled over
  all digits of all samples of the group);
* **exact-match accuracy**: the fraction of samples whose ``n + 1`` sum digits are
  all predicted correctly.

Both are teacher-forced (each digit is predicted from the gold prefix), as in the
paper's Table 3. The end marker is trained but not scored.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, Tuple

import torch

from .data import AdditionBatch


def score_predictions(pred_ids: torch.Tensor, batch: AdditionBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sample hits from predicted next tokens.

    ``pred_ids[b, t]`` is the model's prediction for token ``t + 1`` (``[B, T - 1]``
    or ``[B, T]``; a trailing column is ignored). Returns ``(correct, total)``, both
    ``[B]`` long: the number of correctly predicted sum digits and the number of sum
    digits (``width + 1``).
    """
    target = batch.input_ids[:, 1:]
    mask = batch.digit_mask[:, 1:]
    pred = pred_ids[:, : target.shape[1]]
    if pred.shape != target.shape:
        raise ValueError(f"pred_ids: shape {tuple(pred_ids.shape)} does not fit input_ids {tuple(batch.input_ids.shape)}")
    hits = (pred == target) & mask
    return hits.sum(1), mask.sum(1)


def score_logits(logits: torch.Tensor, batch: AdditionBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`score_predictions` on ``argmax`` of ``logits`` ``[B, T, vocab]``."""
    return score_predictions(logits.argmax(-1), batch)


@dataclass
class _Count:
    digits_correct: int = 0
    digits: int = 0
    samples_correct: int = 0
    samples: int = 0


@dataclass
class AccuracyTally:
    """Accumulates hits per digit width; reports accuracies in percent."""

    counts: Dict[int, _Count] = field(default_factory=dict)

    def add(self, widths: torch.Tensor, correct: torch.Tensor, total: torch.Tensor) -> None:
        for w, c, t in zip(widths.tolist(), correct.tolist(), total.tolist()):
            n = self.counts.setdefault(int(w), _Count())
            n.digits_correct += c
            n.digits += t
            n.samples_correct += int(c == t)
            n.samples += 1

    def _pooled(self, widths: Iterable[int]) -> _Count:
        out = _Count()
        for w in widths:
            n = self.counts[w]
            out.digits_correct += n.digits_correct
            out.digits += n.digits
            out.samples_correct += n.samples_correct
            out.samples += n.samples
        return out

    def digit_acc(self, widths: Iterable[int]) -> float:
        """Pooled digit accuracy over ``widths``."""
        n = self._pooled(widths)
        return 100.0 * n.digits_correct / max(n.digits, 1)

    def exact_acc(self, widths: Iterable[int]) -> float:
        """Pooled exact-match accuracy over ``widths``."""
        n = self._pooled(widths)
        return 100.0 * n.samples_correct / max(n.samples, 1)

    def per_width(self) -> Dict[int, Dict[str, float]]:
        """``{width: {"digit": acc, "exact": acc}}`` for every width seen."""
        return {w: {"digit": self.digit_acc([w]), "exact": self.exact_acc([w])} for w in sorted(self.counts)}
