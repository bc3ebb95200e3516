"""The training infrastructure held to what its docstrings and docs/training.md state, each case against a hand-
written expectation: every recipe bound refused just past it with the message naming the field and the value, and
taken on it; wrong types named down to a list element; the defaults the docs' table lists; ``--set`` without ``=``,
an empty and a non-mapping recipe file, ``.yml`` and ``extends`` next to the file, ``5E4`` read as a number; which
checkpoint folders count as complete, their order, ``LATEST`` before the newest, an 8-digit step; the log's non-
finite values, its lines on disk as they come, nothing from a disabled logger, ``drop_after`` record by record and
``read_log``'s errors by file and line; the stop signals' first and second signal (off the main thread: inactive),
and the device's name."""
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import warnings

import pytest
from test_train import ROOT, recipe

from falcon_fwa.train import config_from_dict, latest_checkpoint, load_config, save_checkpoint
from falcon_fwa.train import launch
from falcon_fwa.train.checkpoint import checkpoint_step, list_checkpoints
from falcon_fwa.train.config import RunConfig, apply_overrides, assign_text, load_yaml, read_recipe, recipe_parent
from falcon_fwa.train.logger import MetricLogger, read_log


def _config(tmp_path, *assignments):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # train.steps=1 under the recipe's 2 warm-up steps warns
        return config_from_dict(apply_overrides(recipe(tmp_path), list(assignments)))


# ---------------------------------------------------------------- recipes

