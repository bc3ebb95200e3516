"""Training at its edges: a resume under another way to compute the same model (the op's backend, its
segments), the loss scoring target id 0 like any other token (against float64 cross-entropy by hand), the
warm-up warning on and one step either side of its bound, and ``extends:`` merging ``model.overrides``
key by key through a chain of recipe files."""
import math
import warnings
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
import yaml
from test_train import losses, recipe, run_trainer

from falcon_fwa.train import Trainer, config_from_dict, lr_at
from falcon_fwa.train.config import load_config, read_recipe
from falcon_fwa.train.trainer import causal_lm_loss


@pytest.mark.parametrize("field, value", [("backend", "torch"), ("segments", 2)])
def test_a_resume_under_another_backend_or_segments_continues_the_same_run(tmp_path, field, value):
    """``model.backend`` and ``model.segments`` change how the model computes, not what it is
    (``trainer.COMPUTE_FIELDS``): a checkpoint written with the defaults resumes under the other value at its
    step, and the steps after it match the uninterrupted run's to float32 rounding."""
    run_trainer(recipe(tmp_path, "full"))
    run_trainer(recipe(tmp_path, "split"), stop_at=2)
    raw = recipe(tmp_path, "split")
    raw["model"]["overrides"] = {field: value}
    trainer = Trainer(config_from_dict(raw))
    try:
        assert trainer.step == 2 and trainer.position == 4  # two steps of two micro-batches
        trainer.train()
    finally:
        trainer.close()
    full, split = losses(tmp_path / "full"), losses(tmp_path / "split")
    assert [s for s, _ in split] == [s for s, _ in full] == [1, 2, 3, 4]
    assert split[:2] == full[:2]  # written before the relaunch
    for (_, x), (_, y) in zip(full[2:], split[2:]):
        assert abs(x - y) <= 1e-5 * abs(x), (full, split)


class _FixedLogits(torch.nn.Module):
    """A model whose logits are given: what ``causal_lm_loss`` scores is then known exactly."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, input_ids, use_cache=False, cu_seqlens=None):
        assert input_ids.shape == self.logits.shape[:2]
        return SimpleNamespace(logits=self.logits)


@pytest.mark.parametrize("packed", [False, True])
def test_the_loss_scores_target_id_0_like_every_other_token(packed):
    """Token id 0 is a real token (a byte, a BPE piece), not padding: every target counts, those of id 0 too.
    Against the mean of ``logsumexp(z) - z[target]`` over all positions, in float64 by hand."""
    gen = torch.Generator().manual_seed(0)
    B, T, V = 2, 5, 7
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 3
    targets = torch.tensor([[0, 3, 0, 0, 6], [2, 0, 5, 0, 1]])  # half the targets are id 0
    batch = {"input_ids": torch.zeros(B, T, dtype=torch.int64), "targets": targets}
    if packed:  # the cu_seqlens packing: one row of B*T tokens
        logits = logits.reshape(1, B * T, V)
        batch = {k: v.reshape(1, -1) for k, v in batch.items()}
        batch["cu_seqlens"] = torch.tensor([0, 3, T, B * T], dtype=torch.int32)
    model = _FixedLogits(logits.float())
    got = causal_lm_loss(model, batch, torch.device("cpu"), nullcontext)
    z, y = logits.double().reshape(-1, V).tolist(), targets.reshape(-1).tolist()
    terms = [math.log(sum(math.exp(v) for v in row)) - row[t] for row, t in zip(z, y)]
    want = sum(terms) / len(terms)
    without_0 = [x for x, t in zip(terms, y) if t != 0]
    assert abs(want - sum(without_0) / len(without_0)) > 0.1  # leaving the id-0 targets out is visible
    assert got.dtype == torch.float32 and abs(got.item() - want) <= 1e-6 * want


@pytest.mark.parametrize("warmup, warns", [(19, False), (20, False), (21, True)])
def test_the_warmup_warning_starts_one_step_past_train_steps(tmp_path, warmup, warns):
    """20 steps: warm-up over 19 or 20 steps reaches optim.lr at the last step (lr_at(19) = lr), over 21 it ends
    at 20/21 of it: only then the recipe warns, with that figure."""
    raw = recipe(tmp_path, "run", steps=20)
    raw["optim"]["warmup_steps"] = warmup
    last = lr_at(19, lr=1.0, warmup_steps=warmup, total_steps=20, min_lr_ratio=0.1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        config_from_dict(raw)
    texts = [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
    if warns:
        assert last == pytest.approx(20 / 21)
        assert texts == [f"optim.warmup_steps={warmup} exceeds train.steps=20: the learning rate ends at 0.952 of "
                         "optim.lr, still warming up"]
    else:
        assert last == 1.0 and texts == []


def test_extends_merges_model_overrides_key_by_key_down_the_chain(tmp_path):
    """A recipe that extends another takes its ``model.overrides`` and changes only the keys it names: the
    child's value wins where both set one, the parent's stays where the child is silent, and the child's own
    keys are added; through two levels, and with ``--set`` last of all."""
    base = recipe(tmp_path, "run")
    base["model"] = {"preset": "tiny-falcon", "overrides": {"rule": "3a", "window": 8, "chunk_size": 16}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "mid.yaml").write_text(yaml.safe_dump(
        {"extends": "base.yaml", "model": {"overrides": {"window": 16, "segments": 2}}, "train": {"steps": 7}}))
    (tmp_path / "child.yaml").write_text(yaml.safe_dump(
        {"extends": "mid.yaml", "model": {"overrides": {"chunk_size": 8, "mup_base_width": 16}}}))

    mid = read_recipe(str(tmp_path / "mid.yaml"))
    assert mid["model"] == {"preset": "tiny-falcon",
                            "overrides": {"rule": "3a", "window": 16, "chunk_size": 16, "segments": 2}}
    child = read_recipe(str(tmp_path / "child.yaml"))
    assert child["model"]["preset"] == "tiny-falcon" and "extends" not in child
    want = {"rule": "3a", "window": 16, "chunk_size": 8, "segments": 2, "mup_base_width": 16}
    assert child["model"]["overrides"] == want
    for key, value in want.items():  # and each one, as the validated recipe carries it
        assert load_config(str(tmp_path / "child.yaml")).model.overrides[key] == value, key
    cfg = load_config(str(tmp_path / "child.yaml"), ["model.overrides.window=32"])
    assert cfg.model.overrides == {**want, "window": 32}
    # the rest of the recipe merged as well: the middle file's train.steps over the base's, the base's others
    assert (cfg.train.steps, cfg.train.global_batch, cfg.data.seq_len) == (7, 4, 24)
    # and the parents read on their own are unchanged by the merge
    assert read_recipe(str(tmp_path / "base.yaml"))["model"] == base["model"]
