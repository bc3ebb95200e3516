"""Training a model of the caller's (``Trainer(cfg, model_fn=...)``) against hand-written references: a model
that draws random numbers in its training forward (dropout) trains the same stopped and resumed as straight
through, bit for bit (the checkpoint's RNG states are put back); a model that defines no ``param_groups`` gets
weight decay on its matrices (the embedding, a linear weight) and none on its vectors (a bias, a norm's gain
and bias), as ``optim.weight_decay`` is documented."""
import pytest
import torch
from test_train import losses, recipe
from torch import nn

from falcon_fwa.train import Trainer, config_from_dict

pytestmark = pytest.mark.usefixtures("cpu_machine")


class _Out:
    def __init__(self, logits):
        self.logits = logits


class DropoutLM(nn.Module):
    """Embedding -> LayerNorm -> dropout -> Linear (with bias), token by token: a model that draws random
    numbers at every training forward and has vectors (a bias, a norm's gain and bias) beside its matrices."""

    def __init__(self, vocab_size, p=0.5):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 16)
        self.norm = nn.LayerNorm(16)
        self.drop = nn.Dropout(p)
        self.head = nn.Linear(16, vocab_size)

    def forward(self, input_ids, use_cache=False, cu_seqlens=None):
        return _Out(self.head(self.drop(self.norm(self.embed(input_ids)))))


def _raw(tmp_path, out, **train):
    raw = recipe(tmp_path, out, **{"steps": 4, "eval_every": 0, "save_every": 0, **train})
    raw["optim"].update(lr=0.01, warmup_steps=1, clip_grad_norm=0.0)
    return raw


def _train(raw, *, model_fn, stop_at=None):
    trainer = Trainer(config_from_dict(raw), model_fn=model_fn)
    try:
        trainer.train(stop_at=stop_at)
    finally:
        trainer.close()
    return trainer


def test_a_model_drawing_random_numbers_trains_alike_stopped_and_resumed(tmp_path):
    """A dropout model stopped after step 2 and resumed logs the straight run's losses, bit for bit, and ends
    with its weights: the resumed launch draws the dropout masks the straight run drew at steps 3 and 4."""
    make = lambda v, e: DropoutLM(v)  # noqa: E731
    straight = _train(_raw(tmp_path, "straight"), model_fn=make)
    _train(_raw(tmp_path, "resumed"), model_fn=make, stop_at=2)
    resumed = _train(_raw(tmp_path, "resumed"), model_fn=make)
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert [s for s, _ in a] == [1, 2, 3, 4] and a == b, (a, b)
    for (name, p), q in zip(straight.core.named_parameters(), resumed.core.parameters()):
        assert torch.equal(p, q), name


def test_a_model_without_its_own_groups_decays_its_matrices_only(tmp_path):
    """One step of a model that defines no ``param_groups``, with ``optim.weight_decay`` 0 and 0.5 from the
    same initial weights ``p0`` and gradient: the embedding and the head's weight (matrices) end apart by
    AdamW's decoupled decay ``lr x wd x p0``; the head's bias and the norm's gain and bias (vectors) end equal,
    bit for bit."""
    make = lambda v, e: DropoutLM(v, p=0.0)  # noqa: E731
    lr, wd = 0.01, 0.5  # one step at the top of a warm-up of one step: the rate is lr
    starts, ends = [], []
    for decay in (0.0, wd):
        raw = _raw(tmp_path, f"wd{decay}", steps=1)
        raw["optim"]["weight_decay"] = decay
        trainer = Trainer(config_from_dict(raw), model_fn=make)
        try:
            starts.append({n: p.detach().double().clone() for n, p in trainer.core.named_parameters()})
            trainer.train()
        finally:
            trainer.close()
        ends.append({n: p.detach().double() for n, p in trainer.core.named_parameters()})
    assert all(torch.equal(starts[0][n], starts[1][n]) for n in starts[0])
    for name in ("embed.weight", "head.weight"):
        torch.testing.assert_close(ends[0][name] - ends[1][name], lr * wd * starts[0][name], rtol=1e-4,
                                   atol=1e-8, msg=lambda m: f"{name}: {m}")
    for name in ("head.bias", "norm.weight", "norm.bias"):
        assert torch.equal(ends[0][name], ends[1][name]), name
