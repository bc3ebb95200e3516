"""backend='triton' with a window its kernels do not take is refused when the config or the model is built, naming
``window``, the rule and the windows taken: rule 3's chunk kernels group a step's writes in 1, 2, 4, 8 or 16 slots,
rule 3A's hold a band of at most 65, and the fused recurrent kernel of form='recurrent' unrolls at most 16 slots.
The config's limits are the kernels' own (``ops.kernel_limits``, which the kernel modules import), checked against
what the Triton op itself refuses (through Triton's interpreter on the CPU, where triton is installed)."""
import importlib.util

import pytest
import torch

from falcon_fwa.models import FalconConfig, FalconForCausalLM

from conftest import random_inputs, rel_err


def _config(**kw):
    return FalconConfig(**{**dict(vocab_size=64, hidden_size=16, num_heads=1, num_hidden_layers=1, chunk_size=16),
                           **kw})


def _refused(**kw) -> bool:
    """Whether the config refuses ``kw``; any refusal must be the window's, naming the rule."""
    try:
        _config(**kw)
    except ValueError as err:
        message = str(err)
        assert message.startswith(f"config field 'window' = {kw['window']}: backend='triton'"), message
        assert f"rule {kw['rule']!r}" in message and "backend='native'" in message, message
        return True
    return False


# (rule, form) -> (windows refused, windows taken), written from the kernels' documented limits
CASES = {
    ("3", "chunk"): ([3, 5, 6, 7, 9, 12, 15, 17, 32, 64], [1, 2, 4, 8, 16]),
    ("3A", "chunk"): ([66, 67, 100, 128], [1, 2, 3, 16, 17, 33, 64, 65]),
    ("3", "recurrent"): ([17, 18, 32, 65], [1, 2, 3, 5, 15, 16]),
    ("3A", "recurrent"): ([17, 18, 32, 65], [1, 3, 7, 15, 16]),
}


@pytest.mark.parametrize("rule,form", list(CASES))
def test_triton_refuses_a_window_its_kernels_do_not_take_when_the_config_is_built(rule, form):
    refused, taken = CASES[(rule, form)]
    for window in refused:
        assert _refused(backend="triton", rule=rule, form=form, window=window), window
    for window in taken:
        assert not _refused(backend="triton", rule=rule, form=form, window=window), window
        assert _config(backend="triton", rule=rule, form=form, window=window).window == window
    for backend in ("native", "torch"):  # the PyTorch forms take any window
        for window in refused:
            assert _config(backend=backend, rule=rule, form=form, window=window).window == window


def test_the_refusal_names_the_windows_taken():
    with pytest.raises(ValueError, match=r"config field 'window' = 3: backend='triton' runs the rule-3 kernels.*"
                                         r"rule '3' of one of 1, 2, 4, 8, 16; set window to one of 1, 2, 4, 8, 16 "
                                         r"or backend='native'"):
        _config(backend="triton", rule="3", window=3)
    with pytest.raises(ValueError, match=r"config field 'window' = 66: backend='triton' runs the rule-3A kernels.*"
                                         r"at most 65; set window to at most 65"):
        _config(backend="triton", rule="3A", window=66)
    for rule in ("3", "3A"):
        with pytest.raises(ValueError, match=r"config field 'window' = 17: backend='triton' runs the fused recurrent "
                                             r"kernel of form='recurrent'.*at most 16; set window to at most 16"):
            _config(backend="triton", rule=rule, form="recurrent", window=17)
    with pytest.raises(ValueError, match=r"config field 'window' = 3: "):  # 3.0 (from a JSON file) is the int 3
        _config(backend="triton", rule="3", window=3.0)
    assert _config(backend="triton", rule="3", window=4.0).window == 4


def test_a_window_assigned_after_the_config_was_built_is_refused_when_the_model_is_built():
    config = _config(backend="triton", rule="3", window=4)
    config.window = 6
    with pytest.raises(ValueError, match=r"config field 'window' = 6: backend='triton'"):
        FalconForCausalLM(config)
    config = _config(backend="triton", rule="3A", window=4)
    config.form = "recurrent"
    config.window = 20  # the chunk kernels take it, the fused recurrent kernel does not
    with pytest.raises(ValueError, match=r"config field 'window' = 20: backend='triton' runs the fused recurrent"):
        FalconForCausalLM(config)


def test_other_rules_mixers_and_backends_never_read_the_window():
    for rule in ("1", "2", "1A", "2A"):
        for form in ("chunk", "recurrent"):
            assert _config(backend="triton", rule=rule, form=form, window=100).window == 100
    assert _config(backend="triton", mixer="transformer", window=100, hidden_size=32, num_heads=2).window == 100
    for backend in ("native", "torch"):
        assert _config(backend=backend, rule="3", form="parallel", window=3).window == 3


def _kernels_refuse(rule: str, form: str, window: int) -> bool:
    """Whether ``falcon_attention(backend='triton')`` refuses ``window`` (``NotImplementedError`` naming it);
    a window it takes gives the outputs of the PyTorch forms."""
    from falcon_fwa.ops import falcon_attention

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = {name: t.to(device) for name, t in random_inputs(rule, B=1, T=3, H=1, K=4, V=4, dtype=torch.float32).items()}
    args = (x["q"], x["k"], x["v"], x["beta"], x["lam"])
    try:
        o, _ = falcon_attention(*args, rule=rule, window=window, form=form, chunk_size=16, backend="triton")
    except NotImplementedError as err:
        assert f"window={window}" in str(err), str(err)
        return True
    ref, _ = falcon_attention(*args, rule=rule, window=window, form=form, chunk_size=16, backend="torch")
    assert rel_err(o, ref) < 2e-3, (window, rel_err(o, ref))
    return False


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("rule,form", list(CASES))
def test_the_config_refuses_exactly_the_windows_the_triton_op_refuses(rule, form):
    """Around each limit (and the non-powers of two of rule 3's chunk kernels), the op on its Triton kernels
    refuses a window exactly when the config does."""
    if not torch.cuda.is_available():
        import os
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("the Triton kernels need CUDA or TRITON_INTERPRET=1 set before triton was imported")
    windows = {("3", "chunk"): range(1, 18), ("3A", "chunk"): [1, 2, 64, 65, 66],
               ("3", "recurrent"): [1, 3, 16, 17], ("3A", "recurrent"): [1, 5, 16, 17]}[(rule, form)]
    for window in windows:
        assert _kernels_refuse(rule, form, window) == _refused(backend="triton", rule=rule, form=form,
                                                               window=window), window
