"""Training steps against independent references: which parameters AdamW decays (the difference of two runs
that differ only in weight decay), gradient clipping against the float64 norm of the whole batch's
gradient, the validation loss at every evaluation against a float64 pass over the validation rows, and
recipe values AdamW cannot run with, refused by name."""
import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F
from test_train import losses, recipe, run_trainer
from test_train_exact import _whole_batch_reference, gradients_at_step

from falcon_fwa.data import PackedRows
from falcon_fwa.train import Trainer, config_from_dict, load_checkpoint
from falcon_fwa.train.config import apply_overrides


# The trainer's CPU arithmetic against float64 references, also on a GPU machine (its CUDA path: test_train.py).
pytestmark = pytest.mark.usefixtures("cpu_machine")


def _one_step(tmp_path, out, *, weight_decay, lr):
    """The weights before and after one step (no warm-up, global batch 4 in two micro-batches), float64."""
    raw = recipe(tmp_path, out, steps=1, eval_every=0, save_every=0)
    raw["model"]["overrides"] = {"mup_base_width": 16}  # tiny-falcon is 32 wide: matrices at lr / 2
    raw["optim"].update(weight_decay=weight_decay, warmup_steps=0, lr=lr)
    trainer = Trainer(config_from_dict(raw))
    try:
        before = {n: p.detach().double().clone() for n, p in trainer.core.named_parameters()}
        trainer.train()
    finally:
        trainer.close()
    return before, {n: p.detach().double() for n, p in trainer.core.named_parameters()}


def test_weight_decay_shrinks_the_linear_weights_and_the_embedding_only(tmp_path):
    """Two one-step runs from the same weights on the same batch, with weight decay 0.1 and 0: AdamW's
    decoupled decay makes their difference -lr_group x 0.1 x the starting weight, where lr_group is the
    muP rate (lr / 2 for every nn.Linear weight, lr for the embedding), and zero for the norm gains, the
    gate biases and the short-convolution kernels (their Adam steps are the same in both runs)."""
    lr, wd = 0.05, 0.1
    before, decayed = _one_step(tmp_path, "wd", weight_decay=wd, lr=lr)
    _, plain = _one_step(tmp_path, "plain", weight_decay=0.0, lr=lr)
    kinds = set()
    for name, p0 in before.items():
        diff = decayed[name] - plain[name]
        if name == "model.embed_tokens.weight":
            want, kind = -lr * wd * p0, "embedding"
        elif name.endswith("_proj.weight"):  # every nn.Linear of the blocks (q, k, v, o, gates, MLP)
            want, kind = -(lr / 2) * wd * p0, "linear"
        else:  # norms, gate biases, convolution kernels
            assert name.endswith(("norm.weight", "_bias", "convs.q.weight", "convs.k.weight", "convs.v.weight")), name
            want, kind = torch.zeros_like(p0), "other"
        kinds.add(kind)
        assert (diff - want).abs().max().item() <= 1e-7 * max(1.0, p0.abs().max().item()), name
    assert kinds == {"embedding", "linear", "other"}


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_clipping_scales_the_whole_batchs_gradient_to_the_clip_norm(tmp_path, clip):
    """The logged grad_norm is the float64 norm of the whole batch's gradient (over all parameters); with
    optim.clip_grad_norm below it the optimizer steps with that gradient times clip / norm (norm = clip),
    with 0 (off) with the gradient itself."""
    raw = recipe(tmp_path, "run", steps=1, eval_every=0, save_every=0)
    raw["optim"].update(clip_grad_norm=clip, warmup_steps=0)
    trainer = Trainer(config_from_dict(raw))
    try:
        _, reference = _whole_batch_reference(trainer, trainer.core, "cu_seqlens")
        norm = math.sqrt(sum((g ** 2).sum().item() for g in reference.values()))
        seen = gradients_at_step(trainer)
        trainer.train()
    finally:
        trainer.close()
    assert norm > 0.5  # well above the clip norm tested
    ((_, logged),) = losses(tmp_path / "run", "grad_norm")
    assert logged == pytest.approx(norm, rel=2e-6)
    scale = clip / norm if clip else 1.0
    stepped = math.sqrt(sum((g ** 2).sum().item() for g in seen.values()))
    assert stepped == pytest.approx(norm * scale, rel=2e-6)
    for name, grad in reference.items():
        err = (seen[name] - scale * grad).abs().max().item()
        assert err <= 3e-5 * scale * grad.abs().max().item() + 1e-12, name


