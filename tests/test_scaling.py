"""The scaling sweep (``falcon-fwa scaling``): its plan, its efficiency arithmetic, and a real
sweep of torchrun launches on CPU (gloo) at one and two processes, DDP and FSDP2."""
import json
import os
import time

import pytest

from falcon_fwa.train import scaling
from conftest import fake_git_commit, fsdp2_on_cpu
from test_train import recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_runs_the_noise_seeds_once_at_the_smallest_count():
    jobs = scaling.plan(["a.yaml", "b.yaml"], ["A", "B"], [2, 1], ["ddp", "fsdp2"], [0, 1])
    got = [(j["model"], j["gpus"], j["strategy"], j["seed"]) for j in jobs]
    assert got == [("A", 1, "ddp", 0), ("A", 1, "ddp", 1), ("A", 1, "fsdp2", 0), ("A", 2, "ddp", 0),
                   ("A", 2, "fsdp2", 0), ("B", 1, "ddp", 0), ("B", 1, "ddp", 1), ("B", 1, "fsdp2", 0),
                   ("B", 2, "ddp", 0), ("B", 2, "fsdp2", 0)]


def test_efficiency_is_tokens_per_s_over_n_times_the_mean_one_process_rate():
    rows = [dict(model="A", strategy="ddp", gpus=1, tokens_per_s=110.0),
            dict(model="A", strategy="ddp", gpus=1, tokens_per_s=90.0),   # second seed: the reference is the mean, 100
            dict(model="A", strategy="ddp", gpus=2, tokens_per_s=180.0),
            dict(model="A", strategy="ddp", gpus=4, tokens_per_s=340.0),
            dict(model="A", strategy="fsdp2", gpus=2, tokens_per_s=150.0),  # no one-process fsdp2 row
            dict(model="A", strategy="ddp", gpus=8, tokens_per_s=None)]
    scaling.efficiencies(rows)
    assert [r["efficiency"] for r in rows[:4]] == pytest.approx([1.1, 0.9, 0.9, 0.85])
    assert rows[4]["efficiency"] == 1.0  # its own smallest count is the reference
    assert rows[5]["efficiency"] is None


def test_no_efficiency_without_a_rate_at_the_smallest_count_run():
    """A failed one-process run leaves the larger counts without their reference: no efficiency, not the
    two-process rate as its own 100 %."""
    rows = [dict(model="A", strategy="fsdp2", gpus=1, tokens_per_s=None),  # failed (e.g. out of memory)
            dict(model="A", strategy="fsdp2", gpus=2, tokens_per_s=150.0),
            dict(model="A", strategy="fsdp2", gpus=4, tokens_per_s=280.0),
            dict(model="A", strategy="ddp", gpus=1, tokens_per_s=100.0),
            dict(model="A", strategy="ddp", gpus=2, tokens_per_s=180.0)]
    scaling.efficiencies(rows)
    assert [r["efficiency"] for r in rows[:3]] == [None, None, None]
    assert [r["efficiency"] for r in rows[3:]] == pytest.approx([1.0, 0.9])


