"""Teacher-forced accuracy on the target suffix.

The model reads the whole gold sequence once; the prediction for token ``t`` is
``argmax logits[t - 1]``. On the ``n + 1`` sum digits of each sample we count

* **digit accuracy**: the fraction of sum digits predicted correctly (pooled over
  all digits of all samples of the group);
* **exact-match accuracy**: the fraction of samples whose ``n + 1`` sum digits are
  all predicted correctly.

Both are teacher-forced (each digit is predicted from the gold prefix), as in the
paper's Table 3. The end marker is trained but not scored.

For diagnosis, :func:`position_hits` also scores each **answer position** ``k``
(``k = 0`` the units digit, ``k = n`` the final carry). On sums longer than the training
widths, where the errors sit shows what carried over: a look-up tied to the width fails
at every position, one tied to the trained positions fails past them, and a rule that
does not depend on the width fails nowhere.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from .data import AdditionBatch


def _digit_hits(pred_ids: torch.Tensor, batch: AdditionBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(hits, mask)``, both ``[B, T - 1]`` bool: where a sum digit is predicted right, and
    where the sum digits are (token ``t + 1`` of the text)."""
    target = batch.input_ids[:, 1:]
    mask = batch.digit_mask[:, 1:]
    B, T = batch.input_ids.shape
    # [B, T - 1], or [B, T] with the prediction after the last token: any other width is misaligned
    if pred_ids.dim() != 2 or pred_ids.shape[0] != B or pred_ids.shape[1] not in (T - 1, T):
        raise ValueError(f"pred_ids: shape {tuple(pred_ids.shape)} does not fit input_ids {(B, T)}: "
                         f"give [{B}, {T - 1}] or [{B}, {T}]")
    return (pred_ids[:, : T - 1] == target) & mask, mask


def score_predictions(pred_ids: torch.Tensor, batch: AdditionBatch) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-sample hits from predicted next tokens.

    ``pred_ids[b, t]`` is the model's prediction for token ``t + 1`` (``[B, T - 1]``
    or ``[B, T]``; a trailing column is ignored, any other shape refused). Returns ``(correct, total)``, both
    ``[B]`` long: the number of correctly predicted sum digits and the number of sum
    digits (``width + 1``).
    """
    hits, mask = _digit_hits(pred_ids, batch)
    return hits.sum(1), mask.sum(1)


def position_hits(pred_ids: torch.Tensor, batch: AdditionBatch) -> torch.Tensor:
    """Hits by answer position: ``[B, P]`` long, ``P = max(width) + 1``; entry ``[b, k]`` is
    1 when sample ``b``'s sum digit ``k`` (``k = 0`` the units digit, the first one written)
    is predicted correctly, 0 otherwise and past the sample's ``width + 1`` digits.
    ``pred_ids`` as in :func:`score_predictions`."""
    hits, mask = _digit_hits(pred_ids, batch)
    k = (mask.long().cumsum(1) - 1).clamp(min=0)  # answer position of each masked token
    out = torch.zeros(hits.shape[0], int(batch.widths.max()) + 1, dtype=torch.long, device=hits.device)
    return out.scatter_add_(1, k, hits.long())


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
    """Accumulates hits per digit width (and, when given, per answer position); reports
    accuracies in percent."""

    counts: Dict[int, _Count] = field(default_factory=dict)
    positions: Dict[int, List[int]] = field(default_factory=dict)  # width -> hits at answer positions 0..width
    position_samples: Dict[int, int] = field(default_factory=dict)  # width -> samples added with positions

    def add(self, widths: torch.Tensor, correct: torch.Tensor, total: torch.Tensor,
            positions: Optional[torch.Tensor] = None) -> None:
        """Add a batch: ``correct``, ``total`` from :func:`score_predictions` and optionally
        ``positions`` from :func:`position_hits`."""
        for w, c, t in zip(widths.tolist(), correct.tolist(), total.tolist()):
            n = self.counts.setdefault(int(w), _Count())
            n.digits_correct += c
            n.digits += t
            n.samples_correct += int(c == t)
            n.samples += 1
        if positions is not None:
            for w, row in zip(widths.tolist(), positions.tolist()):
                acc = self.positions.setdefault(int(w), [0] * (int(w) + 1))
                for k in range(int(w) + 1):
                    acc[k] += row[k]
                self.position_samples[int(w)] = self.position_samples.get(int(w), 0) + 1

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

    def per_position(self) -> Dict[int, List[float]]:
        """``{width: [digit accuracy at answer position k for k = 0..width]}`` for every width
        whose batches came with ``positions``."""
        return {w: [100.0 * h / self.position_samples[w] for h in hits]
                for w, hits in sorted(self.positions.items())}

    def per_width(self) -> Dict[int, Dict[str, float]]:
        """``{width: {"digit": acc, "exact": acc}}`` for every width seen."""
        return {w: {"digit": self.digit_acc([w]), "exact": self.exact_acc([w])} for w in sorted(self.counts)}