def _reference_val_loss(trainer, weights, rows_used):
    """Mean next-token cross-entropy over the first ``rows_used`` validation rows in float64, each
    document piece of a row (``cu_seqlens``) run from an empty state, every target counted."""
    model = copy.deepcopy(trainer.core).double()
    model.load_state_dict(weights)
    rows = PackedRows(trainer.val_split, trainer.cfg.data.seq_len)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(rows_used):
            tokens, starts = rows.row(i)
            tokens = torch.from_numpy(tokens)
            cuts = [0, *(int(p) for p in starts), len(tokens) - 1]
            for a, b in zip(cuts[:-1], cuts[1:]):
                logits = model(input_ids=tokens[a:b][None], use_cache=False).logits[0]
                total += F.cross_entropy(logits, tokens[a + 1:b + 1], reduction="sum").item()
                count += b - a
    return total / count


@pytest.mark.parametrize("eval_batches", [1, 100])
def test_val_loss_at_every_evaluation_is_the_mean_over_the_first_validation_rows(tmp_path, eval_batches):
    """7 steps, eval_every 3: evaluations after steps 3, 6 and 7 (train.steps), each the float64 token mean
    over the first min(eval_batches, rows // global_batch) x global_batch validation rows at that step's
    weights (its checkpoint); 100 batches asks for more rows than the split has, and all whole batches count."""
    raw = recipe(tmp_path, "run", steps=7, eval_every=3, save_every=1, keep_checkpoints=7, eval_batches=eval_batches)
    trainer = run_trainer(raw)
    n_rows = len(PackedRows(trainer.val_split, raw["data"]["seq_len"]))
    assert n_rows >= 12  # at least three batches of 4, so 100 is cut to what the split holds
    used = min(eval_batches, n_rows // 4) * 4
    logged = losses(tmp_path / "run", "val_loss")
    assert [s for s, _ in logged] == [3, 6, 7]
    for step, val_loss in logged:
        weights = load_checkpoint(os.path.join(tmp_path, "run", "checkpoints", f"step-{step:08d}"))["model"]
        assert val_loss == pytest.approx(_reference_val_loss(trainer, weights, used), rel=2e-7), step
    ((_, ppl),) = [(s, v) for s, v in losses(tmp_path / "run", "val_ppl") if s == 7]
    assert ppl == pytest.approx(math.exp(logged[-1][1]), rel=1e-12)


@pytest.mark.parametrize("assignment, message", [
    ("optim.eps=-1", "optim.eps must be a finite number > 0 (AdamW divides by sqrt(v) + eps), got -1.0"),
    ("optim.eps=0", "optim.eps must be a finite number > 0 (AdamW divides by sqrt(v) + eps), got 0.0"),
    ("optim.lr=.inf", "optim.lr must be a finite number > 0, got inf"),
    ("optim.weight_decay=.inf", "optim.weight_decay must be a finite number >= 0, got inf"),
])
def test_optimizer_values_adamw_cannot_run_with_name_their_field(tmp_path, assignment, message):
    """Refused with the recipe, not by AdamW's constructor (``Invalid epsilon value: -1.0``) or as a NaN loss."""
    with pytest.raises(ValueError, match="^config field " + message.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.").replace("+", r"\+") + "$"):
        config_from_dict(apply_overrides(recipe(tmp_path), [assignment]))


@pytest.mark.parametrize("assignment, message", [
    ("train.stpes=3", r"^unknown config field train\.stpes \(did you mean 'steps'\?\); fields of 'train' are \["),
    ("trian.steps=3", r"^unknown config section 'trian' \(did you mean 'train'\?\); sections are \["),
    ("optim.learning_rate=1", r"^unknown config field optim\.learning_rate; fields of 'optim' are \["),
])
def test_a_misspelt_field_or_section_is_named_with_the_closest_real_one(tmp_path, assignment, message):
    with pytest.raises(ValueError, match=message):
        config_from_dict(apply_overrides(recipe(tmp_path), [assignment]))