def test_more_gpus_than_the_machine_has_are_refused_by_name(tmp_path, monkeypatch):
    import torch

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    parser = __import__("argparse").ArgumentParser()
    scaling.add_arguments(parser)
    argv = ["--configs", str(path), "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "multigpu")]
    with pytest.raises(ValueError, match="--gpus 4: this machine has 2 CUDA device"):
        scaling.run(parser.parse_args(argv + ["--gpus", "1", "2", "4"]))
    assert not (tmp_path / "multigpu.json").exists() and not (tmp_path / "runs").exists()


def test_every_run_gets_one_thread_setting_and_multicast_off():
    env = scaling.launch_env({"PATH": "/bin", "NCCL_NVLS_ENABLE": "1"})
    assert env["OMP_NUM_THREADS"] == "1" and env["PATH"] == "/bin"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert scaling.launch_env({"OMP_NUM_THREADS": "4"})["OMP_NUM_THREADS"] == "4"  # the caller's choice stays


def test_bad_arguments_name_themselves(tmp_path):
    parser = __import__("argparse").ArgumentParser()
    scaling.add_arguments(parser)
    for argv, match in ((["--configs", "a", "b", "--names", "A"], "--names"), (["--configs", "a", "--gpus", "0"], "--gpus"),
                        (["--configs", "a", "--steps", "0"], "--steps"),
                        (["--configs", "a", "--warmup-steps", "-1"], "--warmup-steps"),
                        (["--configs", "a", "--set", "train.global_batch=8"], "train.global_batch"),
                        (["--configs", "a", "--deadline", "nan"], "--deadline"),
                        (["--configs", "a", "--deadline", "0"], "--deadline"),
                        (["--configs", "a", "--gpus", "1", "1"], "--gpus"),
                        (["--configs", "a", "--strategies", "ddp", "ddp"], "--strategies"),
                        (["--configs", "a", "--noise-seeds", "0", "0"], "--noise-seeds"),
                        (["--configs", "a", "b", "--names", "A", "A"], "--names"),
                        (["--configs", "a", "--names", "../A"], "--names"),
                        (["--configs", "a", "b", "--names", "A B", "A_B"], "--names"),
                        (["--configs", "a", "--results", "out/"], r"--results 'out/' ends in a separator")):
        with pytest.raises(ValueError, match=match):
            scaling.run(parser.parse_args(argv))


def test_scaling_command_prints_a_bad_option_in_one_line(capsys):
    assert scaling.main(["--configs", "a", "--gpus", "2", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("falcon-fwa scaling: error: --gpus must differ") and "Traceback" not in err


def test_one_global_batch_splits_for_every_process_count():
    assert scaling.shared_global_batch(32, [1, 2, 4]) == 128
    assert scaling.shared_global_batch(16, [2, 3]) == 96  # not 16 x 3: two processes need an even count
    for n in (2, 3):
        assert scaling.shared_global_batch(16, [2, 3]) % (16 * n) == 0


def test_a_run_past_its_deadline_is_stopped_with_its_children(tmp_path):
    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    with open(tmp_path / "log", "w") as log:
        assert scaling._run_group(cmd, dict(os.environ), log, timeout=1.0, grace=5.0) is None
    assert not _running(int(pid_file.read_text()))  # the grandchild is stopped too, not only the launcher


def test_a_stopped_run_returns_only_once_its_slower_children_have_ended(tmp_path):
    # the launcher ends at once on SIGTERM; its child takes 1 s to finish its own shutdown
    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"(trap 'sleep 1; exit 0' TERM; while :; do sleep 0.05; done) & echo $! > {pid_file}; wait"]
    with open(tmp_path / "log", "w") as log:
        assert scaling._run_group(cmd, dict(os.environ), log, timeout=0.5, grace=10.0) is None
    assert not _running(int(pid_file.read_text()))


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"(trap '' TERM; while :; do sleep 0.05; done) & echo $! > {pid_file}; wait"]
    start = time.monotonic()
    with open(tmp_path / "log", "w") as log:
        assert scaling._run_group(cmd, dict(os.environ), log, timeout=0.5, grace=1.0) is None
    assert not _running(int(pid_file.read_text()))
    assert time.monotonic() - start >= 1.5  # the deadline, then the whole grace before the SIGKILL


def test_a_stop_signal_stops_the_run_in_progress_with_its_children(tmp_path):
    import threading

    class Signals:
        received = 0

    signals = Signals()
    pid_file = tmp_path / "child.pid"
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    threading.Timer(1.0, lambda: setattr(signals, "received", 15)).start()
    with open(tmp_path / "log", "w") as log:
        assert scaling._run_group(cmd, dict(os.environ), log, timeout=None, grace=5.0, signals=signals) is None
    assert not _running(int(pid_file.read_text()))


def _fake_sweep(tmp_path, monkeypatch, argv, *, kill_at=None):
    """``scaling.run`` with every torchrun launch replaced: the run writes the summary a real one would
    (the recipe it was given, this commit) and exits 0; the ``kill_at``-th launch is interrupted."""
    from falcon_fwa.train.config import load_config

    monkeypatch.setattr(scaling, "command_provenance",  # this commit, also where the tests run outside a checkout
                        lambda args: dict(commit=fake_git_commit(short=False), dirty=False, options=vars(args)))
    launched = []

    def fake_run_group(cmd, env, log, timeout, grace=30.0, signals=None):
        config, sets = cmd[cmd.index("--config") + 1], [cmd[i + 1] for i, c in enumerate(cmd) if c == "--set"]
        cfg = load_config(config, sets)
        launched.append(os.path.basename(cfg.train.out_dir))
        if len(launched) == kill_at:
            raise KeyboardInterrupt
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        summary = dict(tokens=cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len, steps=cfg.train.steps,
                       tokens_per_s=100.0 * len(launched), val_loss=1.0 + len(launched), peak_mem_bytes=None,
                       commit=fake_git_commit(short=False), config=cfg.to_dict())
        with open(os.path.join(cfg.train.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f)
        return 0

    monkeypatch.setattr(scaling, "_run_group", fake_run_group)
    parser = __import__("argparse").ArgumentParser()
    scaling.add_arguments(parser)
    return scaling.run(parser.parse_args(argv)), launched


def test_a_relaunched_sweep_keeps_the_finished_runs_and_only_those_of_the_same_settings(tmp_path, monkeypatch, cpu_machine,
        checkout):
    raw = recipe(tmp_path)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    results = str(tmp_path / "multigpu")
    argv = ["--configs", str(path), "--names", "Tiny", "--gpus", "1", "2", "--strategies", "ddp",
            "--noise-seeds", "0", "1", "--steps", "3", "--warmup-steps", "0", "--out", str(tmp_path / "runs"),
            "--results", results]
    with pytest.raises(KeyboardInterrupt):  # killed during its third run
        _fake_sweep(tmp_path, monkeypatch, argv, kill_at=3)
    before = json.load(open(results + ".json"))
    assert [r["status"] for r in before] == ["done", "done"]
    rc, launched = _fake_sweep(tmp_path, monkeypatch, argv)
    assert rc == 0 and launched == ["Tiny-ddp-n2-s0"]  # the two finished runs are not run again
    rows = json.load(open(results + ".json"))
    assert rows[:2] == before  # the kept rows, as the first launch wrote them
    assert [r["tokens_per_s"] for r in rows] == [100.0, 200.0, 100.0]  # the first launch's rates, then the new one
    assert rows[2]["efficiency"] == pytest.approx(100.0 / (2 * 150.0))  # against the kept one-process runs
    assert {r["device"] for r in rows} == {scaling.device_description()}
    # the same settings on another machine: every run goes again
    monkeypatch.setattr(scaling, "device_description", lambda: "2 x Other GPU")
    rc, launched = _fake_sweep(tmp_path, monkeypatch, argv)
    assert rc == 0 and len(launched) == 3
    # other settings (more steps): every run goes again, nothing of the earlier sweep is kept
    rc, launched = _fake_sweep(tmp_path, monkeypatch, [a if a != "3" else "4" for a in argv])
    assert rc == 0 and len(launched) == 3 and {r["steps"] for r in json.load(open(results + ".json"))} == {4}


def test_a_second_sweep_into_the_same_folder_is_refused_while_the_first_runs(tmp_path, cpu_machine):
    from falcon_fwa.atomic import folder_lock

    parser = __import__("argparse").ArgumentParser()
    scaling.add_arguments(parser)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    with folder_lock(tmp_path / "runs", ".scaling.lock"):
        with pytest.raises(ValueError, match="is in use by another falcon-fwa scaling"):
            scaling.run(parser.parse_args(["--configs", str(path), "--out", str(tmp_path / "runs"),
                                           "--results", str(tmp_path / "multigpu")]))
    assert not (tmp_path / "multigpu.json").exists()


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan nobody has reaped yet is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@fsdp2_on_cpu
def test_sweep_on_cpu_processes_matches_the_one_process_loss(tmp_path, monkeypatch, cpu_machine):
    raw = recipe(tmp_path)
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.path.join(ROOT, "src"))
    results = str(tmp_path / "multigpu")
    rc = scaling.main(["--configs", str(path), "--names", "Tiny", "--gpus", "1", "2", "--strategies", "ddp", "fsdp2",
                       "--noise-seeds", "0", "--steps", "3", "--micro-batch", "2", "--out", str(tmp_path / "runs"),
                       "--results", results, "--set", "train.dtype=fp32", "--machine", "CPU test",
                       "--warmup-steps", "2"])
    rows = json.load(open(results + ".json"))
    assert rc == 0, [r["status"] for r in rows]
    assert [(r["strategy"], r["gpus"]) for r in rows] == [("ddp", 1), ("fsdp2", 1), ("ddp", 2), ("fsdp2", 2)]
    assert {r["tokens"] for r in rows} == {3 * 4 * 24}  # global batch 2 x 2 rows of 24 tokens, 3 steps
    for r in rows:
        assert set(r) >= {"model", "strategy", "gpus", "tokens_per_s", "efficiency", "peak_mem_bytes_per_gpu",
                          "val_loss"}
        assert r["tokens_per_s"] > 0 and r["efficiency"] > 0
    assert os.path.exists(tmp_path / "runs" / "Tiny-warmup" / "summary.json")  # the untimed warm-up ran first
    # the same token stream and optimizer steps: two processes reproduce the one-process loss
    ref = rows[0]["val_loss"]
    assert all(abs(r["val_loss"] - ref) <= 1e-5 * abs(ref) for r in rows), [r["val_loss"] for r in rows]
    assert [r["efficiency"] for r in rows[:2]] == [1.0, 1.0]
    text = open(results + ".md").read()
    assert "| Tiny | fsdp2 | 2 |" in text and "torch.distributed.run" in text
    assert "warm-up run of 2 steps per model" in text and "Tiny: done" in text


def test_the_suite_stage_keeps_its_rows_beside_the_runs_so_a_second_launch_goes_on(tmp_path):
    """``gpu_suite.sh OUT multigpu`` launched twice, each time into a fresh OUT (as a lent machine's calls
    are): the second sweep is given the rows the first wrote, and each OUT gets the rows."""
    import shlex
    import stat
    import subprocess

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    # the python stub: for the scaling command, records its argv and whether its --results rows already
    # exist, then writes them as a sweep would
    stub = ('[ "$1 $2 $3" = "-m falcon_fwa.cli scaling" ] || exit 0\n'
            'args=("$@"); for i in "${!args[@]}"; do [ "${args[$i]}" = --results ] && res=${args[$((i+1))]}; done\n'
            'echo "$([ -f "$res.json" ] && echo kept || echo fresh) $(printf "%q " "$@")" >> "$CALLS"\n'
            'mkdir -p "$(dirname "$res")"; echo "[]" > "$res.json"; echo "# rows" > "$res.md"\n')
    for name, body in (("python", stub), ("nvidia-smi", 'echo "GPU 0: stub"; echo "GPU 1: stub"')):
        (bin_ / name).write_text(f"#!/usr/bin/env bash\n{body}")
        (bin_ / name).chmod(stat.S_IRWXU)
    calls = tmp_path / "calls.txt"
    env = dict(os.environ, PATH=f"{bin_}{os.pathsep}{os.environ['PATH']}", PYTHON=str(bin_ / "python"),
               CALLS=str(calls), TRITON_CACHE_DIR=str(tmp_path / "cache"), MULTIGPU_RUNS=str(tmp_path / "runs"))
    for out in ("out1", "out2"):
        subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_suite.sh"), str(tmp_path / out), "multigpu"],
                       cwd=ROOT, env=env, capture_output=True, timeout=60)
        assert json.loads((tmp_path / out / "multigpu.json").read_text()) == []
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["fresh", "kept"]
    for line in lines:
        argv = shlex.split(line)[1:]
        assert argv[argv.index("--results") + 1] == str(tmp_path / "runs" / "multigpu")
        assert argv[argv.index("--out") + 1] == str(tmp_path / "runs")
        assert argv[argv.index("--gpus") + 1:argv.index("--strategies")] == ["1", "2"]


