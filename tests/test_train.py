"""Training: schedule, recipes, exact resume, atomic checkpoints, the non-finite guard, torchrun."""
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import fsdp2_on_cpu

from falcon_fwa.train import NonFiniteLoss, Trainer, config_from_dict, latest_checkpoint, load_checkpoint, lr_at
from falcon_fwa.train import checkpoint as ckpt_module
from falcon_fwa.train import trainer as trainer_module
from falcon_fwa.train.config import load_config
from falcon_fwa.train.logger import read_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_corpus(path, n=120, seed=0):
    rng = random.Random(seed)
    words = "the state memory key value write read gate decay token fast weight".split()
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(3, 30)))}) + "\n")


def recipe(tmp_path, out="run", **train):
    corpus = tmp_path / "corpus.jsonl"
    if not corpus.exists():
        write_corpus(corpus)
    return {
        "model": {"preset": "tiny-falcon"},
        "data": {"train_source": str(corpus), "seq_len": 24, "out_dir": str(tmp_path / "data"), "val_every": 10},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": 4, "global_batch": 4, "micro_batch": 2, "dtype": "fp32", "out_dir": str(tmp_path / out),
                  "save_every": 2, "eval_every": 2, "eval_batches": 1, "export_model": False, **train},
        "log": {"every": 1, "progress": False, "tensorboard": False},
    }


def losses(run_dir, key="loss"):
    return [(r["step"], r[key]) for r in read_log(os.path.join(run_dir, "log.jsonl")) if key in r]


def run_trainer(raw, stop_at=None):
    trainer = Trainer(config_from_dict(raw))
    try:
        trainer.train(stop_at=stop_at)
    finally:
        trainer.close()
    return trainer


def signal_during_step_3(monkeypatch, signum):
    """``signum`` sent to this process during step 3 (the fifth micro-step's loss, two micro-batches a step);
    returns the list that counts the loss calls."""
    real, calls = trainer_module.causal_lm_loss, []

    def signalled(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            os.kill(os.getpid(), signum)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", signalled)
    return calls


def test_warmup_cosine_schedule_by_hand():
    kw = dict(lr=1.0, warmup_steps=4, total_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == 1.0  # cosine starts at the peak
    assert lr_at(9, **kw) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way: cos(pi/2) = 0
    assert lr_at(14, **kw) == pytest.approx(0.1) and lr_at(20, **kw) == pytest.approx(0.1)


def test_recipe_errors_name_the_field(tmp_path):
    raw = recipe(tmp_path)
    raw["train"]["stepz"] = 3
    with pytest.raises(ValueError, match="train.stepz"):
        config_from_dict(raw)
    raw = recipe(tmp_path)
    raw["data"]["packing"] = "rows"
    with pytest.raises(ValueError, match="data.packing"):
        config_from_dict(raw)
    raw = recipe(tmp_path, global_batch=6, micro_batch=4)
    with pytest.raises(ValueError, match="train.global_batch"):
        Trainer(config_from_dict(raw))


def test_unreadable_recipes_and_values_are_one_line_errors(tmp_path, capsys):
    """Through ``falcon-fwa train`` and torchrun's entry (``python -m falcon_fwa.train.cli``) alike: YAML
    that does not parse, in a file or a ``--set``, a recipe that extends itself and ``--stop-at 0`` end
    with the message and status 2, not a traceback."""
    from falcon_fwa.cli import main as falcon_fwa
    from falcon_fwa.train.cli import main as torchrun_entry

    good = tmp_path / "good.json"
    good.write_text(json.dumps(recipe(tmp_path)))
    (tmp_path / "broken.yaml").write_text("train:\n  steps: [1\n")
    (tmp_path / "loop.yaml").write_text("extends: loop2.yaml\n")
    (tmp_path / "loop2.yaml").write_text("extends: loop.yaml\n")
    cases = [(["--config", str(tmp_path / "broken.yaml")], "broken.yaml' is not valid YAML"),
             (["--config", str(good), "--set", "train.steps=[1"], "--set 'train.steps=[1': the value is not valid"),
             (["--config", str(tmp_path / "loop.yaml")], "loop.yaml' extends itself"),
             (["--config", str(good), "--stop-at", "0"], "--stop-at must be a step >= 1, got 0")]
    for args, message in cases:
        for entry in (lambda a: falcon_fwa(["train", *a]), torchrun_entry):
            capsys.readouterr()
            assert entry(args) == 2, args
            err = capsys.readouterr().err
            assert err.startswith("falcon-fwa train: error: ") and message in err and "Traceback" not in err, err


def test_shipped_recipes_load_and_name_real_presets():
    from falcon_fwa.models import PRESETS, get_preset

    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ROOT, "configs")) for f in fs
             if f.endswith(".yaml") and "lm_eval" not in d]
    paper = [f for f in files if os.sep + "paper" + os.sep in f and not f.endswith("base.yaml")]
    small = [f for f in files if os.sep + "small" + os.sep in f and not f.endswith("base.yaml")]
    assert len(paper) >= 9 and len(small) >= 7
    for path in paper + small:
        cfg = load_config(path, ["data.train_source=x"])
        assert cfg.model.preset in PRESETS, path
        get_preset(cfg.model.preset, **cfg.model.overrides)
    for path in paper:  # the paper's recipe (Section 5.1, Appendix B)
        cfg = load_config(path)
        o, t = cfg.optim, cfg.train
        assert (o.lr, o.betas, o.weight_decay, o.warmup_steps, o.clip_grad_norm) == (1e-3, [0.9, 0.95], 0.1, 2000, 1.0)
        assert (cfg.data.seq_len, t.global_batch, t.steps, t.dtype) == (1024, 480, 100_000, "bf16")


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    full = run_trainer(recipe(tmp_path, "full"))
    run_trainer(recipe(tmp_path, "split"), stop_at=2)
    assert losses(tmp_path / "split") == losses(tmp_path / "full")[:2]
    resumed = run_trainer(recipe(tmp_path, "split"))
    assert len(losses(tmp_path / "full")) == 4 and full.accum == 2
    assert losses(tmp_path / "split") == losses(tmp_path / "full")
    assert losses(tmp_path / "split", "val_loss") == losses(tmp_path / "full", "val_loss")
    for (name, a), b in zip(full.core.state_dict().items(), resumed.core.state_dict().values()):
        assert torch.equal(a, b), name
    state = load_checkpoint(latest_checkpoint(str(tmp_path / "full" / "checkpoints")))
    assert state["step"] == 4 and state["data"]["position"] == 8 and state["scheduler"]["step"] == 4


