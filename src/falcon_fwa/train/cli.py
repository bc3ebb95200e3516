"""``falcon-fwa train --config configs/....yaml [--set section.field=value ...]``.

One process: ``falcon-fwa train --config ...``. Several GPUs or nodes (or CPU processes with
gloo): ``torchrun --nproc_per_node=N -m falcon_fwa.train.cli --config ... --set train.strategy=fsdp2``.
"""
from __future__ import annotations

import argparse
import sys

from .config import load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="recipe file (YAML or JSON), e.g. configs/small/falcon-1a.3.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="override a recipe field, e.g. --set train.steps=100 (repeatable)")
    parser.add_argument("--stop-at", type=int, default=None,
                        help="stop (with a checkpoint) after this step; the schedule still spans train.steps")


def run(args: argparse.Namespace) -> int:
    from . import distributed
    from .trainer import NonFiniteLoss, Trainer

    cfg = load_config(args.config, args.overrides)
    trainer = Trainer(cfg)
    try:
        summary = trainer.train(stop_at=args.stop_at)
    except NonFiniteLoss as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    finally:
        trainer.close()
        distributed.teardown()
    if trainer.info.is_main:
        print({k: v for k, v in summary.items()})
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="falcon-fwa train", description="train a language model from a recipe")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
