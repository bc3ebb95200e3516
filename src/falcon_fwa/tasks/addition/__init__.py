"""Variable-length multi-digit addition, the length-extrapolation diagnostic of the
paper's Section 5.2 (Table 3).

A sample of width ``n`` is the prompt ``digits_n(a) + "+" + digits_n(b) + "="``
followed by the target suffix ``rev(digits_{n+1}(a + b))`` and an end marker:
operands are written most significant digit first and zero-padded to ``n`` digits,
the sum is written least significant digit first and zero-padded to ``n + 1``.
The task option ``operand_order="lsd"`` (``--operand-order lsd``) writes the operands
least significant digit first as well (``"750+869=5201$"`` for ``57 + 968``), and
``base=2`` (``--base 2``) writes the numbers in binary (``"101+011=0001$"`` for ``5 + 3``).
Training widths are uniform in 1..32; the out-of-distribution widths are 33..48.

Modules: :mod:`.data` (tokenizer, seeded generator, exact checker, batches),
:mod:`.metrics` (teacher-forced accuracies, by width and by answer position), :mod:`.lineup` (the paper's model
names), :mod:`.presets` (model sizes and budgets), :mod:`.reference` (what simple rules score),
:mod:`.train` (one training run), :mod:`.compare` (the Table-3 lineup), :mod:`.plot` and :mod:`.cli`.
"""
from .data import (
    BASES,
    OPERAND_ORDERS,
    VOCAB,
    AdditionBatch,
    AdditionSample,
    check_text,
    collate,
    decode,
    encode,
    make_sample,
    training_batch,
    width_set,
)
from .metrics import AccuracyTally, position_hits, score_logits, score_predictions

__all__ = [
    "VOCAB",
    "OPERAND_ORDERS",
    "BASES",
    "AdditionSample",
    "AdditionBatch",
    "make_sample",
    "check_text",
    "encode",
    "decode",
    "collate",
    "training_batch",
    "width_set",
    "AccuracyTally",
    "position_hits",
    "score_logits",
    "score_predictions",
]
