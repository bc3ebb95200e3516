"""Training throughput of a model configuration: tokens/s of full optimizer steps
(forward, backward, AdamW; bf16 autocast) on random tokens, and peak device memory.

``falcon-fwa throughput --preset falcon-1a.3-130m transformer-124m --seq-len 2048 8192``
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F


def measure(config, *, seq_len: int, batch_size: int, steps: int = 5, warmup: int = 2, device: str = "cuda",
            bf16: bool = True, max_seconds: float = 60.0, seed: int = 0) -> dict:
    """Mean time of ``steps`` timed optimizer steps after ``warmup`` untimed ones.
    Stops early (fewer timed steps, recorded) once ``max_seconds`` have passed."""
    from ..models import FalconForCausalLM
    from .model_factory import param_groups

    torch.manual_seed(seed)
    model = FalconForCausalLM(config).to(device)
    opt = torch.optim.AdamW(param_groups(model, lr=1e-3, weight_decay=0.1), lr=1e-3, betas=(0.9, 0.95),
                            **({"fused": True} if device.startswith("cuda") else {}))
    x = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def step():
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    start = time.perf_counter()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    timed, t0 = 0, time.perf_counter()
    while timed < steps and (timed == 0 or time.perf_counter() - start < max_seconds):
        step()
        timed += 1
        if cuda:
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    out = {"seq_len": seq_len, "batch_size": batch_size, "timed_steps": timed, "step_s": seconds / timed,
           "tokens_per_s": timed * batch_size * seq_len / seconds,
           "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
           "params": sum(p.numel() for p in model.parameters())}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", nargs="+", default=[], help="preset names (NAME or NAME:field=value,...)")
    parser.add_argument("--config", nargs="+", default=[], help="recipe files: their model at their seq_len "
                        "and micro_batch (overrides --seq-len / --batch-tokens)")
    parser.add_argument("--seq-len", nargs="+", type=int, default=[2048], help="sequence lengths to measure")
    parser.add_argument("--batch-tokens", type=int, default=16384, help="tokens per step (batch = this / seq-len)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="per measurement")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="default: cuda when available")
    parser.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    parser.add_argument("--out", default=None, help="append the rows (JSON lines) here")


def parse_preset(spec: str):
    """``"falcon-1a.3-130m:rule=1,window=4"`` -> FalconConfig."""
    import yaml

    from ..models import get_preset

    name, _, rest = spec.partition(":")
    overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in rest.split(",") if item)}
    return get_preset(name, **overrides)


def _jobs(args):
    from ..models import get_preset
    from .config import load_config

    for spec in args.preset:
        for seq_len in args.seq_len:
            yield spec, parse_preset(spec), seq_len, max(1, args.batch_tokens // seq_len)
    for path in args.config:
        cfg = load_config(path, ["data.train_source=unused"])
        yield path, get_preset(cfg.model.preset, **cfg.model.overrides), cfg.data.seq_len, cfg.train.micro_batch


def run(args: argparse.Namespace) -> int:
    if not args.preset and not args.config:
        raise ValueError("give --preset and/or --config")
    for spec, config, seq_len, batch_size in _jobs(args):
        row: dict = {"preset": spec}
        try:
            row.update(measure(config, seq_len=seq_len, batch_size=batch_size,
                               steps=args.steps, warmup=args.warmup, device=args.device, bf16=not args.fp32,
                               max_seconds=args.max_seconds))
        except torch.OutOfMemoryError as err:
            row.update({"seq_len": seq_len, "error": f"out of memory: {str(err)[:200]}"})
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="falcon-fwa throughput", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