@pytest.mark.parametrize("assignment, message", [
    ("data.seq_len=0", "data.seq_len must be >= 1, got 0"),
    ("data.packing=rows", "data.packing must be one of ('eos', 'cu_seqlens'), got 'rows'"),
    ("optim.lr=0", "optim.lr must be a finite number > 0, got 0.0"),
    ("optim.betas=[0.9, 0.95, 0.99]", "optim.betas must be two numbers in [0, 1), got [0.9, 0.95, 0.99]"),
    ("optim.weight_decay=-0.5", "optim.weight_decay must be a finite number >= 0, got -0.5"),
    ("optim.min_lr_ratio=1.5", "optim.min_lr_ratio must lie in [0, 1], got 1.5"),
    ("train.steps=0", "train.steps must be >= 1, got 0"),
    ("train.micro_batch=0", "train.micro_batch must be >= 1, got 0"),
    ("train.dtype=fp16", "train.dtype must be one of bf16 (bfloat16), fp32 (float32), got 'fp16'"),
    ("train.strategy=tp", "train.strategy must be one of ('auto', 'single', 'ddp', 'fsdp2'), got 'tp'"),
    ("train.save_every=-1", "train.save_every must be >= 0 (0: never), got -1"),
    ("train.eval_every=-1", "train.eval_every must be >= 0 (0: never), got -1"),
    ("train.eval_batches=0", "train.eval_batches must be >= 1, got 0"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1, got 0"),
    ("log.every=0", "log.every must be >= 1, got 0"),
])
def test_a_value_just_past_its_bound_is_refused_naming_field_and_value(tmp_path, assignment, message):
    with pytest.raises(ValueError) as err:
        _config(tmp_path, assignment)
    assert str(err.value) == "config field " + message


@pytest.mark.parametrize("assignment, want", [
    ("data.seq_len=1", 1), ("optim.weight_decay=0", 0.0), ("optim.betas=[0, 0]", [0.0, 0.0]), ("train.steps=1", 1),
    ("train.micro_batch=1", 1), ("train.save_every=0", 0), ("train.eval_every=0", 0), ("train.eval_batches=1", 1),
    ("train.keep_checkpoints=1", 1), ("log.every=1", 1), ("train.dtype=bf16", "bf16"), ("train.strategy=ddp", "ddp"),
])
def test_a_value_on_its_bound_is_taken(tmp_path, assignment, want):
    field, _ = assignment.split("=")
    section, key = field.split(".")
    assert getattr(getattr(_config(tmp_path, assignment), section), key) == want


@pytest.mark.parametrize("assignment, message", [
    ("train.compile=1", "train.compile must be true or false, got 1"),
    ("train.steps=true", "train.steps must be an integer, got True"),
    ("optim.lr=true", "optim.lr must be a number, got True"),
    ("optim.betas=[0.9, fast]", "optim.betas[1] must be a number, got 'fast'"),
    ("log.wandb_project=3", "log.wandb_project must be a string, got 3"),
    ("train.out_dir=[a]", "train.out_dir must be a string, got ['a']"),
])
def test_a_value_of_the_wrong_type_is_named_down_to_its_list_element(tmp_path, assignment, message):
    with pytest.raises(ValueError) as err:
        _config(tmp_path, assignment)
    assert str(err.value) == "config field " + message


def test_an_optional_field_takes_null(tmp_path):
    cfg = _config(tmp_path, "log.wandb_project=proj")
    assert cfg.log.wandb_project == "proj"
    assert _config(tmp_path, "log.wandb_project=null").log.wandb_project is None


def _documented_defaults():
    """``{section: {field: default text}}`` from the fields table of docs/training.md (``field (default...)``)."""
    with open(os.path.join(ROOT, "docs", "training.md")) as f:
        rows = [line for line in f if re.match(r"^\| `(model|data|optim|train|log)` \|", line)]
    out = {}
    for row in rows:
        section, cell = re.match(r"^\| `(\w+)` \| (.*) \|$", row.strip()).groups()
        items, depth, start = [], 0, 0
        for i, ch in enumerate(cell):  # split at the commas outside parentheses and brackets
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            if ch == "," and depth == 0:
                items.append(cell[start:i])
                start = i + 1
        items.append(cell[start:])
        fields = {}
        for item in items:
            m = re.search(r"`(\w+)`(?: \((.*)\))?$", item.strip(), re.S)
            name, inside = m.groups()
            token = re.match(r"\[[^\]]*\]|`[^`]*`|[^,;:\s]+", inside).group(0) if inside else None
            fields[name] = token
        out[section] = fields
    return out


def test_the_defaults_are_those_the_docs_table_lists():
    """Every field of every section is in the table, and each default the table gives (the first value in the
    parentheses after the name) is the recipe's: ``keep_checkpoints`` (2), ``warmup_steps`` (2000), ..."""
    documented = _documented_defaults()
    assert sorted(documented) == ["data", "log", "model", "optim", "train"]
    defaults = RunConfig()
    checked = 0
    for section, fields in documented.items():
        obj = getattr(defaults, section)
        assert set(fields) == {f.name for f in dataclasses.fields(obj)}, section
        for name, token in fields.items():
            if token is None or name == "overrides":  # no default given; overrides: a description
                continue
            want = token.strip("`") if token.startswith("`") else load_yaml(token)
            assert getattr(obj, name) == want, (section, name, token)
            checked += 1
    assert checked >= 30


def test_set_without_an_equals_sign_is_refused_naming_it(tmp_path):
    with pytest.raises(ValueError) as err:
        apply_overrides(recipe(tmp_path), ["train.steps"])
    assert str(err.value) == "--set expects section.field=value, got 'train.steps'"


def test_assign_text_keeps_a_string_that_reads_as_yaml_a_string(tmp_path):
    for text in ["a #b", "x: 1", "1e3", "true", "[1]", "null"]:
        cfg = _config(tmp_path, assign_text("data.train_source", text))
        assert cfg.data.train_source == text


def test_an_empty_recipe_file_is_an_empty_recipe_and_a_list_is_refused(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert read_recipe(str(tmp_path / "empty.yaml")) == {}
    cfg = load_config(str(tmp_path / "empty.yaml"), ["data.train_source=x", "optim.warmup_steps=0"])
    assert (cfg.train.steps, cfg.optim.lr, cfg.data.train_source) == (100_000, 1e-3, "x")
    (tmp_path / "list.yaml").write_text("- train\n- optim\n")
    with pytest.raises(ValueError) as err:
        read_recipe(str(tmp_path / "list.yaml"))
    assert str(err.value) == f"recipe {str(tmp_path / 'list.yaml')!r} must hold a mapping of sections"


def test_a_yml_recipe_is_yaml_and_its_parent_is_found_next_to_it(tmp_path, monkeypatch):
    """``.yml`` reads as YAML as ``.yaml`` does; ``recipe_parent`` resolves ``extends`` in the file's own folder
    (not the working directory), and is ``None`` for a recipe that extends nothing."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "base.yml").write_text("train:\n  steps: 7\noptim: {lr: 2e-3}\n")
    (folder / "child.yml").write_text("extends: base.yml\ntrain:\n  seed: 3\n")
    monkeypatch.chdir(tmp_path)
    assert read_recipe(str(folder / "child.yml")) == {"train": {"steps": 7, "seed": 3}, "optim": {"lr": 2e-3}}
    assert recipe_parent(str(folder / "child.yml")) == str(folder / "base.yml")
    assert recipe_parent(str(folder / "base.yml")) is None


def test_load_yaml_reads_exponents_without_a_dot_in_either_case_as_floats():
    assert load_yaml("5E4") == 50000.0 and isinstance(load_yaml("5E4"), float)
    assert load_yaml("1e-3") == 0.001 and load_yaml("-2E+2") == -200.0
    assert load_yaml("12") == 12 and isinstance(load_yaml("12"), int) and load_yaml("e5") == "e5"



# ---------------------------------------------------------------- checkpoints

def _names(paths):
    return [os.path.basename(p) for p in paths]


def test_only_renamed_complete_folders_are_checkpoints_listed_oldest_first(tmp_path):
    """Steps 12, 3 and 7 saved in that order (keep 5): listed 3, 7, 12. A ``.tmp-step-*`` folder holding a whole
    checkpoint (a save killed before its rename) and a folder whose meta.json is not JSON are no checkpoints."""
    folder = tmp_path / "checkpoints"
    for step in (12, 3, 7):
        save_checkpoint(str(folder), step, {"step": step}, keep=5)
    os.rename(folder / "step-00000012", folder / ".tmp-step-00000012")
    save_checkpoint(str(folder), 9, {"step": 9}, keep=5)  # the next save removes the stale temporary folder
    assert not (folder / ".tmp-step-00000012").exists()
    save_checkpoint(str(folder), 20, {"step": 20}, keep=5)
    os.makedirs(folder / ".tmp-step-00000030")
    for name in os.listdir(folder / "step-00000020"):
        with open(folder / "step-00000020" / name, "rb") as src, open(folder / ".tmp-step-00000030" / name, "wb") as dst:
            dst.write(src.read())
    (folder / "step-00000009" / "meta.json").write_text('{"step": 9, "comp')
    assert _names(list_checkpoints(str(folder))) == ["step-00000003", "step-00000007", "step-00000020"]
    (folder / "step-00000003" / "meta.json").write_text('[{"complete": true}]')  # JSON, but no object
    assert _names(list_checkpoints(str(folder))) == ["step-00000007", "step-00000020"]
    (folder / "step-00000020" / "meta.json").write_text("not json\n")
    (folder / "LATEST").write_text("step-00000020")
    assert _names([latest_checkpoint(str(folder))]) == ["step-00000007"]


def test_latest_names_the_checkpoint_latest_points_at_not_the_newest(tmp_path):
    """Steps 5 then 3 saved (a resume from an earlier step): LATEST names step 3 and latest_checkpoint gives it,
    though step 5 is newer and complete; without LATEST, the newest complete one."""
    folder = tmp_path / "checkpoints"
    save_checkpoint(str(folder), 5, {"step": 5}, keep=2)
    save_checkpoint(str(folder), 3, {"step": 3}, keep=2)
    assert (folder / "LATEST").read_text() == "step-00000003"
    assert _names([latest_checkpoint(str(folder))]) == ["step-00000003"]
    os.remove(folder / "LATEST")
    assert _names([latest_checkpoint(str(folder))]) == ["step-00000005"]
    assert latest_checkpoint(str(tmp_path / "none")) is None


def test_a_step_saved_again_replaces_its_checkpoint_and_leaves_no_folder_beside_it(tmp_path):
    import torch

    folder = tmp_path / "checkpoints"
    save_checkpoint(str(folder), 4, {"v": 1}, keep=2)
    save_checkpoint(str(folder), 4, {"v": 2}, keep=2)
    assert sorted(os.listdir(folder)) == ["LATEST", "step-00000004"]
    assert torch.load(folder / "step-00000004" / "state.pt", weights_only=False) == {"v": 2}


def test_checkpoints_past_eight_digits_are_ordered_by_step_and_pruned_oldest_first(tmp_path):
    """Step 100,000,000 (nine digits, ``step-100000000``) is newer than step 99,999,999 (``step-99999999``):
    listed after it, the newest without LATEST, and keep=2 prunes step 99,999,998 rather than the newest."""
    folder = tmp_path / "checkpoints"
    for step in (99_999_998, 99_999_999, 100_000_000):
        save_checkpoint(str(folder), step, {"step": step}, keep=5)
    assert _names(list_checkpoints(str(folder))) == ["step-99999998", "step-99999999", "step-100000000"]
    os.remove(folder / "LATEST")
    assert _names([latest_checkpoint(str(folder))]) == ["step-100000000"]
    save_checkpoint(str(folder), 100_000_001, {"step": 100_000_001}, keep=2)
    assert _names(list_checkpoints(str(folder))) == ["step-100000000", "step-100000001"]


def test_steps_of_eight_digits_keep_their_order_and_number(tmp_path):
    """``step-{step:08d}``: step 12345678 is the folder ``step-12345678``, its step read back whole."""
    folder = tmp_path / "checkpoints"
    path = save_checkpoint(str(folder), 12_345_678, {"step": 1}, keep=1)
    assert os.path.basename(path) == "step-12345678" and checkpoint_step(path) == 12_345_678
    assert checkpoint_step(str(folder / "step-00000040") + os.sep) == 40


# ---------------------------------------------------------------- the log

def _logger(folder):
    return MetricLogger(str(folder), enabled=True, tensorboard=False, wandb_project=None, config={})


def test_a_record_is_strict_json_with_null_for_every_non_finite_float(tmp_path):
    logger = _logger(tmp_path)
    try:
        logger.log(3, loss=float("inf"), grad_norm=float("-inf"), lr=float("nan"), tokens=96, note="x", ok=0.5)
    finally:
        logger.close()
    line = (tmp_path / "log.jsonl").read_text()
    assert line == '{"step": 3, "loss": null, "grad_norm": null, "lr": null, "tokens": 96, "note": "x", "ok": 0.5}\n'


def test_each_record_reaches_the_file_as_it_is_logged_and_a_relaunch_appends(tmp_path):
    """The log's lines are flushed as they come: another reader sees each one while the logger is open; a
    second logger on the folder (the relaunch) adds to the file."""
    logger = _logger(tmp_path)
    try:
        logger.log(1, loss=2.5)
        assert read_log(str(tmp_path / "log.jsonl")) == [{"step": 1, "loss": 2.5}]
        logger.log(2, loss=2.25)
        assert read_log(str(tmp_path / "log.jsonl")) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}]
    finally:
        logger.close()
    logger = _logger(tmp_path)
    try:
        logger.log(3, val_loss=2.0)
    finally:
        logger.close()
    assert [r["step"] for r in read_log(str(tmp_path / "log.jsonl"))] == [1, 2, 3]


def test_a_disabled_logger_writes_nothing_and_keeps_no_file(tmp_path):
    """The log is the main rank's: on the others every call, ``drop_after`` of a resume included, does nothing."""
    logger = MetricLogger(str(tmp_path / "run"), enabled=False, tensorboard=False, wandb_project=None, config={})
    logger.drop_after(2, off_cadence=True)
    logger.log(3, loss=1.0)
    logger.close()
    assert not (tmp_path / "run").exists()


RECORDS = [{"run": "start"}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": 3.5}, {"step": 2, "val_loss": 3.6},
           {"step": 2, "event": "non_finite", "loss": None}, {"step": 3, "loss": 3.0}, {"step": 4, "val_loss": 3.1}]


@pytest.mark.parametrize("off_cadence, kept", [
    (False, [0, 1, 2, 3, 4]),   # every record up to step 2 (a record without a step counts as step 0)
    (True, [0, 1, 3, 4]),       # less the training record of step 2 itself; its evaluation and event stay
])
def test_drop_after_keeps_the_records_up_to_the_step(tmp_path, off_cadence, kept):
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    logger = _logger(tmp_path)
    try:
        logger.drop_after(2, off_cadence=off_cadence)
        logger.log(3, loss=2.9)  # written after the kept records
    finally:
        logger.close()
    assert read_log(str(tmp_path / "log.jsonl")) == [RECORDS[i] for i in kept] + [{"step": 3, "loss": 2.9}]


@pytest.mark.parametrize("text, message", [
    ('{"step": 1}\n{"step": 2, "lo\n', ":2: not a record of a training log; choose another train.out_dir"),
    ('{"step": 1}\n\n[1, 2]\n{"step": 3}\n', ":3: not a record of a training log (a list); choose another"),
    ('{"step": 1}\nnot json\n{"step": 3}\n', ":2: not a record of a training log; choose another"),
])
def test_a_bad_line_is_named_by_file_and_line(tmp_path, text, message):
    """Only a last line cut short (no newline) is left out; a bad whole line, last or not, is an error naming
    its line (blank lines are counted, not read)."""
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        read_log(str(path))
    assert str(err.value).startswith(str(path) + message)


def test_a_last_line_cut_short_is_left_out(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    assert read_log(str(path)) == [{"step": 1}, {"step": 2}]


# ---------------------------------------------------------------- stop signals, the device

def test_stop_signals_off_the_main_thread_are_inactive_and_leave_the_handlers():
    seen = {}

    def body():
        before = signal.getsignal(signal.SIGTERM)
        try:
            with launch.StopSignals(True) as stops:
                seen["enabled"] = stops.enabled
                seen["handler"] = signal.getsignal(signal.SIGTERM) is before
        except ValueError as e:  # what setting a handler off the main thread raises
            seen["error"] = e

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"enabled": False, "handler": True}


_SIGNALS_SCRIPT = """
import importlib.util, os, signal, sys
spec = importlib.util.spec_from_file_location("launch", sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
calls = []
signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
signal.signal(signal.SIGINT, signal.default_int_handler)
with launch.StopSignals(True) as stops:
    signal.raise_signal(signal.SIGINT)
    print("first", stops.received == signal.SIGINT, calls == [], flush=True)
    try:
        signal.raise_signal(signal.SIGINT)
        print("second SIGINT: no KeyboardInterrupt", flush=True)
    except KeyboardInterrupt:
        print("second SIGINT: KeyboardInterrupt", flush=True)
    signal.raise_signal(signal.SIGTERM)
    print("SIGTERM after SIGINT", calls == [signal.SIGTERM], stops.received == signal.SIGINT, flush=True)
print("after", signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
"""


def test_the_first_signal_is_recorded_and_the_second_gets_the_handler_that_was_there():
    """In a child process (a wrong handler there ends only the child): the first SIGINT sets ``received``; the
    second raises KeyboardInterrupt (the handler before); SIGTERM, once a signal was received, goes to the
    handler that was there before (here a Python function), and ``received`` stays the first signal's."""
    out = subprocess.run([sys.executable, "-c", _SIGNALS_SCRIPT, launch.__file__], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == ["first True True", "second SIGINT: KeyboardInterrupt",
                                       "SIGTERM after SIGINT True True", "after True"], (out.stdout, out.stderr)
    assert out.returncode == 0


_HANGUP_SCRIPT = """
import importlib.util, signal, sys
spec = importlib.util.spec_from_file_location("launch", sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
calls = []
for sig in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, lambda signum, frame: calls.append(signum))
with launch.StopSignals(True) as stops:
    signal.raise_signal(signal.SIGHUP)
    signal.raise_signal(signal.SIGHUP)
    signal.raise_signal(signal.SIGHUP)
    print("hangups", stops.received == signal.SIGHUP, calls == [], flush=True)
    signal.raise_signal(signal.SIGTERM)
    print("SIGTERM after SIGHUP", calls == [], stops.received == signal.SIGTERM, flush=True)
    signal.raise_signal(signal.SIGTERM)
    print("second SIGTERM", calls == [signal.SIGTERM], stops.received == signal.SIGTERM, flush=True)
with launch.StopSignals(True) as stops:
    signal.raise_signal(signal.SIGINT)
    signal.raise_signal(signal.SIGHUP)
    print("SIGHUP after SIGINT", stops.received == signal.SIGINT, calls == [signal.SIGTERM], flush=True)
print("restored", signal.getsignal(signal.SIGHUP) is not signal.SIG_DFL, flush=True)
"""


def test_a_hangup_stops_once_and_its_repeats_change_nothing():
    """In a child process: SIGHUP (how a launcher's end reaches its runs, ``end_with_parent``) sets
    ``received``; the same signal again, as the system repeats it once per thread of a dying launcher, leaves
    everything as it is (no handler called, nothing raised); a SIGTERM after it is the first of its kind (it may
    have come with the SIGHUP: ``received`` names it, no handler called), a second SIGTERM goes to the handler
    that was there before, and a SIGHUP after a SIGINT is ignored. The handlers come back after."""
    out = subprocess.run([sys.executable, "-c", _HANGUP_SCRIPT, launch.__file__], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == ["hangups True True", "SIGTERM after SIGHUP True True", "second SIGTERM True True",
                                       "SIGHUP after SIGINT True True", "restored True"], (out.stdout, out.stderr)
    assert out.returncode == 0


def test_end_with_parent_asks_for_the_hangup_signal(monkeypatch):
    """The parent-death signal ``end_with_parent`` sets is SIGHUP (``PR_SET_PDEATHSIG`` = 1), the one that
    ``StopSignals`` takes once; a child whose parent already ended sends it to itself."""
    import ctypes

    calls, killed = [], []

    class Libc:
        def prctl(self, option, value):
            calls.append((option, value))
            return 0

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Libc())
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(signal, "signal", lambda *a: None)  # (the child's SIGHUP action: not this process's)
    preexec = launch.end_with_parent()  # made here: this process is the parent
    parent = os.getpid()
    monkeypatch.setattr(os, "getppid", lambda: parent)  # as in the child, whose parent is alive
    preexec()
    assert calls == [(1, int(signal.SIGHUP))] and killed == []
    monkeypatch.setattr(os, "getppid", lambda: -1)  # as if the parent had ended before the setting took
    preexec()
    assert killed == [(os.getpid(), signal.SIGHUP)]
    assert launch.PARENT_ENDED == signal.SIGHUP and signal.SIGHUP in launch.StopSignals.SIGNALS


def test_the_device_is_named_by_count_and_name_or_as_the_cpu(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert launch.device_description() == f"CPU ({os.cpu_count()} cores, gloo)"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert launch.device_description() == "2 x NVIDIA H200"


def test_a_child_takes_the_hangup_signal_where_its_launcher_ignores_it():
    """Launched under ``nohup`` (SIGHUP ignored, which a child inherits), a child of ``end_with_parent`` still
    takes SIGHUP, the stop its launcher passes on and the one its launcher's end sends: at its default action
    here, a process of this library replaces it with its own stop handler."""
    import subprocess
    import sys

    probe = "import signal; print(signal.getsignal(signal.SIGHUP) == signal.SIG_DFL)"
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
        launched = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                                  preexec_fn=launch.end_with_parent())
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert plain.stdout.strip() == "False"  # inherited, as nohup leaves it
    assert launched.stdout.strip() == "True"
