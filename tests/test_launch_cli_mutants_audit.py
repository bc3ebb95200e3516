"""Launch plumbing and command wiring, pinned against stand-ins that record what they are given.

``falcon_fwa.train.distributed``: ``setup`` reads RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them (the
device is cuda:LOCAL_RANK, the main process is global rank 0, a torchrun launch of one process still joins a
process group, the backend is nccl on CUDA and gloo on the CPU, ``"auto"`` is DDP for several processes),
refuses ``single`` with several processes and ``ddp``/``fsdp2`` without a process group; ``wrap`` gives DDP
the local device and shards every block of the largest ``ModuleList`` and then the root on a one-dimensional
mesh of the device's type over every process; ``set_grad_sync`` turns synchronisation off only while
accumulating; the reductions average, take the maximum and broadcast rank 0's object without touching
their input.

``falcon_fwa.train.launch.drop_hung_up_terminal``: standard output and error are each pointed at /dev/null
where a write to them fails with EIO (a terminal that hung up), and left alone otherwise; ``StopSignals``
built disabled sets no handler.

``falcon-fwa train``: ``--stop-at`` below 1 is refused naming the option and the value; a SIGTERM during a
step ends the command at that step's checkpoint with exit status 128 + SIGTERM and a line naming both; on
a finished run, a ``--stop-at`` before its last step is refused naming the steps it takes, and one at its
last step does nothing and points to a longer ``train.steps``, not to a later ``--stop-at``; a diverging run's
error (exit status 3) is printed on a line of its own, after the progress bar's.

``falcon-fwa ppl``: ``--batch-size`` reaches the scoring, ``--train-len`` marks the buckets from it in the
report and the table, a ``--plot`` name ending in ``.PNG`` is a PNG name, and an ``hf:`` data source is
taken as it is (no local file looked for).

``falcon-fwa generate``: ``--no-stop-at-eos``, ``--seed`` and ``--batch-size`` reach the decoding and the
``--json`` settings; the summary line gives peak GPU memory in GiB (2**30 bytes).
"""
import contextlib
import errno
import signal

import pytest
import torch
from torch import nn
from conftest import fsdp2_on_cpu

from falcon_fwa.train import distributed, launch
from falcon_fwa.train.distributed import DistInfo


