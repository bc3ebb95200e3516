"""Training throughput of a model configuration: tokens/s of full optimizer steps
(forward, backward, AdamW; bf16 autocast) on random tokens, and peak device memory.

``falcon-fwa throughput --preset falcon-1a.3-130m transformer-124m --seq-len 2048 8192 --deadline 110``

Every measurement runs ``--warmup`` untimed steps first (the first step compiles and autotunes
kernels; its time is reported as ``first_step_s``, never counted against ``--max-seconds`` or in
tokens/s, unless ``--warmup 0`` makes it the first timed step), then up to ``--steps`` timed steps,
each synchronized. Timing ends early once ``--max-seconds`` of timed steps have passed, but never
before ``--min-steps`` of them. The one hard cap is
``--deadline`` (wall-clock seconds for the whole command): the measurement in progress ends at
its next step boundary and its row says ``"stopped": "deadline"`` (``"steady": false`` when fewer
than ``--min-steps`` were timed); measurements not started get a row with ``"skipped"``.

A recipe (``--config``) is measured at its ``data.seq_len``, ``train.micro_batch`` and ``train.dtype`` (where
``--dtype`` is not given), compiled where its ``train.compile`` is true and with activation checkpointing where its
``train.activation_checkpointing`` is (as its training runs; ``--compile`` and ``--activation-checkpointing`` turn
them on where it leaves them off), with the model its training builds: the preset's vocabulary grown to the recipe's
tokenizer (``byte``; the record of its prepared data folder; ``bpe:N`` not yet trained: N; a local tokenizer folder
or a cached Hub name). Its row's ``vocab_size`` and ``vocabulary`` say which; where the tokenizer is not here
without a download, the preset's, and the row says so.

Measurements go by sequence length first: every preset at the first length, then every preset
at the next one, so a killed command still leaves one comparable row per preset. Each row is
appended to ``--out`` (JSON lines; its folder made where missing) as soon as it is measured; its
``launch`` (the command's start, UTC) sets the rows of one command apart from those an earlier one left
in the file. ``falcon_op`` says what computed the falcon layers: ``"triton"`` (the chunk kernels),
``"torch"`` (the PyTorch forms), ``"fla"``, ``"none"`` (no falcon layers), or ``"mixed"``. A measurement
that runs out of device memory gets a row with
``"error": "out of memory: ..."`` (the message's first 200 characters) and the next one runs. A Ctrl-C ends the
command (status 130): the rows measured before it stay in ``--out``; the measurement it cut and those not started
get no row, and standard error names the one cut and counts the others. Each measured
row's ``wall_s`` is the seconds its measurement took, from building the model (out of memory or not).
A progress bar on standard error counts each measurement's ``--warmup`` + ``--steps`` steps, the last
step's seconds beside it (``--no-progress``: none); standard output carries only the rows (JSON lines, for
scripts). ``--table``: standard output carries a table instead, a line per row as it is measured: preset,
sequence length, batch, parameters, tokens/s, peak device memory in MiB, ``falcon_op`` and a note (stopped
early, skipped, out of memory); the rows themselves go to ``--out`` only.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..cli_options import (DEVICE_HELP, at_least, check_input_files, check_output_file, dtype_option, finite_at_least,
                           resolve_device)

_clock = time.perf_counter  # every time in this module comes from here


@contextmanager
def falcon_op_calls(model: torch.nn.Module):
    """Count, inside the block, the calls of the model's falcon layers (``counts["layer"]``) and
    those the Triton chunk kernels served (``counts["triton"]``); ``op_backend`` reads them."""
    from ..layers.falcon_attention import FalconAttention

    counts = {"layer": 0, "triton": 0}

    def count_layer(*_):
        counts["layer"] += 1

    layers = [m for m in model.modules() if isinstance(m, FalconAttention)]
    hooks = [m.register_forward_hook(count_layer) for m in layers]
    kernels = None
    if layers:
        try:
            from ..ops import triton as kernels
        except ImportError:  # no Triton: the falcon layers run the PyTorch forms
            pass
    original = getattr(kernels, "falcon_chunk_triton", None)

    def counted(*args, **kwargs):
        out = original(*args, **kwargs)  # NotImplementedError here: the op falls back to PyTorch
        counts["triton"] += 1
        return out

    if original is not None:
        kernels.falcon_chunk_triton = counted  # the op looks the kernels up at every call
    try:
        yield counts
    finally:
        if original is not None:
            kernels.falcon_chunk_triton = original
        for h in hooks:
            h.remove()


def op_backend(counts: dict, config, device: str) -> str:
    """``"none"`` | ``"triton"`` | ``"torch"`` | ``"fla"`` | ``"mixed"`` from ``falcon_op_calls`` counts."""
    if counts["layer"] == 0:
        return "none"
    if counts["triton"] == counts["layer"]:
        return "triton"
    if counts["triton"] == 0:
        fla = getattr(config, "backend", "native") == "fla" and device.startswith("cuda")
        return "fla" if fla else "torch"
    return "mixed"


def measure(config, *, seq_len: int, batch_size: int, steps: int = 5, warmup: int = 2, min_steps: int = 3,
            max_seconds: float = 60.0, deadline: Optional[float] = None, device: str = "cuda", bf16: bool = True,
            seed: int = 0, compile: bool = False, activation_checkpointing: bool = False, profile: int = 0,
            progress: Optional[str] = None) -> dict:
    """Time optimizer steps of ``FalconForCausalLM(config)`` on ``[batch_size, seq_len]`` random tokens.

    ``warmup`` untimed steps, then up to ``steps`` timed ones; timing ends once ``max_seconds``
    of timed steps have passed and at least ``min_steps`` were timed. ``deadline`` (a value of
    this module's clock) ends the measurement at the first step boundary past it, whatever
    was timed. The row: ``first_step_s`` and ``warmup_s`` (compilation included), ``timed_steps``,
    ``step_s`` (mean of the timed steps), ``step_s_median``, ``tokens_per_s``, ``steady``
    (at least ``min_steps`` timed), ``stopped`` (None, ``"max_seconds"`` or ``"deadline"``),
    ``peak_mem_bytes``, ``params``, ``falcon_op``, ``compiled``. ``compile``: ``torch.compile``
    the model first (as ``train.compile`` does); ``falcon_op`` is then read from one uncompiled
    forward on a short input, since the counting hooks would change the compiled model's guards.
    ``activation_checkpointing``: each block runs again in the backward (as
    ``train.activation_checkpointing`` does; the row's ``activation_checkpointing``).
    ``profile`` > 0: one more step under ``torch.profiler`` after the timed ones; the row's
    ``profile`` lists its ``profile`` most expensive kernels (CUDA) or operators (CPU):
    ``name``, ``ms`` (total in that step), ``calls``. ``progress``: the description of a progress bar
    (standard error) over the ``warmup + steps`` steps, each step's seconds beside it; None: no bar.
    """
    from ..models import FalconForCausalLM
    from .model_factory import enable_activation_checkpointing, param_groups

    torch.manual_seed(seed)
    model = FalconForCausalLM(config).to(device)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    opt = torch.optim.AdamW(param_groups(model, lr=1e-3, weight_decay=0.1), lr=1e-3, betas=(0.9, 0.95),
                            **({"fused": True} if device.startswith("cuda") else {}))
    x = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), device=device)
    cuda = device.startswith("cuda")
    op = None
    if compile:
        with falcon_op_calls(model) as counts, torch.no_grad(), torch.autocast(
                device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            model(input_ids=x[:1, :min(seq_len, 64)], use_cache=False)
        op = op_backend(counts, config, device)
        torch._dynamo.reset()  # each model compiles on its own, not against the guards of the last one
        model.compile()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> float:
        """One synchronized optimizer step; returns the clock after it."""
        with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        return _clock()

    def past_deadline(now: float) -> bool:
        return deadline is not None and now >= deadline

    bar = tqdm(total=warmup + steps, desc=progress, unit="step", dynamic_ncols=True, disable=progress is None)

    def shown(now: float) -> float:
        """``now``, with the step that ended then on the bar."""
        bar.set_postfix(step_s=f"{now - marks[-1]:.3f}", refresh=False)
        bar.update(1)
        return now

    start = _clock()
    marks, stopped = [start], None
    # compiled code is not wrapped in the counting hooks: they would change its guards every step
    with bar, (nullcontext({}) if compile else falcon_op_calls(model)) as counts:
        while len(marks) <= warmup and stopped is None:
            marks.append(shown(step()))
            stopped = "deadline" if past_deadline(marks[-1]) else None
        timed_start = len(marks) - 1
        while len(marks) - 1 - timed_start < steps and stopped is None:
            marks.append(shown(step()))
            timed = len(marks) - 1 - timed_start
            if past_deadline(marks[-1]):
                stopped = "deadline"
            elif timed >= min_steps and marks[-1] - marks[timed_start] >= max_seconds and timed < steps:
                stopped = "max_seconds"
    durations = [b - a for a, b in zip(marks[:-1], marks[1:])]
    timed_durations = durations[timed_start:]
    top = _profile_step(step, cuda, profile) if profile > 0 and not past_deadline(_clock()) else None
    step_s = sum(timed_durations) / len(timed_durations) if timed_durations else None
    return {"seq_len": seq_len, "batch_size": batch_size, "tokens_per_step": batch_size * seq_len,
            "warmup_steps": timed_start, "first_step_s": durations[0] if durations else None,
            "warmup_s": marks[timed_start] - start, "timed_steps": len(timed_durations), "step_s": step_s,
            "step_s_median": statistics.median(timed_durations) if timed_durations else None,
            "tokens_per_s": batch_size * seq_len / step_s if step_s else None,
            "steady": len(timed_durations) >= min_steps, "stopped": stopped,
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "params": sum(p.numel() for p in model.parameters()),
            "falcon_op": op if compile else op_backend(counts, config, device), "compiled": compile,
            "activation_checkpointing": activation_checkpointing,
            **({"profile": top} if top is not None else {})}


def _profile_step(step, cuda: bool, n: int) -> list:
    """The ``n`` most expensive kernels (CUDA) or operators (CPU) of one call of ``step``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        step()
    rows = []
    for e in prof.key_averages():
        us = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) if cuda else e.self_cpu_time_total
        if us > 0:
            rows.append({"name": e.key[:80], "ms": round(us / 1e3, 4), "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:n]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", nargs="+", default=[], help="preset names (NAME or NAME:field=value,...)")
    parser.add_argument("--config", nargs="+", default=[], help="recipe files: their model at their seq_len "
                        "and micro_batch (overrides --seq-len / --batch-tokens), train.dtype, train.compile and "
                        "train.activation_checkpointing")
    parser.add_argument("--seq-len", nargs="+", type=int, default=[2048], help="sequence lengths to measure")
    parser.add_argument("--batch-tokens", type=int, default=16384,
                        help="tokens per step (batch = this // seq-len, at least 1)")
    parser.add_argument("--steps", type=int, default=5, help="timed optimizer steps (at most)")
    parser.add_argument("--min-steps", type=int, default=None,
                        help="timed steps that --max-seconds never cuts (default: 3, or --steps where fewer)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them (compilation)")
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="per measurement: seconds of timed steps (warm-up not counted); a finite number: "
                             "--min-steps equal to --steps times every step")
    parser.add_argument("--deadline", type=float, default=None,
                        help="wall-clock seconds for the whole command (the only hard cap)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--dtype", default=None, choices=["bf16", "fp32"], type=dtype_option(["bf16", "fp32"]),
                        help="bf16: the training step under bf16 autocast, fp32 weights (as training runs); fp32: "
                             "no autocast (default: a recipe's train.dtype, bf16 for a preset)")
    parser.add_argument("--fp32", action="store_true", help="the same as --dtype fp32")
    parser.add_argument("--compile", action="store_true", help="torch.compile every model (as train.compile does; "
                        "a recipe whose train.compile is true is compiled without it)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="run each block again in the backward instead of keeping its activations (as "
                             "train.activation_checkpointing does, which a recipe gets without it): peak memory "
                             "against tokens/s")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile one step and keep its N most expensive kernels in the row")
    parser.add_argument("--out", default=None, help="append the rows (JSON lines) here")
    parser.add_argument("--table", action="store_true",
                        help="standard output: a table (preset, seq_len, batch, params, tokens/s, peak memory in MiB, "
                             "backend) instead of the JSON rows, which then go to --out only")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar (standard error) over each measurement's steps")


def parse_preset(spec: str, option: str = "--preset", **defaults):
    """``"falcon-1a.3-130m:rule=1,window=4"`` -> FalconConfig; ``ValueError`` naming ``option``
    for an unknown preset or field (with the closest field name) or a bad value. ``defaults``:
    config fields set on every preset (``falcon-fwa params --vocab-size``); the spec's own fields
    win over them."""
    from ..models import get_preset
    from .config import load_yaml

    name, _, rest = spec.partition(":")
    items = [item for item in rest.split(",") if item]
    for item in items:
        if "=" not in item:
            raise ValueError(f"{option} {spec!r}: {item!r} is not field=value (NAME:field=value,...)")
    try:
        fields = {k.strip(): load_yaml(v) for k, v in (item.split("=", 1) for item in items)}
        return get_preset(name, **{**defaults, **fields})
    except ValueError as err:  # an unknown preset or field, a bad value: named with the option
        raise ValueError(f"{option} {spec!r}: {err}") from None


def recipe_vocabulary(cfg) -> Tuple[Optional[int], Optional[int], str]:
    """``(vocab_size, eos_token_id, where from)`` of the tokenizer a recipe trains with, found without
    downloading: ``byte``; the record of the recipe's prepared data folder where it was prepared with this
    tokenizer (a ``bpe:N`` in any spelling of N, as training reuses the folder); ``bpe:N`` not trained yet (N, the
    most it has); a local tokenizer folder, or a Hub name in the local cache. ``(None, None, why)`` where none of
    these gives it."""
    from ..atomic import read_json
    from ..data.tokenizer import bpe_vocab_size, is_missing_folder, load_tokenizer, same_spec

    spec = cfg.data.tokenizer
    if spec == "byte":
        tok = load_tokenizer("byte")
        return len(tok), tok.eos_token_id, "tokenizer byte"
    folder = cfg.data.out_dir or os.path.join(cfg.train.out_dir, "data")
    try:
        record = read_json(os.path.join(folder, "prepared.json"))
        held = record["spec"]["tokenizer"]  # (bpe:0300 in a record written before one spelling: bpe:300; a folder
        # deleted since, named by a relative path: as the preparation's reuse compares them)
        if isinstance(held, str) and same_spec(held, spec):
            return int(record["vocab_size"]), int(record["eos_token_id"]), f"tokenizer {spec}, as prepared in {folder}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    if spec.startswith("bpe:"):
        size = bpe_vocab_size(spec)  # end-of-text is its first token (the trainer's one special token)
        return size, 0, f"tokenizer {spec}, not trained yet: its most tokens"
    from transformers import AutoTokenizer

    if is_missing_folder(spec):
        return None, None, f"tokenizer folder {spec} does not exist"
    try:
        tok = AutoTokenizer.from_pretrained(spec, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as err:
        return None, None, f"tokenizer {spec} is not here without a download ({str(err)[:80]})"
    return len(tok), tok.eos_token_id, f"tokenizer {spec}"


def recipe_model_config(cfg) -> Tuple[object, dict]:
    """The model config a recipe trains (``model_factory.build_model``'s, the vocabulary grown to the
    recipe's tokenizer as training grows it) and the row's ``vocab_size`` and ``vocabulary`` (where the
    vocabulary comes from). Without the tokenizer here, the preset's vocabulary, and ``vocabulary`` says so."""
    from ..models import get_preset
    from .model_factory import build_model

    size, eos, source = recipe_vocabulary(cfg)
    if size is None:
        config = get_preset(cfg.model.preset, **cfg.model.overrides)
        return config, {"vocab_size": config.vocab_size,
                        "vocabulary": f"the preset's ({source}; training sizes it to the tokenizer)"}
    with torch.device("meta"):  # the config alone: no weights are made
        config = build_model(cfg.model, vocab_size=size, eos_token_id=eos).config
    return config, {"vocab_size": config.vocab_size, "vocabulary": f"{source} ({size} tokens), as training sizes it"}


def _jobs(args):
    """``(name, config, seq_len, batch_size, row fields, settings)``: recipes, then presets length by length.
    ``settings``, :func:`measure`'s: ``bf16`` (``--dtype`` / ``--fp32`` where given, else a recipe's ``train.dtype``,
    bf16 for a preset), ``compile`` and ``activation_checkpointing`` (``--compile`` / ``--activation-checkpointing``,
    or a recipe's ``train.compile`` / ``train.activation_checkpointing``: what its training runs)."""
    from .config import load_config, trains_in_bf16

    given = None if args.dtype is None and not args.fp32 else not args.fp32 and args.dtype != "fp32"
    for path in args.config:
        cfg = load_config(path, ["data.train_source=unused"])
        config, fields = recipe_model_config(cfg)
        settings = {"bf16": given if given is not None else trains_in_bf16(cfg.train),
                    "compile": args.compile or cfg.train.compile,
                    "activation_checkpointing": args.activation_checkpointing or cfg.train.activation_checkpointing}
        yield path, config, cfg.data.seq_len, cfg.train.micro_batch, fields, settings
    configs = {spec: parse_preset(spec) for spec in args.preset}  # a bad spec fails before anything runs
    settings = {"bf16": given is not False, "compile": args.compile,
                "activation_checkpointing": args.activation_checkpointing}
    for seq_len in args.seq_len:
        for spec in args.preset:
            yield spec, configs[spec], seq_len, max(1, args.batch_tokens // seq_len), {}, settings


_COLUMNS = (("seq_len", 7), ("batch", 5), ("params", 13), ("tokens/s", 11), ("peak MiB", 10))


def _table_header(width: int) -> str:
    """The table's header: ``width`` is that of the preset column."""
    return "  ".join([f"{'preset':<{width}}", *(f"{name:>{w}}" for name, w in _COLUMNS), f"{'backend':<7}", "note"])


def _table_line(row: dict, width: int) -> str:
    """A row as a line of the table (``-`` where the row has no value)."""

    def number(key, fmt="{:,}"):
        return "-" if row.get(key) is None else fmt.format(row[key])

    peak = row.get("peak_mem_bytes")
    cells = [number("seq_len", "{}"), number("batch_size", "{}"), number("params"), number("tokens_per_s", "{:,.0f}"),
             "-" if peak is None else f"{peak / 2 ** 20:,.1f}"]
    if "skipped" in row:
        note = f"skipped: {row['skipped']}"
    elif "error" in row:
        note = row["error"][:80]
    elif row.get("stopped"):
        note = f"stopped: {row['stopped']}" + ("" if row.get("steady", True) else f" after {row['timed_steps']} "
                                                 "timed step(s), not steady")
    else:
        note = ""
    return "  ".join([f"{row.get('preset', ''):<{width}}", *(f"{c:>{w}}" for c, (_, w) in zip(cells, _COLUMNS)),
                      f"{row.get('falcon_op') or '-':<7}", note]).rstrip()


def _append_row(path: Optional[str], row: dict, table_width: Optional[int] = None) -> None:
    """The row on standard output (JSON; with ``table_width``, a line of the table) and appended to ``path``."""
    print(json.dumps(row) if table_width is None else _table_line(row, table_width), flush=True)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


def run(args: argparse.Namespace) -> int:
    if not args.preset and not args.config:
        raise ValueError("give --preset and/or --config")
    at_least("--steps", args.steps, 1)
    check_input_files("--config", args.config)
    check_output_file("--out", args.out)
    if args.min_steps is None:
        args.min_steps = min(3, args.steps)
    if args.min_steps < 1 or args.steps < args.min_steps:
        raise ValueError(f"--steps ({args.steps}) must be >= --min-steps ({args.min_steps}) >= 1")
    at_least("--seq-len", min(args.seq_len), 1)
    at_least("--batch-tokens", args.batch_tokens, 1)
    at_least("--warmup", args.warmup, 0)
    at_least("--profile", args.profile, 0)
    finite_at_least("--max-seconds", args.max_seconds, 0)
    finite_at_least("--deadline", args.deadline, 0, strict=True)
    if args.fp32 and args.dtype == "bf16":
        raise ValueError("--fp32 and --dtype bf16 contradict each other: give one")
    args.device = resolve_device(args.device)
    deadline = None if args.deadline is None else _clock() + args.deadline
    launch = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    jobs = list(_jobs(args))
    if args.out:  # each row is appended as it is measured: its folder is made once every option has passed
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    width = max(len("preset"), *(len(job[0]) for job in jobs))
    table = [width] if args.table else []  # _append_row's table width, or none: JSON rows
    if args.table:
        if not args.out:
            print("falcon-fwa throughput: --table without --out keeps no rows (JSON lines: step times, warm-up, "
                  "profile)", file=sys.stderr, flush=True)
        print(_table_header(width), flush=True)
    for index, (name, config, seq_len, batch_size, fields, settings) in enumerate(jobs):
        row: dict = {"preset": name, "seq_len": seq_len, "batch_size": batch_size,
                     "dtype": "bf16" if settings["bf16"] else "fp32",
                     "launch": launch, **fields}
        if deadline is not None and _clock() >= deadline:
            row["skipped"] = f"--deadline {args.deadline:g} s passed before this measurement"
            _append_row(args.out, row, *table)
            continue
        started = _clock()
        try:
            row.update(measure(config, seq_len=seq_len, batch_size=batch_size, steps=args.steps,
                               warmup=args.warmup, min_steps=args.min_steps, max_seconds=args.max_seconds,
                               deadline=deadline, device=args.device, profile=args.profile, **settings,
                               progress=None if args.no_progress else f"{name} seq_len {seq_len}"))
        except torch.OutOfMemoryError as err:
            row["error"] = f"out of memory: {str(err)[:200]}"
            torch.cuda.empty_cache()
        except KeyboardInterrupt:  # the rows measured before it are in --out already; this one has none
            left = len(jobs) - index - 1
            print(f"falcon-fwa throughput: interrupted during {name} at seq_len {seq_len}, which has no row"
                  + (f"; {left} measurement(s) after it not run" if left else "")
                  + (f"; the {index} row(s) before it are in {args.out}" if args.out and index else ""),
                  file=sys.stderr, flush=True)
            raise
        row["wall_s"] = _clock() - started  # the model's building included; also where it ran out of memory
        _append_row(args.out, row, *table)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="falcon-fwa throughput", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    from ..cli import run_command

    return run_command("falcon-fwa throughput", run, parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
