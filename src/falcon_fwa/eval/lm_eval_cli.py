"""``falcon-fwa lm-eval --model DIR --tasks piqa,'arc_*' [--include-path TASK_DIR] [--num-fewshot 1]``:
lm-evaluation-harness (its ``hf`` model: loglikelihood and cached, left-padded generation) on a
saved model folder, with falcon-fwa's model type registered and each request opened by end-of-text, as
in training. Local tasks are YAML files in ``--include-path`` (e.g. ``dataset_path: json`` with local
``data_files``). Patterns in ``--tasks`` are expanded as lm-eval's own command line expands them
(:func:`falcon_fwa.eval.harness.expand_tasks`); the results JSON's ``tasks`` is the expanded list."""
from __future__ import annotations

import argparse
import importlib

from ..atomic import write_json
from ..cli_options import (DEVICE_HELP, at_least, check_model_option, check_output_file, dtype_option, finite_at_least,
                           resolve_device)
from ..provenance import command_provenance


# the arguments of ``harness.evaluate`` as this command takes them: its errors name the options
OPTION_NAMES = {"model_dir": "--model", "tasks": "--tasks", "include_path": "--include-path",
                "max_length": "--max-length"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="saved model folder (save_pretrained + tokenizer)")
    parser.add_argument("--tasks", required=True,
                        help="comma-separated task, group or tag names, or patterns of them as lm-eval's own command "
                             "line takes (arc_*, hellaswag*, arc_e?sy: quote them in the shell), expanded against "
                             "the harness's tasks and those of --include-path; an entry matching none is refused "
                             "with the close names. The results JSON records the expanded list under \"tasks\"")
    parser.add_argument("--include-path", default=None, help="folder of extra task YAML files")
    parser.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: the task's)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per forward pass (default: 8)")
    parser.add_argument("--limit", type=float, default=None,
                        help="documents per task (a whole number), or a fraction of them below 1")
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        type=dtype_option(["float32", "bfloat16", "float16"]),
                        help="the weights' dtype (fp32, bf16 and fp16 are taken too)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="context length in tokens: longer contexts are cut from the left, rolling "
                             "log-likelihoods use windows of it (default: the tokenizer's model_max_length, "
                             "which the byte and bpe:N tokenizers leave unbounded; set it to the training length "
                             "to compare with runs that use one)")
    parser.add_argument("--out", default=None, help="write the results JSON here")


def require_harness() -> None:
    """``ValueError`` where lm-evaluation-harness (``lm_eval``) or ``accelerate``, which its ``hf`` model
    imports, is not installed: the command then ends with one line saying what to install, before the model
    loads, instead of a ``ModuleNotFoundError`` traceback."""
    for module, package in (("lm_eval", "lm-eval"), ("accelerate", "accelerate")):
        try:
            importlib.import_module(module)
        except ImportError as err:
            missing = err.name or module
            raise ValueError(f"lm-eval runs on the {package!r} package, which is not installed here (no module "
                             f"{missing!r}): pip install 'falcon-fwa[eval]' (lm-eval and accelerate)") from None


def run(args: argparse.Namespace) -> int:
    # the options first: a bad value is named before lm-eval is imported or the model loaded
    at_least("--batch-size", args.batch_size, 1)
    at_least("--num-fewshot", args.num_fewshot, 0)
    finite_at_least("--limit", args.limit, 0, strict=True)
    if args.limit is not None and args.limit >= 1 and args.limit != int(args.limit):  # the harness would cut it
        raise ValueError(f"--limit takes a whole number of documents per task or a fraction of them below 1, "
                         f"got {args.limit}")
    at_least("--max-length", args.max_length, 1)
    device = resolve_device(args.device)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"--tasks must name at least one task, got {args.tasks!r}")
    check_model_option(args.model)
    check_output_file("--out", args.out)
    require_harness()
    from lm_eval.utils import make_table

    from .harness import evaluate, paper_columns

    results = evaluate(args.model, tasks, include_path=args.include_path,
                       num_fewshot=args.num_fewshot, batch_size=args.batch_size, limit=args.limit, device=device,
                       dtype=args.dtype, max_length=args.max_length, names=OPTION_NAMES)
    print(make_table(results))
    paper = paper_columns(results)
    for name, title, fmt in (("table1", "the paper's Table 1 (perplexity)", "{:.2f}"),
                             ("table2", "the paper's Table 2 (accuracy, %)", "{:.2f}")):
        if name in paper:
            cols = paper[name]
            print(f"\n{title}:\n| {' | '.join(cols)} |\n|{'---|' * len(cols)}\n"
                  f"| {' | '.join(fmt.format(v) for v in cols.values())} |")
    if args.out:
        report = {k: results[k] for k in ("tasks", "results", "versions", "n-shot", "config", "date")
                  if k in results}
        report["paper_tables"] = paper
        report["provenance"] = command_provenance(args)
        write_json(args.out, report, default=str)
    return 0
