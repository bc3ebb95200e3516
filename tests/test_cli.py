"""The ``falcon-fwa`` entry point: routing and how a command's errors reach the user."""
import pytest

from falcon_fwa import cli


def test_a_bad_option_value_is_one_error_line_naming_it(capsys, monkeypatch):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.main(["addition", "--model", "nope", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa addition: error: model: unknown 'nope'")
    assert "lineup.py:" in err and "Traceback" not in err


def test_the_traceback_on_request(monkeypatch):
    monkeypatch.setenv("FALCON_FWA_TRACEBACK", "1")
    with pytest.raises(ValueError, match="steps"):
        cli.main(["addition", "--preset", "tiny", "--steps", "-3"])


def test_an_unknown_command_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["nope"])
    assert stop.value.code == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
