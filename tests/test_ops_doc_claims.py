"""Statements of ``docs/ops.md`` checked against the op: what the value checks accept and refuse."""
from __future__ import annotations

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, in_this_process

from falcon_fwa.ops.triton.checks import range_flags

pytestmark = in_this_process


def _flags(lam, gate=None, dtype=torch.float64):
    lam = torch.tensor(lam, dtype=dtype, device=DEVICE)
    gate = None if gate is None else torch.tensor(gate, dtype=dtype, device=DEVICE)
    return range_flags(lam, gate).tolist()


def test_float64_values_are_judged_in_float64():
    """``lam`` finite and ``>= 0``, ``log_gate <= 0`` hold of the values as given (docs/ops.md, "Argument
    checks"; the CPU checks judge them so): a float64 entry is not first rounded to float32, where 1e300
    would become inf and -1e-300 or 1e-300 would become 0."""
    assert _flags([1.0, 1e300], [-1e300, 0.0]) == [1, 1]  # finite, in range
    assert _flags([1.0, -1e-300]) == [0, 1]  # negative lam
    assert _flags([1.0], [-1.0, 1e-300]) == [1, 0]  # positive gate
    assert _flags([float("inf")], [float("-inf")]) == [0, 1]


@pytest.mark.parametrize("lam,gate,want", [([1.0, 1e300], [-1.0], True), ([1.0, -1e-300], None, False),
                                           ([1.0, 1.0], [-1.0, 1e-300], False)])
def test_float64_flags_agree_with_the_host_checks(lam, gate, want):
    """The flags kernel and the host's reductions (``ops.validate.check_value_ranges`` on the CPU) give one
    verdict for the same float64 values."""
    from falcon_fwa.ops.validate import check_value_ranges
    lam_t = torch.tensor(lam, dtype=torch.float64)
    gate_t = None if gate is None else torch.tensor(gate, dtype=torch.float64)
    try:
        check_value_ranges(lam_t, gate_t)
        host = True
    except ValueError:
        host = False
    assert host == want
    assert (_flags(lam, gate) == [1, 1]) == want
