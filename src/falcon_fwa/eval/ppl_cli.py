"""``falcon-fwa ppl --model DIR --data FILE_OR_SHARDS [...] --seq-len 4096 --train-len 1024``:
perplexity over held-out data, overall and by position bucket."""
from __future__ import annotations

import argparse
import os

from ..atomic import write_json
from ..cli_options import (DEVICE_HELP, at_least, check_model_option, check_output_file,
                           check_tokenizer_in, dtype_option, resolve_device)
from ..data.cli import option
from ..data.shards import is_shard_folder
from ..data.sources import TEXT_SPLITS, list_files
from ..plotting import require as require_plotting
from ..provenance import command_provenance
from .perplexity import (bucket_report, check_edges, default_edges, load_model, plot_buckets, position_nll,
                         token_stream, windows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="saved model folder (save_pretrained + tokenizer)")
    parser.add_argument("--data", required=True, nargs="+", help="held-out text/JSONL/Parquet files or token shard folders")
    parser.add_argument("--seq-len", type=int, default=1024, help="window length in tokens, default %(default)s (may exceed the training length)")
    parser.add_argument("--train-len", type=int, default=None, help="training length: buckets from here are marked")
    parser.add_argument("--buckets", default=None, help="comma-separated bucket edges from 0 to seq-len (default powers of 2)")
    parser.add_argument("--batch-size", type=int, default=1, help="windows per forward pass")
    parser.add_argument("--max-windows", type=int, default=None, help="evaluate at most this many windows")
    parser.add_argument("--documents", default="reset", choices=["reset", "carry"],
                        help="reset: every document starts from an empty state, positions count from its start (as "
                             "training with cu_seqlens packing); carry: the state runs across documents in a window")
    parser.add_argument("--text-split", default=None, choices=TEXT_SPLITS,
                        help="how text files split into documents (default file; not for token shard folders)")
    parser.add_argument("--text-field", default=None,
                        help="JSON/JSONL/Parquet field holding the text (default text; changes nothing for text "
                             "files; not for token shard folders)")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], type=dtype_option(["fp32", "bf16"]),
                        help="bf16 runs under autocast (float32 and bfloat16 are taken too)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    parser.add_argument("--plot", default=None,
                        help="write the perplexity-by-position plot here (PNG: a path ending in .png)")


def _edges(args: argparse.Namespace) -> list:
    """The bucket edges, checked before any work (a bad --buckets would otherwise end a long run)."""
    for name in ("seq_len", "train_len", "batch_size", "max_windows"):
        at_least(option(name), getattr(args, name), 1)
    if not args.buckets:
        return default_edges(args.seq_len)
    try:
        edges = [int(e) for e in args.buckets.split(",")]
    except ValueError:
        raise ValueError(f"--buckets must be comma-separated integers, got {args.buckets!r}") from None
    try:
        check_edges(edges, args.seq_len, name=option)
    except ValueError as err:
        raise ValueError(f"--buckets: {err}") from None
    return edges


def _check_data(sources: list) -> None:
    """Every ``--data`` source names files or is a token shard folder, checked before the model loads."""
    for source in sources:
        if source.startswith("hf:") or is_shard_folder(source):
            continue
        if os.path.isfile(os.path.join(source, "prepared.json")):  # what `falcon-fwa data --out` wrote
            splits = [os.path.join(source, s) for s in ("val", "train") if is_shard_folder(os.path.join(source, s))]
            raise FileNotFoundError(f"--data {source!r} is a prepared data folder, not a split: give one of its "
                                    f"token shard folders ({' or '.join(splits) or 'none is complete'})")
        try:
            list_files(source)
        except FileNotFoundError as err:
            raise FileNotFoundError(f"--data: {err}") from None


def _check_text_options(args: argparse.Namespace) -> None:
    """``--text-split`` and ``--text-field`` read text sources: refused by name where every ``--data``
    source is a token shard folder (its documents were split and tokenized when it was written); then
    their defaults (``file``, ``text``)."""
    if all(is_shard_folder(source) for source in args.data):
        for flag, value, reads in (("--text-split", args.text_split, "text files"),
                                   ("--text-field", args.text_field, "JSON, JSONL and Parquet files")):
            if value is not None:
                raise ValueError(f"{flag} {value}: --data {' '.join(args.data)} is token shards, whose documents "
                                 f"were split and tokenized when they were written; {flag} applies to {reads} "
                                 "only")
    args.text_split = args.text_split or "file"
    args.text_field = args.text_field or "text"


def run(args: argparse.Namespace) -> int:
    edges = _edges(args)
    args.device = resolve_device(args.device)
    check_model_option(args.model)
    _check_data(args.data)
    _check_text_options(args)
    check_output_file("--out", args.out)
    check_output_file("--plot", args.plot)
    if args.plot and not args.plot.lower().endswith(".png"):  # its format follows the name: refused before the work
        raise ValueError(f"--plot {args.plot!r}: the plot is a PNG; give a path ending in .png")
    if args.plot:
        require_plotting("--plot")
    check_tokenizer_in("--model", args.model)
    model, tokenizer = load_model(args.model, device=args.device)
    eos_id = tokenizer.eos_token_id if args.documents == "reset" else None
    if args.documents == "reset" and eos_id is None:
        raise ValueError("--documents reset needs a tokenizer with an end-of-text token (eos_token_id is None)")
    tokens = token_stream(args.data, tokenizer, text_split=args.text_split, text_field=args.text_field,
                          max_tokens=None if args.max_windows is None else args.max_windows * args.seq_len + 1,
                          name=option)
    rows = windows(tokens, args.seq_len, args.max_windows, name=option)
    total, count = position_nll(model, rows, batch_size=args.batch_size, device=args.device,
                                bf16=args.dtype == "bf16", eos_id=eos_id)
    report = bucket_report(total, count, edges, train_len=args.train_len, windows=len(rows))
    report.update(model=os.path.abspath(args.model), data=args.data, documents=args.documents,
                  provenance=command_provenance(args))
    where = "document" if args.documents == "reset" else "window"
    print(f"perplexity {report['ppl']:.4f} (loss {report['loss']:.4f}) over {report['tokens']} predictions, "
          f"{len(rows)} windows of {args.seq_len}, documents: {args.documents}")
    print(f"{'position in ' + where:>20} {'tokens':>10} {'loss':>8} {'ppl':>10}")
    for b in report["buckets"]:
        mark = "  (beyond training length)" if b["beyond_train_len"] else ""
        loss, ppl = ("-", "-") if b["loss"] is None else (f"{b['loss']:.4f}", f"{b['ppl']:.4f}")
        print(f"{b['start']:>11}-{b['end']:<8} {b['tokens']:>10} {loss:>8} {ppl:>10}{mark}")
    if args.out:
        write_json(args.out, report)
    if args.plot:
        plot_buckets(report, args.plot, label=os.path.basename(os.path.normpath(args.model)))
    return 0