def test_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    raw = recipe(tmp_path, "run")
    run_trainer(raw, stop_at=2)
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        f.write(b"partial bytes of a checkpoint")  # the process dies mid-write
        raise KeyboardInterrupt("killed during save")

    monkeypatch.setattr(ckpt_module.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        run_trainer(raw)
    monkeypatch.setattr(ckpt_module.torch, "save", real_save)
    ckdir = tmp_path / "run" / "checkpoints"
    assert any(n.startswith(".tmp-") for n in os.listdir(ckdir))  # the interrupted save
    latest = latest_checkpoint(str(ckdir))
    assert os.path.basename(latest) == "step-00000002"
    assert load_checkpoint(latest)["step"] == 2
    (ckdir / "LATEST").write_text("step-00000099")  # a dangling pointer falls back to the newest complete one
    assert latest_checkpoint(str(ckdir)) == latest
    trainer = run_trainer(raw)  # resumes from step 2 and finishes
    assert trainer.step == 4 and not any(n.startswith(".tmp-") for n in os.listdir(ckdir))


def test_resaving_a_step_replaces_it_and_leaves_nothing_behind(tmp_path, monkeypatch):
    d = str(tmp_path / "ck")
    ckpt_module.save_checkpoint(d, 1, {"v": torch.tensor(1.0)})
    ckpt_module.save_checkpoint(d, 2, {"v": torch.tensor(2.0)})
    # a crash right after the old step-2 folder is moved aside: step 1 is what loads
    real_rename = os.rename

    def crash_on_second_rename(src, dst, _calls=[]):
        _calls.append(src)
        if len(_calls) == 2:
            raise KeyboardInterrupt
        return real_rename(src, dst)

    monkeypatch.setattr(ckpt_module.os, "rename", crash_on_second_rename)
    with pytest.raises(KeyboardInterrupt):
        ckpt_module.save_checkpoint(d, 2, {"v": torch.tensor(20.0)})
    monkeypatch.undo()
    assert load_checkpoint(latest_checkpoint(d))["v"].item() == 1.0
    # a complete re-save: the new state, and no temporary folder left
    ckpt_module.save_checkpoint(d, 2, {"v": torch.tensor(30.0)})
    assert load_checkpoint(latest_checkpoint(d))["v"].item() == 30.0
    assert not [n for n in os.listdir(d) if n.startswith(".tmp-")]


@pytest.mark.parametrize("where", ["logits", "embeddings"])
def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, where):
    """NaN logits, or NaN embeddings, which reach every layer's gates (lam and log_gate NaN): the op does not
    stop the run (it would, on a GPU, by a device-side assertion); the loss is non-finite and reported."""
    raw = recipe(tmp_path, "run")
    run_trainer(raw, stop_at=2)
    trainer = Trainer(config_from_dict(raw))
    model = trainer.core.model
    module = model if where == "logits" else model.get_input_embeddings()
    module.register_forward_hook(lambda module, args, out: out * float("nan"))
    with pytest.raises(NonFiniteLoss, match=r"step 3.*step-00000002"):
        trainer.train()
    trainer.close()
    assert os.path.basename(latest_checkpoint(str(tmp_path / "run" / "checkpoints"))) == "step-00000002"
    assert read_log(str(tmp_path / "run" / "log.jsonl"))[-1]["event"] == "non_finite"
    # the log stays strict JSON: the NaN loss is written as null (a strict parser refuses NaN/Infinity)
    lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert records[-1]["loss"] is None and records[-1]["event"] == "non_finite"


def test_a_diverging_run_ends_with_exit_status_3_naming_the_command(tmp_path, capsys):
    """At a learning rate of 1e6 the activations overflow in the second step, before any loss: the NaN goes
    through the layers' gates to the loss (no 'lam must be finite' from the op, exit status 2), and the
    command reports the non-finite loss with its own name, exit status 3."""
    import yaml

    from falcon_fwa.train.cli import main
    raw = recipe(tmp_path, "run", steps=6)
    raw["optim"] = {"lr": 1e6, "warmup_steps": 1, "clip_grad_norm": 0}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path)]) == 3
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "falcon-fwa train: error: non-finite training loss")
    assert read_log(str(tmp_path / "run" / "log.jsonl"))[-1]["event"] == "non_finite"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_ends_the_run_at_the_step_in_progress_with_a_checkpoint(tmp_path, monkeypatch, signum):
    import signal

    signum = getattr(signal, signum)
    signal_during_step_3(monkeypatch, signum)
    # a suite launched as a shell's background job inherits SIGINT ignored, which the run leaves ignored
    # (the next test): give the signal its interactive handler for this test
    before = signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    try:
        handler = signal.getsignal(signum)
        raw = recipe(tmp_path, "run", save_every=0, eval_every=0)
        trainer = Trainer(config_from_dict(raw))
        try:
            summary = trainer.train(stop_on_signal=True)
        finally:
            trainer.close()
        assert signal.getsignal(signum) is handler  # the handler is given back
    finally:
        signal.signal(signum, before)
    assert summary["signal"] == signal.Signals(signum).name and summary["steps"] == 3
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["signal"] == summary["signal"]
    assert trainer.last_checkpoint.endswith("step-00000003")
    assert load_checkpoint(latest_checkpoint(str(tmp_path / "run" / "checkpoints")))["step"] == 3
    monkeypatch.undo()
    assert run_trainer(raw).step == 4  # the relaunch resumes at step 3
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3, 4]


