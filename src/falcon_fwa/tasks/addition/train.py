"""One training run on variable-length addition.

AdamW (weight decay on matrices only), linear warmup then cosine decay, gradient
clipping; the loss is the mean next-token cross-entropy over target-suffix tokens.
Every ``eval_every`` steps the model is scored teacher-forced on fixed per-width
sets (training widths for validation, 33..48 out of distribution); the best step
is the one with the highest validation exact-match accuracy (ties: digit accuracy,
then the suffix loss on the training widths, ``val_loss``), and the OOD figures
reported are those of that step (their loss is ``ood_loss``: no OOD figure enters the
choice of the step).

``out_dir`` receives, each written atomically at every evaluation and in this order:
``checkpoint.pt`` (model, optimizer and step, to resume, with the whole results dict: it
is the record a relaunch resumes from), ``best.pt`` (model weights at the best step, when it
changes) and ``results.json`` (settings, history, best step, written from the same dict; the
best step also holds ``per_position``, the digit accuracy at each answer position of every
width). A run killed between two of these writes is put right by its relaunch (:func:`_resume`):
``results.json`` is rewritten from the checkpoint, and ``best.pt`` from the checkpoint's model
when the checkpoint's step is the best one. One process at a time trains a folder (the lock
``.train.lock``, as ``falcon-fwa train`` holds in its run folder).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import signal
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .cli import FAST_WEIGHT_OPTIONS, paper_fields
from .data import VOCAB, AdditionBatch, collate, training_batch, width_set
from .lineup import LINEUP, DigitPositions, build_model
from .metrics import AccuracyTally, position_hits, score_predictions
from .presets import AdditionPreset, preset_size
from ...atomic import folder_lock, read_json, remove_temporaries, save_torch, write_json
from ...provenance import command_provenance
from ...train import schedule
from ...train.launch import LOCK_NAME, StopSignals

_TEMPORARIES = ("checkpoint.pt", "best.pt", "results.json", "accuracy_vs_width.png", "accuracy_by_position.png")
"""The files a run writes under its lock (the last two by ``falcon-fwa addition``'s ``finish``, :func:`train_run`,
or by ``addition-compare`` for a finished run that lacks them)
whose atomic writes' temporary files (:func:`falcon_fwa.atomic.atomic_path`) a process killed during a write
leaves behind."""


def metric_note(ood_widths: Tuple[int, int]) -> str:
    """What the accuracies of a run's ``results.json`` mean, with its own OOD widths."""
    lo, hi = ood_widths
    return ("teacher-forced on the n+1 sum digits; 'acc' = exact match (all digits of a sample right), "
            f"'digit_acc' = fraction of digits right; best.mean_acc_ood = mean over widths {lo}..{hi} "
            "at the best validation step")


@dataclass
class RunSpec:
    """What one run trains: a named model with its config fields under a preset."""

    model: str
    fields: Dict[str, Any]
    preset_name: str
    preset: AdditionPreset
    seed: int = 0
    eval_seed: int = 1234
    device: str = "cpu"
    dtype: str = "float32"
    eval_batch: int = 256
    extra: Dict[str, Any] = field(default_factory=dict)


def lr_at(step: int, preset: AdditionPreset) -> float:
    """Learning rate of optimizer step ``step`` (0-based): the trainer's schedule
    (:func:`falcon_fwa.train.schedule.lr_at`, linear warmup then cosine) with the preset's budget."""
    return schedule.lr_at(step, lr=preset.lr, warmup_steps=preset.warmup, total_steps=preset.steps,
                          min_lr_ratio=preset.min_lr_ratio)


def make_optimizer(model: torch.nn.Module, preset: AdditionPreset) -> torch.optim.AdamW:
    """AdamW over the model's own parameter groups (muP multipliers, decay on matrices only)."""
    groups = model.param_groups(preset.lr, preset.weight_decay)
    return torch.optim.AdamW(groups, lr=preset.lr, betas=preset.betas)


