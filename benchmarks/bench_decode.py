"""Decoding speed of whole models: tokens/s of cached greedy decoding with the fused Triton
step against the PyTorch step, at several batch sizes, for the 130M presets.

    python benchmarks/bench_decode.py --presets falcon-1a.3-130m falcon-3a.3-130m transformer-124m \
        --batch 1 64 --out benchmarks/results --name h200-decode

Each row: a model in bf16 (random weights; speed does not depend on them) reads a prompt of
``--prompt`` tokens with ``use_cache=True`` (the chunk kernels), then decodes ``--new-tokens``
greedy tokens one at a time from its cache, each step ``model(next_ids, cache=cache)``; tokens/s =
batch x (new tokens - 1) / the decoding loop's wall time (the first new token comes from the prompt's
pass; CUDA-synchronized, median of ``--repeats``).
``--compile`` wraps each model in ``torch.compile`` first (the warm-up loop compiles the prompt's
pass and the decoding step; the cache's token counter is kept out of the graph, so the step does not
recompile per token). The Falcon layers' step op is ``falcon_step(..., backend=...)``, forced here to ``"triton"`` (the
fused recurrent kernel, which serves all six rules; the default on CUDA for ``ops.triton.STEP_RULES``) or
``"torch"`` (the PyTorch step); both rows of a preset must pick the same tokens, and the table gives the
largest logit difference between them. The recurrent baselines
(Mamba-2, DeltaNet, ...) decode through the same step op and get both rows; the Transformer row (its KV
cache, SDPA) is the reference. A failing row is reported and the others still run; both files are
rewritten after every row.

Writes ``<out>/<name>.json`` (rows ``{preset, impl, batch, prompt, new_tokens, tokens_per_s,
ms_per_step, commit, dirty}``, plus ``same_tokens`` and ``max_logit_diff`` on a preset's second row; ``commit``
and ``dirty``: the full commit of the falcon_fwa checkout that runs and whether it had uncommitted changes to
tracked files, as ``bench_kernels.source`` gives them) and ``<out>/<name>.md``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Dict, List, Optional

import torch

from bench_kernels import _atomic_write, commit_words, failure, source


def decode(model, prompt: torch.Tensor, new_tokens: int, cuda_graphs: bool = False):
    """Greedy decoding from a cache; returns (tokens [B, new], last logits, seconds of the loop).
    With ``cuda_graphs`` a recurrent model's steps are replayed from a CUDA graph
    (``serve.graphs.GraphedDecoder``, recorded before the timed loop)."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache = getattr(out, "cache", None)
        cache = out.past_key_values if cache is None else cache
        logits = out.logits[:, -1]
        ids = logits.argmax(-1, keepdim=True)
        tokens = [ids]
        if cuda_graphs:
            from falcon_fwa.serve.graphs import GraphedDecoder
            graph = GraphedDecoder(model, cache, prompt.shape[0])
            step = lambda ids: graph.step(ids[:, 0])  # noqa: E731
        else:
            step = lambda ids: model(ids, cache=cache, use_cache=True).logits[:, -1]  # noqa: E731
        sync = torch.cuda.synchronize if prompt.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(new_tokens - 1):
            logits = step(ids)
            ids = logits.argmax(-1, keepdim=True)
            tokens.append(ids)
        sync()
        return torch.cat(tokens, 1), logits.float(), time.perf_counter() - start


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["falcon-1a.3-130m", "falcon-3a.3-130m", "transformer-124m"])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    p.add_argument("--prompt", type=int, default=64, help="prompt length (tokens)")
    p.add_argument("--new-tokens", type=int, default=128, help="decoded tokens per row")
    p.add_argument("--repeats", type=int, default=3, help="timed decoding loops per row (median)")
    p.add_argument("--impls", nargs="+", default=["triton", "torch"], choices=["triton", "torch"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--compile", default="none", choices=["none", "default", "reduce-overhead"],
                   help="torch.compile the model with this mode (reduce-overhead: CUDA graphs)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay the recurrent models' decoding steps from a CUDA graph (serve.graphs)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="decode")
    args = p.parse_args(argv)
    from falcon_fwa.cli_options import resolve_device
    from falcon_fwa.models import get_preset

    try:
        args.device = resolve_device(args.device)
        for preset in args.presets:
            get_preset(preset)
    except ValueError as e:
        p.error(str(e) if str(e).startswith("--") else f"--presets: {e}")
    if min(args.batch) < 1:
        p.error(f"--batch values must be at least 1, got {args.batch}")
    if args.cuda_graphs and not args.device.startswith("cuda"):
        p.error(f"--cuda-graphs needs a CUDA device, got --device {args.device}")
    for name, least in (("prompt", 1), ("new_tokens", 2), ("repeats", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}")

    from falcon_fwa.layers import falcon_attention as layer_module
    from falcon_fwa.models import FalconForCausalLM, get_preset
    from falcon_fwa.ops import falcon_step

    dtype = getattr(torch, args.dtype)
    recorded = source(None)  # the code that is timed, as the run starts
    rows: List[Dict] = []
    errors: List[str] = []
    try:
        for preset in args.presets:
            config = get_preset(preset)
            torch.manual_seed(0)
            model = FalconForCausalLM(config).to(args.device, dtype).eval()
            if args.compile != "none":
                model = torch.compile(model, mode=args.compile, dynamic=False)
            if config.mixer == "transformer":  # KV cache and SDPA: no step op
                impls = ["-"]
            else:  # every rule and the recurrent baselines decode through the same step op
                impls = list(args.impls)
            for B in args.batch:
                g = torch.Generator().manual_seed(B)
                prompt = torch.randint(0, config.vocab_size, (B, args.prompt), generator=g).to(args.device)
                first = {}
                for impl in impls:
                    if impl != "-":
                        layer_module.falcon_step = _on_backend(falcon_step, impl)
                    try:
                        row, tokens, logits = _measure(model, prompt, args, preset, impl)
                    except Exception as e:  # one failing row must not lose the others
                        errors.append(f"{preset} {impl} batch {B}: {failure(e)}")
                        print(errors[-1], flush=True)
                        continue
                    if first:
                        row["same_tokens"] = bool(torch.equal(tokens, first["tokens"]))
                        row["max_logit_diff"] = float((logits - first["logits"]).abs().max())
                    else:
                        first = dict(tokens=tokens, logits=logits)
                    rows.append({**row, **recorded})
                    print(json.dumps(rows[-1]), flush=True)
                    _write(rows, errors, args, recorded)
            del model
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
    finally:
        layer_module.falcon_step = falcon_step
        _write(rows, errors, args, recorded)
    return 0


def _on_backend(step, backend):
    """``step`` on ``backend`` whatever the caller asks for: the layer passes its config's backend ("auto"),
    which would override a ``functools.partial`` keyword and run every row on the same one."""
    return lambda *args, **kwargs: step(*args, **{**kwargs, "backend": backend})


def _measure(model, prompt, args, preset, impl):
    graphs = args.cuda_graphs and impl != "-"  # the Transformer's growing cache is not graphed
    decode(model, prompt, 4, graphs)  # compile / warm up
    times, tokens, logits = [], None, None
    for _ in range(args.repeats):
        tokens, logits, seconds = decode(model, prompt, args.new_tokens, graphs)
        times.append(seconds)
    seconds = statistics.median(times)
    steps = args.new_tokens - 1  # the first new token comes from the prompt's pass
    B = prompt.shape[0]
    row = dict(preset=preset, impl=impl, batch=B, prompt=args.prompt, new_tokens=args.new_tokens, compile=args.compile,
               cuda_graphs=graphs,
               tokens_per_s=round(B * steps / seconds, 1), ms_per_step=round(1e3 * seconds / steps, 3))
    return row, tokens, logits


def _write(rows: List[Dict], errors: List[str], args, recorded: Optional[Dict] = None) -> None:
    """Both files, rewritten after every row (each replaced in one rename)."""
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    for suffix, text in (("json", json.dumps(rows, indent=1) + "\n"), ("md", report(rows, args, errors, recorded))):
        _atomic_write(os.path.join(args.out, f"{args.name}.{suffix}"), text)


def report(rows: List[Dict], args, errors: List[str] = (), recorded: Optional[Dict] = None) -> str:
    """The table of ``rows``, after the commit ``recorded`` (``bench_kernels.source``'s; taken now if not given)."""
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    out = [f"# Decoding speed: {dev}", "",
           f"{commit_words(**(recorded or source(None)))}; torch {torch.__version__}; {args.dtype}; prompt {args.prompt} tokens, "
           f"{args.new_tokens} greedy tokens per row, median of {args.repeats} loops; random weights; "
           f"torch.compile: {args.compile}; CUDA graphs: {'on' if args.cuda_graphs else 'off'}.", "",
           "| preset | step op | batch | tokens/s | ms/step | vs torch step | same tokens | max logit diff |",
           "|---|---|---|---|---|---|---|---|"]
    base = {(r["preset"], r["batch"]): r["tokens_per_s"] for r in rows if r["impl"] == "torch"}
    for r in rows:
        ref = base.get((r["preset"], r["batch"]))
        ratio = f"{r['tokens_per_s'] / ref:.2f}x" if ref and r["impl"] != "torch" else "-"
        out.append(f"| {r['preset']} | {r['impl']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']} | "
                   f"{ratio} | {r.get('same_tokens', '-')} | {r.get('max_logit_diff', '-')} |")
    out += [""] + [f"- failed: {e}" for e in errors] if errors else []
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
