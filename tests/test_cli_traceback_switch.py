"""``FALCON_FWA_TRACEBACK`` turns the traceback of a command's error on where it holds a value that says yes, and
leaves the one-line error where it is unset, empty or says no (``0``, ``false``, ``no``, ``off``)."""
import argparse

import pytest

import falcon_fwa_launcher as launcher
from falcon_fwa import cli


def _fails(args):
    raise ValueError("--steps must be >= 1, got -3")


def _interrupted(args):
    raise KeyboardInterrupt


@pytest.mark.parametrize("value", ["", "0", "false", "No", " off "])
def test_a_value_saying_no_keeps_the_one_line_error(monkeypatch, capsys, value):
    monkeypatch.setenv("FALCON_FWA_TRACEBACK", value)
    assert not launcher.traceback_requested()
    assert cli.run_command("falcon-fwa test", _fails, argparse.Namespace()) == 2
    assert capsys.readouterr().err.startswith("falcon-fwa test: error: --steps must be >= 1, got -3\n")
    assert cli.run_command("falcon-fwa test", _interrupted, argparse.Namespace()) == 130
    assert capsys.readouterr().err == "falcon-fwa test: interrupted\n"


@pytest.mark.parametrize("value", ["1", "yes", "true", "on"])
def test_a_value_saying_yes_raises_the_error_itself(monkeypatch, value):
    monkeypatch.setenv("FALCON_FWA_TRACEBACK", value)
    assert launcher.traceback_requested()
    with pytest.raises(ValueError, match=r"^--steps must be >= 1, got -3$"):
        cli.run_command("falcon-fwa test", _fails, argparse.Namespace())
    with pytest.raises(KeyboardInterrupt):
        cli.run_command("falcon-fwa test", _interrupted, argparse.Namespace())


def test_unset_keeps_the_one_line_error(monkeypatch):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert not launcher.traceback_requested()