def suffix_loss(logits: torch.Tensor, batch: AdditionBatch) -> torch.Tensor:
    """Mean cross-entropy of the target-suffix tokens (``logits[t-1]`` predicts token ``t``)."""
    mask = batch.loss_mask[:, 1:]
    return F.cross_entropy(logits[:, :-1][mask].float(), batch.input_ids[:, 1:][mask])


def forward_logits(model: torch.nn.Module, batch: AdditionBatch) -> torch.Tensor:
    """The model's logits on ``batch``: from the tokens, and with :class:`.lineup.DigitPositions`
    from the tokens and their digit indices."""
    if isinstance(model, DigitPositions):
        return model(batch.input_ids, batch.digit_index).logits
    return model(batch.input_ids).logits


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: AdditionBatch, grad_clip: float,
               autocast: Callable, *, label: str) -> torch.Tensor:
    """One optimizer step on ``batch``: forward, suffix loss, backward, gradient clipping, update.
    Returns the loss; a non-finite loss raises ``FloatingPointError`` naming ``label`` before
    any update."""
    with autocast():
        logits = forward_logits(model, batch)
    loss = suffix_loss(logits, batch)
    if not torch.isfinite(loss):
        raise FloatingPointError(f"non-finite training loss at {label}")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss


def eval_batches(seed: int, widths: range, per_width: int, batch: int, *,
                 operand_order: str = "msd", base: int = 10) -> Dict[int, List[AdditionBatch]]:
    """Fixed evaluation batches, one width per batch (no padding, no digit-index offset)."""
    sets = width_set(seed, widths, per_width, operand_order=operand_order, base=base)
    return {w: [collate(s[i : i + batch]) for i in range(0, len(s), batch)] for w, s in sets.items()}


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Dict[int, List[AdditionBatch]], device: torch.device,
             autocast: Callable) -> tuple:
    """Teacher-forced scores over ``batches`` (by width): ``(AccuracyTally, {width: (suffix
    loss summed over the suffix tokens, their number)})``; :func:`mean_loss` averages a set
    of widths."""
    was_training = model.training
    model.eval()
    tally, losses = AccuracyTally(), {}
    for width, group in batches.items():
        loss_sum, n = 0.0, 0
        for b in group:
            b = b.to(device)
            with autocast():
                logits = forward_logits(model, b)
            pred = logits.argmax(-1)
            tally.add(b.widths, *score_predictions(pred, b), positions=position_hits(pred, b))
            tokens = int(b.loss_mask[:, 1:].sum())
            loss_sum += suffix_loss(logits, b).item() * tokens
            n += tokens
        losses[width] = (loss_sum, n)
    model.train(was_training)
    return tally, losses


def mean_loss(losses: Dict[int, Tuple[float, int]], widths: range) -> float:
    """The suffix loss per token over ``widths`` (token-weighted) from :func:`evaluate`'s losses."""
    total, n = (sum(losses[w][i] for w in widths) for i in (0, 1))
    return total / max(n, 1)


def _summary(tally: AccuracyTally, val_widths: range, ood_widths: range) -> Dict[str, Any]:
    per = tally.per_width()
    lo, hi = ood_widths[0], ood_widths[-1]
    return {
        "val_acc": tally.exact_acc(val_widths),
        "val_digit_acc": tally.digit_acc(val_widths),
        "mean_acc_ood": sum(per[w]["exact"] for w in ood_widths) / len(ood_widths),
        "digit_mean_acc_ood": sum(per[w]["digit"] for w in ood_widths) / len(ood_widths),
        f"acc_d{lo}": per[lo]["exact"],
        f"acc_d{hi}": per[hi]["exact"],
        f"digit_acc_d{lo}": per[lo]["digit"],
        f"digit_acc_d{hi}": per[hi]["digit"],
        "per_width": {str(w): per[w] for w in per},
        # digit accuracy by answer position (k = 0 the units digit); kept for the best step only
        "per_position": {str(w): acc for w, acc in tally.per_position().items()},
    }


def _better(a: Dict[str, Any], b: Optional[Dict[str, Any]]) -> bool:
    if b is None:
        return True
    return (a["val_acc"], a["val_digit_acc"], -a["val_loss"]) > (b["val_acc"], b["val_digit_acc"], -b["val_loss"])


