"""``falcon-fwa addition``: train one model on variable-length addition.

Examples::

    falcon-fwa addition                                   # tiny preset, Falcon-3A.3, CPU
    falcon-fwa addition --model falcon --rule 1A --preset paper --device cuda
    falcon-fwa addition --model Transformer --preset paper --device cuda --seed 1
    falcon-fwa addition --operand-order lsd              # operands least significant digit first
    falcon-fwa addition --base 2                          # numbers in binary

Writes ``results.json``, ``checkpoint.pt``, ``best.pt``, ``accuracy_vs_width.png`` and
``accuracy_by_position.png`` to ``--out`` (default ``runs/addition/<preset>/<model>/seed<seed>``, the
preset's folder named with ``-lsd`` / ``-base<b>`` / ``-abacus<K>`` for another operand order, base or
digit places); an interrupted
run resumes from its last checkpoint when started again with the same ``--out``. A SIGTERM,
SIGINT or SIGHUP ends the run at the end of the step in progress with a checkpoint, exit status 128 +
the signal number (a second SIGTERM or SIGINT interrupts at once); one that comes once the run has finished
(as it draws its plots) ends the command with 0, its results complete. Plots that failed after the results
were written are drawn by the next command over the run. A folder another process is training is refused.
"""
from __future__ import annotations

import argparse
import inspect
import re
import signal
import sys
from pathlib import Path

import torch

from ...cli_options import (DEVICE_HELP, at_least, check_output_folder, check_seed, dtype_option, finite_at_least,
                            resolve_device)
from ...models.configuration import MIXER_DEFAULTS, FalconConfig
from ...ops.rules import get_rule
from .data import BASES, OPERAND_ORDERS
from .lineup import LINEUP, MIXERS, resolve_model
from .presets import MATMUL_PRECISIONS, PRESETS, check_curriculum, get_addition_preset


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Options shared with ``addition-compare``: preset, budget overrides, device."""
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size and training budget")
    p.add_argument("--steps", type=int, help="override the preset's number of optimizer steps")
    p.add_argument("--batch-size", type=int, help="override the preset's batch size")
    p.add_argument("--lr", type=float, help="override the preset's peak learning rate")
    p.add_argument("--hidden-size", type=int, help="override the preset's model width (init scale follows it)")
    p.add_argument("--num-hidden-layers", type=int, help="override the preset's number of layers")
    p.add_argument("--num-heads", type=int, help="override the preset's number of heads")
    p.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS,
                   help="override the preset's float32 matmul precision on CUDA (high: TF32 products)")
    p.add_argument("--eval-every", type=int, help="override the preset's evaluation interval (steps)")
    p.add_argument("--val-per-width", type=int, help="override the validation samples per training width")
    p.add_argument("--ood-per-width", type=int, help="override the test samples per out-of-distribution width")
    p.add_argument("--train-widths", type=int, nargs=2, metavar=("LO", "HI"),
                   help="override the (inclusive) range of training widths")
    p.add_argument("--curriculum-steps", type=int,
                   help="grow the largest training width linearly from LO to HI over this many steps "
                        "(default: the preset's, 0 = the whole range from the start, as in the paper)")
    p.add_argument("--operand-order", choices=OPERAND_ORDERS,
                   help="write the operands most (msd, the paper's) or least (lsd) significant digit first; "
                        "the answer is always least significant digit first (default: the preset's, msd)")
    p.add_argument("--base", type=int, choices=BASES, metavar="{2..10}",
                   help="radix the numbers are written in (default: the preset's, 10; 2 is binary)")
    p.add_argument("--abacus-offset", type=int, metavar="K",
                   help="let the model see each digit's place in its number (a learned embedding added to the "
                        "token's, 'Abacus' digit positions), shifted in training by a random offset in [0, K]; "
                        "default: the preset's, none (the paper's setting)")
    p.add_argument("--ood-widths", type=int, nargs=2, metavar=("LO", "HI"),
                   help="override the (inclusive) range of out-of-distribution widths")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   type=dtype_option(["float32", "bfloat16"]),
                   help="bfloat16 runs the model under autocast (fp32 and bf16 are taken too)")
    p.add_argument("--eval-seed", type=int, default=1234, help="seed of the fixed validation and OOD sets")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: the preset's choice)")


FAST_WEIGHT_OPTIONS = {"rule": "--rule", "window": "--window", "qk_norm": "--qk-norm", "gate": "--gate",
                       "lambda_scale": "--lambda-scale"}
"""Options that configure the fast-weight update of a recurrent mixer (the Transformer has none)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="Falcon-3A.3",
                   help=f"a paper name ({', '.join(LINEUP)}) or a mixer ({', '.join(MIXERS)})")
    p.add_argument("--rule", help="update rule (1, 2, 3, 1A, 2A, 3A) of a mixer (a paper name is defined with its "
                                  "own: --rule, --window, --qk-norm, --gate and --lambda-scale may only restate "
                                  "it)")
    p.add_argument("--window", type=int, help="window B of the sliding rules 3 and 3A")
    p.add_argument("--qk-norm", choices=["rmsnorm", "l2"], help="query/key normalization of the falcon mixer")
    p.add_argument("--gate", choices=["ctx-beta", "ctx-eta"], help="which step-size quantity the context emits")
    p.add_argument("--lambda-scale", type=float,
                   help="scale of the context ridge lambda-bar in (0, lambda_scale), which sets the state's decay "
                        "gamma = 1 - eta * lambda (0: no ridge, no decay; the falcon mixer's default is 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialization and the training stream")
    add_model_arguments(p)
    p.add_argument("--out", help="output folder (default runs/addition/<preset>/<model>/seed<seed>, with -lsd, "
                                 "-base<b> and -abacus<K> appended to <preset> for --operand-order lsd, --base b "
                                 "and --abacus-offset K)")
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds a checkpoint")
    p.add_argument("--no-progress", action="store_true", help="log evaluations as lines instead of a progress bar")


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def preset_from_args(args: argparse.Namespace):
    """The ``--preset`` with the options given replacing its fields; an option out of range, or at odds
    with another option or the preset's value (:func:`check_shape_options`), is named as typed (the
    preset would name its field, ``hidden_size``)."""
    for field in ("steps", "batch_size", "eval_every", "hidden_size", "num_hidden_layers", "num_heads",
                  "val_per_width", "ood_per_width"):
        at_least("--" + field.replace("_", "-"), getattr(args, field), 1)
    at_least("--curriculum-steps", args.curriculum_steps, 0)
    at_least("--abacus-offset", args.abacus_offset, 0)
    finite_at_least("--lr", args.lr, 0, strict=True)
    preset = get_addition_preset(args.preset)
    check_shape_options(args, preset)
    check_curriculum_options(args, preset)
    return preset.replace(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
        hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers, num_heads=args.num_heads,
        matmul_precision=args.matmul_precision, curriculum_steps=args.curriculum_steps,
        operand_order=args.operand_order, base=args.base, abacus_offset=args.abacus_offset,
        val_per_width=args.val_per_width, ood_per_width=args.ood_per_width,
        train_widths=tuple(args.train_widths) if args.train_widths else None,
        ood_widths=tuple(args.ood_widths) if args.ood_widths else None)


