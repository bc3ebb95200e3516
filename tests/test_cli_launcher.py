"""The ``falcon-fwa`` console script's module, ``falcon_fwa_launcher``: the top level (no command, ``-h``,
``--help``, ``--version``, an unknown command) is answered without importing the package, torch or
transformers; a command runs through ``falcon_fwa.cli`` with the one command table; a Ctrl-C while a
command's modules are imported ends it with one line and the status of SIGINT (130), no traceback."""
from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import falcon_fwa_launcher as launcher
from falcon_fwa import cli

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "falcon_fwa", "numpy", "tqdm")  # what ``import falcon_fwa`` brings

# the launcher's main in a fresh interpreter: its exit status, what it printed and which heavy modules it loaded
_TOP = """
import contextlib, io, json, sys
from falcon_fwa_launcher import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        status = main(sys.argv[1:])
    except SystemExit as stop:
        status = stop.code
heavy = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(json.dumps({"status": status, "out": out.getvalue(), "err": err.getvalue(), "heavy": heavy}))
""" % (HEAVY,)


def _top(*argv: str) -> dict:
    env = dict(os.environ, COLUMNS="200")  # argparse wraps help lines at the terminal's width
    done = subprocess.run([sys.executable, "-c", _TOP, *argv], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _listed_commands(help_text: str) -> dict:
    """``{name: help line}`` of the rows under ``COMMAND`` in the top-level help (printed unwrapped)."""
    section = help_text.split("positional arguments:\n", 1)[1].split("\n\n", 1)[0]
    listed = {}
    for row in section.splitlines()[1:]:  # the first row is the COMMAND heading
        named = re.fullmatch(r" {4}(\S+)(?: {2,}(\S.*))?", row)
        if named:  # a name, and its help on the same row unless the name is too long for the column
            name = named.group(1)
            listed[name] = named.group(2) or ""
        else:  # the help of a long name, on the row below it
            listed[name] = (listed[name] + " " + row.strip()).strip()
    return listed


@pytest.mark.parametrize("argv", [[], ["-h"], ["--help"]])
def test_the_help_lists_every_command_and_imports_no_torch(argv):
    """``falcon-fwa``, ``-h`` and ``--help`` print the same help, status 0: every command of the table with its
    help line, in the table's order, and nothing of the package, torch or transformers is imported for it."""
    top = _top(*argv)
    assert top["status"] == 0 and top["err"] == "" and top["heavy"] == [], top
    assert top["out"].startswith("usage: falcon-fwa [-h] [--version] COMMAND ...\n")
    listed = _listed_commands(top["out"])
    assert list(listed) == list(launcher.COMMANDS)
    assert listed == {name: help_text for name, (_, help_text) in launcher.COMMANDS.items()}
    if argv != ["--help"]:
        assert top["out"] == _top("--help")["out"]


def test_version_is_the_installed_distributions_without_importing_the_package():
    top = _top("--version")
    assert top["status"] == 0 and top["heavy"] == [], top
    assert top["out"] == f"falcon-fwa {importlib.metadata.version('falcon-fwa')}\n"


def test_an_unknown_command_is_named_with_status_2_before_any_import():
    top = _top("trian", "--steps", "3")
    assert top["status"] == 2 and top["out"] == "" and top["heavy"] == [], top
    err = top["err"].splitlines()
    assert err[0].startswith("usage: falcon-fwa") and len(err) == 2
    assert err[1] == ("falcon-fwa: error: unknown command 'trian'; choose from "
                      "demo, addition, addition-compare, params, data, train, compare, scaling, throughput, "
                      "ppl, lm-eval, generate")


def test_every_command_of_the_table_is_a_module_with_add_arguments_and_run():
    """Each row of the table names a source file of the package (read, not imported) that defines the two
    functions the CLI calls, and the package's CLI routes through this same table, not a copy."""
    assert cli.COMMANDS is launcher.COMMANDS
    for name, (module, help_text) in launcher.COMMANDS.items():
        assert module.startswith("falcon_fwa.") and help_text, name
        path = ROOT / "src" / (module.replace(".", "/") + ".py")
        defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
        assert {"add_arguments", "run"} <= defined, (name, path)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_the_console_script_is_the_launcher_and_the_launcher_is_packaged():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = project["project"]["scripts"]["falcon-fwa"]
    module, _, function = target.partition(":")
    assert module == launcher.__name__ and getattr(launcher, function) is launcher.main
    assert module in project["tool"]["setuptools"]["py-modules"]
    where = project["tool"]["setuptools"]["packages"]["find"]["where"]
    assert Path(launcher.__file__).resolve() == (ROOT / where[0] / f"{module}.py").resolve()


def test_a_ctrl_c_while_the_commands_module_is_imported_is_one_line_and_status_130(tmp_path, monkeypatch, capsys):
    """``python -m falcon_fwa.cli`` (the package already imported): a KeyboardInterrupt raised by the import of
    the command's module ends it as one during the command does; ``FALCON_FWA_TRACEBACK=1`` re-raises it."""
    (tmp_path / "interrupted_on_import.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(launcher.COMMANDS, "slow", ("interrupted_on_import", "a command whose import is cut"))
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    try:
        status = cli.main(["slow", "--flag"])
    except KeyboardInterrupt:  # (it would end the test session, not this test)
        pytest.fail("the KeyboardInterrupt of the import reached cli.main's caller")
    assert status == 128 + signal.SIGINT
    out, err = capsys.readouterr()
    assert out == "" and err == "falcon-fwa slow: interrupted\n"
    monkeypatch.setenv("FALCON_FWA_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        cli.main(["slow"])


def _interrupt_while_importing_torch() -> subprocess.CompletedProcess:
    """``falcon-fwa train --help`` in a fresh interpreter, sent SIGINT once torch is being imported (a torch
    submodule's line from ``-X importtime``: the launcher itself imports no torch, so that is the package's
    import, seconds before the command's help)."""
    # a suite started as a background job inherits SIGINT ignored: the command gets Ctrl-C's own handler
    code = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from falcon_fwa_launcher import main\nsys.exit(main())\n")
    env = {k: v for k, v in os.environ.items() if k != "FALCON_FWA_TRACEBACK"}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-c", code, "train", "--help"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        for line in proc.stderr:
            seen.append(line)
            if re.search(r"\|\s+torch\.", line):
                proc.send_signal(signal.SIGINT)
                break
        else:
            raise AssertionError("torch was never imported:\n" + "".join(seen[-20:]))
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "".join(seen) + err)


def test_a_ctrl_c_while_the_package_is_imported_is_one_line_and_status_130():
    """Ctrl-C during the seconds a command spends importing the package: status 130 and the one line
    ``falcon-fwa train: interrupted`` on stderr, no traceback and no help. (An interrupt that the
    interpreter swallows, as one landing in a finalizer is, lets the command finish: tried again.)"""
    for _ in range(3):
        done = _interrupt_while_importing_torch()
        if done.returncode != 0:
            break
    err = [line for line in done.stderr.splitlines() if not line.startswith("import time:")]
    assert done.returncode == 128 + signal.SIGINT, (done.returncode, err[-30:])
    assert err == ["falcon-fwa train: interrupted"], err[-30:]
    assert done.stdout == ""