def _autocast(device: torch.device, dtype: str) -> Callable:
    if dtype == "float32":
        return contextlib.nullcontext
    if dtype == "bfloat16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    raise ValueError(f"dtype: unknown {dtype!r}; choose float32 or bfloat16")


@contextlib.contextmanager
def float32_matmul_precision(value: Optional[str]):
    """``torch.set_float32_matmul_precision(value)`` inside the block (``None``: unchanged); the
    process's setting is given back after it."""
    before = torch.get_float32_matmul_precision()
    if value is not None:
        torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def train_run(spec: RunSpec, out_dir, *, progress: bool = True, resume: bool = True,
              log: Callable[[str], None] = print, stop_on_signal: bool = False,
              finish: Optional[Callable[[Dict[str, Any]], None]] = None,
              signals: Optional[StopSignals] = None) -> Dict[str, Any]:
    """Train ``spec`` and return the results dict (also written to ``out_dir/results.json``). On
    CUDA the preset's float32 matmul precision holds for the run; the previous one is restored.
    ``finish`` is called with the results of a run that ended (not stopped by a signal) while the folder is
    still locked, and its signals still held: what it writes there (the plots) is the run's, and a temporary
    file that a kill during its writes leaves is removed by the next holder of the lock (:data:`_TEMPORARIES`).

    A folder that another process is training is refused (a ``ValueError`` naming it). With
    ``stop_on_signal``, a SIGTERM, SIGINT or SIGHUP ends the run at the end of the step in progress with a
    checkpoint (a second SIGTERM or SIGINT interrupts at once, as in ``falcon-fwa train``); the results of a run so
    stopped before its last step name the signal (``"signal": "SIGTERM"``), and the same call resumes it.
    ``signals``, instead of ``stop_on_signal``: the caller's :class:`~falcon_fwa.train.launch.StopSignals`,
    active and held by it past this call (a command that takes a signal coming after the run has finished as
    a stop that cost nothing)."""
    out_dir = Path(out_dir)
    on_cuda = torch.device(spec.device).type == "cuda"
    held = contextlib.nullcontext(signals) if signals is not None else StopSignals(stop_on_signal)
    # the handlers before the lock: a process seen holding the lock already stops cleanly on a signal
    with held as signals, run_lock(out_dir), \
            float32_matmul_precision(spec.preset.matmul_precision if on_cuda else None):
        results = _train(spec, out_dir, progress=progress, resume=resume, log=log, signals=signals)
        if finish is not None and "signal" not in results:
            finish(results)
        return results


@contextlib.contextmanager
def run_lock(out_dir: Path):
    """Hold ``out_dir``'s training lock (:data:`LOCK_NAME`) for the block, or raise a ``ValueError``
    naming the folder when another live process holds it; the files a killed writer left behind
    (:data:`_TEMPORARIES`) are removed once the lock is held."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(folder_lock(out_dir, LOCK_NAME, wait=False))
        except BlockingIOError:
            raise ValueError(f"{out_dir} is being trained by another process (it holds {out_dir / LOCK_NAME}); "
                             "wait for it to end, or give another --out") from None
        remove_temporaries(out_dir, *_TEMPORARIES)  # no other writer is alive: these are stale
        yield


def _new_results(spec: RunSpec, device: torch.device, n_params: int) -> Dict[str, Any]:
    """The results dict of a fresh run: its settings, an empty history, no best step yet."""
    return {
        "task": "addition",
        "model": spec.model,
        "config_fields": spec.fields,
        "preset_name": spec.preset_name,
        "preset": spec.preset.to_dict(),
        **task_fields(spec.preset),
        "size": spec.preset.size(),
        "seed": spec.seed,
        "eval_seed": spec.eval_seed,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": spec.dtype,
        "torch": torch.__version__,
        # the full commit of the falcon_fwa checkout that trains, and whether it had uncommitted changes to
        # tracked files (None where git cannot tell)
        **{k: v for k, v in command_provenance(argparse.Namespace()).items() if k in ("commit", "dirty")},
        "parameters": n_params,
        "metric": metric_note(spec.preset.ood_widths),
        "history": [],
        "best": None,
        "steps_done": 0,
        "finished": False,
        "wall_time_s": 0.0,
        **spec.extra,
    }


TASK_DEFAULTS: Dict[str, Any] = {"operand_order": "msd", "base": 10, "abacus_offset": None}
"""The preset fields that change the samples or what the model sees of them (not the model's size or the
budget), with the values runs recorded before each field existed had."""


def task_fields(preset) -> Dict[str, Any]:
    """The :data:`TASK_DEFAULTS` fields of ``preset``: what a run's samples look like."""
    return {k: getattr(preset, k) for k in TASK_DEFAULTS}


