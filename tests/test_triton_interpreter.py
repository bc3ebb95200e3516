"""Where the Triton kernel tests run on a machine without CUDA.

Triton's interpreter (``TRITON_INTERPRET=1``) only takes effect if the variable is
set before ``triton`` is first imported. The kernel test modules set it on import;
when an earlier module of the same pytest process already imported ``triton``
(``transformers`` does), they cannot run in-process, and the test below runs them
in a fresh interpreter process instead, so that they always run somewhere.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the modules (or single tests, ``module::test``) that launch kernels and skip themselves with
# FRESH_PROCESS_REASON when the interpreter could not be switched on in this process
KERNEL_TESTS = ("test_triton_chunk.py", "test_triton_recurrent.py", "test_triton_window.py", "test_triton_column.py",
                "test_triton_column_delta.py", "test_triton_sliding_delta.py", "test_triton_wy_forward.py",
                "test_triton_sliding_inplace.py", "test_triton_wy_backward.py", "test_triton_step_sizes.py",
                "test_triton_window_sum.py", "test_triton_delta_query_rows.py", "test_triton_checks.py",
                "test_triton_segments.py", "test_triton_matrix.py", "test_triton_edges.py", "test_triton_glue_mutants.py",
                "test_triton_sliding_glue_mutants.py",
                "test_triton_autograd_glue_mutants.py", "test_ops_doc_claims.py", "test_triton_more_checks.py",
                "test_triton_dispatch.py::test_final_state_is_fp32_on_both_backends",
                "test_triton_dispatch.py::test_triton_backend_takes_a_hard_reset_gate",
                "test_triton_dispatch.py::test_triton_backend_matches_the_torch_forms",
                "test_triton_dispatch.py::test_model_backend_field_forces_the_op_backend",
                "test_triton_dispatch.py::test_compiled_caller_runs_the_kernels_between_its_graphs",
                "test_ops_read_norm.py::test_kernels_take_the_normalized_read",
                "test_ops_read_norm.py::test_kernels_float16_read_does_not_overflow",
                "test_ops_trace.py::test_trace_on_the_kernels_is_the_float64_trace")
FRESH_PROCESS_REASON = ("triton was imported before TRITON_INTERPRET=1 could be set; "
                        "test_triton_interpreter.py runs this module in a fresh process")


def prepare_interpreter() -> bool:
    """Set ``TRITON_INTERPRET=1`` if no CUDA and ``triton`` is not imported yet.
    True when the kernels can run in this process (CUDA, or the interpreter active)."""
    if torch.cuda.is_available():
        return True
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    import triton.language as tl
    # the language's own jit helpers were decorated at import: interpreted or not
    return type(tl.zeros).__name__ == "InterpretedFunction"


@pytest.mark.skipif(prepare_interpreter(), reason="the kernel tests run in this process")
def test_kernel_tests_in_a_fresh_interpreter_process():
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(str(here / name) for name in KERNEL_TESTS)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-4000:]


def test_every_module_that_defers_to_a_fresh_process_is_listed():
    """A kernel test module that skips itself with FRESH_PROCESS_REASON (directly or through
    ``kernel_checks.in_this_process``) must be in KERNEL_TESTS, or a full run on a machine without
    CUDA would run its kernels nowhere; a module listed test by test must list every test it skips
    so, not just one of them."""
    here = Path(__file__).parent
    deferring = {path.name for path in here.glob("test_*.py") if path.name != Path(__file__).name
                 and re.search(r"\b(in_this_process|FRESH_PROCESS_REASON)\b", path.read_text())}
    assert deferring == {name.split("::")[0] for name in KERNEL_TESTS}
    by_test = {}
    for name in KERNEL_TESTS:
        if "::" in name:
            module, test = name.split("::")
            by_test.setdefault(module, set()).add(test)
    for module, listed in by_test.items():
        assert module not in KERNEL_TESTS, module  # listed whole and test by test
        skipped = set(re.findall(r"@pytest\.mark\.skipif\([^\n]*\bFRESH_PROCESS_REASON\)\n(?:@.*\n)*def (test_\w+)",
                                 (here / module).read_text()))
        assert skipped and skipped == listed, (module, skipped ^ listed)
