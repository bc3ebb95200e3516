"""What importing the package gives: every name in a package's ``__all__`` is the object its defining module
binds (a re-export, never a copy or a second definition); ``import falcon_fwa`` alone registers the model with
``transformers``' Auto classes (the README and ``docs/training.md`` tell users to import it before
``AutoModelForCausalLM.from_pretrained``); the help of a command imports none of that command's own third-party
dependencies (``lm_eval``, ``datasets``, ``matplotlib``...), only the model stack the commands share."""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import subprocess
import sys

import pytest

# The packages whose ``__all__`` is the public surface (``falcon_fwa.ops.triton`` needs triton, a test extra).
PACKAGES = ["falcon_fwa", "falcon_fwa.ops", "falcon_fwa.layers", "falcon_fwa.models", "falcon_fwa.data",
            "falcon_fwa.eval", "falcon_fwa.serve", "falcon_fwa.train", "falcon_fwa.ops.triton"]

# Public names that are data, not functions or classes, so carry no ``__module__``: the module whose own source
# assigns each (checked below against that source).
DATA_DEFINED_IN = {
    "RULES": "falcon_fwa.ops.rules",
    "PRESETS": "falcon_fwa.models.presets",
    "MIXERS": "falcon_fwa.models.configuration",
    "PACKINGS": "falcon_fwa.data.packing",
    "TRITON_RULES": "falcon_fwa.ops.triton.api",
    "GPU_CHECKED_RULES": "falcon_fwa.ops.triton.api",
    "TRITON_DTYPES": "falcon_fwa.ops.triton.api",
    "STEP_RULES": "falcon_fwa.ops.triton.recurrent",
    "SHORT_PROMPT_LIMITS": "falcon_fwa.ops.triton.recurrent",
    "__version__": "falcon_fwa",
}


def _package(name):
    if name == "falcon_fwa.ops.triton":
        pytest.importorskip("falcon_fwa.ops.triton")  # triton, and one the kernels take
    return importlib.import_module(name)


def _assigned_at_top_level(module) -> set:
    """The names a module's own source binds by assignment at its top level (not by import)."""
    names = set()
    for node in ast.parse(inspect.getsource(module)).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Name):
                    names.add(t.id)
    return names


def _defining_object(obj):
    """What ``obj``'s ``__module__`` and ``__qualname__`` lead to, and that module's name."""
    module = importlib.import_module(obj.__module__)
    found = module
    for part in obj.__qualname__.split("."):
        found = getattr(found, part)
    return found, module.__name__


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_is_the_object_its_defining_module_binds(package):
    pkg = _package(package)
    names = list(pkg.__all__)
    assert len(names) == len(set(names)), f"{package}.__all__ lists a name twice"
    for name in names:
        namespace = {}
        exec(f"from {package} import {name}", namespace)  # noqa: S102 - the statement a user writes
        obj = namespace[name]
        assert obj is getattr(pkg, name)
        if name in DATA_DEFINED_IN:
            home = importlib.import_module(DATA_DEFINED_IN[name])
            assert name in _assigned_at_top_level(home), f"{home.__name__} does not assign {name}"
            assert getattr(home, name) is obj, f"{package}.{name} is not {home.__name__}.{name}"
            continue
        assert hasattr(obj, "__module__") and hasattr(obj, "__qualname__"), \
            f"{package}.{name} is data: add its defining module to DATA_DEFINED_IN"
        defined, where = _defining_object(obj)
        assert where.startswith("falcon_fwa"), f"{package}.{name} re-exports {where}'s object"
        assert defined is obj, f"{package}.{name} is not the object {where} binds"


@pytest.mark.parametrize("package", PACKAGES)
def test_star_import_gives_exactly_all(package):
    pkg = _package(package)
    namespace = {}
    exec(f"from {package} import *", namespace)  # noqa: S102
    namespace.pop("__builtins__", None)
    assert set(namespace) == set(pkg.__all__)
    assert all(namespace[n] is getattr(pkg, n) for n in pkg.__all__)