def test_a_signal_the_process_ignores_stays_ignored(tmp_path, monkeypatch):
    """SIGINT ignored by the launching shell (a background job of a script) does not stop the run."""
    import signal

    calls = signal_during_step_3(monkeypatch, signal.SIGINT)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        trainer = Trainer(config_from_dict(recipe(tmp_path, "run", save_every=0, eval_every=0)))
        try:
            summary = trainer.train(stop_on_signal=True)
        finally:
            trainer.close()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert len(calls) > 5 and "signal" not in summary and summary["steps"] == 4


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_a_stop_that_comes_with_the_launchers_end_is_a_clean_stop_and_a_third_signal_interrupts(stop):
    """A launcher that passes a stop on to its runs and then ends: the run gets the stop and the launcher's
    SIGHUP together. Python runs pending handlers in signal-number order (SIGHUP first), so the stop must not
    be taken for a second one: the run stops cleanly, under the stop's name; a further one interrupts it."""
    import signal

    script = f"""
import os, signal, sys
from falcon_fwa.train.launch import StopSignals
signal.signal(signal.SIGINT, signal.default_int_handler)  # also where the suite runs as a background job
both = {{signal.{stop}, signal.SIGHUP}}
with StopSignals(True) as s:
    signal.pthread_sigmask(signal.SIG_BLOCK, both)
    os.kill(os.getpid(), signal.{stop})
    os.kill(os.getpid(), signal.SIGHUP)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, both)  # both pending: delivered here, SIGHUP's handler first
    print("clean stop", signal.Signals(s.received).name, flush=True)
    try:
        os.kill(os.getpid(), signal.{stop})
        signal.pthread_sigmask(signal.SIG_BLOCK, set())  # a call that lets the handler run
    except KeyboardInterrupt:
        sys.exit(130)
    print("not interrupted", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines() == [f"clean stop {stop}"], (proc.stdout, proc.stderr)
    interrupted = 130 if stop == "SIGINT" else -signal.SIGTERM
    assert proc.returncode == interrupted, proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a pseudo-terminal's hang-up (Linux)")
def test_a_closed_terminal_stops_the_run_with_a_checkpoint_and_its_own_exit_status(tmp_path):
    """``falcon-fwa train`` in a terminal that is closed mid-run (its pseudo-terminal's other end goes away:
    SIGHUP, and every later write to the terminal fails). With a validation loss printed at every step, the
    step the run stops at prints one too: the run still ends with its checkpoint, its summary naming
    SIGHUP, and exit status 128 + SIGHUP."""
    import pty
    import select
    import signal
    import time

    raw = recipe(tmp_path, "run", steps=100_000, save_every=0, eval_every=1)
    raw["log"]["progress"] = True
    (tmp_path / "recipe.json").write_text(json.dumps(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(ROOT, "src"),
                                                                        os.environ.get("PYTHONPATH")]))}
    terminal, other_end = pty.openpty()
    # a session of its own whose leader opens the pseudo-terminal by name, which makes it the session's
    # controlling terminal, and then becomes the command (no Python code runs between fork and exec here)
    become = ("import os, sys; fd = os.open(sys.argv[1], os.O_RDWR); [os.dup2(fd, i) for i in (0, 1, 2)]; "
              "os.close(fd); os.execv(sys.executable, [sys.executable, '-m', 'falcon_fwa.cli'] + sys.argv[2:])")
    proc = subprocess.Popen([sys.executable, "-c", become, os.ttyname(other_end), "train", "--config",
                             str(tmp_path / "recipe.json")], env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, deadline = b"", time.monotonic() + 240
    try:  # this end of the terminal is held open until the command has printed (no hang-up before it opens it)
        while seen.count(b"val_loss") < 3 and time.monotonic() < deadline and proc.poll() is None:
            if select.select([terminal], [], [], 1.0)[0]:
                seen += os.read(terminal, 65536)
    finally:
        os.close(terminal)  # the terminal is gone
        os.close(other_end)
    try:
        status = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail("the run did not end within 120 s of its terminal's hang-up")
    assert seen.count(b"val_loss") >= 3, seen[-2000:]
    assert status == 128 + signal.SIGHUP
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["signal"] == "SIGHUP" and summary["steps"] >= 3
    assert load_checkpoint(latest_checkpoint(str(tmp_path / "run" / "checkpoints")))["step"] == summary["steps"]
    # the stop step's validation loss is in the log, though its line on the terminal was lost
    assert any(r["step"] == summary["steps"] and "val_loss" in r for r in read_log(str(tmp_path / "run" / "log.jsonl")))


def test_only_the_main_process_prints_the_validation_loss(tmp_path, monkeypatch, capsys):
    import dataclasses

    from falcon_fwa.data import prepare_dataset

    raw = recipe(tmp_path, "run", steps=2)
    prepare_dataset(config_from_dict(raw).data.spec(), raw["data"]["out_dir"])  # the main process's part
    real = trainer_module.D.setup
    monkeypatch.setattr(trainer_module.D, "setup", lambda strategy: dataclasses.replace(real(strategy), rank=1))
    capsys.readouterr()
    trainer = run_trainer(raw)  # as the second process (of one: no collectives to wait for)
    assert not trainer.info.is_main and trainer.step == 2
    out = capsys.readouterr()
    assert "val_loss" not in out.out + out.err


WORKER = """
import json, sys
from falcon_fwa.train import Trainer, config_from_dict
from falcon_fwa.train import distributed
for path, stop_at in json.loads(sys.argv[1]):
    trainer = Trainer(config_from_dict(json.load(open(path))))
    trainer.train(stop_at=stop_at)
    trainer.close()
