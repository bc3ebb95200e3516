"""Command-line follow-ups: ``compare --concurrent`` records what a stop signal left of each run and ends with
128 + the signal, as the sequential runs do; ``ppl`` refuses the text options for token shard folders;
``throughput`` shows its progress."""
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


def _wait_until_every_run_has_trained(runs, end):
    """Until every run folder of ``runs`` has logged two steps, or the monotonic clock reaches ``end``."""
    while time.monotonic() < end and not all(
            os.path.isfile(os.path.join(r, "log.jsonl")) and len(read_log(os.path.join(r, "log.jsonl"))) >= 2
            for r in runs):
        time.sleep(0.1)


def assert_killed_whole(code, second, launched):
    """The command ended with 128 + ``second``, each of the two ``launched`` runs was killed (SIGKILL), and nothing
    of either's process group is left."""
    assert code == 128 + second
    assert len(launched) == 2 and [p.returncode for p in launched] == [-signal.SIGKILL] * 2
    for proc in launched:
        with pytest.raises(ProcessLookupError):
            os.killpg(proc.pid, 0)


def _compare_while(thread, tmp_path, *extra):
    """``_compare`` while ``thread`` (started) signals this process, whose own SIGTERM handler must not be
    reached (the command's takes it); the thread is joined after."""
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        return _compare(tmp_path, *extra)
    finally:
        signal.signal(signal.SIGTERM, previous)
        thread.join()


def _signal_once_every_run_has_trained(runs, signum, timeout=120.0):
    """A thread that sends ``signum`` to this process once every run folder of ``runs`` has logged two steps."""
    def wait_then_signal():
        _wait_until_every_run_has_trained(runs, time.monotonic() + timeout)
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
    code = _compare_while(thread, tmp_path, "--concurrent", "--steps", "100000")
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

    def run_all(configs, names, out_dir, sets, tag, signals=None):
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


@pytest.mark.parametrize("option, value", [("--text-split", "line"), ("--text-split", "file"),
                                           ("--text-field", "body")])