class FakeGroup:
    """Stands in for ``torch.distributed``'s process group calls: records each join and its backend."""

    def __init__(self, monkeypatch, initialized=False):
        self.initialized = initialized
        self.backends = []
        monkeypatch.setattr(distributed.dist, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(distributed.dist, "init_process_group", self.init)

    def init(self, backend):
        assert not self.initialized, "joined twice"
        self.backends.append(backend)
        self.initialized = True


def _env(monkeypatch, **values):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in values.items():
        monkeypatch.setenv(name, str(value))


@pytest.fixture
def cpu_only(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_setup_reads_the_torchrun_variables_of_a_process_on_a_second_node(monkeypatch, cpu_only):
    """Process 5 of 8, the second of its node (two nodes of four): global rank 5, local rank 1, gloo on
    the CPU, DDP by default, and not the main process."""
    group = FakeGroup(monkeypatch)
    _env(monkeypatch, RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, TORCHELASTIC_RUN_ID="x")
    info = distributed.setup()
    assert (info.rank, info.world_size, info.local_rank, info.device, info.strategy) == (
        5, 8, 1, torch.device("cpu"), "ddp")
    assert group.backends == ["gloo"] and not info.is_main


def test_the_main_process_is_global_rank_0_not_the_first_of_each_node(monkeypatch, cpu_only):
    FakeGroup(monkeypatch)
    _env(monkeypatch, RANK=4, WORLD_SIZE=8, LOCAL_RANK=0, TORCHELASTIC_RUN_ID="x")
    assert not distributed.setup().is_main
    assert DistInfo(0, 8, 3, torch.device("cpu"), "ddp").is_main


def test_on_cuda_each_process_takes_the_gpu_of_its_local_rank_and_nccl(monkeypatch):
    group = FakeGroup(monkeypatch)
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    _env(monkeypatch, RANK=6, WORLD_SIZE=8, LOCAL_RANK=2, TORCHELASTIC_RUN_ID="x")
    info = distributed.setup("fsdp2")
    assert info.device == torch.device("cuda", 2) and chosen == [torch.device("cuda", 2)]
    assert group.backends == ["nccl"] and info.strategy == "fsdp2"


def test_a_torchrun_launch_of_one_process_joins_a_group_and_a_plain_one_does_not(monkeypatch, cpu_only):
    group = FakeGroup(monkeypatch)
    _env(monkeypatch, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, TORCHELASTIC_RUN_ID="x")
    assert distributed.setup().strategy == "single" and group.backends == ["gloo"]
    group = FakeGroup(monkeypatch)
    _env(monkeypatch, RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, TORCHELASTIC_RUN_ID="x")
    assert distributed.setup("fsdp2").strategy == "fsdp2" and group.backends == ["gloo"]
    group = FakeGroup(monkeypatch)
    _env(monkeypatch)  # no torchrun variables at all: one process, rank 0
    info = distributed.setup()
    assert (info.rank, info.world_size, info.local_rank, info.strategy) == (0, 1, 0, "single")
    assert group.backends == [] and info.is_main


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_ddp_and_fsdp2_without_a_process_group_are_refused_naming_torchrun(monkeypatch, cpu_only, strategy):
    FakeGroup(monkeypatch)
    _env(monkeypatch)
    with pytest.raises(ValueError, match=rf"^train.strategy '{strategy}' needs a process group: .*torchrun"):
        distributed.setup(strategy)


@pytest.mark.parametrize("world", [2, 3])
def test_single_with_several_processes_is_refused_naming_the_count(monkeypatch, cpu_only, world):
    FakeGroup(monkeypatch)
    _env(monkeypatch, RANK=1, WORLD_SIZE=world, LOCAL_RANK=1)
    with pytest.raises(ValueError, match=rf"^train.strategy 'single' cannot run with {world} processes"):
        distributed.setup("single")


def test_ddp_gets_the_local_gpu_on_cuda_and_no_device_ids_on_the_cpu(monkeypatch):
    import torch.nn.parallel

    given = []
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel",
                        lambda model, device_ids: given.append(device_ids) or model)
    model = nn.Linear(2, 2)
    assert distributed.wrap(model, DistInfo(6, 8, 2, torch.device("cuda", 2), "ddp")) is model
    distributed.wrap(model, DistInfo(6, 8, 2, torch.device("cpu"), "ddp"))
    assert given == [[2], None]
    assert distributed.wrap(model, DistInfo(0, 1, 0, torch.device("cpu"), "single")) is model


class _TwoLists(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])


@pytest.mark.parametrize("device", [pytest.param(torch.device("cpu"), marks=fsdp2_on_cpu), torch.device("cuda", 1)])
def test_fsdp2_shards_each_block_of_the_largest_list_then_the_root_on_a_mesh_of_every_process(monkeypatch,
                                                                                             device):
    import torch.distributed.device_mesh as device_mesh

    meshes, sharded = [], []
    monkeypatch.setattr(device_mesh, "init_device_mesh",
                        lambda kind, shape: meshes.append((kind, tuple(shape))) or "mesh")
    monkeypatch.setattr(distributed, "_fully_shard",
                        lambda: lambda module, mesh: sharded.append((module, mesh)))
    model = _TwoLists()
    assert distributed.wrap(model, DistInfo(1, 4, 1, device, "fsdp2")) is model
    assert meshes == [(device.type, (4,))]
    assert [m for m, _ in sharded] == [*model.blocks, model] and {mesh for _, mesh in sharded} == {"mesh"}


