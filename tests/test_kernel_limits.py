"""``ops.kernel_limits``: the Triton kernels' shape limits, defined once where importing them imports no ``triton``.
The kernel modules take their limits from it (the same objects under their own names), and the model config checks
a ``backend="triton"`` model against them with ``triton`` absent."""
import importlib.util
import subprocess
import sys
import textwrap

import pytest

from falcon_fwa.ops import kernel_limits


def test_the_limits_and_a_triton_config_need_no_triton():
    """With ``triton`` unimportable, the limits import and a config is built and refused by them; the kernel
    package ``falcon_fwa.ops.triton`` is never imported."""
    script = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # import triton raises ImportError
        from falcon_fwa.ops import kernel_limits
        from falcon_fwa.models import FalconConfig
        base = dict(vocab_size=64, hidden_size=16, num_heads=1, num_hidden_layers=1, backend="triton")
        assert FalconConfig(**base, rule="3A", window=kernel_limits.MAX_WINDOW).window == 65
        try:
            FalconConfig(**base, rule="3A", window=kernel_limits.MAX_WINDOW + 1)
        except ValueError as err:
            assert "config field 'window' = 66" in str(err), str(err)
        else:
            raise AssertionError("window 66 was taken")
        assert "falcon_fwa.ops.triton" not in sys.modules, sorted(m for m in sys.modules if "falcon_fwa.ops" in m)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]


def test_the_limits_are_the_documented_kernel_shapes():
    """The values the docs and refusals state: chunks of 16 to 128 tokens, rule 3's windows of 1, 2, 4, 8 or 16
    (a divisor of the 16-row blocks), rule 3A's band of at most 65, the fused kernel's 16 window slots, key dims
    of at most 256 in one tile."""
    assert kernel_limits.SUPPORTED_CHUNK_SIZES == (16, 32, 64, 128)
    assert kernel_limits.SLOT_COUNTS == tuple(w for w in range(1, 17) if 16 % w == 0)
    assert (kernel_limits.MAX_WINDOW, kernel_limits.MAX_FUSED_WINDOW) == (65, 16)
    assert kernel_limits.MAX_WY_HEAD_DIM == kernel_limits.MAX_FUSED_HEAD_DIM == 256


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_the_kernel_modules_hold_the_same_objects():
    """Each kernel module's tuple of shapes is the one defined here, not a copy of its values (the widths, small
    integers, are checked where the op refuses past them: tests/test_config_triton_windows.py,
    tests/test_config_refusals_more.py)."""
    from falcon_fwa.ops.triton import column_delta, delta, launch, scalar_decay, sliding_delta

    assert launch.SUPPORTED_CHUNK_SIZES is kernel_limits.SUPPORTED_CHUNK_SIZES
    for module in (delta, column_delta, scalar_decay):
        assert module.SUPPORTED_CHUNK_SIZES is kernel_limits.SUPPORTED_CHUNK_SIZES, module.__name__
    assert delta.SLOT_COUNTS is sliding_delta.SLOT_COUNTS is kernel_limits.SLOT_COUNTS
