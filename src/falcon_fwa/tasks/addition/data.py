"""Samples, tokenizer and batches for variable-length addition.

Format of a width-``n`` sample (character level, one token per character)::

    digits_n(a) "+" digits_n(b) "=" rev(digits_{n+1}(a+b)) "$"
    e.g. n=3, a=57, b=968:   "057+968=5201$"   (57 + 968 = 1025, reversed "5201")

The operand order (:data:`OPERAND_ORDERS`) says how the operands are written: ``"msd"``
(the paper's) most significant digit first, as above; ``"lsd"`` least significant digit
first, like the sum: ``rev(digits_n(a)) "+" rev(digits_n(b)) "=" ...``, e.g.
``"750+869=5201$"``. The answer, the loss and the metrics do not depend on it.

The base (:data:`BASES`, default 10) is the radix the numbers are written in: ``base=2``
writes them in binary, as in Kaiser and Sutskever's Neural GPU tasks, e.g. n=3, a=5, b=3:
``"101+011=0001$"`` (5 + 3 = 8 = 1000 in binary, reversed "0001"). The vocabulary is the
same for every base; a base-``b`` sample uses the digits ``0 .. b-1`` only, so a model that
guesses uniformly among them scores ``1/b`` of the digits.

The prompt is ``2n + 2`` tokens, the target suffix is the ``n + 1`` sum digits
(least significant first) and the end marker ``$``: ``3n + 4`` tokens in all.
Batches are right-padded with ``_``; a causal model's outputs at real positions
do not depend on later padding, so no attention mask is needed. The loss is the
next-token log-likelihood on the target suffix only (sum digits and end marker);
the accuracies are computed on the ``n + 1`` sum digits (:mod:`.metrics`).

Every batch also carries each token's *digit index* (:func:`digit_index`): the place of a
digit in its number, 1 for the units, and 0 for ``+``, ``=``, ``$`` and padding. With the
task option ``abacus_offset`` (None by default, the paper's setting) the model adds a learned
embedding of that index to each token's (per-number digit positions, the "Abacus" embeddings of
McLeish et al., 2024), and every training sample shifts its indices by a random offset in
``[0, abacus_offset]`` (:func:`training_batch`; evaluation uses none), so that the indices of
widths longer than the training ones are trained too.

Every sample comes from a :class:`random.Random` seeded by a string naming its
purpose (``"{seed}/train/{step}"``, ``"{seed}/eval/{width}"``), so data are
identical across machines, Python versions and resumed runs, and no files are
needed. Operands are uniform over ``[0, base^n)`` (leading zeros allowed).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ...ops.validate import check_positive_int

PAD, END, PLUS, EQUALS = "_", "$", "+", "="
VOCAB = PAD + END + "0123456789" + PLUS + EQUALS
"""Token ``i`` is the character ``VOCAB[i]``; the pad token is id 0."""
PAD_ID = 0
_ID = {c: i for i, c in enumerate(VOCAB)}
OPERAND_ORDERS = ("msd", "lsd")
"""How operands are written: most (the paper's) or least significant digit first."""
BASES = tuple(range(2, 11))
"""The radixes numbers can be written in (the vocabulary holds the digits 0-9)."""


def check_operand_order(operand_order: str) -> str:
    """``operand_order`` if it is one of :data:`OPERAND_ORDERS`, else a ``ValueError``."""
    if operand_order not in OPERAND_ORDERS:
        raise ValueError(f"operand_order must be 'msd' or 'lsd', got {operand_order!r}")
    return operand_order


def check_base(base: int) -> int:
    """``base`` if it is one of :data:`BASES` (an ``int`` in 2..10), else a ``ValueError``."""
    if isinstance(base, bool) or not isinstance(base, int) or base not in BASES:
        raise ValueError(f"base must be an integer in 2..10, got {base!r}")
    return base


def to_digits(x: int, width: int, base: int = 10) -> str:
    """``x`` written with exactly ``width`` digits in ``base``, most significant first
    (``ValueError`` if it needs more)."""
    out = []
    for _ in range(width):
        x, d = divmod(x, base)
        out.append(VOCAB[2 + d])  # the digits sit at ids 2..11
    if x:
        raise ValueError(f"x: does not fit in {width} base-{base} digits")
    return "".join(reversed(out))


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
    """``a + b`` at digit width ``width`` (an integer ``>= 1``; ``0 <= a, b < base**width``, else a
    ``ValueError`` naming the field), written in ``base`` (:data:`BASES`), operands in
    ``operand_order`` (:data:`OPERAND_ORDERS`)."""

    a: int
    b: int
    width: int
    operand_order: str = "msd"
    base: int = 10

    def __post_init__(self) -> None:
        check_operand_order(self.operand_order)
        check_base(self.base)
        check_positive_int("width", self.width)
        for name in ("a", "b"):  # an operand of n digits: a wider one has no n-digit text, a negative one none
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < self.base ** self.width:
                raise ValueError(f"{name} must be an integer that fits in {self.width} base-{self.base} digits "
                                 f"(0 <= {name} < {self.base}**{self.width}), got {x!r}")

    @property
    def prompt(self) -> str:
        n = self.width
        a, b = to_digits(self.a, n, self.base), to_digits(self.b, n, self.base)
        if self.operand_order == "lsd":
            a, b = a[::-1], b[::-1]
        return f"{a}{PLUS}{b}{EQUALS}"

    @property
    def answer(self) -> str:
        """The ``width + 1`` sum digits, least significant first."""
        return to_digits(self.a + self.b, self.width + 1, self.base)[::-1]

    @property
    def text(self) -> str:
        return self.prompt + self.answer + END


def make_sample(rng: random.Random, width: int, *, operand_order: str = "msd", base: int = 10) -> AdditionSample:
    """Draw ``a, b`` uniformly from ``[0, base**width)``."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    check_base(base)
    return AdditionSample(rng.randrange(base**width), rng.randrange(base**width), width, operand_order, base)


def check_text(text: str, operand_order: str = "msd", base: int = 10) -> bool:
    """Exact checker: is ``text`` a well-formed sample whose answer is the sum?

    Accepts ``"<n digits>+<n digits>=<n+1 digits reversed>"`` with or without the
    end marker, every digit below ``base``, the operands read in ``operand_order``
    (``"lsd"``: reversed); the sum is verified with Python's exact integers.
    """
    check_operand_order(operand_order)
    check_base(base)
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
    digits = "0123456789"[:base]
    if not all(c in digits for c in a + b + answer):
        return False
    if operand_order == "lsd":
        a, b = a[::-1], b[::-1]
    return int(a, base) + int(b, base) == int(answer[::-1], base)


def digit_index(sample: AdditionSample) -> List[int]:
    """The digit index of every token of ``sample.text`` (``3n + 4`` of them): the place of a
    digit in its number, 1 for the units, ``n`` for the operands' leading digit and ``n + 1`` for
    the sum's last; 0 for ``+``, ``=`` and ``$``. E.g. ``"057+968=5201$"``:
    ``[3, 2, 1, 0, 3, 2, 1, 0, 1, 2, 3, 4, 0]``."""
    n = sample.width
    operand = list(range(n, 0, -1)) if sample.operand_order == "msd" else list(range(1, n + 1))
    return operand + [0] + operand + [0] + list(range(1, n + 2)) + [0]


def check_abacus_offset(abacus_offset) -> None:
    """``None`` or an ``int >= 0``, else a ``ValueError`` naming ``abacus_offset``."""
    if abacus_offset is not None and (isinstance(abacus_offset, bool) or not isinstance(abacus_offset, int)
                                      or abacus_offset < 0):
        raise ValueError(f"abacus_offset must be None or an integer >= 0, got {abacus_offset!r}")


@dataclass
class AdditionBatch:
    """Right-padded token ids and masks, all ``[B, T]`` on one device.

    ``loss_mask[b, t]`` is true where token ``t`` belongs to the target suffix (sum
    digits and end marker) and ``digit_mask[b, t]`` where it is a sum digit: the
    logits at position ``t - 1`` predict token ``t``. ``widths`` is ``[B]``.
    ``digit_index`` is each token's :func:`digit_index` (plus the sample's offset, on digits
    only; 0 on padding).
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    digit_mask: torch.Tensor
    widths: torch.Tensor
    digit_index: torch.Tensor

    def to(self, device) -> "AdditionBatch":
        return AdditionBatch(*(t.to(device, non_blocking=True) for t in
                               (self.input_ids, self.loss_mask, self.digit_mask, self.widths, self.digit_index)))


