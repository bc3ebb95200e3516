"""What ``import falcon_fwa`` costs: the packages it loads are those of its floor and no more.

The floor is set by the promise that ``import falcon_fwa`` registers the model with ``transformers``' Auto
classes (``tests/test_import_surface.py``): ``AutoModelForCausalLM.register`` takes the model class itself, a
``PreTrainedModel`` and ``GenerationMixin`` subclass, and importing those from ``transformers`` already loads
``torch._dynamo``, ``torch._inductor``, ``sympy``, ``scipy``, ``accelerate``, ``tokenizers`` and more. Past
that, the package's own modules add no third-party package: what only a command needs (``matplotlib``,
``datasets``, ``lm_eval``...) is imported where that command runs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What the package must import to define and register its classes.
_FLOOR = ("import numpy, torch; from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, "
          "PreTrainedModel; from transformers.modeling_outputs import CausalLMOutputWithPast")

_LOADED = "import sys, json; {}; print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}})))"


def _top_level_packages(statement: str) -> set:
    done = subprocess.run([sys.executable, "-c", _LOADED.format(statement)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout)) - set(sys.stdlib_module_names)


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is Python 3.10+")
def test_import_falcon_fwa_loads_no_package_beyond_its_floor():
    """A fresh ``import falcon_fwa`` loads no top-level third-party package that importing ``torch``,
    ``numpy`` and the ``transformers`` classes it subclasses and registers with does not load already."""
    floor = _top_level_packages(_FLOOR)
    assert {"torch", "transformers"} <= floor
    extra = _top_level_packages("import falcon_fwa") - floor - {"falcon_fwa"}
    assert not extra, f"import falcon_fwa also loads {sorted(extra)}"
