"""Training against independent references: every step against a plain float64 re-implementation of AdamW
(the recipe's betas, eps and weight decay, the muP learning-rate multipliers and the warmup-cosine rate of
every step, written out by hand) in a straight run and across a resume; the tokens/s a launch reports on a
hand-driven clock (its own warm-up steps and the checkpoint saves left out); which checkpoints a run keeps
and which count as complete; recipe values on and just past the bounds the validation draws."""
import os

import pytest
import torch
from test_train import losses, recipe, run_trainer

from falcon_fwa.train import NonFiniteLoss, Trainer, config_from_dict, latest_checkpoint, load_checkpoint, save_checkpoint
from falcon_fwa.train import trainer as trainer_module
from falcon_fwa.train.checkpoint import list_checkpoints, rng_state, set_rng_state
from falcon_fwa.train.config import apply_overrides
from falcon_fwa.train.logger import read_log

# The trainer's CPU arithmetic against float64 references, also on a GPU machine (its CUDA path: test_train.py).
pytestmark = pytest.mark.usefixtures("cpu_machine")

LR, BETAS, EPS, WD = 0.02, (0.6, 0.8), 1e-4, 0.3
# steps 5, warmup 2, min_lr_ratio 0.2: warmup (s + 1) / 2, then 0.2 + 0.8 (1 + cos(pi (s - 2) / 3)) / 2
RATES = [0.5, 1.0, 1.0, 0.8, 0.4]


def _raw(tmp_path):
    raw = recipe(tmp_path, "run", steps=5, eval_every=0, save_every=2)
    raw["model"]["overrides"] = {"mup_base_width": 16}  # tiny-falcon is 32 wide: matrices at lr / 2
    raw["optim"].update(lr=LR, betas=list(BETAS), eps=EPS, weight_decay=WD, warmup_steps=2, min_lr_ratio=0.2,
                        clip_grad_norm=0.0)
    return raw


def _group(name):
    """(lr multiplier, weight decay) of a tiny-falcon parameter at mup_base_width 16, by its name."""
    if name == "model.embed_tokens.weight":
        return 1.0, WD
    if name.endswith("_proj.weight"):  # every nn.Linear of the blocks
        return 0.5, WD
    assert name.endswith(("norm.weight", "_bias", "convs.q.weight", "convs.k.weight", "convs.v.weight")), name
    return 1.0, 0.0


def _record_steps(trainer, steps):
    """Append (weights before, gradients, weights after) of every optimizer step, float64, by name."""
    step = trainer.optimizer.step

    def recorded(*args, **kwargs):
        params = dict(trainer.core.named_parameters())
        before = {n: p.detach().double().clone() for n, p in params.items()}
        grads = {n: p.grad.detach().double().clone() for n, p in params.items()}
        out = step(*args, **kwargs)
        steps.append((before, grads, {n: p.detach().double().clone() for n, p in params.items()}))
        return out

    trainer.optimizer.step = recorded


def _check_adamw(steps, state, first):
    """Each recorded step against AdamW by its formula, from the weights before it and the gradient it
    stepped with: ``p <- p (1 - lr wd) - lr m_hat / (sqrt(v_hat) + eps)``; ``state`` carries m, v."""
    for k, (before, grads, after) in enumerate(steps, start=first):
        t = k + 1
        for name, p in before.items():
            mult, wd = _group(name)
            lr = LR * RATES[k] * mult
            g = grads[name]
            m, v = state.get(name, (torch.zeros_like(p), torch.zeros_like(p)))
            m = BETAS[0] * m + (1 - BETAS[0]) * g
            v = BETAS[1] * v + (1 - BETAS[1]) * g * g
            state[name] = (m, v)
            m_hat, v_hat = m / (1 - BETAS[0] ** t), v / (1 - BETAS[1] ** t)
            want = p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + EPS)
            err = (after[name] - want).abs().max().item()
            assert err <= 2e-4 * lr + 1e-7, (t, name, err, lr)


def test_every_step_is_adamw_with_the_recipes_hyperparameters_and_schedule(tmp_path):
    raw = _raw(tmp_path)
    steps = []
    trainer = Trainer(config_from_dict(raw))
    try:
        _record_steps(trainer, steps)
        trainer.train()
    finally:
        trainer.close()
    assert len(steps) == 5
    assert losses(tmp_path / "run", "lr") == [(s + 1, pytest.approx(LR * r, rel=1e-12)) for s, r in enumerate(RATES)]
    _check_adamw(steps, {}, 0)