def sample_fields(preset) -> Dict[str, Any]:
    """The task fields that decide the samples themselves (``operand_order``, ``base``): what the data
    functions take. ``abacus_offset`` changes only what the model sees of them, in training."""
    return {k: getattr(preset, k) for k in ("operand_order", "base")}


def task_suffixes(task: Dict[str, Any]) -> List[str]:
    """Name parts of the task fields away from their defaults (a field ``task`` lacks is at its
    default): ``["lsd", "base2", "abacus8"]`` and the like."""
    task = {**TASK_DEFAULTS, **task}
    out = []
    if task["operand_order"] != TASK_DEFAULTS["operand_order"]:
        out.append(task["operand_order"])
    if task["base"] != TASK_DEFAULTS["base"]:
        out.append(f"base{task['base']}")
    if task["abacus_offset"] is not None:
        out.append(f"abacus{task['abacus_offset']}")
    return out


def runs_folder(preset_name: str, task: Dict[str, Any]) -> Path:
    """The default folder of a preset's runs: ``runs/addition/<preset>``, with ``-lsd``, ``-base2`` and
    the like appended for the task fields away from their defaults, so that runs of different tasks
    never share a folder. A run of one model and seed goes to ``<folder>/<model>/seed<seed>``."""
    return Path("runs/addition") / "-".join([preset_name, *task_suffixes(task)])


def held_task(results: Dict[str, Any]) -> Dict[str, Any]:
    """The :data:`TASK_DEFAULTS` fields a run's ``results.json`` records (defaults where it predates one)."""
    return {k: results.get(k, v) for k, v in TASK_DEFAULTS.items()}


def check_same_task(held: Dict[str, Any], wanted: Dict[str, Any], where: Path, advice: str) -> None:
    """A ``ValueError`` naming the option of the first task field where the run in ``where`` (``held``)
    differs from the one asked for (``wanted``): ``--operand-order: run holds a run with operand_order 'msd',
    not 'lsd'; resume it with --operand-order msd, or ...`` (``advice``: how to start afresh instead)."""
    for k in TASK_DEFAULTS:
        if held[k] != wanted[k]:
            raise ValueError(_refusal(PRESET_OPTIONS[k], where, f"with {k} {held[k]!r}", repr(wanted[k]),
                                      _restate(PRESET_OPTIONS[k], held[k]), advice))


PRESET_OPTIONS: Dict[str, str] = {k: "--" + k.replace("_", "-") for k in (
    "steps", "batch_size", "lr", "hidden_size", "num_hidden_layers", "num_heads", "matmul_precision", "eval_every",
    "val_per_width", "ood_per_width", "train_widths", "ood_widths", "curriculum_steps", "operand_order", "base",
    "abacus_offset")}
"""The preset fields an option of ``falcon-fwa addition`` (and ``addition-compare``) sets, by the option's name
(``cpu_threads`` is ``--threads``); the others (``warmup``, ``weight_decay``, ``model``...) come from ``--preset``
alone."""
PRESET_OPTIONS["cpu_threads"] = "--threads"

RUN_OPTIONS: Dict[str, str] = {"seed": "--seed", "eval_seed": "--eval-seed", "dtype": "--dtype",
                               "config_fields": "--model"}
"""The options of ``falcon-fwa addition`` behind the run settings outside the preset."""

def _restate(option: str, value: Any) -> str:
    """``option`` given ``value`` as typed on the command line: ``--train-widths 1 5``, ``--lr 0.003``; an
    option whose value ``None`` is its absence, ``without --abacus-offset``."""
    if value is None:
        return f"without {option}"
    if isinstance(value, (list, tuple)):
        return f"with {option} {' '.join(map(str, value))}"
    return f"with {option} {value}"