distributed.teardown()
"""


def _torchrun(tmp_path, runs):
    """One ``torchrun --nproc_per_node=2`` launch (gloo) training each (recipe, stop_at) in turn."""
    (tmp_path / "worker.py").write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(tmp_path / "worker.py"), json.dumps(runs)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
@fsdp2_on_cpu
def test_torchrun_two_processes_ddp_and_fsdp2_resume_bit_for_bit(tmp_path, cpu_machine):  # gloo processes, on a GPU machine too
    """Launch 1: uninterrupted runs and runs stopped at step 2; launch 2 (new processes): resume. The
    uninterrupted runs log the one-process run's losses (the same global batches, gradients averaged over
    the two processes) to float32 rounding."""
    run_trainer(recipe(tmp_path, "single", micro_batch=1))
    paths = {}
    for strategy in ("ddp", "fsdp2"):
        for name in ("full", "split"):
            raw = recipe(tmp_path, f"{strategy}-{name}", strategy=strategy, micro_batch=1)
            paths[strategy, name] = str(tmp_path / f"{strategy}-{name}.json")
            with open(paths[strategy, name], "w") as f:
                json.dump(raw, f)
    _torchrun(tmp_path, [[paths[s, "full"], None] for s in ("ddp", "fsdp2")] +
              [[paths[s, "split"], 2] for s in ("ddp", "fsdp2")])
    _torchrun(tmp_path, [[paths[s, "split"], None] for s in ("ddp", "fsdp2")])
    for strategy in ("ddp", "fsdp2"):
        full = losses(tmp_path / f"{strategy}-full")
        assert len(full) == 4 and all(math.isfinite(l) for _, l in full)
        for key in ("loss", "val_loss"):
            one = losses(tmp_path / "single", key)
            assert [s for s, _ in one] == [s for s, _ in losses(tmp_path / f"{strategy}-full", key)]
            for (_, a), (_, b) in zip(one, losses(tmp_path / f"{strategy}-full", key)):
                assert abs(a - b) <= 1e-6 * abs(a), (strategy, key, a, b)
        assert losses(tmp_path / f"{strategy}-split") == full, strategy
        assert losses(tmp_path / f"{strategy}-split", "val_loss") == losses(tmp_path / f"{strategy}-full", "val_loss")
        state = load_checkpoint(latest_checkpoint(str(tmp_path / f"{strategy}-split" / "checkpoints")))
        assert state["data"]["world_size"] == 2 and state["step"] == 4 and state["data"]["position"] == 8


@pytest.mark.parametrize("assignment, message", [
    ("train.steps=10.5", "train.steps must be an integer, got 10.5"),
    ("train.micro_batch=true", "train.micro_batch must be an integer, got True"),
    ("train.export_model='false'", "train.export_model must be true or false, got 'false'"),
    ("optim.betas=0.9", "optim.betas must be a list, got 0.9"),
    ("optim.lr=fast", "optim.lr must be a number, got 'fast'"),
    ("train.out_dir=3", "train.out_dir must be a string, got 3"),
    ("model.overrides=3", "model.overrides must be a mapping, got 3"),
])
def test_recipe_values_of_the_wrong_type_name_their_field(tmp_path, assignment, message):
    from falcon_fwa.train.config import apply_overrides

    with pytest.raises(ValueError, match=f"^config field {message}$".replace("[", r"\[").replace(".", r"\.")):
        config_from_dict(apply_overrides(recipe(tmp_path), [assignment]))


def test_set_takes_an_exponent_without_a_dot_as_a_number(tmp_path):
    from falcon_fwa.train.config import apply_overrides

    # YAML 1.1 reads 1e-3 (no dot) as a string; the recipe reader reads it as YAML 1.2 does, a number,
    # in every section, the model's overrides (typed by the model config) included
    cfg = config_from_dict(apply_overrides(recipe(tmp_path), ["optim.lr=1e-3", "optim.eps=1e-6",
                                                              "model.overrides.eps_attn=1e-6",
                                                              "model.overrides.chunk_size=1e1"]))
    assert cfg.optim.lr == 1e-3 and cfg.optim.eps == 1e-6 and isinstance(cfg.optim.lr, float)
    assert cfg.model.overrides["eps_attn"] == 1e-6 and cfg.model.overrides["chunk_size"] == 10.0
    path = tmp_path / "r.yaml"
    path.write_text("optim:\n  lr: 3e-4\n")
    from falcon_fwa.train.config import read_recipe
    assert read_recipe(str(path))["optim"]["lr"] == 3e-4


def test_model_overrides_take_numeric_text_for_float_fields_as_the_other_sections_do(tmp_path):
    """A quoted number (YAML '1e-6', a JSON string) is a number in optim.* and in model.overrides
    alike, and reaches the model as a float; text that is not a number names the override."""
    from falcon_fwa.train.config import read_recipe
    from falcon_fwa.train.model_factory import build_model

    raw = recipe(tmp_path)
    raw["optim"]["eps"] = "1e-7"
    raw["model"]["overrides"] = {"eps_attn": "1e-6", "rule": "2A", "eps": "1e-5"}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(raw))
    cfg = config_from_dict(read_recipe(str(path)))
    assert cfg.optim.eps == 1e-7
    assert cfg.model.overrides == {"eps_attn": 1e-6, "rule": "2A", "eps": 1e-5}
    model_cfg = build_model(cfg.model, vocab_size=257, eos_token_id=256).config
    assert (model_cfg.eps_attn, model_cfg.eps, model_cfg.rule) == (1e-6, 1e-5, "2A")
    raw["model"]["overrides"] = {"eps_attn": "tiny"}
    with pytest.raises(ValueError, match="config field model.overrides.eps_attn must be a number, got 'tiny'"):
        config_from_dict(raw)


@pytest.mark.parametrize("assignment, message", [
    ("model.overrides.rul=3", r"unknown config field 'rul' \(did you mean 'rule'\?\)"),
    ("model.overrides.hidden_size=64.5", "config field 'hidden_size' must be an integer, got 64.5"),
    ("model.overrides.shift='false'", "config field 'shift' must be true or false, got 'false'"),
    ("model.preset=tiny-lstm", "unknown preset 'tiny-lstm'"),
    ("model.overrides.eos_token_id=3", "config field model.overrides.eos_token_id: the end-of-text id is the tokenizer's"),
])
def test_model_overrides_are_checked_with_the_recipe(tmp_path, assignment, message):
    """Before any data is read: a misspelt or mistyped model field stops the recipe, naming it."""
    from falcon_fwa.train.config import apply_overrides

    with pytest.raises(ValueError, match=message):
        config_from_dict(apply_overrides(recipe(tmp_path), [assignment]))


@pytest.mark.parametrize("section, field, value", [("train", "eval_every", -1), ("train", "eval_batches", 0),
                                                   ("log", "every", 0), ("data", "val_every", 1),
                                                   ("data", "max_documents", 0), ("data", "bpe_documents", 0),
                                                   ("train", "seed", -1), ("data", "text_split", "lines"),
                                                   ("optim", "betas", [0.9, 1.0]), ("optim", "betas", [-0.1, 0.9]),
                                                   ("optim", "clip_grad_norm", -1.0)])
def test_recipe_value_errors_name_their_own_field(tmp_path, section, field, value):
    raw = recipe(tmp_path)
    raw[section][field] = value
    with pytest.raises(ValueError, match=rf"config field {section}\.{field} .*got {re.escape(repr(value))}"):
        config_from_dict(raw)


@pytest.mark.parametrize("tokenizer, message", [("bpe:abc", "needs an integer N"), ("bpe:100", "needs N > 257")])
def test_a_bad_bpe_size_names_data_tokenizer_before_any_data_is_read(tmp_path, tokenizer, message):
    raw = recipe(tmp_path)
    raw["data"]["tokenizer"] = tokenizer
    with pytest.raises(ValueError, match=f"^config field data.tokenizer bpe:N {message}.*got '{tokenizer}'$"):
        config_from_dict(raw)
    assert not (tmp_path / "data").exists()


def test_compare_shares_one_data_folder_and_uses_calib_steps(tmp_path, monkeypatch):
    import argparse

    import yaml

    from falcon_fwa.train import compare

    raw = recipe(tmp_path)
    raw["data"]["out_dir"] = ""  # no data folder in the recipe: compare tokenizes once for every run
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    seen = {}
    monkeypatch.setattr(compare, "calibrate_sequential", lambda configs, names, sets, **kw: seen.update(
        steps=kw["steps"]) or {n: dict(setup_s=0, eval_s=0, save_s=0, export_s=0, step_s=1e-6) for n in names})
    monkeypatch.setattr(compare, "run_sequential", lambda configs, names, out, sets, tag, **kw: seen.update(
        sets=sets) or iter(()))
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    out = tmp_path / "cmp"
    compare.run(parser.parse_args(["--configs", str(path), "--out", str(out), "--time-budget", "1",
                                   "--calib-steps", "3"]))
    assert seen["steps"] == 3
    assert f'data.out_dir="{out / "data"}"' in seen["sets"]  # quoted: a path stays the text it is
    assert os.path.isfile(out / "data" / "prepared.json")


def test_resume_after_a_crash_logs_every_step_once(tmp_path):
    raw = recipe(tmp_path, "run")
    run_trainer(raw)
    before = losses(tmp_path / "run")
    ckdir = tmp_path / "run" / "checkpoints"
    shutil.rmtree(ckdir / "step-00000004")  # as if the run died after logging steps 3-4, before saving step 4
    os.remove(ckdir / "LATEST")
    run_trainer(raw)  # resumes from step 2
    after = losses(tmp_path / "run")
    assert [s for s, _ in after] == [1, 2, 3, 4]
    assert after == before


def test_resume_after_a_log_line_was_cut_short(tmp_path):
    raw = recipe(tmp_path, "run")
    run_trainer(raw, stop_at=2)
    log = tmp_path / "run" / "log.jsonl"
    with open(log, "a") as f:
        f.write('{"step": 3, "loss": 4.1')  # the write of step 3's record was cut short
    run_trainer(raw)
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2, 3, 4]
    with open(log, "a") as f:
        f.write('{"step": 5, "lo\n{"step": 6}\n')  # a bad line before the last one is no cut-off write
    n_bad = len(log.read_text().splitlines()) - 1
    with pytest.raises(ValueError, match=rf"log\.jsonl:{n_bad}: not a record of a training log"):
        read_log(str(log))


def test_a_log_of_something_else_in_the_run_folder_is_named(tmp_path):
    raw = recipe(tmp_path, "run")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "log.jsonl").write_text("step,loss\n1,2.0\n")  # someone's CSV under that name
    with pytest.raises(ValueError, match=r"log\.jsonl:1: not a record of a training log; choose another "
                                         r"train\.out_dir"):
        run_trainer(raw)


def test_set_fills_an_empty_section_and_rejects_a_path_through_a_value(tmp_path):
    from falcon_fwa.train.config import apply_overrides

    raw = recipe(tmp_path)
    raw["log"] = None  # "log:" with nothing under it in a YAML file
    assert config_from_dict(apply_overrides(raw, ["log.every=5"])).log.every == 5
    with pytest.raises(ValueError, match=r"train\.steps is a value"):
        apply_overrides(raw, ["train.steps.x=1"])


def test_resume_with_another_micro_batch_continues_at_the_same_sample(tmp_path):
    run_trainer(recipe(tmp_path, "run"), stop_at=2)  # micro_batch 2, accumulation 2: position 4 micro-steps
    trainer = Trainer(config_from_dict(recipe(tmp_path, "run", micro_batch=1)))  # accumulation 4
    try:
        assert trainer.step == 2 and trainer.accum == 4
        assert trainer.position == 8  # 2 steps x 4 samples, one sample per micro-step
    finally:
        trainer.close()


# ---- restarts in a used folder, relaunches, logged rates, recipe changes on resume
def test_a_fresh_run_in_an_old_run_folder_keeps_its_own_checkpoints(tmp_path):
    run_trainer(recipe(tmp_path, "run", steps=6))  # an earlier run leaves step-4 and step-6
    run_trainer(recipe(tmp_path, "run", steps=8, resume="none", seed=1), stop_at=2)  # a new run, preempted
    ckdir = str(tmp_path / "run" / "checkpoints")
    assert latest_checkpoint(ckdir) == os.path.join(ckdir, "step-00000002")
    trainer = Trainer(config_from_dict(recipe(tmp_path, "run", steps=8, seed=1)))  # relaunch: resume=auto
    try:
        assert trainer.step == 2 and trainer.last_checkpoint.endswith("step-00000002")
    finally:
        trainer.close()


def test_a_run_that_died_before_its_first_checkpoint_logs_every_step_once(tmp_path):
    raw = recipe(tmp_path, "run")
    run_trainer(raw)
    before = losses(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # as if it died before its first save
    run_trainer(raw)  # resume=auto finds no checkpoint: starts again at step 0
    assert losses(tmp_path / "run") == before


def test_resume_none_starts_a_fresh_log(tmp_path):
    run_trainer(recipe(tmp_path, "run"))
    run_trainer(recipe(tmp_path, "run", steps=2, resume="none"))
    assert [s for s, _ in losses(tmp_path / "run")] == [1, 2]


def test_a_finished_run_launched_again_keeps_its_summary(tmp_path, capsys):
    raw = recipe(tmp_path, "run")
    run_trainer(raw)
    path = tmp_path / "run" / "summary.json"
    first = json.loads(path.read_text())
    assert first["val_loss"] is not None and first["tokens_per_s"] is not None
    run_trainer(raw)  # resume=auto: already at train.steps, trains nothing
    assert json.loads(path.read_text()) == first
    capsys.readouterr()
    run_trainer({**raw, "train": {**raw["train"], "steps": 3}})  # a shorter schedule: said, not silent
    assert "the checkpoint is at step 4, train.steps is 3: nothing to train" in capsys.readouterr().out
    assert json.loads(path.read_text()) == first


def test_a_relaunch_replaces_the_summary_of_an_earlier_launch(tmp_path):
    """A launch stopped by a signal wrote its summary; the next trained to the end and died before writing
    its own: a third launch trains nothing, writes the summary of the finished run and exits 0, not 143."""
    from falcon_fwa.train.cli import main

    raw = recipe(tmp_path, "run")
    finished = run_trainer(raw)
    path = tmp_path / "run" / "summary.json"
    done = json.loads(path.read_text())
    path.write_text(json.dumps({**done, "steps": 3, "tokens": 3 * 96, "val_loss": 9.0, "signal": "SIGTERM"}))
    (tmp_path / "recipe.json").write_text(json.dumps(raw))
    assert main(["--config", str(tmp_path / "recipe.json")]) == 0
    summary = json.loads(path.read_text())
    assert finished.step == 4 and summary["steps"] == 4 and summary["tokens"] == 4 * 96 and "signal" not in summary
    assert summary["val_loss"] == pytest.approx(done["val_loss"], rel=1e-12)  # evaluated again, not kept
    assert main(["--config", str(tmp_path / "recipe.json")]) == 0  # and that one stays
    assert json.loads(path.read_text()) == summary


def test_a_signal_that_reached_another_process_is_named_in_this_ones_summary(tmp_path, monkeypatch):
    """With several processes a signal may reach only some: the all-reduced flags stop every process at
    the same step, and each (rank 0, which writes summary.json, among them) names the signal."""
    import signal

    real, calls = trainer_module.D.all_reduce_mean, []

    def other_process_got_sigterm(tensor, info):  # as if one process of two had received SIGTERM in step 3
        calls.append(1)
        out = real(tensor, info)
        if tensor.numel() == 1 + len(trainer_module.StopSignals.SIGNALS) and len(calls) == 3:
            out = out.clone()
            out[1 + trainer_module.StopSignals.SIGNALS.index(signal.SIGTERM)] = 0.5
        return out

    monkeypatch.setattr(trainer_module.D, "all_reduce_mean", other_process_got_sigterm)
    trainer = Trainer(config_from_dict(recipe(tmp_path, "run", save_every=0, eval_every=0)))
    try:
        summary = trainer.train(stop_on_signal=True)
    finally:
        trainer.close()
    assert summary["steps"] == 3 and summary["signal"] == "SIGTERM"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["signal"] == "SIGTERM"
    assert trainer.last_checkpoint.endswith("step-00000003")


def test_a_second_launch_into_a_run_folder_in_use_is_refused(tmp_path):
    raw = recipe(tmp_path, "run")
    first = Trainer(config_from_dict(raw))
    try:
        with pytest.raises(ValueError, match="train.out_dir=.* is in use by another training launch"):
            Trainer(config_from_dict(raw))
    finally:
        first.close()
    run_trainer(raw)  # closed: free again


def test_the_summary_records_the_recipe_and_the_commit(tmp_path):
    from falcon_fwa.provenance import git_commit
    from falcon_fwa.train.config import config_from_dict

    raw = recipe(tmp_path, "run", steps=2)
    run_trainer(raw)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["commit"] == git_commit(short=False)
    assert config_from_dict(summary["config"]) == config_from_dict(raw)  # the run can be relaunched from it


def test_logged_tokens_per_s_is_not_inflated_by_an_evaluation_between_log_steps(tmp_path, monkeypatch):
    """On a clock that a training micro-step advances by 1 s and an evaluation batch by 100 s, every
    logged rate is the tokens of the window's steps over their 2 s each, evaluations left out."""
    now = [0.0]
    real = trainer_module.causal_lm_loss

    def charged(*args, **kwargs):
        now[0] += 1.0 if torch.is_grad_enabled() else 100.0
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", charged)
    monkeypatch.setattr(trainer_module, "_clock", lambda: now[0])
    raw = recipe(tmp_path, "run", steps=9, eval_every=2, save_every=0)
    raw["log"]["every"] = 3  # evaluations (steps 2, 4, 6, 8) fall between log steps
    micro_steps = raw["train"]["global_batch"] // raw["train"]["micro_batch"]
    assert micro_steps == 2
    run_trainer(raw)
    tokens_per_step = raw["train"]["global_batch"] * raw["data"]["seq_len"]
    rates = losses(tmp_path / "run", "tokens_per_s")
    assert [step for step, _ in rates] == [3, 6, 9]
    for step, rate in rates:
        assert rate == pytest.approx(tokens_per_step / micro_steps), (step, rate)


