"""What the scaling sweep (``falcon-fwa scaling``) and the process-group layer (``train.distributed``) promise,
each against a hand-written expectation, where a small change to either module would otherwise go unseen:

- the noise band compares a larger count with the one-process run of its own seed, whatever the row order,
  and a validation loss of 0 is a number, not "-";
- ``--gpus`` may name as many processes as the machine has CUDA devices (one more is refused by name), and
  every field a sweep sets for itself, ``train.eval_every`` included, is refused in its ``--set`` with the reason;
- a sweep exits 1 when a run fails (its row keeps no rate, even with a summary left behind), 128 + the signal
  when a SIGTERM stops it (no further run starts), runs one untimed warm-up per model before that model's first
  timed run, and records each run's ``peak_mem_bytes`` as its ``peak_mem_bytes_per_gpu``;
- ``setup`` refuses DDP/FSDP2 without a process group and ``single`` with several processes, joins a group
  under torchrun with one process too, and ``auto`` is DDP with several processes; ``wrap`` shards every block
  of the largest ``ModuleList`` then the root and names an unknown strategy; ``set_grad_sync`` turns DDP's and
  FSDP2's gradient reduction off while accumulating; ``all_reduce_mean`` is the mean over the processes and
  leaves its input as it was.

Everything runs on the CPU (gloo): in this process for one-member groups, two spawned processes otherwise.
"""
import argparse
import json
import os
import re
import signal
import socket

import pytest
import torch
from torch import nn

from falcon_fwa.train import distributed as D
from falcon_fwa.train import scaling
from conftest import fake_git_commit, fsdp2_on_cpu
from test_train import recipe


def _parser():
    parser = argparse.ArgumentParser()
    scaling.add_arguments(parser)
    return parser


# ---- the results table ----------------------------------------------------------------------------------------

def _row(model, strategy, gpus, seed, val_loss, tokens_per_s=100.0):
    return dict(model=model, strategy=strategy, gpus=gpus, seed=seed, tokens_per_s=tokens_per_s, efficiency=None,
                peak_mem_bytes_per_gpu=None, val_loss=val_loss, status="done", command=f"cmd-{model}{gpus}{seed}")


def test_the_noise_band_compares_a_larger_count_with_the_one_process_run_of_its_own_seed():
    """Seed 1's one-process run comes first (2.0), seed 0's second (1.0); ddp x2 seed 0 at 1.25 is +0.25 against
    seed 0 (not -0.75 against the first row), inside the seed spread of 1.0. A loss of exactly 0 is printed."""
    rows = [_row("A", "ddp", 1, 1, 2.0), _row("A", "ddp", 1, 0, 1.0), _row("A", "ddp", 2, 0, 1.25),
            _row("Z", "ddp", 1, 0, 0.0)]
    lines = scaling.markdown(rows, {}).splitlines()
    assert ("- A: one-process seeds 2.0000, 1.0000 (spread 1.0000); against the 1-process run of the same strategy "
            "and seed: ddp x2 +0.2500 (largest 0.2500: within the seed spread).") in lines
    assert "| Z | ddp | 1 | 0 | 100 | - | - | 0.0000 | done |" in lines
    assert "- Z: one-process seeds 0.0000." in lines


# ---- the checks of the options -----------------------------------------------------------------------------------

def _args(tmp_path, *argv):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    return _parser().parse_args(["--configs", str(path), "--names", "Tiny", "--out", str(tmp_path / "runs"),
                                 "--results", str(tmp_path / "r"), *argv])


def test_as_many_processes_as_cuda_devices_are_taken_and_one_more_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    scaling._check(_args(tmp_path, "--gpus", "1", "2"), ["Tiny"])  # both devices: taken
    with pytest.raises(ValueError, match=r"^--gpus 3: this machine has 2 CUDA device\(s\)$"):
        scaling._check(_args(tmp_path, "--gpus", "1", "3"), ["Tiny"])


