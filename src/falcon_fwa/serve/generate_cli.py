"""``falcon-fwa generate --model DIR --prompt TEXT [--prompt ...] [--prompts-file FILE] [...]``:
continue prompts with a saved model folder, greedily or by sampling. ``--prompts-file`` holds one prompt a
line (UTF-8; a pipe such as ``/dev/stdin`` is read too, and ``-`` reads stdin).

``--stop TEXT`` (repeatable) ends a completion as soon as its text holds TEXT, and cuts it just before
(:mod:`falcon_fwa.serve.stops`); each completion's ``finish_reason`` in ``--json`` says what ended it:
``eos``, ``stop`` (and its ``stop_string``) or ``length``.

With one prompt the text is streamed to stdout as it is produced (with ``--stop``, the few characters that
may begin a stop string wait until they are decided); otherwise each completion is printed as its batch
ends, under a ``=== completion i/n ===`` header (a Ctrl-C keeps what was printed, the text streamed so far
included, and ends the command with status 130, writing no ``--json``). One summary
line goes to stderr: the prompt forward passes (prefill: prompt step and first new token), the decoding
speed (new tokens after the first, summed over each batch's rows, per second of the decoding loop), whether
the decoding steps were replayed from a CUDA graph (``--cuda-graphs``; recording is timed apart), and on
CUDA the peak GPU memory (weights included); clocks are read after ``torch.cuda.synchronize`` on CUDA (see
:mod:`falcon_fwa.serve.generation`). ``--json`` writes prompts, completions (text and token ids), the
settings, the timings and the provenance, atomically.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List

from ..cli_options import (DEVICE_HELP, check_model_option, check_output_file, check_tokenizer_in, dtype_option,
                           resolve_device)
from ..atomic import read_json, write_json
from ..eval.perplexity import load_model
from ..provenance import command_provenance
from .generation import check_settings, generate_text
from .graphs import graphable


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="saved model folder (save_pretrained + tokenizer)")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a prompt (repeatable; these come before the lines of --prompts-file); every prompt "
                             "opens with the end-of-text token, so an empty one continues that token alone")
    parser.add_argument("--prompts-file", default=None,
                        help="a file of prompts, one per line (blank lines skipped); - reads them from stdin")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="new tokens per prompt at most (>= 1; default 64)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default), which takes no --top-k or --top-p; > 0: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample among the most likely tokens holding this probability mass, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling (runs with the same seed, "
                        "batch size and device draw the same tokens)")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per batch (left-padded)")
    parser.add_argument("--stop-at-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="end a completion at its first end-of-text token")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT",
                        help="end a completion as soon as its text holds TEXT, cut just before it (repeatable: the "
                             "earliest occurrence of any ends it; not empty; a newline in bash: --stop $'\\n')")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], type=dtype_option(["fp32", "bf16"]),
                        help="the weights' dtype (bfloat16 and float32 are taken too)")
    parser.add_argument("--cuda-graphs", default="auto", choices=["auto", "on", "off"],
                        help="replay decoding steps from a CUDA graph: auto (a recurrent model on CUDA, falling back "
                             "to eager steps if recording fails), on (required), off")
    parser.add_argument("--json", default=None, help="write prompts, completions, settings and timings here")


def _prompts(args: argparse.Namespace) -> List[str]:
    prompts = list(args.prompt)
    path = args.prompts_file
    if path is not None:
        if os.path.isdir(path):
            raise ValueError(f"--prompts-file {path!r} is a folder: give a file of prompts, one per line")
        if path != "-" and not os.path.exists(path):  # a pipe (/dev/stdin, <(...)) is no regular file, but is read
            raise FileNotFoundError(f"--prompts-file {path!r} does not exist")
        try:
            if path == "-":
                text = sys.stdin.buffer.read().decode("utf-8-sig")
            else:
                with open(path, "rb") as f:
                    text = f.read().decode("utf-8-sig")  # a byte-order mark is no part of the first prompt
        except UnicodeDecodeError as e:
            raise ValueError(f"--prompts-file {path!r} is not UTF-8 text ({e})") from None
        lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")  # \n, \r\n or \r ends a line
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError("--prompt/--prompts-file: no prompt given; give at least one with --prompt TEXT or in "
                         "--prompts-file FILE")
    return prompts


def _summary(timing, n_prompts: int, device: str, dtype: str) -> str:
    rate = timing.decode_tokens_per_s
    line = (f"generate: {n_prompts} prompt(s), {timing.prompt_tokens} prompt tokens, {timing.new_tokens} new tokens "
            f"in {timing.batches} batch(es) on {device}/{dtype}; prefill {timing.prefill_s:.4f} s; decode "
            f"{timing.decode_tokens} tokens in {timing.decode_s:.4f} s = "
            + (f"{rate:.1f} tokens/s" if rate is not None else "n/a tokens/s") + f" ({timing.decode_mode} steps")
    if timing.graphed_batches:
        line += f", recorded in {timing.graph_capture_s:.3f} s"
    line += ")"
    if timing.graph_note:
        line += f" [{timing.graph_note}]"
    if timing.peak_gpu_memory_bytes is not None:
        line += f"; peak GPU memory {timing.peak_gpu_memory_bytes / 2**30:.2f} GiB"
    return line


def run(args: argparse.Namespace) -> int:
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, batch_size=args.batch_size)
    check_settings(**settings, seed=args.seed, stop=args.stop, name=lambda n: "--" + n.replace("_", "-"))
    filters = [o for o, on in (("--top-k", args.top_k != 0), ("--top-p", args.top_p != 1.0)) if on]
    if filters and args.temperature == 0:  # greedy decoding takes the most likely token whatever they say
        raise ValueError(f"{' and '.join(filters)} shape a sampled draw, but --temperature 0 (the default) decodes "
                         "greedily: give --temperature > 0 to sample, or drop them")
    prompts = _prompts(args)
    device = resolve_device(args.device)
    check_model_option(args.model)
    check_output_file("--json", args.json)
    if args.cuda_graphs == "on" and not device.startswith("cuda"):
        raise ValueError(f"--cuda-graphs on needs a CUDA device, got --device {args.device}")
    config = os.path.join(args.model, "config.json")
    if args.cuda_graphs == "on" and os.path.isfile(config) and read_json(config).get("mixer") == "transformer":
        raise ValueError("--cuda-graphs on: the Transformer's key/value cache grows with the context; "
                         "use --cuda-graphs auto or off")
    check_tokenizer_in("--model", args.model)
    model, tokenizer = load_model(args.model, device=device, dtype=args.dtype)
    if args.cuda_graphs == "on":
        ok, why = graphable(model, next(model.parameters()).device)
        if not ok:
            raise ValueError(f"--cuda-graphs on: {why}; use --cuda-graphs auto or off")

    streamed = []

    def stream(piece):  # one prompt: its text as it is decided
        streamed.append(piece)
        print(piece, end="", flush=True)

    streaming = len(prompts) == 1
    graphs = {"auto": None, "on": True, "off": False}[args.cuda_graphs]
    shown = []

    def show(batch):  # each batch's completions as it ends (a Ctrl-C keeps what was printed)
        for c in batch:
            shown.append(c)
            print(f"=== completion {len(shown)}/{len(prompts)} (prompt: {c.prompt!r}) ===\n{c.text}", flush=True)

    try:
        out = generate_text(model, tokenizer, prompts, seed=args.seed, stop_at_eos=args.stop_at_eos, stop=args.stop,
                            on_text=stream if streaming else None, cuda_graphs=graphs,
                            on_batch=None if streaming else show, **settings)
    except BaseException:
        if streamed:  # a Ctrl-C: the line of the text shown so far is ended
            print(flush=True)
        raise
    if streaming:
        print(flush=True)
    print(_summary(out.timing, len(prompts), device, args.dtype), file=sys.stderr)
    if args.json:
        write_json(args.json, {
            "model": os.path.abspath(args.model),
            "settings": {**settings, "seed": args.seed, "stop_at_eos": args.stop_at_eos, "stop": args.stop,
                         "device": device,
                         "dtype": args.dtype, "greedy": args.temperature == 0, "cuda_graphs": args.cuda_graphs},
            "completions": [{"prompt": c.prompt, "prompt_ids": c.prompt_ids, "token_ids": c.token_ids,
                             "text": c.text, "stopped_at_eos": c.stopped_at_eos, "finish_reason": c.finish_reason,
                             "stop_string": c.stop_string} for c in out.completions],
            "timing": out.timing.as_dict(),
            "provenance": command_provenance(args),
        })
    return 0