def test_resume_applies_the_recipes_optimizer_hyperparameters(tmp_path):
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    raw = recipe(tmp_path, "run")
    raw["optim"].update(weight_decay=0.0, betas=[0.8, 0.9], eps=1e-6)
    trainer = Trainer(config_from_dict(raw))
    try:
        assert trainer.step == 2
        for g in trainer.optimizer.param_groups:
            assert g["weight_decay"] == 0.0 and tuple(g["betas"]) == (0.8, 0.9) and g["eps"] == 1e-6
    finally:
        trainer.close()


@pytest.mark.parametrize("section,key,value", [("train", "seed", 1), ("data", "seq_len", 16),
                                               ("data", "tokenizer", "bpe:300"),
                                               ("data", "val_every", 5), ("data", "max_documents", 60)])
def test_resume_refuses_another_data_order(tmp_path, section, key, value):
    """Other samples (another seed, row length, tokenizer or held-out documents) would not be
    where the checkpoint's data position points: refused by name, before any weight is loaded."""
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    raw = recipe(tmp_path, "run")
    raw[section][key] = value
    raw["data"]["out_dir"] = str(tmp_path / "other-data")  # tokenized again with the new settings
    with pytest.raises(ValueError, match=rf"holds a run of other settings than this recipe's \({section}\.{key} "):
        Trainer(config_from_dict(raw))