def _refusal(option: str, where: Path, held: str, wanted: str, restate: Optional[str], advice: str) -> str:
    """A refused resume: the option to change, what the run in ``where`` holds and what was asked for, how
    to resume it (``restate``: the option with the run's value, or ``None`` where no option gives it) and
    ``advice``: how to start afresh instead."""
    fix = f"resume it {restate}, or " if restate else ""
    return f"{option}: {where} holds a run {held}, not {wanted}; {fix}{advice}"


def _preset_note(held: Dict[str, Any], wanted: Dict[str, Any]) -> str:
    """Where the run in a folder was trained under another ``--preset`` than the one asked for: a note
    saying so (its settings may differ through the preset, not an option given), else ``""``."""
    h, w = held.get("preset_name"), wanted.get("preset_name")
    return f" (the run's --preset is {h}, this command's {w})" if h is not None and w is not None and h != w else ""


RESUMABLE_FIELDS = ("steps", "eval_every", "cpu_threads", "matmul_precision")
"""Preset fields a run may be continued under with another value (a longer budget, another evaluation
interval, thread count or matmul precision); the other fields decide what the steps so far trained on and
what the evaluations measured."""

INIT_FIELDS = ("model", "fan_in_init")
"""Preset fields compared through the model config they give (:func:`.presets.preset_size`), not one by one: runs
from before ``fan_in_init`` existed held the same fan-in scale in ``model`` as ``initializer_range``."""


def check_same_setup(held: Dict[str, Any], wanted: Dict[str, Any], where: Path, advice: str, *,
                     options: Optional[Dict[str, str]] = None) -> None:
    """A ``ValueError`` naming the first setting where the run in ``where`` (its results dict ``held``)
    differs from the one asked for (``wanted``: ``config_fields``, ``eval_seed``, ``preset`` and, where
    given, the training ``seed`` and ``dtype``, the ``model`` name and the ``preset_name``): the model's config
    fields, the evaluation seed, the training seed, the dtype, a preset field outside :data:`RESUMABLE_FIELDS`
    (fields the run predates are not compared; ``model`` and ``fan_in_init`` through the model config they give,
    :func:`.presets.preset_size`), or a budget shorter than the steps the run has done.

    The error names the setting by the option that sets it, as typed (``--lr``, ``--batch-size``; ``--model`` or
    ``--rule`` and the like for the config fields; ``--preset`` for a field no option sets), with the run's value
    and the one asked for, how to resume the run (the option with the run's value; the run's ``--preset`` where it
    was trained under another) and ``advice``: how to start afresh instead. ``options`` renames the options of
    :data:`RUN_OPTIONS` for another command (``addition-compare``'s ``--seeds``); a setting so named is not
    restated (that option names several runs)."""
    held_preset = held.get("preset") or {}
    wanted_preset = json.loads(json.dumps(wanted["preset"]))  # tuples as lists, as results.json holds them
    fields = json.loads(json.dumps(wanted["config_fields"]))
    named = {**RUN_OPTIONS, **(options or {})}
    note = _preset_note(held, wanted)
    held_name = held.get("preset_name")
    by_preset = f"with --preset {held_name}" if note else None

    def restate(k: str, value: Any) -> Optional[str]:
        if options and k in options:
            return None
        return _restate(named[k], value)

    # a paper name's run recorded with options that restated its definition (as earlier versions kept them)
    held_fields = held.get("config_fields")
    if held_fields is not None and held.get("model") in LINEUP:
        held_fields = paper_fields(held["model"], held_fields)
    if wanted.get("model") in LINEUP:
        fields = paper_fields(wanted["model"], fields)
    if held_fields is not None and held_fields != fields:
        h, w = held_fields, fields
        option, fix = named["config_fields"], None
        same_name = "model" in held and held["model"] == wanted.get("model")
        if not (options and "config_fields" in options) and "model" in held:
            if held["model"] not in LINEUP:  # a mixer name: its fast-weight fields are the options given
                if same_name:
                    option = next((FAST_WEIGHT_OPTIONS[f] for f in FAST_WEIGHT_OPTIONS if h.get(f) != w.get(f)), option)
                fix = f"with --model {held['model']}" + "".join(
                    f" {o} {h[f]}" for f, o in FAST_WEIGHT_OPTIONS.items() if f in h)
            elif not same_name:  # a paper name is its fields (one defined anew since: no option gives them back)
                fix = f"with --model {held['model']}"
        held_model = f"{held['model']} " if "model" in held else ""
        wanted_model = f"{wanted['model']} " if "model" in wanted else ""
        raise ValueError(_refusal(option, where, f"of {held_model}{h!r}", f"{wanted_model}{w!r}", fix, advice))
    for k in ("eval_seed", "seed", "dtype"):  # the evaluation set, the training draws, the arithmetic
        if k in held and k in wanted and held[k] != wanted[k]:
            raise ValueError(_refusal(named[k], where, f"with {k} {held[k]!r}", repr(wanted[k]),
                                      restate(k, held[k]), advice))
    for k, v in wanted_preset.items():
        if k in held_preset and k not in RESUMABLE_FIELDS + INIT_FIELDS and held_preset[k] != v:
            if k in PRESET_OPTIONS:
                fix = _restate(PRESET_OPTIONS[k], held_preset[k]) + (f" and --preset {held_name}" if note else "")
                raise ValueError(_refusal(PRESET_OPTIONS[k], where, f"with {k} {held_preset[k]!r}", f"{v!r}{note}",
                                          fix, advice))
            raise ValueError(_refusal("--preset", where, f"with {k} {held_preset[k]!r}",
                                      f"{v!r} ({k} is set by the preset alone, no option changes it){note}",
                                      by_preset, advice))
    if "model" in held_preset and preset_size(held_preset) != preset_size(wanted_preset):
        raise ValueError(_refusal("--preset", where, f"of model {preset_size(held_preset)!r}",
                                  f"{preset_size(wanted_preset)!r} (the preset's model config: its initialization "
                                  f"and extra fields, which no option changes){note}", by_preset, advice))
    if held.get("steps_done", 0) > wanted_preset["steps"]:
        done = held["steps_done"]
        raise ValueError(f"--steps: {where} holds a run of {done} steps, more than {wanted_preset['steps']}; resume "
                         f"it with --steps {done} or more, or {advice}")