def test_a_resumed_run_steps_with_the_saved_moments_and_the_schedule_of_its_step(tmp_path):
    """Stopped after step 2 and resumed: steps 3 to 5 continue the moments of steps 1 and 2 (bias correction
    by the global step count) at the rates of steps 3 to 5, with the muP multipliers."""
    raw = _raw(tmp_path)
    steps, state = [], {}
    for stop_at in (2, None):
        trainer = Trainer(config_from_dict(raw))
        try:
            _record_steps(trainer, steps)
            trainer.train(stop_at=stop_at)
        finally:
            trainer.close()
    assert len(steps) == 5
    _check_adamw(steps, state, 0)


def test_a_resumed_launch_times_its_own_steps_after_its_own_warm_up(tmp_path, monkeypatch):
    """20 steps stopped after step 10 and resumed, on a clock that the n-th training micro-step of a launch
    advances by n seconds: the resumed launch's summary rate leaves out its own first 20 // 10 = 2 steps
    (11 and 12, micro-steps 1 to 4) and counts steps 13 to 20 (micro-steps 5 to 20) at 4 x 24 tokens each."""
    now, calls = [0.0], []
    real = trainer_module.causal_lm_loss

    def charged(*args, **kwargs):
        if torch.is_grad_enabled():
            calls.append(1)
            now[0] += len(calls)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", charged)
    monkeypatch.setattr(trainer_module, "_clock", lambda: now[0])
    raw = recipe(tmp_path, "run", steps=20, eval_every=0, save_every=10)
    for stop_at in (10, None):
        calls.clear()
        trainer = Trainer(config_from_dict(raw))
        try:
            summary = trainer.train(stop_at=stop_at)
        finally:
            trainer.close()
    assert len(calls) == 20 and summary["steps"] == 20
    assert summary["tokens_per_s"] == pytest.approx(8 * 4 * 24 / sum(range(5, 21)), rel=1e-12)