def test_an_unknown_strategy_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"'single', 'ddp' or 'fsdp2', got 'zero3'"):
        distributed.wrap(nn.Linear(2, 2), DistInfo(0, 2, 0, torch.device("cpu"), "zero3"))


class _Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.events = []

    def no_sync(self):
        self.events.append("no_sync")
        return contextlib.nullcontext("no_sync")

    def set_requires_gradient_sync(self, sync):
        self.events.append(("sync", sync))


def test_grad_sync_is_off_only_while_accumulating():
    cpu = torch.device("cpu")
    for strategy, accumulating, last in (("ddp", ["no_sync"], []),
                                         ("fsdp2", [("sync", False)], [("sync", True)]),
                                         ("single", [], [])):
        model, info = _Recorder(), DistInfo(0, 2, 0, cpu, strategy)
        with distributed.set_grad_sync(model, info, sync=False):
            pass
        assert model.events == accumulating, strategy
        model.events = []
        with distributed.set_grad_sync(model, info, sync=True):
            pass
        assert model.events == last, strategy


@pytest.fixture
def three_ranks(monkeypatch):
    """This process holds one value; two others hold ``[1, 8]`` and ``[4, -2]``."""
    others = torch.tensor([[1.0, 8.0], [4.0, -2.0]])
    ops = []

    def all_reduce(value, op):
        ops.append(op)
        if op == torch.distributed.ReduceOp.SUM:
            value += others.sum(0)
        else:
            value.copy_(torch.maximum(value, others.max(0).values))

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    return DistInfo(0, 3, 0, torch.device("cpu"), "ddp"), ops


def test_the_mean_and_max_are_over_every_process_and_leave_the_input_alone(three_ranks):
    info, ops = three_ranks
    mine = torch.tensor([7.0, 0.0])
    assert torch.equal(distributed.all_reduce_mean(mine, info), torch.tensor([4.0, 2.0]))  # (7+1+4)/3, (0+8-2)/3
    assert torch.equal(distributed.all_reduce_max(mine, info), torch.tensor([7.0, 8.0]))
    assert torch.equal(mine, torch.tensor([7.0, 0.0]))
    assert ops == [torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.MAX]
    one = DistInfo(0, 1, 0, torch.device("cpu"), "single")
    assert distributed.all_reduce_mean(mine, one) is mine and distributed.all_reduce_max(mine, one) is mine


def test_broadcast_gives_every_process_the_object_of_rank_0(monkeypatch):
    sources = []

    def broadcast_object_list(box, src):
        sources.append(src)
        box[0] = "rank 0's"

    FakeGroup(monkeypatch, initialized=True)
    monkeypatch.setattr(distributed.dist, "broadcast_object_list", broadcast_object_list)
    assert distributed.broadcast_object("mine", DistInfo(3, 4, 3, torch.device("cpu"), "ddp")) == "rank 0's"
    assert sources == [0]
    assert distributed.broadcast_object("mine", DistInfo(0, 1, 0, torch.device("cpu"), "single")) == "mine"
    FakeGroup(monkeypatch, initialized=False)
    assert distributed.broadcast_object("mine", DistInfo(3, 4, 3, torch.device("cpu"), "ddp")) == "mine"
    assert sources == [0]


class _FakeOs:
    """Stands in for ``os`` in :mod:`falcon_fwa.train.launch`: writes fail with the given errno per file
    descriptor; opens, redirections and closes are recorded, none made."""

    devnull, O_WRONLY = "/dev/null", 1

    def __init__(self, failures):
        self.failures, self.events = failures, []

    def write(self, fd, data):
        assert data == b""
        if fd in self.failures:
            raise OSError(self.failures[fd], "write failed")
        return 0

    def open(self, path, flags):
        self.events.append(("open", path))
        return 99

    def dup2(self, fd, to):
        self.events.append(("dup2", fd, to))

    def close(self, fd):
        self.events.append(("close", fd))