RESUME_ADVICE = "give another --out, or --no-resume to start over there"


def _resume(out_dir: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, results: Dict[str, Any],
            device: torch.device) -> Optional[Dict[str, Any]]:
    """Load ``out_dir``'s checkpoint into ``model`` / ``optimizer`` and its history, best step and
    wall time into ``results``; returns the checkpoint's training state (``step``, ``wall_time_s``,
    ``loss_sum`` and ``loss_n`` of the steps since the last evaluation, ``run_id``), or ``None``
    when there is nothing to resume.

    The checkpoint is the record: ``results.json`` is rewritten from it at once (a run killed after
    writing its checkpoint but before ``results.json`` loses no evaluation), and so is ``best.pt`` when
    the checkpoint's step is the best one and ``best.pt`` does not hold it (killed before that write).
    A checkpoint from before the results were kept in it is resumed with ``results.json`` where both
    are at the same step, and refused where they are not."""
    if not (out_dir / "checkpoint.pt").exists():
        return None
    ckpt = torch.load(out_dir / "checkpoint.pt", map_location=device, weights_only=False)
    held = ckpt.get("results")
    if held is None:  # written before the checkpoint kept the results: they are in results.json
        if not (out_dir / "results.json").exists():
            return None
        held = read_json(out_dir / "results.json")
        if held.get("steps_done") != ckpt["step"]:
            raise ValueError(f"{out_dir}: checkpoint.pt is at step {ckpt['step']} but results.json at step "
                             f"{held.get('steps_done')} (a run of an earlier version killed between the two "
                             "writes); give --no-resume to start over there, or another --out")
    check_same_task(held_task(held), held_task(results), out_dir, RESUME_ADVICE)
    check_same_setup(held, results, out_dir, RESUME_ADVICE)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    state = {"step": ckpt["step"], "wall_time_s": held.get("wall_time_s", 0.0), "loss_sum": ckpt.get("loss_sum", 0.0),
             "loss_n": ckpt.get("loss_n", 0), "run_id": ckpt.get("run_id")}
    # the wall time too: a finished run launched again writes results.json without training
    # finished only with an evaluation at its last step: a run stopped between evaluations and relaunched with
    # --steps at the step reached is evaluated there first
    evaluated = bool(held["history"]) and held["history"][-1]["step"] == ckpt["step"]
    results.update(history=held["history"], best=held["best"], steps_done=ckpt["step"],
                   finished=ckpt["step"] == results["preset"]["steps"] and evaluated,
                   wall_time_s=state["wall_time_s"])
    best = results["best"]
    if best is not None and best["step"] == ckpt["step"] and not _holds(out_dir / "best.pt", best["step"],
                                                                       state["run_id"]):
        _save_best(out_dir, model, results, state["run_id"])
    write_json(out_dir / "results.json", results)
    return state


