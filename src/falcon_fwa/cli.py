"""Command-line entry point: ``falcon-fwa <command> [options]``.

Each command lives in its own module and exposes ``add_arguments(parser)`` and
``run(args)``; this file only routes to them, importing a module when it is used. The command table and
the top level (``--help``, ``--version``, an unknown command) are :mod:`falcon_fwa_launcher`'s, the
console script's module, which answers them without importing this package (and so torch).

A ``ValueError``, ``OSError`` or ``NotImplementedError`` that a command raises (a bad option
value, a missing file or one it cannot write, an unsupported combination; the messages name the
argument or the path) ends it with ``falcon-fwa COMMAND: error: MESSAGE`` and the place it was raised,
exit status 2, instead of a traceback; ``FALCON_FWA_TRACEBACK=1`` re-raises it. A Ctrl-C that
reaches a command as ``KeyboardInterrupt`` (one with no clean stop of its own, such as ``data``, or a
second Ctrl-C during a training's clean stop), or while the command's module is imported, ends it with
``falcon-fwa COMMAND: interrupted`` and the status of SIGINT (130). Output piped into a reader that
stops early (``falcon-fwa demo | head``) ends the command quietly, with the status of a process ended by
SIGPIPE (141).
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback
from typing import List, Optional

import falcon_fwa_launcher as launcher

# the command table and the top level live in the launcher, which imports no torch (``falcon-fwa --help``
# answers from it alone)
COMMANDS = launcher.COMMANDS


class _HelpFormatter(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one that says something (not ``None``,
    not off) and the help does not already give it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is None or action.default is False
                or action.default is argparse.SUPPRESS or action.default == [] or "default" in text):
            return text
        return text + " (default: %(default)s)"


def main(argv: Optional[List[str]] = None) -> int:
    """``falcon-fwa`` (the top level as :func:`falcon_fwa_launcher.top_level` answers it) and its commands."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = launcher.top_level(argv)
    return 0 if name is None else run_named(name, argv[1:])


def run_named(name: str, argv: List[str]) -> int:
    """The command ``name`` of :data:`COMMANDS` on its options ``argv``, as an exit status (:func:`run_command`).
    A Ctrl-C while the command's module is imported or its options parsed ends it as one during the
    command does: ``falcon-fwa COMMAND: interrupted``, status 130."""
    prog = f"{launcher.PROG} {name}"
    try:
        module = importlib.import_module(COMMANDS[name][0])
        cmd = argparse.ArgumentParser(prog=prog, description=COMMANDS[name][1], formatter_class=_HelpFormatter)
        module.add_arguments(cmd)
        args = cmd.parse_args(argv)
    except KeyboardInterrupt:
        if launcher.traceback_requested():
            raise
        return launcher.interrupted(prog)
    return run_command(prog, module.run, args)


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
        if launcher.traceback_requested():
            raise
    except (ValueError, OSError, NotImplementedError) as e:
        if launcher.traceback_requested():
            raise
        where = traceback.extract_tb(e.__traceback__)[-1]
        close_progress_bars()
        print(f"{prog}: error: {e}\n  (raised at {where.filename}:{where.lineno}; "
              "FALCON_FWA_TRACEBACK=1 shows the traceback)", file=sys.stderr)
        return 2
    # interrupted: said once the exception is gone, with the frames that held progress bars open
    return launcher.interrupted(prog)


if __name__ == "__main__":
    sys.exit(main())