def test_logged_tokens_per_s_leaves_out_the_checkpoint_saves(tmp_path, monkeypatch):
    """On a clock that a training micro-step advances by 1 s and a checkpoint save by 100 s, a save every
    step: every logged rate is the tokens of the window's steps over their 2 s each, the saves left out."""
    now = [0.0]
    real_loss, real_save = trainer_module.causal_lm_loss, trainer_module.save_checkpoint

    def charged(*args, **kwargs):
        now[0] += 1.0
        return real_loss(*args, **kwargs)

    def slow_save(*args, **kwargs):
        now[0] += 100.0
        return real_save(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", charged)
    monkeypatch.setattr(trainer_module, "save_checkpoint", slow_save)
    monkeypatch.setattr(trainer_module, "_clock", lambda: now[0])
    raw = recipe(tmp_path, "run", steps=6, eval_every=0, save_every=1)
    raw["log"]["every"] = 3
    trainer = Trainer(config_from_dict(raw))
    try:
        trainer.train()
    finally:
        trainer.close()
    rates = losses(tmp_path / "run", "tokens_per_s")
    assert [step for step, _ in rates] == [3, 6]
    for step, rate in rates:  # 4 rows x 24 tokens a step, 2 micro-steps of 1 s
        assert rate == pytest.approx(4 * 24 / 2.0, rel=1e-12), (step, rate)


def test_a_run_keeps_exactly_its_newest_keep_checkpoints(tmp_path):
    """A checkpoint every step of 5, keep_checkpoints 2: steps 4 and 5 remain, LATEST names step 5."""
    raw = recipe(tmp_path, "run", steps=5, eval_every=0, save_every=1, keep_checkpoints=2)
    trainer = Trainer(config_from_dict(raw))
    try:
        trainer.train()
    finally:
        trainer.close()
    folder = tmp_path / "run" / "checkpoints"
    assert sorted(n for n in os.listdir(folder) if not n.startswith(".")) == ["LATEST", "step-00000004",
                                                                            "step-00000005"]
    assert (folder / "LATEST").read_text() == "step-00000005"


def test_a_checkpoint_without_its_state_file_is_not_complete(tmp_path):
    """Checkpoints of steps 1 to 3, then step 3's state.pt gone (its meta.json still says complete): step 3
    is neither listed, nor loaded, nor LATEST's answer (LATEST names it); the newest complete one, step 2, is."""
    folder = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        save_checkpoint(str(folder), step, {"step": step}, keep=3)
    os.remove(folder / "step-00000003" / "state.pt")
    assert (folder / "LATEST").read_text() == "step-00000003"
    assert [os.path.basename(p) for p in list_checkpoints(str(folder))] == ["step-00000001", "step-00000002"]
    assert os.path.basename(latest_checkpoint(str(folder))) == "step-00000002"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        load_checkpoint(str(folder / "step-00000003"))


def test_training_goes_on_in_training_mode_after_an_evaluation(tmp_path, monkeypatch):
    """Evaluations after steps 1 and 2 of 3 (the model in eval mode while they run): every training
    micro-step, before and after them, runs the model in training mode."""
    modes = []
    real = trainer_module.causal_lm_loss

    def seen(model, *args, **kwargs):
        modes.append((torch.is_grad_enabled(), model.training))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(trainer_module, "causal_lm_loss", seen)
    run_trainer(recipe(tmp_path, "run", steps=3, eval_every=1, save_every=0))
    assert modes == [(True, True)] * 2 + [(False, False)] * 2 + [(True, True)] * 2 + [(False, False)] * 2 \
        + [(True, True)] * 2 + [(False, False)] * 2


def test_a_non_finite_gradient_under_a_finite_loss_stops_before_the_step(tmp_path):
    """A backward hook turns the embedding's gradient into NaN in step 3 (the loss stays finite): the run
    stops with NonFiniteLoss naming step 3 and the last checkpoint, and the weights are still step 2's
    (the optimizer never stepped with the NaN gradient)."""
    raw = recipe(tmp_path, "run")
    run_trainer(raw, stop_at=2)
    trainer = Trainer(config_from_dict(raw))
    try:
        embed = trainer.core.model.embed_tokens.weight
        embed.register_hook(lambda grad: grad * float("nan"))
        with pytest.raises(NonFiniteLoss, match=r"step 3.*step-00000002"):
            trainer.train()
        saved = load_checkpoint(str(tmp_path / "run" / "checkpoints" / "step-00000002"))["model"]
        for name, p in trainer.core.named_parameters():
            assert torch.equal(p.detach(), saved[name]), name
    finally:
        trainer.close()
    (record,) = [r for r in read_log(str(tmp_path / "run" / "log.jsonl")) if r.get("event") == "non_finite"]
    assert record["step"] == 3 and record["loss"] is not None and record["grad_norm"] is None


def test_rng_state_restores_every_generator():
    """set_rng_state(rng_state()) puts Python's, NumPy's and torch's generators back: the draws after it
    repeat the draws after the capture."""
    import random

    import numpy as np

    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(()).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == first


def test_a_resume_whose_micro_batch_does_not_divide_the_consumed_samples_is_refused(tmp_path):
    """One step of global batch 6 in micro-batches of 2 consumed 6 samples; resumed with micro-batches of 4
    the data position would fall between two micro-steps (6 / 4), so the resume is refused naming it."""
    raw = recipe(tmp_path, "run", steps=3, global_batch=6, eval_every=0)
    run_trainer(raw, stop_at=1)
    raw["train"].update(global_batch=8, micro_batch=4)
    with pytest.raises(ValueError, match=r"consumed 6 samples, not a multiple of train.micro_batch x processes = 4"):
        Trainer(config_from_dict(raw))


@pytest.mark.parametrize("assignment, message", [
    ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0, got -1"),
    ("train.seed=4294967296", r"train.seed must lie in \[0, 2\*\*32\), got 4294967296"),
    ("train.global_batch=1", "train.global_batch must be >= train.micro_batch, got 1"),
])
def test_recipe_values_just_past_a_bound_are_refused_by_name(tmp_path, assignment, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(apply_overrides(recipe(tmp_path), [assignment]))


@pytest.mark.parametrize("assignment", ["optim.min_lr_ratio=1.0", "optim.warmup_steps=0", "train.seed=4294967295",
                                        "train.global_batch=2"])
def test_recipe_values_on_a_bound_are_accepted(tmp_path, assignment):
    field, value = assignment.split("=")
    section, key = field.split(".")
    cfg = config_from_dict(apply_overrides(recipe(tmp_path), [assignment]))
    assert getattr(getattr(cfg, section), key) == float(value)