def _holds(best_file: Path, step: int, run_id: Optional[str]) -> bool:
    """Does ``best_file`` hold the weights of step ``step`` of the run ``run_id``?"""
    if not best_file.exists():
        return False
    held = torch.load(best_file, map_location="cpu", weights_only=False)
    return held.get("step") == step and held.get("run_id") == run_id


def _save_best(out_dir: Path, model: torch.nn.Module, results: Dict[str, Any], run_id: Optional[str]) -> None:
    save_torch(out_dir / "best.pt", {"model": model.state_dict(), "step": results["best"]["step"],
                                     "config_fields": results["config_fields"], "size": results["size"],
                                     "run_id": run_id})


def _save(results: Dict[str, Any], model: torch.nn.Module, optimizer: torch.optim.Optimizer, out_dir: Path,
          run_id: Optional[str], *, loss_sum: float = 0.0, loss_n: int = 0, new_best: bool = False) -> None:
    """Write, atomically and in this order: ``checkpoint.pt`` (model, optimizer, step, the train loss
    summed since the last evaluation and the whole ``results``: the record), ``best.pt`` when
    ``new_best``, and ``results.json``. A kill between two writes leaves a checkpoint that
    :func:`_resume` puts the others right from."""
    save_torch(out_dir / "checkpoint.pt", {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                           "step": results["steps_done"],
                                           "results": json.loads(json.dumps(results)),  # as results.json holds it
                                           "loss_sum": loss_sum, "loss_n": loss_n, "run_id": run_id})
    if new_best:
        _save_best(out_dir, model, results, run_id)
    write_json(out_dir / "results.json", results)


def _record(entry: Dict[str, Any], results: Dict[str, Any], model: torch.nn.Module,
            optimizer: torch.optim.Optimizer, spec: RunSpec, out_dir: Path, wall_time_s: float,
            run_id: Optional[str] = None) -> None:
    """Append an evaluation to the history, make it the best step if it is, and write the run's
    files (:func:`_save`)."""
    done = entry["step"]
    results["history"].append({k: v for k, v in entry.items() if k != "per_position"})
    new_best = _better(entry, results["best"])
    if new_best:
        results["best"] = entry
    results.update(steps_done=done, finished=done == spec.preset.steps, wall_time_s=wall_time_s)
    _save(results, model, optimizer, out_dir, run_id, new_best=new_best)