def _max_over_ranks(rank, world, init_file, out_dir):
    import torch
    import torch.distributed as dist

    from falcon_fwa.train import distributed as D

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        info = D.DistInfo(rank=rank, world_size=world, local_rank=rank, device=torch.device("cpu"), strategy="ddp")
        value = torch.tensor([[10, -3], [7, 100]], dtype=torch.int64) * (rank + 1) - 50 * rank
        got = D.all_reduce_max(value, info)
        torch.save({"got": got, "value": value}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_all_reduce_max_gives_every_process_the_elementwise_largest_value(tmp_path):
    # what the trainer's peak memory per GPU takes over the processes (an FSDP2 shard can be larger on one rank)
    import torch
    import torch.multiprocessing as mp

    world = 2
    mp.spawn(_max_over_ranks, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    expected = torch.stack([r["value"] for r in results]).amax(0)
    # by hand: rank r holds v * (r + 1) - 50 r; the maxima come from rank 0 (three entries) and rank 1 (one)
    assert expected.tolist() == [[10, -3], [7, 150]]
    base = torch.tensor([[10, -3], [7, 100]], dtype=torch.int64)
    for rank, r in enumerate(results):
        assert torch.equal(r["got"], expected)
        assert torch.equal(r["value"], base * (rank + 1) - 50 * rank)  # its input is left as it was


def test_peak_memory_is_none_on_the_cpu():
    import torch

    from falcon_fwa.train import distributed as D

    info = D.DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), strategy="single")
    assert D.peak_memory_bytes(info) is None


