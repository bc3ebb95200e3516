"""Every rule's kernels at the full benchmark shape (B=8, T=2048, H=16, K=V=128) against
the float64 recurrent form.

The other kernel tests use the benchmark's sequence length and head dims with fewer rows
and heads. Rows and heads multiply the batch of some library calls inside the op (rule 3's
window-Gram eigenvalues: B x H x T matrices), so failures that depend on them show only
here. The float64 recurrence keeps every step's state for its backward, too much for the
whole batch at once; it runs one batch row at a time (``reference_by_rows``), which this
file first checks against the whole-batch reference on a small shape (CPU included).
"""
from __future__ import annotations

import pytest
import torch

# kernel_checks first: it switches Triton's interpreter on (without CUDA) before triton is imported
from kernel_checks import DEVICE, check_kernel, kernel_inputs, needs_cuda, reference_by_rows, rel_norm, run_op

from falcon_fwa import FalconState, falcon_attention

RULES = ("1A", "1", "3A", "2A", "2", "3")
FULL = (8, 2048, 16, 128, 128)


@pytest.mark.parametrize("rule", ["1", "2A", "3"])
def test_reference_by_rows_equals_whole_batch(rule):
    """Row by row, the float64 recurrence gives the whole batch's outputs, final state and
    gradients (same probes), to rounding."""
    window = 3 if rule == "3" else 1
    leaves = kernel_inputs(3, 9, 2, 4, 5, torch.float64, seed=5, rule=rule, window=window, state=True)
    switches = dict(rule=rule, window=window, shift=True, output_final_state=True)
    whole = run_op(falcon_attention, leaves, form="recurrent", backend="torch", **switches)
    shapes = {n: t.shape for n, t in whole[0].items() if n != "tail_valid" and t is not None}
    rows = reference_by_rows(leaves, shapes, "cpu", **switches)
    assert set(rows[0]) == set(whole[0]) and set(rows[1]) == set(whole[1])
    if window > 1:
        assert torch.equal(rows[0]["tail_valid"], whole[0]["tail_valid"])
    for part in (0, 1):
        for name, ref in whole[part].items():
            if ref is None or ref.dtype == torch.bool:
                continue
            assert rel_norm(rows[part][name], ref) < 1e-12, (part, name)


def test_probes_are_drawn_in_output_order():
    """``run_op`` backpropagates probes drawn from one generator seeded 123 in the order ``o``,
    ``S_T``, ``last_key``, ``tail_x``, ``tail_y``: a loss built by hand from such draws gives
    ``run_op``'s gradients, for every leaf including the initial state's."""
    leaves = kernel_inputs(2, 6, 2, 3, 4, torch.float64, seed=1, rule="3A", window=3, state=True)
    _, grads = run_op(falcon_attention, leaves, rule="3A", window=3, shift=True, output_final_state=True,
                      form="recurrent", backend="torch")
    x = {n: t.detach().clone().requires_grad_() for n, t in leaves.items() if t is not None and n != "tail_valid"}
    state = FalconState(rule="3A", window=3, shift=True, S=x["S0"], last_key=x["last_key"], tail_x=x["tail_x"],
                        tail_y=x["tail_y"], tail_valid=leaves["tail_valid"])
    o, final = falcon_attention(x["q"], x["k"], x["v"], x["beta"], x["lam"], rule="3A", window=3,
                                log_gate=x["log_gate"], initial_state=state, output_final_state=True,
                                form="recurrent", backend="torch")
    g = torch.Generator().manual_seed(123)
    loss = sum((t * torch.randn(t.shape, generator=g, dtype=torch.float64)).sum()
               for t in (o, final.S, final.last_key, final.tail_x, final.tail_y))
    loss.backward()
    assert set(grads) == set(x)
    for name, leaf in x.items():
        assert torch.allclose(leaf.grad, grads[name], rtol=1e-13, atol=1e-13), name


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rule", RULES)
def test_cuda_full_benchmark_shape(rule, dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    check_kernel(rule, FULL, dtype, window=4 if rule in ("3", "3A") else 1, chunk_size=64, state=True,
                 output_final_state=True, device=DEVICE, reference_rows=True)