def test_ppl_refuses_text_options_by_name_for_token_shards(tmp_path, capsys, monkeypatch, option, value):
    """A token shard folder (`falcon-fwa data`'s val split) was split into documents and tokenized when it was
    written: --text-split and --text-field would change nothing there, so they are refused by name (status 2,
    before any model loads); a text file beside it still takes them, and the shards alone run without them."""
    from falcon_fwa import cli
    from falcon_fwa.data import DataSpec, prepare_dataset
    from falcon_fwa.data.tokenizer import byte_tokenizer
    from falcon_fwa.eval import ppl_cli
    from falcon_fwa.models import FalconForCausalLM, get_preset

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of the state" for i in range(40)))
    prepare_dataset(DataSpec(train_source=str(corpus), text_split="line", val_every=4), str(tmp_path / "prepared"))
    shards = str(tmp_path / "prepared" / "val")
    model = tmp_path / "model"
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320)).save_pretrained(model)
    byte_tokenizer().save_pretrained(model)
    capsys.readouterr()  # the tokenizing's progress bars
    base = ["ppl", "--model", str(model), "--seq-len", "16", "--max-windows", "1", "--device", "cpu"]

    loaded = []
    original = ppl_cli.load_model
    monkeypatch.setattr(ppl_cli, "load_model", lambda *a, **k: loaded.append(1) or original(*a, **k))
    assert cli.main([*base, "--data", shards, option, value]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa ppl: error: {option} {value}: --data {shards} is token shards")
    reads = {"--text-split": "text files", "--text-field": "JSON, JSONL and Parquet files"}[option]
    assert f"{option} applies to {reads} only" in err  # the files each option reads (sources._split_text, records)
    assert loaded == []
    assert cli.main([*base, "--data", shards]) == 0
    assert cli.main([*base, "--data", shards, str(corpus), option, value]) == 0  # the text file reads them
    assert cli.main([*base, "--data", str(corpus), option, value]) == 0


def test_throughput_shows_a_progress_bar_over_each_measurements_steps_unless_told_not_to(tmp_path, capsys):
    """Each measurement's bar counts its --warmup + --steps steps (1 + 2 here) on standard error, named by its
    preset and length; standard output keeps only the JSON rows. --no-progress: no bar."""
    import re

    from test_compare_tools import run_throughput

    rows = run_throughput(tmp_path, "--steps", "2", "--min-steps", "2")
    captured = capsys.readouterr()
    assert [json.loads(line) for line in captured.out.splitlines()] == rows
    for preset, seq_len in (("tiny-falcon", 8), ("tiny-transformer", 8), ("tiny-falcon", 16),
                            ("tiny-transformer", 16)):
        ends = re.findall(rf"{preset} seq_len {seq_len}: *100%[^\r\n]*\| *(\d+)/(\d+) ", captured.err)
        assert ends and ends[-1] == ("3", "3"), captured.err
    (tmp_path / "rows.jsonl").unlink()
    rows = run_throughput(tmp_path, "--steps", "2", "--min-steps", "2", "--no-progress")
    captured = capsys.readouterr()
    assert len(rows) == 4 and captured.err == ""


def test_a_stop_signal_that_the_concurrent_calibration_runs_outlive_still_trains_no_recipe(tmp_path, monkeypatch,
                                                                                          capsys):
    """A SIGTERM that arrives as the concurrent calibration runs end (each has finished its steps, so none
    records it): it is kept all the same. No step count is planned, no main run starts (all not_run, no
    OUT/main), and the command ends with 143, as a stop during the main runs ends it."""
    real_collect = compare._collect

    def collect_then_signal(procs, signals=None):
        yield from real_collect(procs, signals)  # every calibration run has ended here
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(compare, "_collect", collect_then_signal)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        code = _compare(tmp_path, "--concurrent", "--time-budget", "5", "--calib-steps", "3", "--max-steps", "20")
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = tmp_path / "cmp"
    report = json.loads((out / "compare.json").read_text())
    assert {n: (r.get("steps"), r.get("signal")) for n, r in report["calibration"].items()} == {
        "a": (3, None), "b": (3, None)}  # the calibration runs finished, unstopped
    assert code == 128 + signal.SIGTERM
    assert report["status"] == {"a": "not_run", "b": "not_run"} and report["finished"] is False
    assert "steps" not in report and report["error"] == "stopped by SIGTERM during calibration"
    assert report["signal"] == "SIGTERM"
    assert not (out / "main").exists()
    assert "stopped by SIGTERM during calibration" in capsys.readouterr().err


def test_a_stop_during_calibration_is_kept_where_sigterm_was_ignored_at_launch(tmp_path, monkeypatch):
    """Launched with SIGTERM ignored (as under some launchers), the command's stop handler is found by no
    signal's handler: it is handed to the calibration and main runs, so a SIGINT as the calibration runs end
    still trains no recipe (exit 130)."""
    real_collect = compare._collect

    def collect_then_signal(procs, signals=None):
        yield from real_collect(procs, signals)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(compare, "_collect", collect_then_signal)
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        code = _compare(tmp_path, "--concurrent", "--time-budget", "5", "--calib-steps", "3", "--max-steps", "20")
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert code == 128 + signal.SIGINT
    assert report["status"] == {"a": "not_run", "b": "not_run"} and report["signal"] == "SIGINT"
    assert not (tmp_path / "cmp" / "main").exists()


def test_a_stop_that_comes_as_every_main_run_ends_leaves_the_comparison_complete(tmp_path, monkeypatch, capsys):
    """A SIGTERM that arrives once every main run has ended cut nothing short: the report is finished, with
    every run done and the signal named, and the command ends with 143 all the same."""
    real_collect = compare._collect

    def collect_then_signal(procs, signals=None):
        yield from real_collect(procs, signals)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(compare, "_collect", collect_then_signal)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    try:
        code = _compare(tmp_path, "--concurrent", "--steps", "3")
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert code == 128 + signal.SIGTERM
    assert report["status"] == {"a": "done", "b": "done"} and report["finished"] is True
    assert report["signal"] == "SIGTERM" and {r["steps"] for r in report["runs"].values()} == {3}
    assert "after every run had ended: the comparison is complete" in capsys.readouterr().err


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_second_sigterm_kills_every_concurrent_run_at_once_and_records_it(tmp_path, monkeypatch, capsys, second):
    """A second SIGTERM or SIGINT to ``compare --concurrent`` (after a first SIGTERM, handled, the runs not yet at
    their stop): the command kills each run's process group at once (SIGKILL: no checkpoint is written, none
    outlives the command), records each run killed by that second signal in compare.json (not running) and ends
    with 128 + it."""
    name = signal.Signals(second).name
    launched = []
    real_launch = compare._launch

    def launch(*a, **k):
        launched.append(real_launch(*a, **k))
        return launched[-1]

    monkeypatch.setattr(compare, "_launch", launch)
    out = tmp_path / "cmp"
    runs = [str(out / "main" / name) for name in ("a", "b")]

    def wait_then_signal_twice():
        end = time.monotonic() + 120.0
        _wait_until_every_run_has_trained(runs, end)
        os.kill(os.getpid(), signal.SIGTERM)
        handler = signal.getsignal(signal.SIGTERM)  # the command's: the second must come after it took the first
        while time.monotonic() < end and not getattr(getattr(handler, "__self__", None), "received", 0):
            time.sleep(0.001)
        os.kill(os.getpid(), second)

    thread = threading.Thread(target=wait_then_signal_twice, daemon=True)
    thread.start()
    code = _compare_while(thread, tmp_path, "--concurrent", "--steps", "100000")
    assert_killed_whole(code, second, launched)
    report = json.loads((out / "compare.json").read_text())
    assert report["status"] == {"a": "killed", "b": "killed"} and report["finished"] is False
    assert report["signal"] == name
    for recipe_name, run_dir in zip(("a", "b"), runs):
        result = report["runs"][recipe_name]
        assert result["signal"] == name and result["planned_steps"] == 100000
        assert result["error"].startswith(f"a second {name} ended it at once")
        assert latest_checkpoint(os.path.join(run_dir, "checkpoints")) is None  # killed, not stopped at a step
        assert not os.path.exists(os.path.join(run_dir, "summary.json"))
        assert len([r for r in result["log"] if "loss" in r]) >= 2
    table = compare_report.markdown_table(compare_report.result_rows(report))
    assert f"| a | killed: a second {name}" in table and f"| b | killed: a second {name}" in table
    assert f"stopped by {name}" in capsys.readouterr().err


def test_a_concurrent_comparison_under_nohup_still_stops_its_runs(tmp_path):
    """``nohup falcon-fwa compare --concurrent`` (SIGHUP ignored, which launched processes inherit): a SIGTERM still
    stops each run at its step with a checkpoint, as without nohup, rather than letting it train on to its end."""
    out = tmp_path / "cmp"
    runs = [str(out / "main" / name) for name in ("a", "b")]
    thread = _signal_once_every_run_has_trained(runs, signal.SIGTERM)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("the signal reached the test's handler"))
    hangup = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        code = _compare(tmp_path, "--concurrent", "--steps", "3000")
    finally:
        signal.signal(signal.SIGHUP, hangup)
        signal.signal(signal.SIGTERM, previous)
        thread.join()
    assert code == 128 + signal.SIGTERM
    report = json.loads((out / "compare.json").read_text())
    assert report["status"] == {"a": "stopped", "b": "stopped"}
    for name, run_dir in zip(("a", "b"), runs):
        result = report["runs"][name]
        assert result["signal"] == "SIGTERM" and 2 <= result["steps"] < 3000
        assert load_checkpoint(latest_checkpoint(os.path.join(run_dir, "checkpoints")))["step"] == result["steps"]


def test_a_run_folder_that_a_run_still_holds_is_not_removed_for_a_fresh_run(tmp_path):
    """A run of a launch killed just before may still be ending its step in its folder (it holds the trainer's
    lock there): a fresh run in that folder is refused by name and the folder kept; once free, it is emptied."""
    from falcon_fwa.atomic import folder_lock
    from falcon_fwa.train.launch import LOCK_NAME

    run_dir = tmp_path / "main" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "log.jsonl").write_text("{}\n")
    with folder_lock(run_dir, LOCK_NAME, wait=False):
        with pytest.raises(ValueError, match=rf"^{run_dir} is in use by a run still going"):
            compare._fresh_dir(str(run_dir))
        assert (run_dir / "log.jsonl").read_text() == "{}\n"
    assert compare._fresh_dir(str(run_dir)) == str(run_dir) and os.listdir(run_dir) == []