def check_shape_options(args: argparse.Namespace, preset) -> None:
    """``--train-widths`` and ``--ood-widths`` ranges ``1 <= LO <= HI`` that do not overlap, and a
    ``--hidden-size`` that ``--num-heads`` divides, the preset's value standing for an option left out;
    else a ``ValueError`` naming the options given."""
    ranges = {}
    for option, field in (("--train-widths", "train_widths"), ("--ood-widths", "ood_widths")):
        given = getattr(args, field)
        if given is not None and not 1 <= given[0] <= given[1]:
            raise ValueError(f"{option} {given[0]} {given[1]}: give LO HI with 1 <= LO <= HI")
        ranges[option] = (tuple(given) if given is not None else tuple(getattr(preset, field)), given is not None)
    (t_lo, t_hi), (o_lo, o_hi) = (r for r, _ in ranges.values())
    if o_lo <= t_hi and t_lo <= o_hi:  # the preset's own ranges never overlap: an option was given
        named = " and ".join(f"{option} {lo} {hi}" for option, ((lo, hi), given) in ranges.items() if given)
        raise ValueError(f"{named}: the training widths {t_lo}-{t_hi} and the out-of-distribution widths "
                         f"{o_lo}-{o_hi} overlap; the out-of-distribution widths must lie outside the training ones")
    hidden, heads = args.hidden_size or preset.hidden_size, args.num_heads or preset.num_heads
    if hidden % heads:
        named = " and ".join(f"{option} {value}" for option, value in
                             (("--hidden-size", args.hidden_size), ("--num-heads", args.num_heads)) if value)
        raise ValueError(f"{named}: the width {hidden} is not a multiple of the number of heads {heads}")


