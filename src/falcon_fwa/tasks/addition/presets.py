"""Budgets for the addition task: model size and training schedule, shared by every model.

``tiny``  the README's first command: a CPU run of a few minutes (2 cores), on the
          same task at widths 1..5 (out of distribution: 6..8), small enough to learn there.
``paper`` the Table-3 budget: ~2,000 steps of a small model, minutes on one GPU (float32
          weights, TF32 matrix products on CUDA: ``matmul_precision="high"``).

Both presets initialize every matrix and the (tied) embedding with the fan-in
standard deviation ``1 / sqrt(hidden_size)`` (``initializer_range``, from
:attr:`AdditionPreset.fan_in_init`, following the width when it is overridden) instead of the language-model default ``0.02``.
Each sum digit is ``(a_i + b_i + carry) mod 10`` of two digits read from two
different places of the prompt; neither digit alone says anything about it, so its
gradient signal is a product of two read-outs and grows with the initial weight
scale. With ``0.02`` (at ``hidden_size`` 64 that is 1/6 of the fan-in scale) the
least significant digit stays at chance (~10 %) for thousands of steps for every
model; with the fan-in scale it is learned within a few hundred. The middle digits
also need each operand digit found by its distance from the end of its operand
(the sum is written least significant digit first, the operands are not, unless
``operand_order="lsd"``); the models learn that last, which is what limits the
``tiny`` accuracy at widths >= 3.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, Mapping, Optional, Tuple

from .data import OPERAND_ORDERS, check_abacus_offset, check_base

MATMUL_PRECISIONS = ("highest", "high", "medium")
"""The values of ``torch.set_float32_matmul_precision``."""


def check_curriculum(curriculum_steps: int, steps: int, train_widths: Tuple[int, int], *,
                     names: Tuple[str, str] = ("curriculum_steps", "steps"), notes: Tuple[str, str] = ("", "")) -> None:
    """A ``ValueError`` where a curriculum of ``curriculum_steps`` is longer than a run of ``steps``: the largest
    training width would reach the top of ``train_widths`` only after the last step, so that the widest widths
    are trained little or never, yet the validation that chooses the best step scores them. The one check of
    the preset's fields and of the options that set them: ``names`` name the two values (the fields, or the
    options as typed), and ``notes`` follow each value (where it came from, such as the preset's)."""
    if curriculum_steps <= steps:
        return
    (lo, hi), (curriculum_name, steps_name) = train_widths, names
    raise ValueError(f"{curriculum_name} {curriculum_steps}{notes[0]} is more than {steps_name} {steps}{notes[1]}: "
                     f"the widths would still be growing to {hi} at the last step, the widest of {lo}-{hi} trained "
                     f"little or never, yet validated in choosing the best step; give {curriculum_name} {steps} or "
                     f"fewer, or {steps_name} {curriculum_steps} or more")


@dataclass(frozen=True)
class AdditionPreset:
    """Model size and optimisation budget of one run.

    ``train_widths`` is the inclusive range the training widths are drawn from
    (uniformly); ``ood_widths`` the inclusive out-of-distribution range. Validation
    uses ``val_per_width`` fixed samples for each training width, the OOD test
    ``ood_per_width`` for each OOD width. The learning rate follows linear warmup
    over ``warmup`` steps, then a cosine to ``lr * min_lr_ratio`` at ``steps``.
    """

    hidden_size: int
    num_hidden_layers: int
    num_heads: int
    steps: int
    batch_size: int
    lr: float
    warmup: int
    eval_every: int
    val_per_width: int
    ood_per_width: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: Tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    train_widths: Tuple[int, int] = (1, 32)
    ood_widths: Tuple[int, int] = (33, 48)
    model: Dict[str, Any] = field(default_factory=dict)
    """Extra model config fields shared by every model of the preset."""
    fan_in_init: bool = True
    """Initialize at ``initializer_range = 1 / sqrt(hidden_size)`` (unless ``model`` sets it)."""
    cpu_threads: Optional[int] = None
    """torch threads on CPU (``None``: torch's default). Small models train fastest on one thread."""
    curriculum_steps: int = 0
    """Steps over which the largest training width grows linearly from ``train_widths[0]`` to
    ``train_widths[1]`` (:meth:`max_train_width`); 0 (the paper's setting) draws from the whole range
    from the first step. At most ``steps``: a longer curriculum would end after the run, its widest
    widths trained little or never, yet scored in the validation that chooses the best step."""
    matmul_precision: str = "highest"
    """``torch.set_float32_matmul_precision`` on CUDA: "high" runs float32 matrix products (cuBLAS and
    the Falcon kernels' dots) on TF32 tensor cores; "highest" keeps exact fp32 products, which on a
    Hopper GPU run on the FMA units: a measured 3.7 ms per call of the rule-1A gradient kernel at the
    ``paper`` shapes (batch 128)."""
    operand_order: str = "msd"
    """How the operands of every sample are written (:data:`.data.OPERAND_ORDERS`): "msd" (the paper's)
    most significant digit first, "lsd" least significant digit first, like the sum."""
    base: int = 10
    """The radix every number is written in (:data:`.data.BASES`): 10 (decimal, the default; the paper
    does not name a base) or 2 for binary, as in Kaiser and Sutskever's tasks, which the paper cites.
    Uniform guessing scores ``1/base`` of the digits."""
    abacus_offset: Optional[int] = None
    """``None`` (the paper's setting): the model sees the tokens alone. An integer ``K >= 0``: it also
    sees each digit's place in its number (:func:`.data.digit_index`, a learned embedding added to the
    token's: :class:`.lineup.DigitPositions`), shifted in training by a random offset in ``[0, K]``
    per sample, so that the places of widths up to ``train_widths[1] + K`` are trained."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_heads", "steps", "batch_size", "eval_every",
                     "val_per_width", "ood_per_width"):
            if getattr(self, name) < 1:
                raise ValueError(f"preset field {name!r} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"preset fields: hidden_size {self.hidden_size} is not a multiple of num_heads "
                             f"{self.num_heads}")
        if self.curriculum_steps < 0:
            raise ValueError(f"preset field 'curriculum_steps' must be >= 0, got {self.curriculum_steps}")
        check_curriculum(self.curriculum_steps, self.steps, self.train_widths)
        if self.operand_order not in OPERAND_ORDERS:
            raise ValueError(f"preset field 'operand_order' must be 'msd' or 'lsd', got {self.operand_order!r}")
        try:
            check_base(self.base)
        except ValueError as e:
            raise ValueError(f"preset field {e}") from None
        try:
            check_abacus_offset(self.abacus_offset)
        except ValueError as e:
            raise ValueError(f"preset field {e}") from None
        if not (self.lr > 0 and math.isfinite(self.lr)) or self.warmup < 0:
            raise ValueError(f"preset fields 'lr' > 0 (finite) and 'warmup' >= 0 required, got {self.lr}, {self.warmup}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(f"preset field 'matmul_precision' must be 'highest', 'high' or 'medium', "
                             f"got {self.matmul_precision!r}")
        for name in ("train_widths", "ood_widths"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"preset field {name!r} must be an inclusive range 1 <= lo <= hi, got {(lo, hi)}")
        if self.ood_widths[0] <= self.train_widths[1] and self.train_widths[0] <= self.ood_widths[1]:
            raise ValueError(f"preset field 'ood_widths' {self.ood_widths} overlaps the training widths "
                             f"{self.train_widths}: out-of-distribution widths must lie outside them")

    def size(self) -> Dict[str, Any]:
        """The model config fields of the preset: width, depth, heads, the initialization scale and ``model``."""
        return preset_size(vars(self))

    def num_digit_indices(self) -> int:
        """Rows of the digit-index table under ``abacus_offset``: index 0 (the non-digits) and the
        places up to the longest answer of training (with the offset) or evaluation (without)."""
        longest = max(self.train_widths[1] + (self.abacus_offset or 0), self.ood_widths[1]) + 1
        return longest + 1

    def max_train_width(self, step: int) -> int:
        """The largest width drawn at training step ``step`` (0-based): with a curriculum,
        ``lo + ceil((hi - lo) * min(1, (step + 1) / curriculum_steps))``, else ``hi``."""
        lo, hi = self.train_widths
        if self.curriculum_steps == 0 or step + 1 >= self.curriculum_steps:
            return hi
        return lo + -(-(hi - lo) * (step + 1) // self.curriculum_steps)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def replace(self, **changes: Any) -> "AdditionPreset":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def preset_size(preset: Mapping[str, Any]) -> Dict[str, Any]:
    """The model config fields of a preset's fields (an :class:`AdditionPreset`'s, or its ``preset`` dict in
    a run's results): width, depth, heads, the fan-in scale where ``fan_in_init`` is set, and ``model``. A
    results dict from before ``fan_in_init`` existed lacks it; such runs held their scale in ``model``."""
    init = {"initializer_range": preset["hidden_size"] ** -0.5} if preset.get("fan_in_init") else {}
    return {"hidden_size": preset["hidden_size"], "num_hidden_layers": preset["num_hidden_layers"],
            "num_heads": preset["num_heads"], **init, **(preset.get("model") or {})}


PRESETS: Dict[str, AdditionPreset] = {
    "tiny": AdditionPreset(
        hidden_size=64, num_hidden_layers=2, num_heads=2,
        steps=1000, batch_size=64, lr=3e-3, warmup=100, eval_every=250,
        val_per_width=64, ood_per_width=32, train_widths=(1, 5), ood_widths=(6, 8), cpu_threads=1,
    ),
    "paper": AdditionPreset(
        hidden_size=256, num_hidden_layers=4, num_heads=4,
        steps=2000, batch_size=128, lr=1e-3, warmup=100, eval_every=100,
        val_per_width=64, ood_per_width=100, matmul_precision="high",
    ),
}


def get_addition_preset(name: str) -> AdditionPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"preset: unknown {name!r}; choose from {', '.join(PRESETS)}") from None