def test_resume_refuses_another_model_but_not_another_way_to_compute_it(tmp_path):
    """A checkpoint's weights belong to its model: another window would mix two models silently (another
    width, a size mismatch). The chunk size or form only change how the same model computes."""
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    raw = recipe(tmp_path, "run")
    raw["model"]["overrides"] = {**raw["model"].get("overrides", {}), "window": 16}
    with pytest.raises(ValueError, match=r"holds a run of other settings than this recipe's "
                                         r"\(model\.window 4 there, 16 here\)"):
        Trainer(config_from_dict(raw))
    # the same model written otherwise: the rule's other spelling, a field at the preset's own value
    raw = recipe(tmp_path, "sliding")
    raw["model"] = {"preset": "tiny-falcon", "overrides": {"rule": "3A"}}
    run_trainer(raw, stop_at=2)
    raw = recipe(tmp_path, "sliding")
    raw["model"] = {"preset": "tiny-falcon", "overrides": {"rule": "3a", "window": 4}}
    trainer = Trainer(config_from_dict(raw))
    try:
        assert trainer.step == 2
    finally:
        trainer.close()
    raw = recipe(tmp_path, "run")
    raw["model"]["overrides"] = {**raw["model"].get("overrides", {}), "chunk_size": 8, "form": "recurrent"}
    trainer = Trainer(config_from_dict(raw))
    try:
        assert trainer.step == 2
    finally:
        trainer.close()