@pytest.mark.parametrize("failures, events", [
    ({1: errno.EIO, 2: errno.EIO}, [("open", "/dev/null"), ("dup2", 99, 1), ("dup2", 99, 2), ("close", 99)]),
    ({2: errno.EIO}, [("open", "/dev/null"), ("dup2", 99, 2), ("close", 99)]),
    ({1: errno.EIO, 2: errno.EPIPE}, [("open", "/dev/null"), ("dup2", 99, 1), ("close", 99)]),
    ({1: errno.EPIPE, 2: errno.EBADF}, []),  # a closed pipe, a closed descriptor: no hung-up terminal
    ({}, []),
])
def test_only_a_hung_up_terminal_is_pointed_at_devnull(monkeypatch, failures, events):
    fake = _FakeOs(failures)
    monkeypatch.setattr(launch, "os", fake)
    launch.drop_hung_up_terminal()
    assert fake.events == events


def test_stop_signals_built_disabled_leave_every_handler_as_it_was():
    before = {sig: signal.getsignal(sig) for sig in launch.StopSignals.SIGNALS}
    with launch.StopSignals(False) as stops:
        assert not stops.enabled
        assert {sig: signal.getsignal(sig) for sig in launch.StopSignals.SIGNALS} == before
    with launch.StopSignals(True) as stops:  # on this (main) thread, enabled: its own handler is in place
        assert stops.enabled and signal.getsignal(signal.SIGTERM) == stops._handle
    assert {sig: signal.getsignal(sig) for sig in launch.StopSignals.SIGNALS} == before


@pytest.mark.parametrize("stop_at", ["0", "-3"])
def test_a_stop_step_below_1_is_refused_naming_the_option(monkeypatch, capsys, tmp_path, stop_at):
    from falcon_fwa.train.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    assert main(["--config", str(tmp_path / "recipe.yaml"), "--stop-at", stop_at]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"falcon-fwa train: error: --stop-at must be a step >= 1, got {stop_at}"), err


def test_a_sigterm_ends_the_train_command_with_a_checkpoint_and_status_128_plus_sigterm(tmp_path, monkeypatch,
                                                                                        capsys):
    import json

    from test_train import recipe, signal_during_step_3

    from falcon_fwa.train.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    reached = []  # a run that took no stop would hand the signal here and train on to its end
    before = signal.signal(signal.SIGTERM, lambda signum, frame: reached.append(signum))
    try:
        signal_during_step_3(monkeypatch, signal.SIGTERM)
        path = tmp_path / "recipe.json"
        path.write_text(json.dumps(recipe(tmp_path, "run", save_every=0, eval_every=0)))
        capsys.readouterr()
        status = main(["--config", str(path)])
    finally:
        signal.signal(signal.SIGTERM, before)
        torch.set_num_threads(threads)
    assert status == 128 + signal.SIGTERM and reached == []
    err = capsys.readouterr().err
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    assert f"stopped by SIGTERM at step 3 with checkpoint {checkpoint}; the same command resumes it" in err, err
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def test_stop_at_on_a_finished_run(tmp_path, monkeypatch, capsys):
    import json

    from test_train import recipe, run_trainer

    from falcon_fwa.train.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        raw = recipe(tmp_path, "run")  # train.steps = 4, checkpoints at 2 and 4
        assert run_trainer(raw).step == 4
        path = tmp_path / "recipe.json"
        path.write_text(json.dumps(raw))
        capsys.readouterr()
        assert main(["--config", str(path), "--stop-at", "2"]) == 2
        err = capsys.readouterr().err
        assert ("--stop-at 2 is before the run's checkpoint at step 4, where it resumes: give a step from 4 to "
                "train.steps = 4, or train.resume=none") in err, err
        assert main(["--config", str(path), "--stop-at", "4"]) == 0
        said = capsys.readouterr()
        said = said.out + said.err
        assert "a longer train.steps continues the run" in said  # the trainer's word on a finished run
        assert "a later --stop-at" not in said and "is at --stop-at 4 already" not in said
    finally:
        torch.set_num_threads(threads)