def collate(samples: Sequence[AdditionSample], offsets: Optional[Sequence[int]] = None) -> AdditionBatch:
    """Encode and right-pad ``samples`` into one :class:`AdditionBatch`; ``offsets`` (one per
    sample, default 0) are added to the digit indices of that sample's digits."""
    if not samples:
        raise ValueError("samples: empty batch")
    if offsets is not None and len(offsets) != len(samples):
        raise ValueError(f"offsets: {len(offsets)} for {len(samples)} samples")
    T = max(3 * s.width + 4 for s in samples)
    ids = torch.full((len(samples), T), PAD_ID, dtype=torch.long)
    index = torch.zeros(len(samples), T, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), T, dtype=torch.bool)
    digit_mask = torch.zeros(len(samples), T, dtype=torch.bool)
    for i, s in enumerate(samples):
        tokens = encode(s.text)
        ids[i, : len(tokens)] = torch.tensor(tokens)
        places = torch.tensor(digit_index(s))
        index[i, : len(tokens)] = places + (offsets[i] if offsets is not None else 0) * (places > 0)
        start = 2 * s.width + 2  # first answer digit
        loss_mask[i, start : len(tokens)] = True
        digit_mask[i, start : start + s.width + 1] = True
    widths = torch.tensor([s.width for s in samples], dtype=torch.long)
    return AdditionBatch(ids, loss_mask, digit_mask, widths, index)


def training_batch(seed: int, step: int, batch_size: int, min_width: int = 1, max_width: int = 32, *,
                   operand_order: str = "msd", base: int = 10, abacus_offset: Optional[int] = None) -> AdditionBatch:
    """The training batch of ``step``: widths uniform in ``[min_width, max_width]``; the same
    sums in either ``operand_order``. With ``abacus_offset`` every sample's digit indices are
    shifted by an offset uniform in ``[0, abacus_offset]``, drawn from a stream of its own
    (the sums do not depend on it)."""
    check_abacus_offset(abacus_offset)
    rng = random.Random(f"{seed}/train/{step}")
    samples = [make_sample(rng, rng.randint(min_width, max_width), operand_order=operand_order, base=base)
               for _ in range(batch_size)]
    offsets = None
    if abacus_offset:
        shift = random.Random(f"{seed}/abacus/{step}")
        offsets = [shift.randint(0, abacus_offset) for _ in samples]
    return collate(samples, offsets)


def width_set(seed: int, widths: Sequence[int], per_width: int, *,
              operand_order: str = "msd", base: int = 10) -> Dict[int, List[AdditionSample]]:
    """A fixed evaluation set: ``per_width`` samples for every width in ``widths``; the same
    sums in either ``operand_order``."""
    out = {}
    for w in widths:
        rng = random.Random(f"{seed}/eval/{w}")
        out[w] = [make_sample(rng, w, operand_order=operand_order, base=base) for _ in range(per_width)]
    return out