def test_top_level_names_are_the_subpackages_objects():
    """``falcon_fwa.X`` and ``falcon_fwa.ops.X`` / ``falcon_fwa.models.X`` are one object, whichever path a user
    imports it by (a class seen twice would fail ``isinstance`` checks across the two)."""
    import falcon_fwa
    from falcon_fwa import models, ops
    for name in falcon_fwa.__all__:
        if name == "__version__":
            continue
        homes = [m for m in (ops, models) if name in m.__all__]
        assert len(homes) == 1, f"{name} is exported by {len(homes)} of ops, models"
        assert getattr(falcon_fwa, name) is getattr(homes[0], name)


def test_version_is_the_distributions():
    """``falcon_fwa.__version__`` is the version ``pyproject.toml`` gives the distribution."""
    tomllib = pytest.importorskip("tomllib")
    import falcon_fwa
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        assert falcon_fwa.__version__ == tomllib.load(f)["project"]["version"]


def _child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


_REGISTERED = """
import falcon_fwa
from transformers import AutoConfig, AutoModelForCausalLM
config = AutoConfig.for_model("falcon_fwa")
print(type(config) is falcon_fwa.FalconConfig)
model = AutoModelForCausalLM.from_config(falcon_fwa.get_preset("tiny-falcon"))
print(type(model) is falcon_fwa.FalconForCausalLM)
"""

_UNKNOWN = """
from transformers import AutoConfig
try:
    AutoConfig.for_model("falcon_fwa")
except ValueError:
    print("unknown")
"""


def test_import_falcon_fwa_alone_registers_the_auto_classes():
    """In a fresh interpreter, ``import falcon_fwa`` (no submodule named) is what makes ``transformers`` know the
    model type: without it ``AutoConfig`` refuses ``falcon_fwa``; with it ``AutoConfig`` and
    ``AutoModelForCausalLM`` build the package's classes."""
    before = _child(_UNKNOWN)
    assert before.returncode == 0 and before.stdout.split() == ["unknown"], before.stderr[-2000:]
    after = _child(_REGISTERED)
    assert after.returncode == 0, after.stderr[-2000:]
    assert after.stdout.split() == ["True", "True"], after.stdout


_HELP_IMPORTS = """
import contextlib, io, sys
import falcon_fwa.cli as cli
base = set(sys.modules)
with contextlib.redirect_stdout(io.StringIO()) as out:
    status = cli.main(["--help"])
new = set(sys.modules) - base
print("top", status, sorted(m for m in new if m.split(".")[0] not in sys.stdlib_module_names), bool(out.getvalue()))
import falcon_fwa.models  # the model stack (torch, transformers) that the commands share
for name in cli.COMMANDS:
    before = set(sys.modules)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        try:
            cli.main([name, "--help"])
            code = None
        except SystemExit as e:
            code = e.code
    new = {m.split(".")[0] for m in set(sys.modules) - before} - {"falcon_fwa"} - set(sys.stdlib_module_names)
    print(name, code, sorted(new), out.getvalue().startswith(f"usage: falcon-fwa {name}"))
"""


@pytest.mark.skipif(sys.version_info < (3, 10), reason="sys.stdlib_module_names is Python 3.10+")
def test_help_imports_no_command_dependency():
    """``falcon-fwa --help`` imports no module of the package or outside the standard library beyond
    ``falcon_fwa.cli``'s own import (no command's module), and ``falcon-fwa COMMAND
    --help`` (status 0, the command's usage) no third-party module beyond the model stack (``falcon_fwa.models``:
    torch, transformers): each command parses its arguments before importing what only running it needs
    (``lm_eval``, ``datasets``, ``matplotlib``...)."""
    done = _child(_HELP_IMPORTS)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[0] == "top 0 [] True", lines[0]
    from falcon_fwa.cli import COMMANDS
    assert [line.split()[0] for line in lines[1:]] == list(COMMANDS)
    for line in lines[1:]:
        assert line.split(None, 1)[1] == "0 [] True", line
