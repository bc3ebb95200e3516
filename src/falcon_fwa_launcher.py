"""The ``falcon-fwa`` command's launcher: the command table and the top-level options, with the
standard library only.

``falcon-fwa``, ``falcon-fwa --help`` (``-h``) and ``falcon-fwa --version`` are answered here, and an
unknown command is refused here (argparse's error naming it, exit status 2), all without importing the
package: ``import falcon_fwa`` imports torch and transformers (it registers the models' Auto classes),
which takes seconds. A command is run by :func:`falcon_fwa.cli.run_named`, imported only then. A Ctrl-C
during those imports (the package's, then the command's module) ends the command with
``falcon-fwa COMMAND: interrupted`` and the status of SIGINT (130), as a Ctrl-C during the command does,
instead of a traceback; ``FALCON_FWA_TRACEBACK=1`` re-raises it.

This is a top-level module, outside the package, so that importing it does not run the package's
``__init__``.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

PROG = "falcon-fwa"

# name -> (the module with add_arguments(parser) and run(args), the line of --help)
COMMANDS = {
    "demo": ("falcon_fwa.demo", "check the three forms of every rule on random inputs and time them"),
    "addition": ("falcon_fwa.tasks.addition.cli", "train one model on variable-length addition (the paper's Table 3 task)"),
    "addition-compare": ("falcon_fwa.tasks.addition.compare", "train the Table-3 lineup under one budget and tabulate it"),
    "params": ("falcon_fwa.models.cli", "parameter counts of the model presets"),
    "data": ("falcon_fwa.data.cli", "tokenize a corpus once into memory-mapped token shards"),
    "train": ("falcon_fwa.train.cli", "train a language model from a recipe (torchrun for DDP/FSDP2)"),
    "compare": ("falcon_fwa.train.compare", "train several recipes on the same tokens and tabulate them"),
    "scaling": ("falcon_fwa.train.scaling", "DDP/FSDP2 scaling through torchrun: tokens/s, efficiency, memory, loss"),
    "throughput": ("falcon_fwa.train.throughput", "training tokens/s and peak memory of model presets"),
    "ppl": ("falcon_fwa.eval.ppl_cli", "perplexity of a saved model over held-out files, by position bucket"),
    "lm-eval": ("falcon_fwa.eval.lm_eval_cli", "lm-evaluation-harness tasks on a saved model folder"),
    "generate": ("falcon_fwa.serve.generate_cli", "continue prompts with a saved model folder (streamed, timed)"),
}

SIGINT_STATUS = 130  # 128 + SIGINT, as a shell reports a command ended by Ctrl-C


def version() -> str:
    """The installed distribution's version (the package's own where it runs from a source tree, which
    imports the package)."""
    from importlib.metadata import PackageNotFoundError, version as installed

    try:
        return installed("falcon-fwa")
    except PackageNotFoundError:
        from falcon_fwa import __version__
        return __version__


def top_level_parser() -> argparse.ArgumentParser:
    """The parser of ``falcon-fwa [-h] [--version] COMMAND ...``: it prints the help, lists every command
    of :data:`COMMANDS` and reports an unknown one; each command parses its own options."""
    parser = argparse.ArgumentParser(prog=PROG, description="Falcon fast-weight attention")
    parser.add_argument("--version", action="store_true", help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def top_level(argv: Sequence[str]) -> Optional[str]:
    """The command that ``argv`` names, or ``None`` where ``argv`` is answered here: nothing, ``-h`` or
    ``--help`` prints the help, ``--version`` the version. An unknown command is argparse's error (exit
    status 2, ``SystemExit``) naming it and the commands there are."""
    parser = top_level_parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return None
    if argv[0] == "--version":
        print(f"{PROG} {version()}")
        return None
    name = argv[0]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    return name


def traceback_requested() -> bool:
    """Whether ``FALCON_FWA_TRACEBACK`` asks for tracebacks: set to anything but empty, ``0``, ``false``, ``no``
    or ``off`` (any case)."""
    return os.environ.get("FALCON_FWA_TRACEBACK", "").strip().lower() not in ("", "0", "false", "no", "off")


def interrupted(prog: str) -> int:
    """``PROG: interrupted`` on stderr, and the status of SIGINT."""
    print(f"{prog}: interrupted", file=sys.stderr)
    return SIGINT_STATUS


def main(argv: Optional[List[str]] = None) -> int:
    """The ``falcon-fwa`` console script: the top level here, a command through :mod:`falcon_fwa.cli`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = top_level(argv)
    if name is None:
        return 0
    try:
        from falcon_fwa import cli
    except KeyboardInterrupt:
        if traceback_requested():
            raise
        return interrupted(f"{PROG} {name}")
    return cli.run_named(name, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
