"""The logged training loss of a float64 model is float64 throughout: each step's record equals the mean over its
micro-batches of the next-token cross-entropy computed here in float64 from the weights the step started with
(log-softmax by hand, over every target), to 1e-12; float32 anywhere on the way (the logits, the sum over the
micro-batches) would leave about 1e-7."""
import copy
import math

import pytest
import torch
from test_train import recipe

from falcon_fwa.data import BatchStream
from falcon_fwa.train import Trainer, config_from_dict
from falcon_fwa.train.logger import read_log
from falcon_fwa.train.model_factory import build_model

# The trainer's CPU arithmetic against float64 references, also on a GPU machine.
pytestmark = pytest.mark.usefixtures("cpu_machine", "one_thread")


def _loss64(model, batch) -> float:
    """Mean over every target of ``-log softmax(logits)[target]``, float64, by hand."""
    kwargs = {"input_ids": batch["input_ids"], "use_cache": False, "return_dict": True}
    if "cu_seqlens" in batch:
        kwargs["cu_seqlens"] = batch["cu_seqlens"]
    with torch.no_grad():
        logits = model(**kwargs).logits
    assert logits.dtype == torch.float64
    z = logits.reshape(-1, logits.shape[-1])
    y = batch["targets"].reshape(-1)
    top = z.max(dim=-1, keepdim=True).values
    logsumexp = top.squeeze(-1) + (z - top).exp().sum(-1).log()
    return float((logsumexp - z[torch.arange(len(y)), y]).sum()) / len(y)


@pytest.mark.parametrize("packing", ["eos", "cu_seqlens"])
def test_a_float64_models_logged_loss_is_the_float64_mean_of_its_steps(tmp_path, packing):
    raw = recipe(tmp_path, steps=4, eval_every=0, save_every=0)  # global batch 4 = 2 micro-batches of 2 rows
    raw["data"]["packing"] = packing
    cfg = config_from_dict(raw)
    trainer = Trainer(cfg, model_fn=lambda v, e: build_model(cfg.model, vocab_size=v, eos_token_id=e).double())
    try:
        assert trainer.accum == 2
        # the same micro-batches in the same order as the run's, from their own stream
        stream = BatchStream(trainer.train_rows, micro_batch=2, packing=packing, seed=cfg.train.seed, rank=0,
                             world_size=1, position=0)
        want, step = [], trainer.optimizer.step

        def reference(*args, **kwargs):  # before the weights change: those every micro-batch of the step saw
            model = copy.deepcopy(trainer.core)
            want.append(math.fsum(_loss64(model, next(stream)) for _ in range(trainer.accum)) / trainer.accum)
            return step(*args, **kwargs)

        trainer.optimizer.step = reference
        trainer.train()
    finally:
        trainer.close()
    got = [r["loss"] for r in read_log(str(tmp_path / "run" / "log.jsonl")) if "loss" in r]
    assert len(got) == len(want) == 4
    assert len({round(w, 6) for w in want}) == 4  # the weights change from step to step
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-12, (got, want)
