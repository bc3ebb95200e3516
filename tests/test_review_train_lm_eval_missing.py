"""``falcon-fwa lm-eval`` where lm-evaluation-harness (or ``accelerate``, which its ``hf`` model imports) is not
installed: one error line naming the missing package and how to install it, exit status 2, and no traceback."""
import sys

import pytest

from falcon_fwa import cli


@pytest.mark.parametrize("module, package", [("lm_eval", "'lm-eval'"), ("accelerate", "'accelerate'")])
def test_a_missing_harness_is_named_with_the_install_command(module, package, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    if module == "accelerate":  # named only where the harness itself is there
        pytest.importorskip("lm_eval")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a model folder by its form: the command reaches its imports
    # a None entry in sys.modules makes ``import NAME`` raise ModuleNotFoundError, as an uninstalled package does
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    status = cli.main(["lm-eval", "--model", str(model), "--tasks", "piqa", "--device", "cpu"])
    err = capsys.readouterr().err
    assert status == 2, err
    first = err.splitlines()[0]
    assert first.startswith("falcon-fwa lm-eval: error: ") and package in first, err
    assert "pip install 'falcon-fwa[eval]'" in first and "Traceback" not in err