def check_curriculum_options(args: argparse.Namespace, preset) -> None:
    """The preset's curriculum check (:func:`.presets.check_curriculum`) on the run the options ask for: a
    ``ValueError`` naming ``--curriculum-steps`` and ``--steps`` with their values (the preset's where an option
    is left out) where the curriculum is longer than the run."""
    curriculum = preset.curriculum_steps if args.curriculum_steps is None else args.curriculum_steps
    steps = args.steps or preset.steps
    widths = tuple(args.train_widths) if args.train_widths else preset.train_widths
    preset_note = f" (the {args.preset} preset's)"
    check_curriculum(curriculum, steps, widths, names=("--curriculum-steps", "--steps"),
                     notes=tuple("" if given is not None else preset_note for given in (args.curriculum_steps,
                                                                                       args.steps)))


def check_machine_options(args: argparse.Namespace) -> None:
    """``--device`` resolved (``auto``: cuda where available), ``--threads`` and ``--window``
    >= 1, ``--lambda-scale`` a finite number >= 0, or a ``ValueError`` naming the option."""
    args.device = resolve_device(args.device)
    at_least("--threads", args.threads, 1)  # 0 would otherwise silently mean "the preset's choice"
    at_least("--window", getattr(args, "window", None), 1)  # the model config would name its field 'window'
    finite_at_least("--lambda-scale", getattr(args, "lambda_scale", None), 0)


def _defined(model: str, field: str):
    """The value of a fast-weight field that the paper name ``model`` is defined with: its own, else its
    mixer's default (``window``: the config's)."""
    if field == "window":
        return inspect.signature(FalconConfig.__init__).parameters["window"].default
    return LINEUP[model].get(field, MIXER_DEFAULTS[LINEUP[model]["mixer"]][field])


def model_fields(args: argparse.Namespace) -> dict:
    """The config fields of ``--model`` with the fast-weight options (:data:`FAST_WEIGHT_OPTIONS`), or a
    ``ValueError`` naming the option and the model for one that changes nothing (any on the Transformer,
    ``--window`` on a rule without one) or changes a paper name's model (a paper name is that model,
    baselines included: a variant is trained under its mixer's name)."""
    given = {field: getattr(args, field) for field in FAST_WEIGHT_OPTIONS if getattr(args, field) is not None}
    if args.rule is not None:
        try:  # by its canonical name: --rule 3a trains (and resumes) the run of rule 3A
            given["rule"] = get_rule(args.rule).name
        except ValueError as err:  # named as typed (the op names its argument 'rule')
            raise ValueError(f"--rule: {err}") from None
    fields = resolve_model(args.model, given, name="--model")
    if fields["mixer"] == "transformer" and given:  # softmax attention has no fast-weight update to configure
        raise ValueError(f"{FAST_WEIGHT_OPTIONS[next(iter(given))]}: model {args.model!r} is a Transformer (softmax "
                         f"attention), which has no fast-weight update; {', '.join(FAST_WEIGHT_OPTIONS.values())} "
                         "apply to the recurrent mixers only")
    rule = get_rule(fields.get("rule", MIXER_DEFAULTS[fields["mixer"]]["rule"]))
    if args.window is not None and not rule.sliding:
        raise ValueError(f"--window {args.window}: model {args.model!r} (rule {rule.name}) has no window; only "
                         "the sliding rules 3 and 3A have one")
    if args.model in LINEUP:  # a paper name is that model: another rule, norm, gate or window is another model
        for field, value in given.items():
            option, defined = FAST_WEIGHT_OPTIONS[field], _defined(args.model, field)
            if value != defined:
                raise ValueError(f"{option} {value}: {args.model} is defined with {field} {defined}; for another "
                                 f"variant name the mixer (--model {LINEUP[args.model]['mixer']} {option} {value})")
    return paper_fields(args.model, fields)


def paper_fields(model: str, fields: dict) -> dict:
    """The config fields a run of ``model`` is recorded and compared by: for a paper name whose ``fields`` hold
    its definition and restate the rest of it only (``--window 4`` on Falcon-3A.3, ``--rule 1A`` on Mamba-2),
    the definition itself (:data:`.lineup.LINEUP`), so that the run is the one the name alone trains; else
    ``fields`` as they are."""
    if model not in LINEUP:
        return fields
    definition = LINEUP[model]
    if all(fields.get(k) == v for k, v in definition.items()) and all(
            k in definition or (k in FAST_WEIGHT_OPTIONS and v == _defined(model, k)) for k, v in fields.items()):
        return dict(definition)
    return fields


