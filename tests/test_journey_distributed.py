"""Two processes under ``torchrun`` (gloo) against one process, from the outside: the training rows each
process takes at every step, the weights DDP and FSDP2 end with, and a launch stopped by a SIGTERM sent to
``torchrun`` that is then launched again (docs/training.md, section 3)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import fsdp2_on_cpu

from falcon_fwa.train import Trainer, config_from_dict
from falcon_fwa.train.checkpoint import checkpoint_step, latest_checkpoint, load_checkpoint
from falcon_fwa.train.logger import read_log

from test_train import ROOT, recipe

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

# Trains each recipe of argv[1] and writes, per process, the training row indices it took at each
# micro-step (the training split's ``PackedRows.row`` calls, evaluation left out) and the final weights.
RECORDER = """
import json, sys, torch
from falcon_fwa.data import packing
from falcon_fwa.train import Trainer, config_from_dict, distributed
from falcon_fwa.train.trainer import _full
calls, real = [], packing.PackedRows.row
def row(self, index):
    calls.append((self, int(index)))
    return real(self, index)
packing.PackedRows.row = row
for path, out in json.loads(sys.argv[1]):
    calls.clear()
    trainer = Trainer(config_from_dict(json.load(open(path))))
    trainer.train()
    mine = [i for rows, i in calls if rows is trainer.train_rows]
    weights = {k.removeprefix("module."): _full(v).detach().clone() for k, v in trainer.model.state_dict().items()}
    torch.save({"rows": mine, "accum": trainer.accum, "weights": weights}, f"{out}.rank{trainer.info.rank}.pt")
    trainer.close()
distributed.teardown()
"""


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src"), "CUDA_VISIBLE_DEVICES": ""}


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]


def _records(run_dir):
    """The log's records without their timing."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_log(os.path.join(run_dir, "log.jsonl"))]


def _same_records(got, want):
    """The same records, step for step: equal steps, learning rates and token counts, losses and gradient
    norms to float32 rounding (the two processes' halves of the gradient are summed in another order)."""
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    for a, b in zip(got, want):
        assert {k: a[k] for k in ("step", "lr", "tokens") if k in a} == {k: b[k] for k in ("step", "lr", "tokens")
                                                                         if k in b}, (a, b)
        for key in ("loss", "grad_norm", "val_loss"):
            if key in b:
                assert abs(a[key] - b[key]) <= 1e-6 * abs(b[key]), (key, a, b)


def _single_rows(path):
    """The rows one process takes, with the weights it ends with."""
    import falcon_fwa.data.packing as packing

    calls, real = [], packing.PackedRows.row

    def row(self, index):
        calls.append((self, int(index)))
        return real(self, index)

    packing.PackedRows.row = row
    try:
        trainer = Trainer(config_from_dict(json.loads(path.read_text())))
        trainer.train()
        trainer.close()
    finally:
        packing.PackedRows.row = real
    return [i for rows, i in calls if rows is trainer.train_rows], trainer


