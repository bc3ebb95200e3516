"""The ``falcon-fwa`` entry point: routing and how a command's errors reach the user."""
import types

import pytest

from falcon_fwa import cli


def test_a_bad_option_value_is_one_error_line_naming_it(capsys, monkeypatch):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.main(["addition", "--model", "nope", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa addition: error: --model: unknown 'nope'")
    assert "lineup.py:" in err and "Traceback" not in err
    assert cli.main(["addition-compare", "--models", "Transformer", "nope"]) == 2
    assert capsys.readouterr().err.startswith("falcon-fwa addition-compare: error: --models: unknown 'nope'")


def test_the_traceback_on_request(monkeypatch):
    monkeypatch.setenv("FALCON_FWA_TRACEBACK", "1")
    with pytest.raises(ValueError, match=r"^--steps must be >= 1, got -3$"):  # the error itself, not a line
        cli.main(["addition", "--preset", "tiny", "--steps", "-3"])


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"falcon-fwa {version('falcon-fwa')}\n"


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


def _fake_forms(monkeypatch, perturb):
    """demo's op and clock replaced: each call takes 5 ms of a fake clock, and the first call of each form
    100 ms more (a cold start); ``perturb[(rule, form)]`` is added to that output's largest entry, as a
    fraction of the recurrent output's largest magnitude."""
    from falcon_fwa import demo, falcon_attention

    clock, seen = [0.0], set()

    def op(q, k, v, beta, lam, *, rule, window, form):
        o, state = falcon_attention(q, k, v, beta, lam, rule=rule, window=window, form=form)
        clock[0] += 0.005 + (0.1 if form not in seen else 0.0)
        seen.add(form)
        if (rule, form) in perturb:
            ref, _ = falcon_attention(q, k, v, beta, lam, rule=rule, window=window, form="recurrent")
            o = o.contiguous().clone()
            o.view(-1)[ref.abs().argmax()] += perturb[rule, form] * ref.abs().max()
        return o, state

    monkeypatch.setattr(demo, "falcon_attention", op)
    monkeypatch.setattr(demo, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))


def test_demo_prints_the_forms_differences_and_their_steady_times(capsys, monkeypatch):
    """The printed differences are max |o_form - o_recurrent| / max |o_recurrent| of the outputs the forms
    gave (a known error put into two of them is printed as it is; the others agree to float64 rounding),
    and the printed times are those of a call after the first: a form's cold start is not counted in the
    first rule's row. The forms that disagree are named, and the exit status is 1."""
    _fake_forms(monkeypatch, {("2", "parallel"): 1e-3, ("3A", "chunk"): 2.5e-2})
    assert cli.main(["demo", "--seq-len", "12", "--heads", "2", "--head-dim", "3", "--window", "2"]) == 1
    out, err = capsys.readouterr()
    assert err == "falcon-fwa demo: the forms disagree beyond 1e-10: rule 2 parallel 1.0e-03, rule 3A chunk 2.5e-02\n"
    lines = out.splitlines()
    assert lines[0].startswith("B=1 T=12 H=2 K=V=3 window=2, float64")
    rows = {r[0]: [float(x) for x in r[1:]] for r in (line.split() for line in lines[2:])}
    assert list(rows) == ["1", "2", "3", "1A", "2A", "3A"]
    for rule, (parallel, chunk, *times) in rows.items():
        assert parallel == (1e-3 if rule == "2" else pytest.approx(0, abs=1e-12)), rule
        assert chunk == (2.5e-2 if rule == "3A" else pytest.approx(0, abs=1e-12)), rule
        assert times == [5.0, 5.0, 5.0], rule


@pytest.mark.parametrize("seed", ["-9223372036854775809", "18446744073709551616"])
def test_a_seed_torch_cannot_take_is_one_error_line_naming_it(capsys, monkeypatch, seed):
    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.main(["demo", "--seq-len", "2", "--seed", seed]) == 2
    assert capsys.readouterr().err.startswith(f"falcon-fwa demo: error: --seed must lie in [-2^63, 2^64), got {seed}")


def test_a_form_just_past_the_tolerance_fails_the_demo(capsys, monkeypatch):
    _fake_forms(monkeypatch, {("1A", "parallel"): 2e-10})
    assert cli.main(["demo", "--seq-len", "6", "--heads", "1", "--head-dim", "2"]) == 1
    assert capsys.readouterr().err.endswith(": rule 1A parallel 2.0e-10\n")
    _fake_forms(monkeypatch, {("1A", "parallel"): 5e-11})
    assert cli.main(["demo", "--seq-len", "6", "--heads", "1", "--head-dim", "2"]) == 0


def test_demo_takes_a_negative_seed_and_the_largest(capsys):
    for seed in ("-9223372036854775808", "18446744073709551615"):
        assert cli.main(["demo", "--seq-len", "2", "--heads", "1", "--head-dim", "2", "--seed", seed]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 16



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


@pytest.mark.parametrize("flushed", [True, False])
def test_a_reader_that_stops_early_ends_the_command_quietly(flushed):
    """``falcon-fwa ... | head -1``: the writes after the reader has gone end the command with the
    status of SIGPIPE (141) and no traceback, whether the line was written at once or left in the buffer."""
    import os
    import signal
    import subprocess
    import sys

    script = ("import sys, time\n"
              "from falcon_fwa import cli\n"
              "def run(args):\n"
              "    print('first', flush=True)\n"
              "    time.sleep(0.5)\n"
              f"    for i in range(100000): print('line', i, flush={flushed})\n"
              "sys.exit(cli.run_command('falcon-fwa test', run, None))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # unbuffered, nothing stays in the buffer
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline() == b"first\n"
    proc.stdout.close()  # the reader stops, as head does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    assert err == "", err


def test_an_os_error_is_one_error_line_naming_the_path(capsys, monkeypatch):
    """A file the command cannot write (no permission, a full disk) ends it as a bad option does: one line
    with the path and the place, status 2, no traceback."""
    def run(args):
        raise PermissionError(13, "Permission denied", "/read-only/out.json")

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.run_command("falcon-fwa test", run, None) == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa test: error: [Errno 13] Permission denied: '/read-only/out.json'\n"
                          "  (raised at ") and "test_cli.py:" in err and "Traceback" not in err


def test_a_keyboard_interrupt_is_one_line_and_the_status_of_sigint(capsys, monkeypatch):
    """Ctrl-C in a command with no clean stop of its own (tokenizing, say), or a second one during a
    training's clean stop: ``PROG: interrupted`` and 128 + SIGINT, no traceback; the traceback on request."""
    import signal

    def run(args):
        print("working", flush=True)
        raise KeyboardInterrupt

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert cli.run_command("falcon-fwa test", run, None) == 128 + signal.SIGINT
    out, err = capsys.readouterr()
    assert out == "working\n" and err == "falcon-fwa test: interrupted\n"
    monkeypatch.setenv("FALCON_FWA_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        cli.run_command("falcon-fwa test", run, None)


def test_a_real_ctrl_c_ends_with_the_line_after_the_progress_bar():
    """SIGINT to a command in a progress-bar loop: exit status 130, no traceback, and the progress bar
    closed before the line that says so (the line is the last thing on stderr)."""
    import signal
    import subprocess
    import sys

    # a suite started as a background job inherits SIGINT ignored: the command gets Ctrl-C's own handler
    script = ("import signal, sys, time\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              "from tqdm import tqdm\n"
              "from falcon_fwa import cli\n"
              "def run(args):\n"
              "    for i in tqdm(range(10 ** 9), desc='work', mininterval=0):\n"
              "        if i == 1: print('ready', flush=True)\n"
              "        time.sleep(0.01)\n"
              "sys.exit(cli.run_command('falcon-fwa test', run, None))\n")
    env = {k: v for k, v in __import__("os").environ.items() if k != "FALCON_FWA_TRACEBACK"}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout.readline() == b"ready\n"
    proc.send_signal(signal.SIGINT)
    try:
        err = proc.communicate(timeout=60)[1].decode()
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert "Traceback" not in err and "work:" in err, err
    assert err.endswith("\nfalcon-fwa test: interrupted\n"), err


def _parsers():
    import argparse
    import importlib

    for name, (module, _) in cli.COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"falcon-fwa {name}")
        importlib.import_module(module).add_arguments(parser)
        yield name, parser


def test_every_option_says_what_it_does_and_a_shared_option_reads_the_same_everywhere():
    """Each option of each command has a help text; an option that several commands take has one
    metavar and one type in all of them (``--set SECTION.FIELD=VALUE`` in train, compare and scaling)."""
    shared = {}
    for name, parser in _parsers():
        for action in parser._actions:
            if not action.option_strings or action.option_strings[0] == "-h":
                continue
            assert action.help, f"falcon-fwa {name} {action.option_strings[0]} has no help"
            for option in action.option_strings:
                shared.setdefault(option, {})[name] = (action.metavar, getattr(action.type, "__name__", None))
    for option, seen in shared.items():
        assert len(set(seen.values())) == 1, (option, seen)
    assert set(shared["--set"]) == {"train", "compare", "scaling"}
    assert set(shared["--set"].values()) == {("SECTION.FIELD=VALUE", None)}


def test_params_writes_the_table_it_prints_to_out(tmp_path, capsys):
    """``params --out FILE`` (as every command that writes a file spells it; ``--output`` is still taken)
    writes the printed table under a heading that gives the command."""
    for option in ("--out", "--output"):
        path = tmp_path / f"params{option}.md"
        assert cli.main(["params", "tiny-falcon", "tiny-transformer", option, str(path)]) == 0
        table = capsys.readouterr().out
        text = path.read_text()
        assert text.startswith("# Parameter counts of the presets\n\nProduced by `falcon-fwa params tiny-falcon "
                               "tiny-transformer`.")
        assert text.endswith("\n" + table) and table.count("\n| tiny-") == 2


def test_a_model_folder_without_a_tokenizer_is_named_before_ppl_loads_it(capsys, monkeypatch, tmp_path):
    """``model.save_pretrained`` alone writes no tokenizer: ``ppl`` names the folder (``--model``) before loading
    it, as ``generate`` does, rather than transformers' error after the load (``lm-eval``: test_eval)."""
    from falcon_fwa import FalconForCausalLM, get_preset

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    folder = tmp_path / "weights_only"
    FalconForCausalLM(get_preset("tiny-transformer", vocab_size=320)).save_pretrained(folder)
    (tmp_path / "d.txt").write_text("some held-out text\n")
    capsys.readouterr()  # the save's progress bar

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the folder was checked")

    monkeypatch.setattr("falcon_fwa.eval.ppl_cli.load_model", no_load)
    assert cli.main(["ppl", "--model", str(folder), "--data", str(tmp_path / "d.txt"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa ppl: error: --model: model folder {str(folder)!r} holds no tokenizer")