def test_a_validation_split_too_small_for_one_evaluation_is_found_before_training(tmp_path, monkeypatch):
    raw = recipe(tmp_path, "run")
    write_corpus(tmp_path / "val.jsonl", n=2)  # a few rows of 24 tokens, fewer than global_batch
    raw["data"]["val_source"] = str(tmp_path / "val.jsonl")
    raw["train"]["global_batch"] = raw["train"]["micro_batch"] = 64
    trained = []
    monkeypatch.setattr(trainer_module.Trainer, "train", lambda self, **kw: trained.append(1))
    with pytest.raises(ValueError, match=r"^the validation split has \d+ rows of data.seq_len=24: fewer than "
                                         r"train.global_batch=64"):
        Trainer(config_from_dict(raw))
    assert not trained


def test_an_export_never_replaces_a_folder_it_did_not_write(tmp_path):
    raw = recipe(tmp_path, "run", export_model=True)
    foreign = tmp_path / "run" / "model"
    foreign.mkdir(parents=True)
    (foreign / "weights.bin").write_text("someone else's")
    with pytest.raises(ValueError, match=r"model' exists and is no exported model of this library"):
        Trainer(config_from_dict(raw))
    assert (foreign / "weights.bin").read_text() == "someone else's"
    (foreign / "weights.bin").unlink()
    foreign.rmdir()
    run_trainer(raw)  # its own export, then the same run relaunched with a longer schedule exports again
    assert json.loads((foreign / "config.json").read_text())["model_type"] == "falcon_fwa"
    run_trainer(recipe(tmp_path, "run", export_model=True, steps=6))
    assert json.loads((foreign / "config.json").read_text())["model_type"] == "falcon_fwa"


def test_an_export_is_on_disk_file_by_file_before_it_replaces_the_last_one(tmp_path, monkeypatch):
    from falcon_fwa import atomic

    events, real_fsync, real_replace = [], os.fsync, os.replace
    monkeypatch.setattr(atomic.os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_ino)) or real_fsync(fd))
    monkeypatch.setattr(trainer_module.os, "replace", lambda a, b: events.append(("replace", os.fspath(b)))
                        or real_replace(a, b))
    run_trainer(recipe(tmp_path, "run", export_model=True))
    folder = tmp_path / "run" / "model"
    renamed = events.index(("replace", os.fspath(folder)))
    flushed = {ino for kind, ino in events[:renamed] if kind == "fsync"}
    exported = [p for p in folder.rglob("*")] + [folder]
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert {p.stat().st_ino for p in exported} <= flushed  # every file and folder, before the rename
    assert events[renamed + 1] == ("fsync", (tmp_path / "run").stat().st_ino)  # then the rename itself


def test_a_warmup_longer_than_the_run_is_warned_about(tmp_path):
    import warnings

    raw = recipe(tmp_path, "run", steps=20)
    raw["optim"]["warmup_steps"] = 100
    with pytest.warns(UserWarning, match=r"optim.warmup_steps=100 exceeds train.steps=20: .* ends at 0.2 of"):
        config_from_dict(raw)
    raw["optim"]["warmup_steps"] = 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_from_dict(raw)


def test_model_segments_train_as_the_whole_sequence(tmp_path, monkeypatch):
    """``model.overrides.segments`` (the op in pieces, recomputed in the backward) trains the same model
    with packed documents (the recipe's default packing, where the pieces are groups of documents):
    the logged losses of four steps agree with the whole sequence's to float32 rounding."""
    from falcon_fwa.ops import api

    calls = []
    real = api.run_segments
    monkeypatch.setattr(api, "run_segments", lambda *a, **kw: calls.append(kw["segments"]) or real(*a, **kw))
    whole = recipe(tmp_path, out="whole", steps=4)
    pieces = recipe(tmp_path, out="pieces", steps=4)
    pieces["model"]["overrides"] = {"segments": 3}
    run_trainer(whole)
    assert calls == []
    run_trainer(pieces)
    assert calls and set(calls) == {3}  # every layer's op ran in pieces
    a, b = losses(tmp_path / "whole"), losses(tmp_path / "pieces")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a, b):
        assert abs(x - y) <= 1e-5 * abs(x), (a, b)


