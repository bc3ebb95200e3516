"""Process group setup and model wrapping for ``torchrun``: DDP or FSDP2 (``fully_shard``).

One code path for one process, many GPUs or nodes, and CPU (gloo backend). Strategy
``"auto"`` is DDP when more than one process runs, else single.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    strategy: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(strategy: str = "auto") -> DistInfo:
    """Join the process group that ``torchrun`` describes (RANK, WORLD_SIZE, LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    launched = "TORCHELASTIC_RUN_ID" in os.environ  # torchrun: a process group even of one member
    if (world > 1 or launched) and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    if strategy == "auto":
        strategy = "ddp" if world > 1 else "single"
    if strategy == "single" and world > 1:
        raise ValueError(f"train.strategy 'single' cannot run with {world} processes; use 'ddp' or 'fsdp2'")
    if strategy in ("ddp", "fsdp2") and not dist.is_initialized():
        raise ValueError(f"train.strategy {strategy!r} needs a process group: launch with torchrun "
                         f"(torchrun --nproc_per_node=N -m falcon_fwa.train.cli ...)")
    return DistInfo(rank, world, local_rank, device, strategy)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _blocks(model: nn.Module):
    """The repeated blocks: the elements of the model's largest ``nn.ModuleList``."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=len) if lists else []


def fsdp2_shards_on_cpu() -> bool:
    """Whether the installed torch's FSDP2 shards CPU processes: torch 2.4's opens CUDA streams when it gathers
    parameters, so it runs on CUDA devices only (read at each call: the version is what ``torch`` says now)."""
    return not torch.__version__.startswith("2.4.")


def wrap(model: nn.Module, info: DistInfo) -> nn.Module:
    """DDP: replicate and all-reduce gradients. FSDP2: shard every block, then the root, over a mesh of
    ``info.device``'s type (one dimension, every process): CPU processes (gloo) shard on the CPU also on a
    machine with a GPU, where ``fully_shard``'s own default mesh would name the GPU."""
    if info.strategy == "single":
        return model
    if info.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.local_rank] if info.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if info.strategy == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        fully_shard = _fully_shard()
        if info.device.type == "cpu" and not fsdp2_shards_on_cpu():
            raise RuntimeError(f"train.strategy='fsdp2' on the CPU: the FSDP2 of torch {torch.__version__} opens CUDA "
                               "streams, so it runs on CUDA devices only; use strategy 'ddp' on the CPU, or a newer "
                               "torch")
        mesh = init_device_mesh(info.device.type, (info.world_size,))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"train.strategy must be 'single', 'ddp' or 'fsdp2', got {info.strategy!r}")


def set_grad_sync(model: nn.Module, info: DistInfo, sync: bool):
    """Gradient synchronisation on (last micro-step) or off (accumulating) for DDP/FSDP2."""
    import contextlib

    if info.strategy == "ddp" and not sync:
        return model.no_sync()
    if info.strategy == "fsdp2":
        model.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def _fully_shard():
    """FSDP2's ``fully_shard``: public in ``torch.distributed.fsdp`` since torch 2.6, under
    ``torch.distributed._composable.fsdp`` in 2.4 and 2.5."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard
        except ImportError:
            raise RuntimeError(f"train.strategy='fsdp2' needs FSDP2's fully_shard (torch >= 2.4); torch "
                               f"{torch.__version__} has none: use strategy 'ddp'") from None
    return fully_shard


def all_reduce_mean(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= info.world_size
    return value


def all_reduce_max(value: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The largest of every process's ``value`` (elementwise), on every process."""
    if info.world_size > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


def peak_memory_bytes(info: DistInfo) -> "int | None":
    """The largest peak of allocated CUDA memory over the processes (an FSDP2 shard can hold more on one
    rank than another), ``None`` on the CPU. A collective: every process calls it."""
    if info.device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(info.device)], dtype=torch.int64, device=info.device)
    return int(all_reduce_max(peak, info).item())


def broadcast_object(obj, info: DistInfo):
    """The main process's ``obj`` (any picklable object), on every process."""
    if info.world_size == 1 or not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()