def test_fsdp2_takes_fully_shard_where_older_torch_keeps_it_and_names_the_strategy_where_there_is_none(monkeypatch):
    # torch 2.4 and 2.5 keep FSDP2's fully_shard under torch.distributed._composable.fsdp, 2.6 on in fsdp
    import sys
    import types

    from falcon_fwa.train import distributed as D

    marker = object()
    for module in ("torch.distributed.fsdp.fully_shard", "torch.distributed._composable.fsdp.fully_shard"):
        monkeypatch.delitem(sys.modules, module, raising=False)  # no submodule of that name in its place
    old = types.ModuleType("torch.distributed._composable.fsdp")
    old.fully_shard = marker
    monkeypatch.setitem(sys.modules, "torch.distributed.fsdp", types.ModuleType("torch.distributed.fsdp"))
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.fsdp", old)
    assert D._fully_shard() is marker
    monkeypatch.setitem(sys.modules, "torch.distributed._composable.fsdp",
                        types.ModuleType("torch.distributed._composable.fsdp"))
    with pytest.raises(RuntimeError, match=r"train.strategy='fsdp2'.*use strategy 'ddp'"):
        D._fully_shard()


def test_run_sets_and_command_of_one_run_by_hand():
    """30 steps: warm-up over 30 // 15 = 2 steps, one evaluation and one save at the end, a log line every 3 steps,
    the job's own seed and strategy; 7 steps: warm-up and log cadence at their floor of 1. The caller's --set
    comes last, after the recipe file."""
    job = dict(model="m", config="c.yaml", gpus=4, strategy="fsdp2", seed=5)
    sets = scaling.run_sets(job, steps=30, micro_batch=3, global_batch=12, out_dir="runs/x y", extra_sets=["a.b=1"])
    assert sets == ["train.strategy=fsdp2", "train.steps=30", "train.seed=5", "train.micro_batch=3",
                    "train.global_batch=12", "optim.warmup_steps=2", "train.eval_every=30", "train.save_every=30",
                    "train.resume=none", "train.export_model=false", 'train.out_dir="runs/x y"', "log.progress=false",
                    "log.every=3", "a.b=1"]
    short = scaling.run_sets(job, steps=7, micro_batch=3, global_batch=12, out_dir="o", extra_sets=[])
    assert "optim.warmup_steps=1" in short and "log.every=1" in short and "train.eval_every=7" in short
    cmd = scaling.command(job, ["x=1", "y=2"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", "falcon_fwa.train.cli",
                       "--config", "c.yaml", "--set", "x=1", "--set", "y=2"]


def test_a_run_is_done_only_with_exit_status_0():
    assert scaling._status(0, "r.log") == "done"
    assert scaling._status(1, "r.log") == "failed (exit 1, r.log)"
    assert scaling._status(None, "r.log") == "stopped: deadline"
    assert scaling._status(None, "r.log", 15) == "stopped: SIGTERM"


def test_only_the_finished_rows_of_an_earlier_sweep_are_kept_by_command(tmp_path):
    results = str(tmp_path / "multigpu")
    assert scaling._earlier_rows(results) == {}  # none yet
    rows = [dict(command="a", status="done", tokens_per_s=1.0), dict(command="b", status="failed (exit 1, b.log)"),
            dict(command="c", status="stopped: deadline"), dict(status="done"), "not a row",
            dict(command="d", status="done", tokens_per_s=2.0)]
    (tmp_path / "multigpu.json").write_text(json.dumps(rows))
    assert scaling._earlier_rows(results) == {"a": rows[0], "d": rows[5]}
    (tmp_path / "multigpu.json").write_text("{cut short")
    assert scaling._earlier_rows(results) == {}


def test_the_table_and_the_noise_band_by_hand():
    """One-process ddp seeds 0 and 1 at val loss 1.0 and 1.5 (spread 0.5; the fsdp2 one-process run is not a
    noise seed); ddp x2 seed 0 at 1.5 differs from its own seed's one-process run by +0.5, the spread itself:
    within it. Model B: its seed 0 one-process run failed, so its two-process run has no baseline and one
    seed gives no spread."""
    rows = [dict(model="A", strategy="ddp", gpus=1, seed=0, tokens_per_s=1234.4, efficiency=1.0,
                 peak_mem_bytes_per_gpu=3 * 2 ** 29, val_loss=1.0, status="done", command="cmd-a1"),
            dict(model="A", strategy="ddp", gpus=1, seed=1, tokens_per_s=1000.0, efficiency=0.81,
                 peak_mem_bytes_per_gpu=None, val_loss=1.5, status="done", command="cmd-a2"),
            dict(model="A", strategy="fsdp2", gpus=1, seed=0, tokens_per_s=900.0, efficiency=1.0,
                 peak_mem_bytes_per_gpu=None, val_loss=1.25, status="done", command="cmd-a3"),
            dict(model="A", strategy="ddp", gpus=2, seed=0, tokens_per_s=2000.0, efficiency=0.9004,
                 peak_mem_bytes_per_gpu=None, val_loss=1.5, status="done", command="cmd-a4"),
            dict(model="B", strategy="ddp", gpus=1, seed=0, tokens_per_s=None, efficiency=None,
                 peak_mem_bytes_per_gpu=None, val_loss=None, status="failed (exit 1, l)", command="cmd-b1"),
            dict(model="B", strategy="ddp", gpus=1, seed=1, tokens_per_s=500.0, efficiency=None,
                 peak_mem_bytes_per_gpu=None, val_loss=2.0, status="done", command="cmd-b2"),
            dict(model="B", strategy="ddp", gpus=2, seed=0, tokens_per_s=800.0, efficiency=None,
                 peak_mem_bytes_per_gpu=None, val_loss=2.25, status="done", command="cmd-b3")]
    text = scaling.markdown(rows, dict(machine="M", commit="c0", steps=10, global_batch=8, seq_len=24, micro_batch=4,
                                       omp_num_threads="1"))
    lines = text.splitlines()
    assert "| A | ddp | 1 | 0 | 1,234 | 100.0 % | 1.50 GiB | 1.0000 | done |" in lines
    assert "| A | ddp | 2 | 0 | 2,000 | 90.0 % | - | 1.5000 | done |" in lines
    assert "| B | ddp | 1 | 0 | - | - | - | - | failed (exit 1, l) |" in lines
    assert ("- A: one-process seeds 1.0000, 1.5000 (spread 0.5000); against the 1-process run of the same strategy "
            "and seed: ddp x2 +0.5000 (largest 0.5000: within the seed spread).") in lines
    assert "- B: one-process seeds 2.0000." in lines
    assert [line.strip() for line in lines[lines.index("## Commands") + 2:]] == [r["command"] for r in rows]
    rows[3]["val_loss"] = 1.5625  # +0.5625: outside the spread
    assert "(largest 0.5625: outside the seed spread)." in scaling.markdown(rows, {})


def test_micro_batch_sets_every_runs_batch_and_zero_is_refused(tmp_path, monkeypatch, cpu_machine):
    """--micro-batch 3 at 1 and 2 processes: a global batch of 3 x lcm(1, 2) = 6 rows in every run (3 steps of
    6 x 24 tokens), not the recipe's micro_batch of 2; --micro-batch 0 is refused by name."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    argv = ["--configs", str(path), "--names", "Tiny", "--gpus", "1", "2", "--strategies", "ddp", "--noise-seeds", "0",
            "--steps", "3", "--warmup-steps", "0", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r")]
    rc, launched = _fake_sweep(tmp_path, monkeypatch, argv + ["--micro-batch", "3"])
    rows = json.load(open(tmp_path / "r.json"))
    assert rc == 0 and launched == ["Tiny-ddp-n1-s0", "Tiny-ddp-n2-s0"]
    assert [r["tokens"] for r in rows] == [3 * 6 * 24] * 2
    assert all("train.micro_batch=3" in r["command"] and "train.global_batch=6" in r["command"] for r in rows)
    with pytest.raises(ValueError, match="--micro-batch must be >= 1, got 0"):
        _fake_sweep(tmp_path, monkeypatch, argv + ["--micro-batch", "0"])


def _argv(tmp_path, *configs):
    return ["--configs", *map(str, configs), "--gpus", "1", "--strategies", "ddp", "--noise-seeds", "0",
            "--steps", "3", "--warmup-steps", "0", "--out", str(tmp_path / "runs"), "--results",
            str(tmp_path / "multigpu")]


def test_a_data_source_that_names_no_file_is_refused_by_recipe_before_any_run(tmp_path, monkeypatch, cpu_machine):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(recipe(tmp_path)))
    raw = recipe(tmp_path)
    raw["data"].update(train_source=str(tmp_path / "missing.txt"), out_dir=str(tmp_path / "data-bad"))
    bad.write_text(json.dumps(raw))
    with pytest.raises(FileNotFoundError, match=rf"--configs {bad}: data.train_source: data source .*missing.txt"):
        _fake_sweep(tmp_path, monkeypatch, _argv(tmp_path, good, bad))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "multigpu.json").exists()  # nothing launched


def test_a_recipe_that_does_not_load_is_refused_before_the_first_recipe_runs(tmp_path, monkeypatch, cpu_machine):
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(recipe(tmp_path)))
    raw = recipe(tmp_path)
    raw["train"]["stepz"] = 3
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="stepz"):
        _fake_sweep(tmp_path, monkeypatch, _argv(tmp_path, good, bad))
    assert not (tmp_path / "runs").exists()


def test_tokenized_data_whose_corpus_is_gone_still_runs(tmp_path, monkeypatch, cpu_machine):
    from falcon_fwa.data import prepare_dataset
    from falcon_fwa.train.config import config_from_dict

    raw = recipe(tmp_path)
    prepare_dataset(config_from_dict(raw).data.spec(), raw["data"]["out_dir"])
    os.remove(raw["data"]["train_source"])  # the runs read the tokens of data.out_dir
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    rc, launched = _fake_sweep(tmp_path, monkeypatch, _argv(tmp_path, path))
    assert rc == 0 and launched == ["tiny-ddp-n1-s0"]


def test_the_console_gives_a_runs_rate_and_loss_or_the_error_its_log_ends_with(tmp_path, monkeypatch, capsys,
                                                                                cpu_machine):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(recipe(tmp_path)))
    rc, _ = _fake_sweep(tmp_path, monkeypatch, _argv(tmp_path, path))
    assert rc == 0 and "    done: 100 tokens/s, val loss 2.0000\n" in capsys.readouterr().out

    def failing_run(cmd, env, log, timeout, grace=30.0, signals=None):
        log.write("falcon-fwa train: error: first\nTraceback\nfalcon-fwa train: error: data.seq_len must be >= 2\n"
                  "torchrun: ChildFailedError\n")
        return 1

    monkeypatch.setattr(scaling, "_run_group", failing_run)
    parser = __import__("argparse").ArgumentParser()
    scaling.add_arguments(parser)
    argv = _argv(tmp_path, path)
    argv[argv.index("3")] = "4"  # other settings: the run goes again
    assert scaling.run(parser.parse_args(argv)) == 1
    log = tmp_path / "runs" / "tiny-ddp-n1-s0.log"
    assert (f"    failed (exit 1, {log})\n    falcon-fwa train: error: data.seq_len must be >= 2\n"
            in capsys.readouterr().out)


def test_a_finished_sweep_whose_corpus_is_gone_relaunches_without_a_run(tmp_path, monkeypatch, cpu_machine,
        checkout):
    """Recipes without data.out_dir tokenize in each run's folder: where every run's folder holds its tokens,
    the corpus is not needed again, kept runs or not; a missing one is named where a run would tokenize it,
    also for a sweep of other settings (a new data.out_dir) over finished run folders."""
    raw = recipe(tmp_path)
    del raw["data"]["out_dir"]
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(raw))
    argv = _argv(tmp_path, path)
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, ["tiny-ddp-n1-s0"])
    prepared = tmp_path / "runs" / "tiny-ddp-n1-s0" / "data" / "prepared.json"
    prepared.parent.mkdir()
    prepared.write_text("{}")  # as the run, which tokenized its corpus there
    os.remove(raw["data"]["train_source"])
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, [])  # kept from the first sweep
    os.remove(tmp_path / "runs" / "tiny-ddp-n1-s0" / "summary.json")  # to run again, from the tokens there
    assert _fake_sweep(tmp_path, monkeypatch, argv) == (0, ["tiny-ddp-n1-s0"])
    with pytest.raises(FileNotFoundError, match=rf"--configs {path}: data.train_source"):
        _fake_sweep(tmp_path, monkeypatch, argv + ["--set", f"data.out_dir={tmp_path / 'new-data'}"])
    prepared.unlink()
    with pytest.raises(FileNotFoundError, match=rf"--configs {path}: data.train_source"):
        _fake_sweep(tmp_path, monkeypatch, argv)