def test_activation_checkpointing_trains_the_same_model_and_replays_each_block(tmp_path):
    """``train.activation_checkpointing`` runs every block's forward again in the backward and changes
    neither the losses nor the weights: four logged steps and the final parameters match."""
    counts = []

    def counting_model(vocab_size, eos_token_id):
        from falcon_fwa.train.model_factory import build_model

        model = build_model(config_from_dict(recipe(tmp_path)).model, vocab_size=vocab_size, eos_token_id=eos_token_id)
        calls = {"n": 0}
        model.model.layers[0].mixer.register_forward_hook(lambda *_: calls.__setitem__("n", calls["n"] + 1))
        counts.append(calls)
        return model

    trainers = []
    for out, on in (("plain", False), ("replayed", True)):
        trainer = Trainer(config_from_dict(recipe(tmp_path, out=out, steps=4, eval_every=0, activation_checkpointing=on)),
                          model_fn=counting_model)
        try:
            trainer.train()
        finally:
            trainer.close()
        trainers.append(trainer)
    # 4 steps x 2 micro-batches: one forward each, plus one replay each in the backward with checkpointing
    assert [c["n"] for c in counts] == [8, 16]
    a, b = losses(tmp_path / "plain"), losses(tmp_path / "replayed")
    assert [s for s, _ in a] == [s for s, _ in b] == [1, 2, 3, 4]
    for (_, x), (_, y) in zip(a, b):
        assert abs(x - y) <= 1e-6 * abs(x), (a, b)
    for p, q in zip(trainers[0].core.parameters(), trainers[1].core.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@fsdp2_on_cpu
def test_torchrun_ddp_and_fsdp2_with_activation_checkpointing_train_the_same_model(tmp_path, cpu_machine):  # gloo processes, on a GPU machine too
    """Two processes (gloo), DDP and FSDP2 (each block sharded, the replay inside its forward): the logged
    losses with train.activation_checkpointing equal those without it."""
    runs = []
    for strategy in ("ddp", "fsdp2"):
        for on in (False, True):
            path = tmp_path / f"{strategy}-{on}.json"
            path.write_text(json.dumps(recipe(tmp_path, f"{strategy}-{on}", strategy=strategy, micro_batch=1,
                                              eval_every=0, activation_checkpointing=on)))
            runs.append([str(path), None])
    _torchrun(tmp_path, runs)
    for strategy in ("ddp", "fsdp2"):
        plain, replayed = losses(tmp_path / f"{strategy}-False"), losses(tmp_path / f"{strategy}-True")
        assert [s for s, _ in plain] == [s for s, _ in replayed] == [1, 2, 3, 4], strategy
        for (_, x), (_, y) in zip(plain, replayed):
            assert abs(x - y) <= 1e-6 * abs(x), (strategy, plain, replayed)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_summary_peak_memory_on_cuda_holds_the_weights_their_gradients_and_adam_states(tmp_path):
    """On a GPU the trainer records the peak of allocated CUDA memory (``distributed.peak_memory_bytes``):
    at least the float32 parameters, their gradients and AdamW's two moments (16 bytes a parameter), and
    no more than the card has. On the CPU it is null (``test_scaling``)."""
    trainer = run_trainer(recipe(tmp_path, "run", steps=2))
    n = sum(p.numel() for p in trainer.model.parameters())
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    peak = summary["peak_mem_bytes"]
    assert isinstance(peak, int)
    assert 16 * n <= peak <= torch.cuda.get_device_properties(0).total_memory


def test_optimizer_values_on_their_bounds_are_taken(tmp_path):
    # betas of 0 (no moment) and clip_grad_norm 0 (clipping off) are valid, as documented beside the refusals above
    raw = recipe(tmp_path)
    raw["optim"].update(betas=[0.0, 0.0], clip_grad_norm=0.0)
    cfg = config_from_dict(raw)
    assert list(cfg.optim.betas) == [0.0, 0.0] and cfg.optim.clip_grad_norm == 0.0


def test_a_run_plots_its_logged_losses_and_says_why_when_it_cannot(tmp_path, monkeypatch, capsys):
    """``loss.png`` holds the log's training losses (a line) and validation losses (dots) against tokens, as read
    back from the figure; ``log.plot=false`` writes none, and without matplotlib the run says so and ends well."""
    import importlib.util

    import matplotlib.figure

    drawn = {}
    real_savefig = matplotlib.figure.Figure.savefig

    def savefig(fig, path, **kw):
        drawn["lines"] = [line.get_xydata().tolist() for line in fig.axes[0].get_lines()]
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    run_trainer(recipe(tmp_path))
    png = tmp_path / "run" / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    log = read_log(str(tmp_path / "run" / "log.jsonl"))
    train = [[r["tokens"], r["loss"]] for r in log if "loss" in r]
    tokens_per_step = 4 * 24
    val = [[r["step"] * tokens_per_step, r["val_loss"]] for r in log if "val_loss" in r]
    assert len(train) == 4 and len(val) == 2 and drawn["lines"] == [train, val]

    run_trainer(recipe(tmp_path, out="off") | {"log": {"every": 1, "progress": False, "tensorboard": False,
                                                       "plot": False}})
    assert (tmp_path / "off" / "summary.json").exists() and not (tmp_path / "off" / "loss.png").exists()

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib"
                        else real_find_spec(name, *a))
    capsys.readouterr()
    run_trainer(recipe(tmp_path, out="nompl"))
    assert "log.plot: matplotlib is not installed" in capsys.readouterr().out
    assert (tmp_path / "nompl" / "summary.json").exists() and not (tmp_path / "nompl" / "loss.png").exists()
