"""Two processes (gloo) against one, in float64: DDP and FSDP2 train what one process trains, step for step.

In float32 the runs drift apart by rounding alone (the halves of a gradient, and FSDP2's shard norms, are
summed in another order; AdamW's first steps divide a near-zero gradient by its own size), so a float32
comparison needs tolerances that would also let through a small real difference: a gradient scaled, clipped
or decayed otherwise, a parameter left out of the sharding or set differently on one rank. In float64 the
rounding is about 1e-16 a step, and every gradient (after accumulation and clipping) and every weight after
every step must agree to 1e-9."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import fsdp2_on_cpu

from falcon_fwa.train.logger import read_log

from test_train import ROOT, recipe

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo")]

# Trains each recipe of argv[1] with the model in float64 (whose loss the trainer computes and logs in float64), and
# saves, from rank 0, the dtype and value of each micro-batch's loss as the trainer computes it, each step's
# gradients as the optimizer steps with them and the weights after the step, gathered whole, by parameter name.
WORKER = """
import json, sys, torch
from falcon_fwa.train import Trainer, config_from_dict, distributed
from falcon_fwa.train import trainer as trainer_module
from falcon_fwa.train.model_factory import build_model
from falcon_fwa.train.trainer import _full

micro, loss = [], trainer_module.causal_lm_loss

def observed(*args):
    value = loss(*args)
    micro.append((str(value.dtype), value.item()))
    return value

trainer_module.causal_lm_loss = observed
for path, out in json.loads(sys.argv[1]):
    cfg = config_from_dict(json.load(open(path)))
    trainer = Trainer(cfg, model_fn=lambda v, e: build_model(cfg.model, vocab_size=v, eos_token_id=e).double())
    steps, step = [], trainer.optimizer.step
    whole = lambda: {n: _full(p).detach().clone() for n, p in trainer.core.named_parameters()}
    def record(*args, **kwargs):
        grads = {n: _full(p.grad).detach().clone() for n, p in trainer.core.named_parameters()}
        result = step(*args, **kwargs)
        steps.append({"grad": grads, "weight": whole()})
        return result
    trainer.optimizer.step = record
    first = whole()
    trainer.train()
    if trainer.info.is_main:
        torch.save({"init": first, "steps": steps, "micro": micro, "world_size": trainer.info.world_size,
                    "strategy": trainer.info.strategy}, out)
    micro.clear()
    trainer.close()
distributed.teardown()
"""


def _run(cmd, tmp_path, runs):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.path.join(ROOT, "src"), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([*cmd, str(tmp_path / "worker.py"), json.dumps(runs)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@fsdp2_on_cpu
def test_ddp_and_fsdp2_train_the_one_process_runs_gradients_and_weights_in_float64(tmp_path):
    """Six steps of global batch 4 (one process: four micro-steps of one row; two processes: two each),
    clipping at 1.0 reached, weight decay 0.1 on the matrices and the tied embedding, the gate offsets and
    decays in the vector group: each step's clipped gradients and the weights after it are one process's
    to 1e-9 (in float32, rounding alone moves the first step's gradients by 1e-7 to 1e-6). The model is float64
    and so is the trainer's own loss, which each run logs: the same at every step to 1e-9."""
    (tmp_path / "worker.py").write_text(WORKER)
    paths, outs = {}, {}
    for strategy in ("single", "ddp", "fsdp2"):
        raw = recipe(tmp_path, strategy, strategy=strategy, micro_batch=1, steps=6, save_every=0, eval_every=0)
        raw["optim"].update(weight_decay=0.1, clip_grad_norm=1.0)
        paths[strategy], outs[strategy] = str(tmp_path / f"{strategy}.json"), str(tmp_path / f"{strategy}.pt")
        with open(paths[strategy], "w") as f:
            json.dump(raw, f)
    _run([sys.executable], tmp_path, [[paths["single"], outs["single"]]])
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"], tmp_path,
         [[paths[s], outs[s]] for s in ("ddp", "fsdp2")])
    one = torch.load(outs["single"])
    assert one["world_size"] == 1 and len(one["steps"]) == 6
    weights = one["steps"][0]["weight"]
    assert all(v.dtype == torch.float64 for v in weights.values())
    # clipping acts: the logged norms (before clipping) pass 1.0 at some steps, whose gradients are scaled to 1.0
    records = {s: [r for r in read_log(str(tmp_path / s / "log.jsonl")) if "loss" in r] for s in outs}
    logged = [r["grad_norm"] for r in records["single"]]
    clipped = [torch.cat([g.reshape(-1) for g in s["grad"].values()]).norm().item() for s in one["steps"]]
    assert len(logged) == 6 and any(n > 1.0 for n in logged), logged
    for before, after in zip(logged, clipped):
        assert abs(after - min(before, 1.0)) <= 1e-5, (logged, clipped)
    # the trainer's loss of each micro-step is float64, and each step logs the mean of its four to 1e-15
    # (a loss rounded to float32 is 1e-8 to 1e-7 off)
    assert len(one["micro"]) == 24 and {dtype for dtype, _ in one["micro"]} == {"torch.float64"}, one["micro"]
    loss = [r["loss"] for r in records["single"]]
    for i, step_loss in enumerate(loss):
        assert abs(step_loss - sum(v for _, v in one["micro"][4 * i:4 * i + 4]) / 4) <= 1e-15 * step_loss
    for strategy in ("ddp", "fsdp2"):
        two = torch.load(outs[strategy])
        # rank 0's two rows of each step are two of the one process's four, and the logged mean over both ranks is
        # the one process's mean, in float64 (to 1e-9, as the gradients and weights)
        assert len(two["micro"]) == 12 and {dtype for dtype, _ in two["micro"]} == {"torch.float64"}, strategy
        for i in range(6):
            for _, v in two["micro"][2 * i:2 * i + 2]:
                assert min(abs(v - w) for _, w in one["micro"][4 * i:4 * i + 4]) <= 1e-9 * v, (strategy, i)
        assert [r["step"] for r in records[strategy]] == [r["step"] for r in records["single"]]
        assert max(abs(r["loss"] - w) / w for r, w in zip(records[strategy], loss)) <= 1e-9, strategy
        assert (two["world_size"], two["strategy"], len(two["steps"])) == (2, strategy, 6)
        assert sorted(two["init"]) == sorted(one["init"])
        assert all(torch.equal(two["init"][k], v) for k, v in one["init"].items()), strategy
        for i, (a, b) in enumerate(zip(two["steps"], one["steps"]), start=1):
            for kind in ("grad", "weight"):
                worst = max((_rel(a[kind][k], b[kind][k]), k) for k in b[kind])
                assert worst[0] <= 1e-9, (strategy, f"step {i}", kind, worst)