def check_model_config(args: argparse.Namespace, model: str, fields: dict, preset, *, option: str = "--model") -> None:
    """A ``ValueError`` before anything is written where the model config of ``model`` (its ``fields`` at the
    ``preset``'s size) is refused, such as a Transformer head dim made odd by ``--hidden-size`` / ``--num-heads``:
    it names the width, head and fast-weight options given, as typed (``option`` and the model where none was),
    and the config's reason. Building the config draws no weights."""
    from ...models.configuration import FalconConfig
    from .data import VOCAB

    try:
        FalconConfig(vocab_size=len(VOCAB), **preset.size(), **fields)
    except ValueError as err:
        given = [f"--{name.replace('_', '-')} {getattr(args, name)}"
                 for name in ("hidden_size", "num_heads", *FAST_WEIGHT_OPTIONS)
                 if getattr(args, name, None) is not None]
        named = " and ".join(given) or f"{option} {model}"
        raise ValueError(f"{named}: model {model!r} (width {preset.hidden_size}, {preset.num_heads} heads) cannot "
                         f"be built: {err}") from None


def run(args: argparse.Namespace) -> int:
    from ...train.launch import StopSignals
    from .plot import plot_run
    from .train import RunSpec, runs_folder, task_fields, train_run

    check_machine_options(args)
    check_seed("--seed", args.seed)  # torch.manual_seed's range
    fields = model_fields(args)
    preset = preset_from_args(args)
    check_model_config(args, args.model, fields, preset)
    threads = args.threads or (preset.cpu_threads if args.device == "cpu" else None)
    if threads:
        torch.set_num_threads(threads)
    out = Path(args.out or runs_folder(args.preset, task_fields(preset)) / slug(args.model) / f"seed{args.seed}")
    check_output_folder("--out", str(out))
    spec = RunSpec(model=args.model, fields=fields, preset_name=args.preset, preset=preset, seed=args.seed,
                   eval_seed=args.eval_seed, device=args.device, dtype=args.dtype,
                   extra={"argv": list(sys.argv)})
    print(f"addition: {args.model} {fields} preset {args.preset} "
          f"(width {preset.hidden_size}, {preset.num_hidden_layers} layers, {preset.steps} steps"
          f"{', operands ' + preset.operand_order if preset.operand_order != 'msd' else ''}"
          f"{f', base {preset.base}' if preset.base != 10 else ''}"
          f"{f', digit positions (offset <= {preset.abacus_offset})' if preset.abacus_offset is not None else ''}) "
          f"on {args.device} -> {out}")
    plots = []

    def write_plots(res) -> None:  # under the run's lock, as its other files
        plots.extend(plot_run(res, out))

    # the command's signals are held to its end: one that comes once the results are complete (as the run
    # draws its plots or says how it ended) changes nothing, and the status is 0
    with StopSignals(True) as signals:
        res = train_run(spec, out, progress=not args.no_progress, resume=not args.no_resume, signals=signals,
                        finish=write_plots)
        if "signal" in res:  # stopped early, with a checkpoint: the same command resumes it
            if res["steps_done"]:
                print(f"stopped by {res['signal']} at step {res['steps_done']} of {preset.steps} (checkpoint in "
                      f"{out}); the same command resumes it", file=sys.stderr)
            else:  # no step was trained, so no checkpoint was written
                print(f"stopped by {res['signal']} before its first step (no checkpoint); the same command starts "
                      "it", file=sys.stderr)
            return 128 + int(getattr(signal, res["signal"]))
        b = res["best"]
        lo, hi = preset.ood_widths
        print(f"{args.model}: {res['parameters']:,} parameters, {res['wall_time_s']:.0f} s; best step {b['step']}: "
              f"validation (widths {preset.train_widths[0]}-{preset.train_widths[1]}) exact {b['val_acc']:.1f}% "
              f"digits {b['val_digit_acc']:.1f}%; widths {lo}-{hi}: mean exact {b['mean_acc_ood']:.1f}% "
              f"digits {b['digit_mean_acc_ood']:.1f}%, d{lo}/d{hi} {b[f'acc_d{lo}']:.1f}/{b[f'acc_d{hi}']:.1f}")
        written = ", ".join(str(p) for p in plots)
        print(f"results: {out / 'results.json'}" + (f", plots: {written}" if written else ""))
        if signals.received:
            print(f"{signal.Signals(signals.received).name} came as the run finished: its results are complete "
                  "and written, nothing was lost", file=sys.stderr)
        return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="falcon-fwa addition", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # as addition-compare starts its runs: errors as falcon-fwa addition's, one line
    from ...cli import run_command

    parser = argparse.ArgumentParser(prog="falcon-fwa addition", description=__doc__.splitlines()[0])
    add_arguments(parser)
    sys.exit(run_command("falcon-fwa addition", run, parser.parse_args()))
