"""The training loop: data -> forward (bf16 autocast) -> loss -> accumulate -> clip -> AdamW.

Every optimizer step ``s`` consumes micro-steps ``[s*A, (s+1)*A)`` of the deterministic
batch stream (``A`` = accumulation steps), so a checkpoint's step fixes the data position,
and the learning rate is a pure function of ``s``: resuming from a checkpoint reproduces
the uninterrupted run exactly.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import signal
import time
from contextlib import ExitStack, nullcontext
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..atomic import folder_lock, fsync_folder, read_json, remove_temporaries, replaceable, sync_tree, write_json
from ..data import BatchStream, PackedRows, open_split, prepare_dataset
from ..data.sources import same_setting
from ..models.modeling import output_object
from ..provenance import command_provenance, uncommitted_changes
from . import distributed as D
from .checkpoint import is_complete, latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .config import RunConfig, resolved_model, trains_in_bf16
from .launch import LOCK_NAME, StopSignals
from .logger import MetricLogger, read_log
from .model_factory import build_model, enable_activation_checkpointing, param_groups
from .schedule import lr_at, set_lr

_clock = time.perf_counter  # every time the loop measures comes from here

# model fields that change how a model computes, not what it is: a run may resume under other values
COMPUTE_FIELDS = ("form", "chunk_size", "segments", "backend")


def check_export_folder(folder: str) -> None:
    """``ValueError`` unless ``folder`` is absent or an earlier export (a ``config.json`` of this
    library's model type): an export replaces it whole, and must not delete a folder of something else."""
    if replaceable(folder, "config.json", "model_type", "falcon_fwa"):
        return
    raise ValueError(f"{folder!r} exists and is no exported model of this library: it is not replaced; choose "
                     "another train.out_dir, or remove it")


# the data fields that decide which token rows the training samples are, in which order
# (not data.packing: the same rows, only split at the documents' ends or not)
_SAMPLE_FIELDS = ("train_source", "val_source", "tokenizer", "text_split", "text_field", "val_every",
                  "max_documents", "bpe_documents", "seq_len")


def _same_samples(key: str, was, now, saved_data: dict, data) -> bool:
    """Whether the data field ``key`` at ``was`` (the checkpoint's) and ``now`` gives the same training rows.
    Without a ``val_source`` every ``val_every``-th training document is held out; with one none is: which
    validation file it is, or ``val_every`` beside it, changes no training row."""
    if key == "val_source":
        return (was is None) == (now is None)
    if key == "val_every" and saved_data.get("val_source") is not None and data.val_source is not None:
        return True
    # a local path in another spelling (./corpus.jsonl, corpus.jsonl, its absolute path) names the same file
    return same_setting(key, was, now)


# config fields that do not define the model's weights or what they compute
_NOT_MODEL_FIELDS = frozenset(COMPUTE_FIELDS) | {"use_cache", "pad_token_id", "bos_token_id", "eos_token_id"}


def _model_fields(section: dict) -> dict:
    """A recipe's model section as the fields that define the model: the preset's config with the
    overrides applied, without :data:`_NOT_MODEL_FIELDS` (:func:`~falcon_fwa.train.config.resolved_model`; so
    ``rule: 3a`` and ``3A``, or an override equal to the preset's value, are the same model). A section that
    does not resolve (a preset this version does not have) is compared as written: the preset and each
    override (``overrides.NAME``)."""
    return resolved_model(section, _NOT_MODEL_FIELDS)


def resume_differences(saved: dict, cfg: RunConfig) -> list:
    """The settings of the recipe ``saved`` (a checkpoint's ``config``) that a resume under ``cfg`` cannot take,
    as ``"FIELD WAS there, NOW here"``: those that decide which samples the data position counts
    (``train.seed``, :data:`_SAMPLE_FIELDS`), then the model's fields (:func:`_model_fields`). The data fields are
    compared as recorded: ``to_dict`` writes every field, its default included, so one set to its default and
    one left out are alike (a checkpoint older than a field is not asked about it); ``data.tokenizer`` is
    recorded in one spelling, and the sources and tokenizer are compared as the paths they name
    (:func:`~falcon_fwa.data.sources.same_setting`: ``corpus.jsonl`` and ``./corpus.jsonl`` are one). The
    optim section is not compared: a resume trains with the recipe's."""
    differ = []
    for section, key in (("train", "seed"), *(("data", k) for k in _SAMPLE_FIELDS)):
        if key not in saved[section]:  # a checkpoint older than the field
            continue
        was, now = saved[section][key], getattr(getattr(cfg, section), key)
        if not _same_samples(key, was, now, saved["data"], cfg.data):
            differ.append(f"{section}.{key} {was!r} there, {now!r} here")
    was, now = _model_fields(saved["model"]), _model_fields(cfg.to_dict()["model"])
    differ += [f"model.{k} {was.get(k)!r} there, {now.get(k)!r} here"
               for k in sorted(set(was) | set(now)) if was.get(k) != now.get(k)]
    return differ


def refusal_message(where: str, differ: list, *, out_dir: Optional[str] = None) -> str:
    """Why ``where`` (a checkpoint, or the run folder that holds it) is not resumed: the first few of the
    settings ``differ`` and the ways out: ``out_dir``'s, where the run was found there by ``train.resume=auto``."""
    shown = "; ".join(differ[:5]) + (f"; and {len(differ) - 5} more" if len(differ) > 5 else "")
    if out_dir is not None:
        ways = (f"train into another train.out_dir, give the recipe that run's settings to resume it, or set "
                f"train.resume=none to start afresh in {out_dir!r} over that run's checkpoints and log")
    else:
        ways = "give the recipe that run's settings, another train.resume, or train.resume=none to start afresh"
    return (f"{where} holds a run of other settings than this recipe's ({shown}): its weights and data position "
            f"fit only its own, so it is not resumed and nothing is written; {ways}")


class ResumeRefused(ValueError):
    """``train.resume`` finds a checkpoint this recipe cannot resume (another run's: other data or another
    model), or names no checkpoint. The main process decides and tells the others of a launch, so that every
    process refuses alike, before anything is written; a launcher reports it once (``train.cli``)."""


class NonFiniteLoss(RuntimeError):
    """Raised when a step's loss or gradient norm is NaN or Inf."""


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def causal_lm_loss(model, batch: dict, device: torch.device, autocast) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch``: float32 (lower-precision logits are widened to it), float64 for
    a float64 model."""
    kwargs = {"input_ids": batch["input_ids"].to(device, non_blocking=True), "use_cache": False}
    if "cu_seqlens" in batch:
        kwargs["cu_seqlens"] = batch["cu_seqlens"].to(device, non_blocking=True)
    kwargs.update(output_object(model))  # .logits whatever the config's return_dict (DDP, compile looked through)
    with autocast():
        logits = model(**kwargs).logits
    targets = batch["targets"].to(device, non_blocking=True)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Trainer:
    """Train the recipe ``cfg``. ``model_fn(vocab_size, eos_token_id) -> nn.Module`` replaces
    the preset model (any module whose ``forward(input_ids, use_cache=False, cu_seqlens=...)``
    returns ``.logits``)."""

    def __init__(self, cfg: RunConfig, *, model_fn: Optional[Callable] = None):
        self.cfg = cfg
        t = cfg.train
        if cfg.log.wandb_project:  # found before the data is tokenized, not as the logger opens
            try:
                import wandb  # noqa: F401
            except ImportError:
                raise ValueError(f"log.wandb_project={cfg.log.wandb_project!r} needs the wandb package, which is "
                                 "not installed: pip install wandb, or leave log.wandb_project unset") from None
        self.info = D.setup(t.strategy)
        self.out_dir = t.out_dir
        self.ckpt_dir = os.path.join(t.out_dir, "checkpoints")
        self._resume_path = self._resume_target()  # refused before anything is written
        # the commit of the code that trains and whether its checkout has uncommitted changes to tracked files
        # (None: unknown), as every command records them, and the fingerprint of those changes, by which compare
        # and scaling keep a run only for the same code: taken as the launch starts (once it is not refused), from
        # the code it imported, so that edits made while it trains are not put down to it (and before any stop
        # handler is in place: no git process of the run's own is left running when a stop signal comes)
        self._source = dict(command_provenance(argparse.Namespace()), diff_sha256=uncommitted_changes())
        per_step = t.micro_batch * self.info.world_size
        if t.global_batch % per_step:
            raise ValueError(f"config field train.global_batch = {t.global_batch} is not a multiple of "
                             f"train.micro_batch x processes = {t.micro_batch} x {self.info.world_size}")
        self.accum = t.global_batch // per_step
        if t.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)

        # data: tokenized once (by the main rank), then memory-mapped everywhere
        d = cfg.data
        self.data_dir = d.out_dir or os.path.join(t.out_dir, "data")
        if self.info.is_main:
            prepare_dataset(d.spec(), self.data_dir)
        D.barrier(self.info)
        train_split, self.val_split = open_split(self.data_dir, "train"), open_split(self.data_dir, "val")
        self.train_rows = PackedRows(train_split, d.seq_len)
        if t.eval_every:  # found now rather than at the first evaluation, after eval_every steps of training
            val_rows = len(PackedRows(self.val_split, d.seq_len))
            if val_rows < t.global_batch:
                raise ValueError(f"the validation split has {val_rows} rows of data.seq_len={d.seq_len}: fewer than "
                                 f"train.global_batch={t.global_batch}, the rows one evaluation needs")
        if t.export_model:
            check_export_folder(os.path.join(t.out_dir, "model"))

        # model (identical initialisation on every rank), wrapping, optimizer
        seed_everything(t.seed)
        make = model_fn or (lambda v, e: build_model(cfg.model, vocab_size=v, eos_token_id=e))
        model = make(train_split.vocab_size, train_split.eos_token_id).to(self.info.device)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.core = model
        if t.activation_checkpointing:
            enable_activation_checkpointing(model)
        if t.compile:
            model.compile()
        self.model = D.wrap(model, self.info)
        groups = param_groups(self.core, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        # fused AdamW on plain CUDA tensors; FSDP2's sharded DTensor parameters take the foreach path
        fused = {"fused": True} if self.info.device.type == "cuda" and self.info.strategy != "fsdp2" else {}
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                           eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay, **fused)
        self.step = 0
        self.position = 0
        self.last_checkpoint: Optional[str] = None
        self.use_bf16 = trains_in_bf16(t)  # (any spelling; also a config never validated)
        # one launch at a time in a run folder: two would delete each other's checkpoints in progress
        self._lock = ExitStack()
        if self.info.is_main:
            try:
                self._lock.enter_context(folder_lock(t.out_dir, LOCK_NAME, wait=False))
            except BlockingIOError:
                raise ValueError(f"train.out_dir={t.out_dir!r} is in use by another training launch (it holds "
                                 f"{os.path.join(t.out_dir, LOCK_NAME)}); wait for it to end, or train "
                                 "into another folder") from None
            # left by a launch killed writing them
            remove_temporaries(t.out_dir, "log.jsonl", "summary.json", "loss.png")
        self.logger = MetricLogger(t.out_dir, enabled=self.info.is_main, tensorboard=cfg.log.tensorboard,
                                   wandb_project=cfg.log.wandb_project, config=cfg.to_dict())
        try:
            self._maybe_resume()
        except BaseException:
            self.close()
            raise

    # ----------------------------------------------------------------------------- state
    def autocast(self):
        if not self.use_bf16:
            return nullcontext()
        return torch.autocast(device_type=self.info.device.type, dtype=torch.bfloat16)

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=opts)
        return {"model": model_sd, "optimizer": optim_sd, "scheduler": {"step": self.step},
                "data": {"position": self.position, "seed": self.cfg.train.seed, "world_size": self.info.world_size,
                         "micro_batch": self.cfg.train.micro_batch},
                "rng": rng_state(), "step": self.step, "config": self.cfg.to_dict()}

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        # the data position counts samples of one order: the same documents, tokens, rows and shuffle; the
        # weights are of one model
        differ = resume_differences(state["config"], self.cfg)
        if differ:
            raise ResumeRefused(refusal_message("the checkpoint", differ))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=StateDictOptions(full_state_dict=True))
        # The optimizer state dict brings the saved run's hyperparameters back into the param groups;
        # the recipe's optim section is what this run trains with (the lr is set at every step).
        o = self.cfg.optim
        for group, fresh in zip(self.optimizer.param_groups,
                                param_groups(self.core, lr=o.lr, weight_decay=o.weight_decay)):
            group.update(weight_decay=fresh.get("weight_decay", o.weight_decay), betas=tuple(o.betas), eps=o.eps,
                         lr_multiplier=fresh["lr_multiplier"])
        self.step = int(state["step"])
        data = state["data"]
        # The position counts micro-steps of micro_batch x processes samples: convert the samples
        # consumed so far to this run's micro-steps (the process count or micro_batch may differ).
        saved_micro = int(data.get("micro_batch", state["config"]["train"]["micro_batch"]))
        consumed = int(data["position"]) * saved_micro * int(data["world_size"])
        per_micro_step = self.cfg.train.micro_batch * self.info.world_size
        if consumed % per_micro_step:
            raise ValueError(f"the checkpoint consumed {consumed} samples, not a multiple of train.micro_batch x "
                             f"processes = {per_micro_step}")
        self.position = consumed // per_micro_step
        set_rng_state(state["rng"])

    def _resume_target(self) -> Optional[str]:
        """The checkpoint this launch resumes from (``None``: it starts at step 0), as the main process finds
        it; ``ResumeRefused`` on every process where it names no checkpoint, or one of another run."""
        resume = self.cfg.train.resume
        if resume == "none":
            return None
        path = message = None
        if self.info.is_main or self.info.world_size == 1:
            path = latest_checkpoint(self.ckpt_dir) if resume == "auto" else resume
            message = self._refusal(path, found=resume == "auto")
        path, message = D.broadcast_object((path, message), self.info)
        if message is not None:
            raise ResumeRefused(message)
        return path

    def _refusal(self, path: Optional[str], *, found: bool) -> Optional[str]:
        """Why the checkpoint ``path`` cannot be resumed (``found``: by ``train.resume=auto`` in the run
        folder), else ``None``. Only the checkpoint's recipe is read (its tensors are mapped, not loaded)."""
        if path is None:
            return None
        no_checkpoint = (f"train.resume={path!r} is no complete checkpoint (a checkpoints/step-* folder of a run); "
                         "'auto' resumes this run's latest, 'none' starts afresh")
        if not found and not is_complete(path):
            return no_checkpoint
        try:
            saved = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False,
                               mmap=True)["config"]
        except (OSError, RuntimeError, KeyError, TypeError):  # (a checkpoint unreadable here is named as it loads)
            return None
        differ = resume_differences(saved, self.cfg)
        if not differ:
            return None
        if found:
            return refusal_message(f"train.out_dir={self.out_dir!r}", differ, out_dir=self.out_dir)
        return refusal_message(f"train.resume={path!r}", differ)

    def _maybe_resume(self) -> None:
        path = self._resume_path
        if path is not None:
            try:
                state = load_checkpoint(path)
            except FileNotFoundError:
                raise ResumeRefused(f"train.resume={path!r} is no complete checkpoint (a checkpoints/step-* folder "
                                    "of a run); 'auto' resumes this run's latest, 'none' starts afresh") from None
            self.load_state_dict(state)
            self.last_checkpoint = path
        # steps after the starting point (the checkpoint, or step 0 when there is none: a run that
        # died before its first save, or a fresh run in an old run's folder) are trained and logged again;
        # a record of the starting step that the log.every cadence would not have written (the one a
        # launch stopped there by a signal or --stop-at writes) goes too, as the uninterrupted run has none
        self.logger.drop_after(self.step, off_cadence=not self._logs_step(self.step))
        if path is not None and self.info.is_main:
            print(f"resumed from {path} at step {self.step}")
            if self.step == self.cfg.train.steps:
                print(f"the run is finished: its checkpoint is at train.steps = {self.step}; nothing to train "
                      "(a longer train.steps continues the run; train.resume=none starts afresh)")
            elif self.step > self.cfg.train.steps:
                print(f"the checkpoint is at step {self.step}, train.steps is {self.cfg.train.steps}: nothing to "
                      "train (a longer train.steps continues the run; train.resume=none starts afresh)")

    def _logs_step(self, step: int) -> bool:
        """Whether an uninterrupted run writes a training record at ``step``: every ``log.every``
        steps and at ``train.steps``."""
        return step % self.cfg.log.every == 0 or step == self.cfg.train.steps

    def save(self) -> str:
        state = self.state_dict()  # collective under FSDP2
        path = None
        if self.info.is_main:
            path = save_checkpoint(self.ckpt_dir, self.step, state, keep=self.cfg.train.keep_checkpoints)
        D.barrier(self.info)
        self.last_checkpoint = path or os.path.join(self.ckpt_dir, f"step-{self.step:08d}")
        return self.last_checkpoint

    # ----------------------------------------------------------------------------- loop
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Validation loss over the first ``eval_batches x global_batch`` validation rows (fewer if the
        split is shorter), in micro-batches shared among the processes: the same rows and the same
        micro-batches whatever the number of processes."""
        t = self.cfg.train
        rows = PackedRows(self.val_split, self.cfg.data.seq_len)
        n_global = min(t.eval_batches, len(rows) // t.global_batch)
        if n_global == 0:
            raise ValueError(f"the validation split has {len(rows)} rows of data.seq_len={self.cfg.data.seq_len}: "
                             f"fewer than train.global_batch={t.global_batch}")
        n_batches = n_global * self.accum  # micro-batches per process
        stream = BatchStream(rows, micro_batch=t.micro_batch, packing=self.cfg.data.packing, seed=0,
                             rank=self.info.rank, world_size=self.info.world_size, shuffle=False)
        self.model.eval()
        total = torch.zeros((), device=self.info.device, dtype=torch.float64)
        for _ in range(n_batches):
            total += causal_lm_loss(self.model, next(stream), self.info.device, self.autocast).double()
        self.model.train()
        loss = D.all_reduce_mean(total / n_batches, self.info).item()
        return {"val_loss": loss, "val_ppl": math.exp(min(loss, 50.0))}

    def _check_finite(self, loss: float, grad_norm: float) -> None:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            return
        where = self.last_checkpoint or "none saved yet"
        msg = (f"non-finite training loss {loss} (gradient norm {grad_norm}) at step {self.step + 1}; "
               f"stopping without saving. Last good checkpoint: {where}. Lower optim.lr, raise "
               f"optim.warmup_steps or check the data, then resume.")
        self.logger.log(self.step + 1, event="non_finite", loss=loss, grad_norm=grad_norm)
        raise NonFiniteLoss(msg)

    def _tokens_seen(self) -> int:
        """Input tokens trained on so far: the samples the data position has consumed (``micro_batch`` x
        processes per micro-step, so a resume with another ``global_batch`` counts each step at its own
        batch) times ``seq_len``."""
        return self.position * self.cfg.train.micro_batch * self.info.world_size * self.cfg.data.seq_len

    def train(self, *, stop_at: Optional[int] = None, should_stop: Optional[Callable[[int], bool]] = None,
              stop_on_signal: bool = False) -> dict:
        """Run to ``train.steps`` (or stop after step ``stop_at`` with a checkpoint); returns a summary.
        A ``stop_at`` before the step the run resumed at is refused (``ValueError``); one at it trains nothing.
        ``should_stop(step)`` is asked after every step (give every process the same answer); once it
        answers true, the run ends at that step as if it were ``stop_at``. With ``stop_on_signal``,
        a SIGTERM, SIGINT or SIGHUP (e.g. a preemption, Ctrl-C, the launching command's end) that
        reaches any process ends the run the same way at the end of the step in progress, with a
        checkpoint; the summary of a run so stopped before ``train.steps`` names the signal
        (``"signal": "SIGTERM"``). A second SIGTERM or SIGINT interrupts at once (``launch.StopSignals``)."""
        with StopSignals(stop_on_signal) as signals:
            return self._train(stop_at, should_stop, signals)

    def _train(self, stop_at: Optional[int], should_stop: Optional[Callable[[int], bool]], signals) -> dict:
        cfg, t, o, info = self.cfg, self.cfg.train, self.cfg.optim, self.info
        if stop_at is not None and stop_at < self.step:  # the run is past it: no step to stop after
            raise ValueError(f"stop_at={stop_at} is before step {self.step}, where this run resumed from "
                             f"{self.last_checkpoint}: it would stop after no step")
        stream = BatchStream(self.train_rows, micro_batch=t.micro_batch, packing=cfg.data.packing, seed=t.seed,
                             rank=info.rank, world_size=info.world_size, position=self.position)
        tokens_per_step = t.global_batch * cfg.data.seq_len
        end = t.steps if stop_at is None else min(stop_at, t.steps)
        bar = tqdm(total=t.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (info.is_main and cfg.log.progress))
        if info.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(info.device)
        self.model.train()
        window_start, window_steps, timed_tokens, timed_seconds = _clock(), 0, 0, 0.0
        skip = self.step + min(10, t.steps // 10)  # the first steps include allocation and warm-up
        last_val = {}
        first_step = self.step
        stopped_by = None  # the signal that ended this launch early, as every process saw it
        while self.step < end:
            step_start = _clock()
            lr = lr_at(self.step, lr=o.lr, warmup_steps=o.warmup_steps, total_steps=t.steps,
                       min_lr_ratio=o.min_lr_ratio)
            set_lr(self.optimizer, lr)
            loss_sum = torch.zeros((), device=info.device, dtype=torch.float64)  # (as the validation loss's)
            for micro in range(self.accum):
                with D.set_grad_sync(self.model, info, micro == self.accum - 1):
                    loss = causal_lm_loss(self.model, next(stream), info.device, self.autocast)
                    (loss / self.accum).backward()
                loss_sum += loss.detach()
            max_norm = o.clip_grad_norm if o.clip_grad_norm > 0 else float("inf")
            grad_norm = float(_full(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)))
            # one reduction: the mean loss, and which stop signals reached any process
            flags = [torch.full((), float(signals.received == s), device=info.device) for s in signals.SIGNALS]
            step_loss, *reached = D.all_reduce_mean(torch.stack([loss_sum / self.accum, *flags]), info).tolist()
            self._check_finite(step_loss, grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.position = stream.position
            if should_stop is not None and should_stop(self.step):
                end = self.step
            if stopped_by is None and max(reached) > 0:  # every process stops here, and names the signal
                stopped_by = signals.SIGNALS[[r > 0 for r in reached].index(True)]
                end = self.step
            if self.step > skip:
                timed_tokens += tokens_per_step
                timed_seconds += _clock() - step_start
            window_steps += 1
            bar.update(1)
            if self._logs_step(self.step) or self.step == end:
                if info.device.type == "cuda":
                    torch.cuda.synchronize(info.device)
                seconds = _clock() - window_start
                tok_s = window_steps * tokens_per_step / max(seconds, 1e-9)
                self.logger.log(self.step, loss=step_loss, lr=lr, grad_norm=grad_norm,
                                tokens=self._tokens_seen(), tokens_per_s=tok_s)
                bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tok_s:,.0f}", lr=f"{lr:.2e}")
                window_start, window_steps = _clock(), 0
            # evaluation and checkpoint time is left out of the window's tokens/s (not its steps)
            if t.eval_every and (self.step % t.eval_every == 0 or self.step == t.steps):
                paused = _clock()
                last_val = self.evaluate()
                self.logger.log(self.step, **last_val)
                if info.is_main:  # tqdm.write prints even where the bar is disabled
                    bar.write(f"step {self.step}: val_loss {last_val['val_loss']:.4f} ppl {last_val['val_ppl']:.3f}")
                window_start += _clock() - paused
            if (t.save_every and self.step % t.save_every == 0) or self.step == end:
                paused = _clock()
                self.save()
                window_start += _clock() - paused
        bar.close()
        summary_path = os.path.join(self.out_dir, "summary.json")
        export_dir = os.path.join(self.out_dir, "model")
        found = stored = None  # nothing trained (a finished run launched again): the summary of its last steps
        if self.step == first_step and os.path.isfile(summary_path):
            found = read_json(summary_path)
            found = found if isinstance(found, dict) and found.get("steps") == self.step else None
            stored = found
            if stored is not None and self.step == t.steps and (
                    "signal" in stored or (stored.get("config") or {}).get("train", {}).get("steps") != t.steps):
                # the summary of a launch stopped here before its own train.steps (by --stop-at or a signal),
                # now the run's end: it is finished as a run of this length ends, evaluated at its last step
                stored = None
        # the export: once the run reaches train.steps; a finished run launched again exports only where
        # its summary is not the finished one (a launch that died between the two: the export comes first)
        # or the export is missing
        keep = stored is not None
        export = self.step == t.steps and t.export_model and (
            not keep or not os.path.isfile(os.path.join(export_dir, "config.json")))
        if self.step == first_step and info.world_size > 1:
            # as the main process finds the run folder, for every process: what follows are collectives
            found = torch.tensor([float(keep and info.is_main), float(export and info.is_main)], device=info.device)
            keep, export = (v > 0 for v in D.all_reduce_max(found, info).tolist())
        if export:
            self.export(export_dir)
        if self.step == first_step:
            if keep:
                # its summary, with the validation loss and tokens/s of the steps that were trained, stays;
                # no signal stopped this launch
                return {k: v for k, v in (stored or {}).items() if k != "signal"}
            # none, one of an earlier launch (one that trained on died before writing its own), or one of a
            # launch stopped at what is now train.steps: evaluated as the run's last step is
            if t.eval_every:
                last_val = self.evaluate()
                if self.step == t.steps and not self._logged_val(self.step):
                    self.logger.log(self.step, **last_val)
                    if info.is_main:
                        print(f"step {self.step}: val_loss {last_val['val_loss']:.4f} ppl {last_val['val_ppl']:.3f}")
        tokens_per_s = timed_tokens / timed_seconds if timed_seconds else None
        peak_mem = D.peak_memory_bytes(info)
        if found is not None:  # of the launch that trained the run's last steps: its measures
            tokens_per_s, peak_mem = found.get("tokens_per_s"), found.get("peak_mem_bytes")
        summary = {"params": self.n_params, "steps": self.step, "tokens": self._tokens_seen(),
                   "tokens_per_s": tokens_per_s, "peak_mem_bytes": peak_mem,
                   "world_size": info.world_size, "strategy": info.strategy, **last_val,
                   "commit": self._source["commit"], "dirty": self._source["dirty"],
                   "diff_sha256": self._source["diff_sha256"], "config": cfg.to_dict()}
        if stopped_by is not None and self.step < t.steps:  # in summary.json too: why the run ended early
            summary["signal"] = signal.Signals(stopped_by).name
        if info.is_main:
            write_json(summary_path, summary)
            if cfg.log.plot:
                self._plot_losses(summary)
        return summary

    def _logged_val(self, step: int) -> bool:
        """Whether the log holds a validation record of ``step`` (main process; the others log nothing)."""
        if not self.info.is_main or not os.path.isfile(self.logger.path):
            return not self.info.is_main
        return any(r.get("step") == step and "val_loss" in r for r in read_log(self.logger.path))

    def _plot_losses(self, summary: dict) -> None:
        """``loss.png`` in the run folder: the log's training (line) and validation (dots) losses against
        tokens. Skipped, with a line saying why, without matplotlib or when the plot cannot be written (the
        run's results are in ``summary.json`` and ``log.jsonl`` already)."""
        if importlib.util.find_spec("matplotlib") is None:
            print("log.plot: matplotlib is not installed; no loss.png (pip install matplotlib)")
            return
        from .compare_report import plot_curves

        path = os.path.join(self.out_dir, "loss.png")
        name = self.cfg.model.preset
        val = f", val_loss {summary['val_loss']:.4f}" if summary.get("val_loss") is not None else ""
        try:
            plot_curves({name: {"log": read_log(self.logger.path)}}, path,
                        title=f"{name}: {summary['steps']} steps, {summary['tokens']:,} tokens{val}")
        except (OSError, ValueError) as err:
            print(f"log.plot: no loss.png ({err})")

    def export(self, folder: str) -> None:
        """Save the model as a Hugging Face folder (``save_pretrained``) with its tokenizer, written into
        ``folder.tmp``, flushed to disk file by file (:func:`~falcon_fwa.atomic.sync_tree`), then renamed
        over the last export."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.info.is_main:
            check_export_folder(folder)
            tmp = folder.rstrip("/") + ".tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            self.core.save_pretrained(tmp, state_dict=state)
            shutil.copytree(os.path.join(self.data_dir, "tokenizer"), tmp, dirs_exist_ok=True)
            sync_tree(tmp)  # the whole folder on disk before it replaces the last export
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
            fsync_folder(os.path.dirname(os.path.abspath(folder)))
        D.barrier(self.info)

    def close(self) -> None:
        """Close the logs and free the run folder for the next launch."""
        try:
            self.logger.close()
        finally:
            self._lock.close()