@pytest.mark.slow
@fsdp2_on_cpu
def test_two_processes_take_disjoint_rows_whose_union_is_the_one_process_batch(tmp_path, cpu_machine):
    """Global batch 4: one process of 4 rows a micro-batch; DDP of 1 row a process (2 accumulation steps);
    FSDP2 of 2 rows a process. At every step the two processes' rows are disjoint and together the one
    process's rows; an epoch visits no row twice; DDP's and FSDP2's weights after the run are the one
    process's to float32 rounding."""
    runs = {"single": dict(micro_batch=4, strategy="single"), "ddp": dict(micro_batch=1, strategy="ddp"),
            "fsdp2": dict(micro_batch=2, strategy="fsdp2")}
    paths = {}
    for name, train in runs.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(recipe(tmp_path, name, steps=4, eval_every=0, save_every=0, **train)))
    one, trainer = _single_rows(paths["single"])
    (tmp_path / "recorder.py").write_text(RECORDER)
    jobs = [[str(paths[n]), str(tmp_path / n)] for n in ("ddp", "fsdp2")]
    done = subprocess.run(_torchrun(str(tmp_path / "recorder.py"), json.dumps(jobs)), env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    batch, n_rows = 4, len(trainer.train_rows)
    assert len(one) == 4 * batch
    epoch = one[:min(len(one), n_rows)]
    assert len(set(epoch)) == len(epoch) and all(0 <= i < n_rows for i in one)
    want = {k.removeprefix("module."): v for k, v in trainer.model.state_dict().items()}
    for name, micro in (("ddp", 1), ("fsdp2", 2)):
        got = [torch.load(f"{tmp_path / name}.rank{r}.pt") for r in (0, 1)]
        accum = batch // (2 * micro)
        assert [g["accum"] for g in got] == [accum, accum]
        for g in got:
            assert len(g["rows"]) == 4 * accum * micro
        per_step = accum * micro
        for step in range(4):
            ranks = [g["rows"][step * per_step:(step + 1) * per_step] for g in got]
            assert not set(ranks[0]) & set(ranks[1]), (name, step, ranks)
            assert sorted(ranks[0] + ranks[1]) == sorted(one[step * batch:(step + 1) * batch]), (name, step)
        assert got[0]["weights"].keys() == want.keys()
        for key, value in want.items():
            torch.testing.assert_close(got[0]["weights"][key], value, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
            torch.testing.assert_close(got[1]["weights"][key], got[0]["weights"][key], rtol=0, atol=0)


@pytest.mark.slow
def test_a_sigterm_to_torchrun_stops_both_processes_with_a_checkpoint_and_the_relaunch_ends_as_one_process(
        tmp_path, cpu_machine):
    """``kill -TERM`` to the launcher's process group (what a closed job or ``kill -TERM -PGID`` sends):
    ``torchrun`` passes it to its two DDP processes, which stop at one step with a checkpoint there and
    ``"signal": "SIGTERM"`` in ``summary.json``; the same command resumes, and the run's log is the log
    of one uninterrupted process with the same global batch (2 accumulation steps of 2 rows)."""
    steps = 60
    raw = recipe(tmp_path, "single", steps=steps, eval_every=20, save_every=25)
    raw["log"]["plot"] = False
    trainer = Trainer(config_from_dict(raw))
    trainer.train()
    trainer.close()

    raw["train"].update(out_dir=str(tmp_path / "ddp"), strategy="ddp")
    config = tmp_path / "ddp.json"
    config.write_text(json.dumps(raw))
    command = _torchrun("-m", "falcon_fwa.train.cli", "--config", str(config))
    launch = subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    log = tmp_path / "ddp" / "log.jsonl"
    deadline = time.monotonic() + 120
    while not (log.exists() and any(r.get("step", 0) >= 2 for r in read_log(str(log)))):
        assert launch.poll() is None and time.monotonic() < deadline, launch.communicate()[0][-3000:]
        time.sleep(0.02)
    os.killpg(launch.pid, signal.SIGTERM)
    out = launch.communicate(timeout=120)[0]
    assert launch.returncode != 0, out[-3000:]
    summary = json.loads((tmp_path / "ddp" / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["signal"] == "SIGTERM" and 2 <= stopped < steps, out[-3000:]
    assert f"stopped by SIGTERM at step {stopped} with checkpoint" in out
    assert checkpoint_step(latest_checkpoint(str(tmp_path / "ddp" / "checkpoints"))) == stopped

    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"resumed from {tmp_path / 'ddp' / 'checkpoints'}/step-{stopped:08d} at step {stopped}" in done.stdout
    _same_records(_records(tmp_path / "ddp"), _records(tmp_path / "single"))
    state = load_checkpoint(latest_checkpoint(str(tmp_path / "ddp" / "checkpoints")))
    assert state["step"] == steps and "signal" not in json.loads((tmp_path / "ddp" / "summary.json").read_text())
    for key, value in trainer.core.state_dict().items():
        torch.testing.assert_close(state["model"][key], value, rtol=1e-5, atol=1e-6, msg=key)