# the fields every run sets for itself, after the recipe and --set (so a --set of one would lose or break the
# sweep): the run's batch, strategy, steps, seed, folder, fresh start and one evaluation at the end
SET_BY_THE_SWEEP = ("train.global_batch", "train.micro_batch", "train.strategy", "train.steps", "train.seed",
                    "train.out_dir", "train.resume", "train.eval_every")


@pytest.mark.parametrize("field", SET_BY_THE_SWEEP)
def test_every_field_the_sweep_sets_is_refused_in_its_set_with_a_reason(tmp_path, field):
    with pytest.raises(ValueError) as err:
        scaling._check(_args(tmp_path, "--set", f"{field}=5"), ["Tiny"])
    assert re.fullmatch(rf"--set {re.escape(field)}=5: the sweep sets {re.escape(field)} itself \(.{{10,}}\)",
                        str(err.value)), str(err.value)


# ---- a sweep with its launches replaced --------------------------------------------------------------------------

def _sweep(tmp_path, monkeypatch, argv, outcome):
    """``scaling.run`` with every torchrun launch replaced by ``outcome(n, cfg, signals)`` (n: the launch's number
    from 1), which returns the exit code (None: stopped); a launch that returns 0 or 1 leaves the summary a real
    run writes (the recipe it was given, this commit, peak memory 3 GiB). Returns the exit status, the launched
    run folders' names with their steps, and the rows."""
    from falcon_fwa.train.config import load_config

    monkeypatch.setattr(scaling, "command_provenance",  # this commit, also where the tests run outside a checkout
                        lambda args: dict(commit=fake_git_commit(short=False), dirty=False, options=vars(args)))
    launched = []

    def fake_run_group(cmd, env, log, timeout, grace=30.0, signals=None):
        config, sets = cmd[cmd.index("--config") + 1], [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
        cfg = load_config(config, sets)
        launched.append((os.path.basename(cfg.train.out_dir), cfg.train.steps))
        code = outcome(len(launched), cfg, signals)
        if code is not None:
            os.makedirs(cfg.train.out_dir, exist_ok=True)
            summary = dict(tokens=cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len, steps=cfg.train.steps,
                           tokens_per_s=1000.0, val_loss=2.0, peak_mem_bytes=3 * 2 ** 30,
                           commit=fake_git_commit(short=False), config=cfg.to_dict())
            with open(os.path.join(cfg.train.out_dir, "summary.json"), "w") as f:
                json.dump(summary, f)
        return code

    monkeypatch.setattr(scaling, "_run_group", fake_run_group)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    rc = scaling.run(_parser().parse_args(["--configs", str(path), "--out", str(tmp_path / "runs"),
                                           "--results", str(tmp_path / "r"), "--gpus", "1", "2",
                                           "--strategies", "ddp", "--noise-seeds", "0", "--steps", "3", *argv]))
    return rc, launched, json.loads((tmp_path / "r.json").read_text())


def test_a_failed_run_keeps_no_rate_and_the_sweep_exits_1(tmp_path, monkeypatch, cpu_machine):
    rc, launched, rows = _sweep(tmp_path, monkeypatch, ["--names", "Tiny", "--warmup-steps", "0"],
                                lambda n, cfg, signals: 1 if n == 2 else 0)  # the two-process run fails
    assert rc == 1 and [name for name, _ in launched] == ["Tiny-ddp-n1-s0", "Tiny-ddp-n2-s0"]
    log = os.path.join(str(tmp_path / "runs"), "Tiny-ddp-n2-s0.log")
    assert [r["status"] for r in rows] == ["done", f"failed (exit 1, {log})"]
    # the failed run's summary is not read: no rate, loss, memory or efficiency in its row
    assert [rows[1][k] for k in ("tokens_per_s", "val_loss", "peak_mem_bytes_per_gpu", "efficiency", "tokens")] == \
        [None] * 5
    # the finished run: the summary's numbers, its peak_mem_bytes as the per-GPU peak memory
    assert rows[0]["tokens_per_s"] == 1000.0 and rows[0]["efficiency"] == 1.0
    assert rows[0]["peak_mem_bytes_per_gpu"] == 3 * 2 ** 30 and rows[0]["tokens"] == 3 * 4 * 24
    assert "| Tiny | ddp | 1 | 0 | 1,000 | 100.0 % | 3.00 GiB | 2.0000 | done |" in (tmp_path / "r.md").read_text()


def test_a_sigterm_stops_the_run_in_progress_starts_no_other_and_exits_128_plus_15(tmp_path, monkeypatch,
                                                                                     cpu_machine):
    def sigterm_during_the_first(n, cfg, signals):
        if n > 1:
            return 0  # a second SIGTERM would end this process: a launch after the first is only counted
        signal.raise_signal(signal.SIGTERM)  # the sweep's handler only takes note; the run is stopped
        assert signals.received == signal.SIGTERM
        return None

    rc, launched, rows = _sweep(tmp_path, monkeypatch, ["--names", "Tiny", "--warmup-steps", "0"],
                                sigterm_during_the_first)
    assert rc == 128 + 15 and len(launched) == 1
    assert [r["status"] for r in rows] == ["stopped: SIGTERM", "not run"]


def test_one_warm_up_per_model_runs_before_its_first_timed_run(tmp_path, monkeypatch, cpu_machine):
    path = tmp_path / "other.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    rc, launched, rows = _sweep(tmp_path, monkeypatch, ["--configs", str(tmp_path / "tiny.json"), str(path),
                                                        "--names", "A", "B", "--warmup-steps", "2"],
                                lambda n, cfg, signals: 0)
    assert rc == 0
    assert launched == [("A-warmup", 2), ("A-ddp-n1-s0", 3), ("A-ddp-n2-s0", 3),
                        ("B-warmup", 2), ("B-ddp-n1-s0", 3), ("B-ddp-n2-s0", 3)]
    assert [(r["model"], r["gpus"]) for r in rows] == [("A", 1), ("A", 2), ("B", 1), ("B", 2)]  # no warm-up row
    assert "an untimed warm-up run of 2 steps per model filled the kernel caches first (A: done, B: done)." in \
        (tmp_path / "r.md").read_text()


