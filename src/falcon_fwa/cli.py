"""Command-line entry point: ``falcon-fwa <command> [options]``.

Each command lives in its own module and exposes ``add_arguments(parser)`` and
``run(args)``; this file only routes to them, importing a module when it is used.

A ``ValueError``, ``OSError`` or ``NotImplementedError`` that a command raises (a bad option
value, a missing file or one it cannot write, an unsupported combination; the messages name the
argument or the path) ends it with ``falcon-fwa COMMAND: error: MESSAGE`` and the place it was raised,
exit status 2, instead of a traceback; ``FALCON_FWA_TRACEBACK=1`` re-raises it. A Ctrl-C that
reaches a command as ``KeyboardInterrupt`` (one with no clean stop of its own, such as ``data``, or a
second Ctrl-C during a training's clean stop) ends it with ``falcon-fwa COMMAND: interrupted`` and the
status of SIGINT (130). Output piped into a reader that stops early (``falcon-fwa demo | head``) ends
the command quietly, with the status of a process ended by SIGPIPE (141).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback
from typing import List, Optional

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


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one that says something (not ``None``,
    not off) and the help does not already give it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or action.default == [] or "default" in text):
            return text
        return text + " (default: %(default)s)"


def _version() -> str:
    """The installed distribution's version (the package's own where it runs from a source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("falcon-fwa")
    except PackageNotFoundError:
        from . import __version__
        return __version__


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="falcon-fwa", description="Falcon fast-weight attention")
    parser.add_argument("--version", action="store_true", help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    if argv[0] == "--version":
        print(f"falcon-fwa {_version()}")
        return 0
    name = argv[0]
    if name not in COMMANDS:
        parser.error(f"unknown command {name!r}; choose from {', '.join(COMMANDS)}")
    module = importlib.import_module(COMMANDS[name][0])
    cmd = argparse.ArgumentParser(prog=f"falcon-fwa {name}", description=COMMANDS[name][1],
                                  formatter_class=_HelpFormatter)
    module.add_arguments(cmd)
    return run_command(f"falcon-fwa {name}", module.run, cmd.parse_args(argv[1:]))


def close_progress_bars() -> None:
    """End every progress bar still open, as a command ends on an error raised inside a bar's loop: the bar's
    line is finished before the error is printed, where the error would run on after the bar and the bar be
    drawn again below it when it is collected."""
    std = sys.modules.get("tqdm.std")
    if std is None:  # no bar was ever made
        return
    classes, seen = [std.tqdm], set()
    while classes:  # a subclass (tqdm.auto's) may keep its own set of instances
        cls = classes.pop()
        if cls not in seen:
            seen.add(cls)
            classes.extend(cls.__subclasses__())
            for bar in list(vars(cls).get("_instances", ())):
                bar.close()


def run_command(prog: str, run, args: argparse.Namespace) -> int:
    """``run(args)`` as an exit status: a ``ValueError``, ``OSError`` or ``NotImplementedError``
    is printed as ``PROG: error: MESSAGE`` with the place it was raised, status 2; a ``KeyboardInterrupt``
    as ``PROG: interrupted``, status 128 + SIGINT; a closed output pipe ends it quietly, status 128 + SIGPIPE."""
    try:
        status = int(run(args) or 0)
        sys.stdout.flush()  # what is still buffered, while a closed pipe can be caught here
        return status
    except BrokenPipeError:
        # the reader is gone: later writes (and the interpreter's final flush) must not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except KeyboardInterrupt:
        if os.environ.get("FALCON_FWA_TRACEBACK"):
            raise
    except (ValueError, OSError, NotImplementedError) as e:
        if os.environ.get("FALCON_FWA_TRACEBACK"):
            raise
        where = traceback.extract_tb(e.__traceback__)[-1]
        close_progress_bars()
        print(f"{prog}: error: {e}\n  (raised at {where.filename}:{where.lineno}; "
              "FALCON_FWA_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 2
    # interrupted: said once the exception is gone, with the frames that held progress bars open
    print(f"{prog}: interrupted", file=sys.stderr)
    return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
