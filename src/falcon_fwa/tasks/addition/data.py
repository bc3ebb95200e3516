"""Samples, tokenizer and batches for variable-length addition.

Format of a width-``n`` sample (character level, one token per character)::

    digits_n(a) "+" digits_n(b) "=" rev(digits_{n+1}(a+b)) "$"
    e.g. n=3, a=57, b=968:   "057+968=5201$"   (57 + 968 = 1025, reversed "5201")

The prompt is ``2n + 2`` tokens, the target suffix is the ``n + 1`` sum digits
(least significant first) and the end marker ``$``: ``3n + 4`` tokens in all.
Batches are right-padded with ``_``; a causal model's outputs at real positions
do not depend on later padding, so no attention mask is needed. The loss is the
next-token log-likelihood on the target suffix only (sum digits and end marker);
the accuracies are computed on the ``n + 1`` sum digits (:mod:`.metrics`).

Every sample comes from a :class:`random.Random` seeded by a string naming its
purpose (``"{seed}/train/{step}"``, ``"{seed}/eval/{width}"``), so data are
identical across machines, Python versions and resumed runs, and no files are
needed. Operands are uniform over ``[0, 10^n)`` (leading zeros allowed).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch

PAD, END, PLUS, EQUALS = "_", "$", "+", "="
VOCAB = PAD + END + "0123456789" + PLUS + EQUALS
"""Token ``i`` is the character ``VOCAB[i]``; the pad token is id 0."""
PAD_ID = 0
_ID = {c: i for i, c in enumerate(VOCAB)}


def encode(text: str) -> List[int]:
    """Character-level token ids of ``text`` (every character must be in :data:`VOCAB`)."""
    try:
        return [_ID[c] for c in text]
    except KeyError as e:
        raise ValueError(f"text: character {e.args[0]!r} is not in the vocabulary {VOCAB!r}") from None


def decode(ids: Sequence[int]) -> str:
    """Inverse of :func:`encode`."""
    return "".join(VOCAB[int(i)] for i in ids)


@dataclass(frozen=True)
class AdditionSample:
    """``a + b`` at digit width ``width`` (``0 <= a, b < 10**width``)."""

    a: int
    b: int
    width: int

    @property
    def prompt(self) -> str:
        n = self.width
        return f"{self.a:0{n}d}{PLUS}{self.b:0{n}d}{EQUALS}"

    @property
    def answer(self) -> str:
        """The ``width + 1`` sum digits, least significant first."""
        return f"{self.a + self.b:0{self.width + 1}d}"[::-1]

    @property
    def text(self) -> str:
        return self.prompt + self.answer + END


def make_sample(rng: random.Random, width: int) -> AdditionSample:
    """Draw ``a, b`` uniformly from ``[0, 10**width)``."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    return AdditionSample(rng.randrange(10**width), rng.randrange(10**width), width)


def check_text(text: str) -> bool:
    """Exact checker: is ``text`` a well-formed sample whose answer is the sum?

    Accepts ``"<n digits>+<n digits>=<n+1 digits reversed>"`` with or without the
    end marker; the sum is verified with Python's exact integers.
    """
    if text.endswith(END):
        text = text[:-1]
    try:
        left, answer = text.split(EQUALS)
        a, b = left.split(PLUS)
    except ValueError:
        return False
    n = len(a)
    if n < 1 or len(b) != n or len(answer) != n + 1:
        return False
    if not (a.isdigit() and b.isdigit() and answer.isdigit()):
        return False
    return int(a) + int(b) == int(answer[::-1])


@dataclass
class AdditionBatch:
    """Right-padded token ids and masks, all ``[B, T]`` on one device.

    ``loss_mask[b, t]`` is true where token ``t`` belongs to the target suffix (sum
    digits and end marker) and ``digit_mask[b, t]`` where it is a sum digit: the
    logits at position ``t - 1`` predict token ``t``. ``widths`` is ``[B]``.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    digit_mask: torch.Tensor
    widths: torch.Tensor

    def to(self, device) -> "AdditionBatch":
        return AdditionBatch(*(t.to(device, non_blocking=True) for t in
                               (self.input_ids, self.loss_mask, self.digit_mask, self.widths)))


def collate(samples: Sequence[AdditionSample]) -> AdditionBatch:
    """Encode and right-pad ``samples`` into one :class:`AdditionBatch`."""
    if not samples:
        raise ValueError("samples: empty batch")
    T = max(3 * s.width + 4 for s in samples)
    ids = torch.full((len(samples), T), PAD_ID, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), T, dtype=torch.bool)
    digit_mask = torch.zeros(len(samples), T, dtype=torch.bool)
    for i, s in enumerate(samples):
        tokens = encode(s.text)
        ids[i, : len(tokens)] = torch.tensor(tokens)
        start = 2 * s.width + 2  # first answer digit
        loss_mask[i, start : len(tokens)] = True
        digit_mask[i, start : start + s.width + 1] = True
    widths = torch.tensor([s.width for s in samples], dtype=torch.long)
    return AdditionBatch(ids, loss_mask, digit_mask, widths)


def training_batch(seed: int, step: int, batch_size: int, min_width: int = 1, max_width: int = 32) -> AdditionBatch:
    """The training batch of ``step``: widths uniform in ``[min_width, max_width]``."""
    rng = random.Random(f"{seed}/train/{step}")
    return collate([make_sample(rng, rng.randint(min_width, max_width)) for _ in range(batch_size)])


def width_set(seed: int, widths: Sequence[int], per_width: int) -> Dict[int, List[AdditionSample]]:
    """A fixed evaluation set: ``per_width`` samples for every width in ``widths``."""
    out = {}
    for w in widths:
        rng = random.Random(f"{seed}/eval/{w}")
        out[w] = [make_sample(rng, w) for _ in range(per_width)]
    return out
