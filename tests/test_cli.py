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


@pytest.mark.parametrize("command, option", [
    (["demo"], "--seq-len"), (["demo"], "--heads"), (["demo"], "--head-dim"), (["demo"], "--window"),
])
def test_a_size_below_one_is_one_error_line_naming_the_option(capsys, monkeypatch, command, option):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.main([*command, option, "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa {command[0]}: error: {option} must be >= 1, got 0")
    assert "Traceback" not in err


def test_demo_on_one_token_reports_agreement_not_nan(capsys):
    # one token is the sentinel step: every form outputs zeros, and agrees exactly
    assert cli.main(["demo", "--seq-len", "1", "--heads", "1", "--head-dim", "2"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["1", "2", "3", "1A", "2A", "3A"]
    assert all(float(r[1]) == 0.0 and float(r[2]) == 0.0 for r in rows)



@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_commands_help_shows_its_defaults(name, capsys):
    """Each command's --help prints (argparse's %-formatting of every help text included) and gives the
    defaults that say something: demo's shape, not a None or an off switch."""
    with pytest.raises(SystemExit) as stop:
        cli.main([name, "--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith(f"usage: falcon-fwa {name}") and "(default: None)" not in text
    assert "(default: False)" not in text
    if name == "demo":
        assert "sequence length T (default: 256)" in text and "(default: 0)" in text
