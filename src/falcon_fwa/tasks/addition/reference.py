"""Reference scores: what simple rules score on an evaluation set, to read the accuracies against.

A digit accuracy means little without a scale. Uniform guessing scores ``1/base`` of the
digits, and a rule can do much better without solving the task. :func:`short_carry_answer`
is such a rule. It reads every operand digit right, at every width, but takes the carry into
place ``k`` from the ``window`` places below it only, as if no carry came from further down::

    c = 0
    for j in k - window .. k - 1:   c = (a_j + b_j + c) >= base
    s_k = (a_k + b_k + c) mod base               (a_n = b_n = 0 for the final carry, k = n)

With ``window >= n`` it is the true sum. With ``window = 0`` it ignores every carry.
In binary a carry comes in at about half the places, so such rules score far more
digits than answers (:func:`reference_scores`).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Mapping, Sequence, Union

from .data import AdditionSample, to_digits

__all__ = ["short_carry_answer", "reference_scores", "REFERENCE_WINDOWS"]

REFERENCE_WINDOWS = (0, 1, 2, 3)
"""The carry windows :func:`reference_scores` reports by default."""


def _digits(x: int, n: int, base: int) -> List[int]:
    """The ``n`` digits of ``x`` in ``base``, least significant first."""
    return [int(c) for c in reversed(to_digits(x, n, base))]


def short_carry_answer(sample: AdditionSample, window: int) -> str:
    """The answer (``width + 1`` digits, least significant first, as :attr:`AdditionSample.answer`)
    of the rule that reads every operand digit right and takes the carry into place ``k`` from
    places ``k - window .. k - 1`` only. ``window >= width`` gives the true answer."""
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    n, base = sample.width, sample.base
    a, b = _digits(sample.a, n, base) + [0], _digits(sample.b, n, base) + [0]
    out = []
    for k in range(n + 1):
        c = 0
        for j in range(max(0, k - window), k):
            c = int(a[j] + b[j] + c >= base)
        out.append(str((a[k] + b[k] + c) % base))
    return "".join(out)


def reference_scores(samples: Union[Iterable[AdditionSample], Mapping[int, Sequence[AdditionSample]]],
                     windows: Sequence[int] = REFERENCE_WINDOWS) -> Dict[str, Dict[str, float]]:
    """Scores (percent, pooled over ``samples``) of uniform guessing and of :func:`short_carry_answer`
    at each carry window: ``{"uniform": {"digit": 100 / base, "exact": ...}, "carry_window_0": {"digit":
    ..., "exact": ...}, ...}``. Guessing's exact score is its expectation, ``base ** -(width + 1)``
    averaged over the samples. ``samples`` may also be a set by width, as :func:`.data.width_set` returns."""
    if isinstance(samples, Mapping):
        samples = [s for group in samples.values() for s in group]
    samples = list(samples)
    if not samples:
        raise ValueError("samples: empty")
    if not all(isinstance(s, AdditionSample) for s in samples):
        raise TypeError("samples: expected AdditionSample items (or a width_set dict of them)")
    n_digits = sum(s.width + 1 for s in samples)
    out = {"uniform": {
        "digit": 100.0 * sum((s.width + 1) / s.base for s in samples) / n_digits,
        "exact": 100.0 * sum(s.base ** -(s.width + 1) for s in samples) / len(samples)}}
    for w in windows:
        right = exact = 0
        for s in samples:
            hits = sum(p == t for p, t in zip(short_carry_answer(s, w), s.answer))
            right += hits
            exact += hits == s.width + 1
        out[f"carry_window_{w}"] = {"digit": 100.0 * right / n_digits, "exact": 100.0 * exact / len(samples)}
    return out
