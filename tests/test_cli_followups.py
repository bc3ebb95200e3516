"""Command-line follow-ups: ``compare --concurrent`` records what a stop signal left of each run and ends with
128 + the signal, as the sequential runs do."""
import json
import os
import signal
import threading
import time

import pytest

from falcon_fwa.train import compare, compare_report, latest_checkpoint, load_checkpoint
from falcon_fwa.train.logger import read_log
from test_cli_journeys import _compare


pytestmark = pytest.mark.usefixtures("one_thread")


def _signal_once_every_run_has_trained(runs, signum, timeout=120.0):
    """A thread that sends ``signum`` to this process once every run folder of ``runs`` has logged two steps."""
    def wait_then_signal():
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            logged = [os.path.join(r, "log.jsonl") for r in runs]
            if all(os.path.isfile(p) and len(read_log(p)) >= 2 for p in logged):
                break
            time.sleep(0.1)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.start()
    return thread


def test_a_sigterm_stops_every_concurrent_run_with_its_checkpoint_and_the_command_with_128_plus_it(tmp_path, capsys):
    """SIGTERM to ``compare --concurrent`` while both runs train: each ends its step with a checkpoint and is
    recorded ``stopped`` at that step (not ``running``), the command is not marked finished and ends with 143."""
    out = tmp_path / "cmp"
    runs = [str(out / "main" / name) for name in ("a", "b")]
    thread = _signal_once_every_run_has_trained(runs, signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        code = _compare(tmp_path, "--concurrent", "--steps", "100000")
    finally:
        signal.signal(signal.SIGTERM, previous)
        thread.join()
    assert code == 128 + signal.SIGTERM
    report = json.loads((out / "compare.json").read_text())
    assert report["status"] == {"a": "stopped", "b": "stopped"}
    assert report["finished"] is False
    for name, run_dir in zip(("a", "b"), runs):
        result = report["runs"][name]
        assert result["signal"] == "SIGTERM" and result["planned_steps"] == 100000
        # stopped after the two logged steps, short of the plan, with the checkpoint of the step it ended
        assert 2 <= result["steps"] < 100000
        assert load_checkpoint(latest_checkpoint(os.path.join(run_dir, "checkpoints")))["step"] == result["steps"]
        assert [r["step"] for r in result["log"] if "loss" in r] == list(range(1, result["steps"] + 1))
    table = compare_report.markdown_table(compare_report.result_rows(report))
    assert "| a | stopped: " in table and "| b | stopped: " in table
    assert "stopped by SIGTERM" in capsys.readouterr().err


def test_a_concurrent_comparison_stopped_before_a_launch_leaves_that_recipe_not_run(tmp_path):
    """A stop signal received before a recipe is launched: it is not started, and is recorded not_run."""
    class Received:
        received = signal.SIGINT

    events = list(compare.run_all([str(tmp_path / "never.yaml")], ["only"], str(tmp_path), [], "main", Received()))
    assert events == [("only", "not_run", {"error": "stopped by SIGINT before this recipe started",
                                           "signal": "SIGINT"})]
    assert not (tmp_path / "main" / "only").exists()


def test_a_stop_signal_during_the_concurrent_calibration_trains_no_recipe(tmp_path, monkeypatch, capsys):
    """The calibration runs stopped by a SIGTERM (one stopped at its step 5, the other had finished): no step
    count is planned from the partial rates, no recipe trains, every recipe is not_run and the command ends
    with 143."""
    calls = []

    def run_all(configs, names, out_dir, sets, tag):
        calls.append(tag)
        yield "a", "running", None
        yield "b", "running", None
        yield "a", "stopped", {"steps": 5, "tokens_per_s": 40.0, "signal": "SIGTERM"}
        yield "b", "done", {"steps": 30, "tokens_per_s": 50.0}

    monkeypatch.setattr(compare, "run_all", run_all)
    code = _compare(tmp_path, "--concurrent", "--time-budget", "30")
    assert code == 128 + signal.SIGTERM and calls == ["calibration"]
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert report["status"] == {"a": "not_run", "b": "not_run"} and report["finished"] is False
    assert "steps" not in report and report["error"] == "stopped by SIGTERM during calibration"
    assert "stopped by SIGTERM" in capsys.readouterr().err