def test_a_diverging_runs_error_starts_a_line_of_its_own_after_the_progress_bar(tmp_path, monkeypatch, capsys):
    import json

    from test_train import recipe

    from falcon_fwa.train.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    raw = recipe(tmp_path, "run", steps=6)
    raw["optim"] = {"lr": 1e6, "warmup_steps": 1, "clip_grad_norm": 0}
    raw["log"]["progress"] = True
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(raw))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        capsys.readouterr()
        assert main(["--config", str(path)]) == 3
    finally:
        torch.set_num_threads(threads)
    before, error = capsys.readouterr().err.split("falcon-fwa train: error: ", 1)
    assert "train: " in before.rsplit("\n", 2)[-2], before  # the last line before the error is the bar's
    assert before.endswith("\n") and error.startswith("non-finite training loss"), (before[-200:], error)


def _saved_model(folder):
    from falcon_fwa import FalconForCausalLM, get_preset
    from falcon_fwa.data.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    FalconForCausalLM(get_preset("tiny-falcon", vocab_size=320)).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return str(folder)


def test_ppl_passes_the_batch_size_on_and_marks_the_buckets_from_the_training_length(tmp_path, monkeypatch, capsys):
    import json

    from falcon_fwa.cli import main
    from falcon_fwa.eval import ppl_cli

    given = []
    real = ppl_cli.position_nll

    def recording(model, rows, **kwargs):
        given.append(dict(kwargs, windows=len(rows)))
        return real(model, rows, **kwargs)

    monkeypatch.setattr(ppl_cli, "position_nll", recording)
    model = _saved_model(tmp_path / "m")
    text = tmp_path / "held.txt"
    text.write_text("fast weight attention reads the state " * 20)
    out = tmp_path / "ppl.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        capsys.readouterr()
        assert main(["ppl", "--model", model, "--data", str(text), "--seq-len", "16", "--buckets", "0,4,8,16",
                     "--train-len", "8", "--batch-size", "3", "--max-windows", "5", "--device", "cpu",
                     "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert [(g["batch_size"], g["windows"], g["bf16"], g["eos_id"]) for g in given] == [(3, 5, False, 256)]
    report = json.loads(out.read_text())
    assert [(b["start"], b["end"], b["beyond_train_len"]) for b in report["buckets"]] == [
        (0, 4, False), (4, 8, False), (8, 16, True)]
    table = [line for line in capsys.readouterr().out.splitlines() if line.lstrip()[:1].isdigit()]
    assert [line.endswith("(beyond training length)") for line in table] == [False, False, True], table


def test_a_plot_named_in_capitals_is_a_png_name(tmp_path, monkeypatch, capsys):
    """``--plot OUT.PNG`` passes the name check: the command goes on to the next check (the model folder's
    tokenizer, missing here); ``--plot out.svg`` is refused naming the option."""
    from falcon_fwa.cli import main

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    text = tmp_path / "held.txt"
    text.write_text("some text")
    for plot, said in ((tmp_path / "OUT.PNG", "--model"), (tmp_path / "out.svg", "--plot")):
        capsys.readouterr()
        assert main(["ppl", "--model", str(folder), "--data", str(text), "--device", "cpu",
                     "--plot", str(plot)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"falcon-fwa ppl: error: {said}"), err
        assert ("PNG" in err) == (said == "--plot"), err


def test_ppl_takes_a_hub_data_source_without_looking_for_a_local_file(tmp_path):
    from falcon_fwa.eval import ppl_cli

    ppl_cli._check_data(["hf:someone/held-out"])
    with pytest.raises(FileNotFoundError, match=r"^--data: "):
        ppl_cli._check_data([str(tmp_path / "missing.txt")])


@pytest.mark.parametrize("eos", [[], ["--no-stop-at-eos"]])
def test_generate_passes_its_options_to_the_decoding_and_the_json(tmp_path, monkeypatch, capsys, eos):
    import json

    from falcon_fwa.cli import main
    from falcon_fwa.serve import generate_cli

    given = []
    real = generate_cli.generate_text

    def recording(model, tokenizer, prompts, **kwargs):
        given.append(dict(kwargs, prompts=list(prompts)))
        return real(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(generate_cli, "generate_text", recording)
    model = _saved_model(tmp_path / "m")
    out = tmp_path / "out.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["generate", "--model", model, "--prompt", "ab", "--prompt", "c", "--max-new-tokens", "3",
                     "--seed", "7", "--batch-size", "2", "--temperature", "0.5", "--device", "cpu",
                     "--cuda-graphs", "off", "--json", str(out), *eos]) == 0
    finally:
        torch.set_num_threads(threads)
    stop_at_eos = not eos
    assert len(given) == 1
    g = given[0]
    assert (g["prompts"], g["seed"], g["stop_at_eos"], g["batch_size"], g["max_new_tokens"], g["temperature"],
            g["cuda_graphs"]) == (["ab", "c"], 7, stop_at_eos, 2, 3, 0.5, False)
    settings = json.loads(out.read_text())["settings"]
    assert (settings["seed"], settings["stop_at_eos"], settings["batch_size"], settings["greedy"]) == (
        7, stop_at_eos, 2, False)


def test_the_summary_gives_peak_gpu_memory_in_gib():
    import types

    from falcon_fwa.serve.generate_cli import _summary

    timing = types.SimpleNamespace(decode_tokens_per_s=None, prompt_tokens=5, new_tokens=2, batches=1, prefill_s=0.5,
                                   decode_tokens=1, decode_s=0.25, decode_mode="eager", graphed_batches=0,
                                   graph_capture_s=0.0, graph_note="", peak_gpu_memory_bytes=3 * 2**30 + 2**29)
    line = _summary(timing, 1, "cuda", "bf16")
    assert line.endswith("n/a tokens/s (eager steps); peak GPU memory 3.50 GiB"), line
    timing.peak_gpu_memory_bytes = None
    assert "GPU memory" not in _summary(timing, 1, "cpu", "fp32")


def test_generate_max_new_tokens_default_is_the_one_its_help_states():
    """``--max-new-tokens`` left out is 64 new tokens per prompt, the default its help names."""
    import argparse

    from falcon_fwa.serve.generate_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    action = next(a for a in parser._actions if "--max-new-tokens" in a.option_strings)
    assert "default 64" in action.help
    assert parser.parse_args(["--model", "m"]).max_new_tokens == 64


@pytest.mark.parametrize("main_process", [True, False])
def test_a_non_finite_loss_is_reported_by_the_main_process_only(tmp_path, monkeypatch, capsys, main_process):
    """Every process of a launch sees the same all-reduced loss and stops alike: the main one prints the error,
    the others end with the same exit status (3) and print nothing, so torchrun's output holds it once."""
    import json
    import types

    from test_train import recipe

    from falcon_fwa.train import cli as train_cli
    from falcon_fwa.train import trainer as trainer_module
    from falcon_fwa.train.trainer import NonFiniteLoss

    class Stopping:
        def __init__(self, cfg):
            self.info = types.SimpleNamespace(is_main=main_process)
            self.step = 0
            self.closed = False

        def train(self, **kwargs):
            raise NonFiniteLoss("non-finite training loss nan (gradient norm nan) at step 1")

        def close(self):
            self.closed = True

    monkeypatch.delenv("FALCON_FWA_TRACEBACK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(trainer_module, "Trainer", Stopping)  # train.cli imports it when it runs
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe(tmp_path, "run", steps=2)))
    capsys.readouterr()
    assert train_cli.main(["--config", str(path)]) == 3
    err = capsys.readouterr().err
    assert ("falcon-fwa train: error: non-finite training loss nan" in err) is main_process, err
