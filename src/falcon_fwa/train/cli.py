"""``falcon-fwa train --config configs/....yaml [--set section.field=value ...]``.

One process: ``falcon-fwa train --config ...``. Several GPUs or nodes (or CPU processes with
gloo): ``torchrun --nproc_per_node=N -m falcon_fwa.train.cli --config ... --set train.strategy=fsdp2``.

A SIGTERM, SIGINT or SIGHUP (a preemption, Ctrl-C, the end of a launching command) ends the run at the end
of the step in progress with a checkpoint, exit status 128 + the signal number; the same command resumes
it. A second SIGTERM or SIGINT interrupts at once.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Optional

from ..cli_options import check_input_files, check_output_folder
from .config import load_config

# Seconds a process other than rank 0 waits, after a refused resume or a non-finite loss, before it ends (torchrun
# then stops the rest).
REPORT_GRACE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe file (YAML or JSON), e.g. configs/small/falcon-1a.3.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a recipe field, e.g. --set train.steps=100 (repeatable)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop (with a checkpoint) after this step (from the step of the checkpoint the run "
                             "resumes from, else 1, to train.steps); the schedule still spans train.steps")


def _resume_step(cfg) -> Optional[int]:
    """The step of the checkpoint a launch of ``cfg`` resumes from (``train.resume``: the run's latest, or the
    ``step-*`` folder it names), ``None`` where it starts at step 0."""
    from .checkpoint import checkpoint_step, latest_checkpoint, list_checkpoints

    resume = cfg.train.resume
    if resume == "none":
        return None
    if resume == "auto":
        path = latest_checkpoint(os.path.join(cfg.train.out_dir, "checkpoints"))
    else:  # one that is no complete checkpoint is refused by the trainer, by name
        path = os.path.normpath(resume)
        path = path if path in map(os.path.normpath, list_checkpoints(os.path.dirname(path) or ".")) else None
    return None if path is None else checkpoint_step(path)


def _traceback_requested() -> bool:
    import falcon_fwa_launcher

    return falcon_fwa_launcher.traceback_requested()


def _leave_the_report_to_rank_0() -> None:
    """Before a process other than rank 0 ends quietly on an error every process meets alike: torchrun stops the
    other processes as soon as one ends, so leave rank 0 the time to print its report (no wait outside torchrun)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(REPORT_GRACE_S)


def run(args: argparse.Namespace) -> int:
    from . import distributed
    from .trainer import NonFiniteLoss, ResumeRefused, Trainer

    if args.stop_at is not None and args.stop_at < 1:
        raise ValueError(f"--stop-at must be a step >= 1, got {args.stop_at}")
    check_input_files("--config", args.config)
    cfg = load_config(args.config, args.overrides)
    if args.stop_at is not None and args.stop_at > cfg.train.steps:  # it would run on to the end and finish the run
        raise ValueError(f"--stop-at {args.stop_at} is past the run's end, train.steps = {cfg.train.steps}: give a "
                         f"step <= {cfg.train.steps}, or a longer train.steps (--set train.steps=N)")
    check_output_folder("train.out_dir", cfg.train.out_dir)
    check_output_folder("data.out_dir", cfg.data.out_dir)
    at = None if args.stop_at is None else _resume_step(cfg)
    if at is not None and args.stop_at < at:  # the run is past it: it would train nothing, and stop at no step N
        later = (f"a step from {at} to train.steps = {cfg.train.steps}" if at <= cfg.train.steps else
                 f"a longer train.steps (it is {cfg.train.steps}) and a step from {at}")
        raise ValueError(f"--stop-at {args.stop_at} is before the run's checkpoint at step {at}, where it resumes: "
                         f"give {later}, or train.resume=none to start afresh")
    try:
        trainer = Trainer(cfg)
    except ResumeRefused:
        # every process of a launch refuses alike: the main one (rank 0) reports it, the others end with its
        # exit status and say nothing, so that torchrun's output holds the message once
        rank = int(os.environ.get("RANK", "0"))
        if rank == 0 or _traceback_requested():
            raise
        _leave_the_report_to_rank_0()
        distributed.teardown()
        return 2
    if args.stop_at is not None and trainer.step == args.stop_at < cfg.train.steps and trainer.info.is_main:
        print(f"the run's checkpoint is at --stop-at {args.stop_at} already: nothing to train (a later --stop-at, "
              "or none, continues the run)")
    try:
        summary = trainer.train(stop_at=args.stop_at, stop_on_signal=True)
    except NonFiniteLoss as err:
        # every process sees the same all-reduced loss and global gradient norm, so every one stops alike: the
        # main one reports it, the others end with its exit status and say nothing (the message once in
        # torchrun's output), after leaving it the time to print before torchrun stops the rest
        if not trainer.info.is_main and not _traceback_requested():
            _leave_the_report_to_rank_0()
            return 3
        from ..cli import close_progress_bars

        close_progress_bars()  # the bar's line ends before the error's
        print(f"falcon-fwa train: error: {err}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
        distributed.teardown()
    if trainer.info.is_main:
        print({k: v for k, v in summary.items() if k != "config"})  # the recipe is in summary.json
    if "signal" in summary:  # stopped early, with a checkpoint: launch the same command again to resume
        if trainer.info.is_main:
            print(f"stopped by {summary['signal']} at step {summary['steps']} with checkpoint "
                  f"{trainer.last_checkpoint}; the same command resumes it", file=sys.stderr)
        return 128 + int(getattr(signal, summary["signal"]))
    return 0


def main(argv=None) -> int:
    """The entry point of ``python -m falcon_fwa.train.cli`` (torchrun): errors as ``falcon-fwa train``'s."""
    from ..cli import run_command

    parser = argparse.ArgumentParser(prog="falcon-fwa train", description="train a language model from a recipe")
    add_arguments(parser)
    return run_command("falcon-fwa train", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
