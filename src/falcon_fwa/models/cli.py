"""``falcon-fwa params``: parameter counts of presets (markdown table, optionally written to a file). The table
ends with the commit of the code that counted, and whether that checkout had uncommitted changes to tracked files
(:func:`falcon_fwa.provenance.command_provenance`, in :func:`falcon_fwa.provenance.written_at_line`'s words)."""
from __future__ import annotations

import argparse

from ..atomic import write_text
from ..cli_options import at_least, check_output_file
from ..provenance import command_provenance, written_at_line
from .params import parameter_table
from .presets import PRESETS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("presets", nargs="*", metavar="PRESET",
                        help="presets to count (default: all), as NAME or NAME:field=value,... (as throughput's "
                             f"--preset). Choose from: {', '.join(PRESETS)}")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the vocabulary size")
    parser.add_argument("--out", "--output", default=None,
                        help="also write the table to this markdown file")


def run(args: argparse.Namespace) -> int:
    at_least("--vocab-size", args.vocab_size, 1)
    check_output_file("--out", args.out)
    names = args.presets or list(PRESETS)
    overrides = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    from ..train.throughput import parse_preset  # the NAME:field=value,... form of throughput's --preset

    table = parameter_table(names, [parse_preset(n, "PRESET", **overrides) for n in names])
    table += "\n\n" + written_at_line(command_provenance(args))
    print(table)
    if args.out:
        text = "# Parameter counts of the presets\n\nProduced by `falcon-fwa params" + \
               (" " + " ".join(args.presets) if args.presets else "") + \
               (f" --vocab-size {args.vocab_size}" if args.vocab_size else "") + \
               "`. Tied input/output embeddings are counted once.\n\n" + table + "\n"
        write_text(args.out, text)
    return 0
