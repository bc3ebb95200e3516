"""The device-side value checks (``ops.triton.checks``): the flags kernel on hand-made tensors
(through Triton's interpreter without CUDA), and on a GPU the assertion that names the argument."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, in_this_process, needs_cuda

from falcon_fwa.ops.triton.checks import range_flags

pytestmark = in_this_process

INF, NAN = float("inf"), float("nan")


def _flags(lam, gate=None, dtype=torch.float32):
    lam = torch.tensor(lam, dtype=dtype, device=DEVICE)
    gate = None if gate is None else torch.tensor(gate, dtype=dtype, device=DEVICE)
    return range_flags(lam, gate).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flags_of_hand_made_values(dtype):
    assert _flags([0.0, 1.0, 3e4], [0.0, -1.0, -INF], dtype) == [1, 1]
    assert _flags([0.0, -1e-3], [0.0], dtype) == [0, 1]
    assert _flags([NAN, 1.0], None, dtype) == [0, 1]
    assert _flags([INF], [-0.5], dtype) == [0, 1]
    assert _flags([1.0], [-0.5, 0.1], dtype) == [1, 0]
    assert _flags([1.0], [NAN], dtype) == [1, 0]
    assert _flags([-1.0], [1.0], dtype) == [0, 0]


def test_a_bad_entry_in_any_block_and_tensors_of_different_sizes():
    # several programs (4096 entries each); the gate longer than lam (per-column tensors are not, but the
    # kernel covers both lengths); one bad entry far from the start, in the last partial block
    lam = torch.rand(3 * 4096 + 17, device=DEVICE)
    gate = -torch.rand(5 * 4096 + 3, device=DEVICE)
    assert range_flags(lam, gate).tolist() == [1, 1]
    lam[-1] = -1.0
    gate[4 * 4096 + 1] = NAN
    assert range_flags(lam, gate).tolist() == [0, 0]
    assert range_flags(lam[:-1], gate[:4 * 4096]).tolist() == [1, 1]
    assert range_flags(lam[:0], None).tolist() == [1, 1]  # empty: nothing to flag


# a negative lam in a decoding step (the fused step kernel), a positive log_gate in a sequence (the chunk kernels)
_BAD_VALUES_ON_CUDA = {
    "lam must be finite and >= 0": """
import torch
from falcon_fwa import falcon_step
q, k, v = (torch.randn(2, 2, 16, device="cuda") for _ in range(3))
beta, lam = torch.rand(2, 2, device="cuda"), -torch.rand(2, 2, device="cuda") - 0.1
falcon_step(q, k, v, beta, lam, state=None, rule="1A", backend="triton")
torch.cuda.synchronize()
""",
    "log_gate must be <= 0": """
import torch
from falcon_fwa import falcon_attention
q, k, v = (torch.randn(1, 16, 2, 16, device="cuda") for _ in range(3))
beta, lam = torch.rand(1, 16, 2, device="cuda"), torch.rand(1, 16, 2, device="cuda")
gate = -torch.rand(1, 16, 2, device="cuda")
gate[0, 9, 1] = 0.5
falcon_attention(q, k, v, beta, lam, rule="1", log_gate=gate, backend="triton")
torch.cuda.synchronize()
""",
}


@needs_cuda
@pytest.mark.parametrize("message", sorted(_BAD_VALUES_ON_CUDA))
def test_a_bad_value_on_cuda_is_a_device_assertion_naming_the_argument(message):
    # the checks do not wait for the device: the process stops at the next synchronization, with the argument's
    # name in the message (run in a child process, since the assertion ends its CUDA context)
    run = subprocess.run([sys.executable, "-c", _BAD_VALUES_ON_CUDA[message]], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode != 0
    assert message in run.stderr