def _train(spec: RunSpec, out_dir: Path, *, progress: bool, resume: bool, log: Callable[[str], None],
           signals: StopSignals) -> Dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    p = spec.preset
    device = torch.device(spec.device)
    autocast = _autocast(device, spec.dtype)

    torch.manual_seed(spec.seed)
    model = build_model(spec.fields, p.size(), vocab_size=len(VOCAB))
    if p.abacus_offset is not None:
        model = DigitPositions(model, p.num_digit_indices())
    model = model.to(device)
    optimizer = make_optimizer(model, p)
    val_widths = range(p.train_widths[0], p.train_widths[1] + 1)
    ood_widths = range(p.ood_widths[0], p.ood_widths[1] + 1)
    samples = sample_fields(p)
    batches = eval_batches(spec.eval_seed, val_widths, p.val_per_width, spec.eval_batch, **samples)
    batches.update(eval_batches(spec.eval_seed, ood_widths, p.ood_per_width, spec.eval_batch, **samples))

    results = _new_results(spec, device, sum(t.numel() for t in model.parameters()))
    state = _resume(out_dir, model, optimizer, results, device) if resume else None
    # a fresh run gets its own id, kept by its checkpoints and best.pt: a best.pt left by another run
    # in the folder (--no-resume) is never taken for this run's
    state = state or {"step": 0, "wall_time_s": 0.0, "loss_sum": 0.0, "loss_n": 0, "run_id": uuid.uuid4().hex}
    start, elapsed_before, run_id = state["step"], state["wall_time_s"], state["run_id"]
    if start:
        log(f"resuming {spec.model} seed {spec.seed} at step {start}")

    t0 = time.perf_counter()
    model.train()
    loss_sum, loss_n = state["loss_sum"], state["loss_n"]  # the train loss since the last evaluation
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=p.steps, initial=start, desc=f"{spec.model} s{spec.seed}", dynamic_ncols=True)
    done = start

    def evaluate_at(lr: float) -> None:
        nonlocal loss_sum, loss_n
        tally, losses = evaluate(model, batches, device, autocast)
        # val_loss (a tie-breaker of the best step) sees the training widths only
        entry = {"step": done, "lr": lr, "train_loss": loss_sum / max(loss_n, 1),
                 "val_loss": mean_loss(losses, val_widths), "ood_loss": mean_loss(losses, ood_widths),
                 **_summary(tally, val_widths, ood_widths)}
        loss_sum, loss_n = 0.0, 0
        _record(entry, results, model, optimizer, spec, out_dir, elapsed_before + time.perf_counter() - t0, run_id)
        msg = (f"step {done}: loss {entry['train_loss']:.3f} val {entry['val_acc']:.1f}% "
               f"(digits {entry['val_digit_acc']:.1f}%) ood {entry['mean_acc_ood']:.1f}% "
               f"(digits {entry['digit_mean_acc_ood']:.1f}%)")
        if bar is not None:
            bar.set_postfix_str(f"val {entry['val_acc']:.1f}% ood {entry['mean_acc_ood']:.1f}%")
            bar.write(msg)
        else:
            log(msg)

    for step in range(start, p.steps):
        if signals.received:  # stop before the next step; the one in progress is done
            break
        lr = lr_at(step, p)
        schedule.set_lr(optimizer, lr)
        batch = training_batch(spec.seed, step, p.batch_size, p.train_widths[0], p.max_train_width(step),
                               **samples, abacus_offset=p.abacus_offset).to(device)
        loss = train_step(model, optimizer, batch, p.grad_clip, autocast,
                          label=f"step {step + 1} ({spec.model}, seed {spec.seed})")
        loss_sum += loss.item()
        loss_n += 1
        done = step + 1
        if bar is not None:
            bar.update(1)
        if done % p.eval_every == 0 or done == p.steps:
            evaluate_at(lr)
    if done == p.steps and not results["finished"]:
        # resumed at its last step without an evaluation there (stopped between two, its --steps cut to the
        # step reached): evaluated now, with the rate its last step ran at
        group = optimizer.param_groups[0]
        evaluate_at(group["lr"] / group.get("lr_multiplier", 1.0))
    if bar is not None:
        bar.close()
    if done < p.steps:  # a signal stopped the run: a checkpoint at the step reached (its files name the signal)
        results["signal"] = signal.Signals(signals.received).name
        if done > start:
            results.update(steps_done=done, finished=False, wall_time_s=elapsed_before + time.perf_counter() - t0)
            _save(results, model, optimizer, out_dir, run_id, loss_sum=loss_sum, loss_n=loss_n)
        return results
    if results["steps_done"] < p.steps or not results["history"]:
        raise RuntimeError("training ended without an evaluation")
    results["finished"] = True
    write_json(out_dir / "results.json", results)
    return results
