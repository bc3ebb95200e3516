"""``falcon-fwa data --train SOURCE [--val SOURCE] --tokenizer byte --out DIR``: tokenize a corpus
once into memory-mapped token shards (``DIR/train``, ``DIR/val``, ``DIR/tokenizer``). Training
recipes do this themselves on first use; this command does it ahead (e.g. once for many runs)."""
from __future__ import annotations

import argparse
import json

from ..cli_options import check_output_folder
from .prepare import DataSpec, prepare_dataset
from .sources import TEXT_SPLITS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--train", required=True, help="files/folder/glob of .txt/.jsonl/.parquet, or hf:NAME[:CONFIG]")
    parser.add_argument("--val", default=None, help="held-out source (default: every --val-every-th document)")
    parser.add_argument("--tokenizer", default="byte", help="byte | bpe:<vocab_size> | tokenizer folder | Hub name")
    parser.add_argument("--text-split", default="file", choices=TEXT_SPLITS,
                        help="a text file is one document (file), one per line, or one per blank-line paragraph")
    parser.add_argument("--text-field", default="text",
                        help="JSON/JSONL/Parquet (and hf:) field holding the text (changes nothing for text files)")
    parser.add_argument("--val-every", type=int, default=20,
                        help="without --val: hold out every N-th document (counted after --text-split: with line, "
                             "every N-th line)")
    parser.add_argument("--max-documents", type=int, default=None, help="read at most this many documents")
    parser.add_argument("--bpe-documents", type=int, default=100_000, help="documents that train a bpe:N tokenizer")
    parser.add_argument("--out", required=True, help="output folder (DIR/train, DIR/val, DIR/tokenizer)")
    parser.add_argument("--overwrite", action="store_true", help="rebuild a folder prepared with other settings")


_OPTIONS = {"train_source": "train", "val_source": "val", "out_dir": "out"}


def option(field: str) -> str:
    """The command-line option of a setting ``field`` (``text_field`` -> ``--text-field``), not the recipe's
    ``data.FIELD``: the ``name`` that the ``data`` and ``ppl`` commands pass to what reports their settings."""
    return "--" + _OPTIONS.get(field, field).replace("_", "-")


def run(args: argparse.Namespace) -> int:
    spec = DataSpec(train_source=args.train, val_source=args.val, tokenizer=args.tokenizer, text_split=args.text_split,
                    text_field=args.text_field, val_every=args.val_every, max_documents=args.max_documents,
                    bpe_documents=args.bpe_documents)
    check_output_folder("--out", args.out)
    record = prepare_dataset(spec, args.out, overwrite=args.overwrite, name=option)
    print(json.dumps(record, indent=1))
    return 0