def test_a_child_that_ignores_sigterm_is_killed_once_the_grace_is_over(tmp_path):
    """Stopped at its 0.5 s deadline with a grace of 1 s, a group whose child ignores SIGTERM gets SIGKILL at about
    1.5 s: the call returns well before the 20 s a missed grace would leave it waiting, the child gone."""
    import time

    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"(trap '' TERM; while :; do sleep 0.05; done) & echo $! > {pid_file}; wait"]
    start = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        assert scaling._run_group(cmd, dict(os.environ), log, timeout=0.5, grace=1.0) is None
    assert 1.5 <= time.monotonic() - start < 20.0
    assert _gone(int(pid_file.read_text()))


def _gone(pid: int) -> bool:
    """No such process, or a zombie (ended, not yet reaped)."""
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


# ---- the process group, in this process ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def one_process_torchrun(monkeypatch, cpu_machine):
    """The environment ``torchrun --nproc_per_node=1`` gives its one worker; the group is ended afterwards."""
    for name, value in (("TORCHELASTIC_RUN_ID", "test"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(_free_port())), ("RANK", "0"), ("WORLD_SIZE", "1"),
                        ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    yield
    D.teardown()


def test_ddp_and_fsdp2_without_a_process_group_are_refused_by_name(monkeypatch, cpu_machine):
    for name in ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for strategy in ("ddp", "fsdp2"):
        with pytest.raises(ValueError, match=rf"^train.strategy '{strategy}' needs a process group: launch with "
                                             r"torchrun \(torchrun --nproc_per_node=N -m falcon_fwa.train.cli"):
            D.setup(strategy)
    info = D.setup("auto")  # one process without torchrun: no group
    assert (info.strategy, info.world_size, info.rank, info.is_main) == ("single", 1, 0, True)
    assert not torch.distributed.is_initialized()


def test_one_process_under_torchrun_is_a_real_one_member_group(one_process_torchrun):
    info = D.setup("ddp")
    assert torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1
    assert torch.distributed.get_backend() == "gloo" and info.strategy == "ddp"


def test_ddp_stops_reducing_gradients_only_while_accumulating(one_process_torchrun):
    info = D.setup("ddp")
    model = D.wrap(nn.Linear(3, 2), info)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    with D.set_grad_sync(model, info, False):
        assert model.require_backward_grad_sync is False
    with D.set_grad_sync(model, info, True):
        assert model.require_backward_grad_sync is True


class _Blocks(nn.Module):
    """A small list (two heads) ahead of the three repeated blocks in ``modules()`` order."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    def forward(self, x):
        for m in [*self.heads, *self.layers]:
            x = m(x)
        return x


@fsdp2_on_cpu
def test_fsdp2_shards_each_block_of_the_largest_list_then_the_root_and_accumulates_unreduced(one_process_torchrun):
    from torch.distributed.fsdp import FSDPModule

    model = _Blocks()
    assert list(D._blocks(model)) == list(model.layers)  # the three blocks, not the first list met
    info = D.setup("fsdp2")
    D.wrap(model, info)
    assert [isinstance(b, FSDPModule) for b in model.layers] == [True, True, True]
    assert [isinstance(h, FSDPModule) for h in model.heads] == [False, False] and isinstance(model, FSDPModule)
    # accumulating: no gradient reaches the sharded parameters; the last micro-step reduces
    D.set_grad_sync(model, info, False)
    model(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is None for p in model.layers.parameters())
    D.set_grad_sync(model, info, True)
    model(torch.ones(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.layers.parameters())


def test_an_unknown_strategy_is_refused_by_wrap_with_the_choices():
    info = D.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), strategy="tp")
    with pytest.raises(ValueError, match=r"^train.strategy must be 'single', 'ddp' or 'fsdp2', got 'tp'$"):
        D.wrap(nn.Linear(2, 2), info)


# ---- two processes -------------------------------------------------------------------------------------------------

def _two_process_worker(rank, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    info = D.setup("auto")
    try:
        value = torch.tensor([1.0, -2.0, 10.0]) * (rank + 1)  # rank 0: v, rank 1: 2 v; the mean is 1.5 v
        mean = D.all_reduce_mean(value, info)
        try:
            D.setup("single")
            refused = None
        except ValueError as err:
            refused = str(err)
        D.barrier(info)
        torch.save(dict(info=(info.rank, info.world_size, info.strategy, info.is_main), value=value, mean=mean,
                        refused=refused), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        D.teardown()


def test_two_processes_join_as_ddp_average_without_touching_the_input_and_refuse_single(tmp_path, cpu_machine):
    import torch.multiprocessing as mp

    mp.spawn(_two_process_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["info"] == (rank, 2, "ddp", rank == 0)
        assert got["mean"].tolist() == [1.5, -3.0, 15.0]
        assert got["value"].tolist() == [(rank + 1) * v for v in (1.0, -2.0, 10.0)]  # its input as it was
        assert got["refused"] == "train.strategy 'single' cannot run with 2 processes; use 'ddp' or 'fsdp2'"


def test_the_module_docstring_states_the_sweeps_defaults_as_the_parser_has_them():
    """The defaults the module docstring lists are the parser's own (the docs state them once, from there)."""
    import argparse

    from falcon_fwa.train import scaling

    parser = argparse.ArgumentParser()
    scaling.add_arguments(parser)
    d = parser.parse_args(["--configs", "x.yaml"])
    doc = " ".join(scaling.__doc__.split())
    assert d.strategies == ["ddp", "fsdp2"] and "both strategies" in doc
    for flag, value in (("--gpus", d.gpus), ("--steps", d.steps), ("--warmup-steps", d.warmup_steps),
                        ("--noise-seeds", d.noise_seeds), ("--out", d.out), ("--results", d.results)):
        text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        assert f"``{flag} {text}``" in doc, (flag, text)
