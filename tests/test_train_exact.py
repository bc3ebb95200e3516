"""Training, exactly: a stopped and resumed run keeps the uninterrupted run's log and weights; gradient
accumulation is the whole batch's token mean (against a float64 reference run document by document);
checkpoints move between one process and FSDP2; resuming refuses a recipe that trains on other rows."""
import copy
import json
import os
import signal

import pytest
import torch
import torch.nn.functional as F
from test_train import _torchrun, losses, recipe, run_trainer, signal_during_step_3
from conftest import fsdp2_on_cpu

from falcon_fwa.data import PackedRows, RowOrder
from falcon_fwa.train import Trainer, config_from_dict, latest_checkpoint, load_checkpoint
from falcon_fwa.train.logger import read_log


# The trainer's CPU arithmetic against float64 references, also on a GPU machine (its CUDA path: test_train.py).
pytestmark = pytest.mark.usefixtures("cpu_machine")


def records(run_dir):
    """The log's records without the measured rates (the one thing a rerun does not repeat)."""
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_log(os.path.join(run_dir, "log.jsonl"))]


def final_weights(run_dir):
    return load_checkpoint(latest_checkpoint(os.path.join(run_dir, "checkpoints")))["model"]


@pytest.mark.parametrize("stop", ["SIGTERM", "stop_at"])
def test_a_run_stopped_off_the_log_cadence_and_resumed_logs_the_uninterrupted_runs_records(tmp_path, stop):
    """Stopped after step 3 (log.every 2, evaluations every 2 steps, two micro-batches a step), by a SIGTERM
    or --stop-at: the stopped launch logs step 3; the resumed run's log is the straight run's record for
    record (step 3's stop record gone, nothing twice), and its weights are the straight run's bit for bit."""
    def raw(out):
        r = recipe(tmp_path, out, steps=6, save_every=4, eval_every=2)
        r["log"]["every"] = 2
        return r

    run_trainer(raw("full"))
    stop_at = None
    # the signal's patch in a context of its own: undoing the test's monkeypatch would also undo cpu_machine's,
    # and on a GPU machine the relaunch would resume on CUDA
    with pytest.MonkeyPatch.context() as patch:
        if stop == "SIGTERM":
            signal_during_step_3(patch, signal.SIGTERM)
            before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
        else:
            stop_at = 3
        try:
            trainer = Trainer(config_from_dict(raw("split")))
            try:
                summary = trainer.train(stop_at=stop_at, stop_on_signal=True)
            finally:
                trainer.close()
        finally:
            if stop == "SIGTERM":
                signal.signal(signal.SIGTERM, before)
    assert summary["steps"] == 3 and trainer.last_checkpoint.endswith("step-00000003")
    assert [s for s, _ in losses(tmp_path / "split")] == [2, 3]  # the stop record, off the cadence
    run_trainer(raw("split"))
    full, split = records(tmp_path / "full"), records(tmp_path / "split")
    assert [(r["step"], sorted(r)) for r in full] == [(r["step"], sorted(r)) for r in split]
    assert split == full
    a, b = final_weights(tmp_path / "full"), final_weights(tmp_path / "split")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_resume_at_a_logged_step_keeps_its_record(tmp_path):
    """The record of the checkpoint's step stays where the cadence writes one (here step 4 of 6, log.every 2)
    and at train.steps (a finished run launched again)."""
    raw = recipe(tmp_path, "run", steps=6, save_every=4, eval_every=0)
    raw["log"]["every"] = 2
    run_trainer(raw, stop_at=4)
    run_trainer(raw)
    assert [s for s, _ in losses(tmp_path / "run")] == [2, 4, 6]
    raw["log"]["every"] = 4
    run_trainer(raw)  # at train.steps: nothing to train, step 6's record stays
    assert [s for s, _ in losses(tmp_path / "run")] == [2, 4, 6]


def test_tokens_count_each_step_at_its_own_batch_after_a_resume(tmp_path):
    """Two steps of global batch 4, then a resume at global batch 8 for two more: the log's and the summary's
    ``tokens`` are the input tokens trained on, 4 x 24 per step then 8 x 24 (not step x the final batch)."""
    raw = recipe(tmp_path, "run", steps=4, save_every=2, eval_every=0)
    run_trainer(raw, stop_at=2)
    raw["train"]["global_batch"] = 8
    trainer = run_trainer(raw)
    seq_len = raw["data"]["seq_len"]
    want = {1: 4 * seq_len, 2: 8 * seq_len, 3: 16 * seq_len, 4: 24 * seq_len}
    assert dict(losses(tmp_path / "run", "tokens")) == want
    with open(tmp_path / "run" / "summary.json") as f:
        assert json.load(f)["tokens"] == want[4] and trainer.step == 4


def gradients_at_step(trainer) -> dict:
    """A dict that the trainer's optimizer steps fill with each parameter's gradient as it steps with it
    (after accumulation and clipping), by name."""
    seen, step = {}, trainer.optimizer.step

    def capture(*args, **kwargs):
        seen.update({n: p.grad.clone() for n, p in trainer.core.named_parameters()})
        return step(*args, **kwargs)

    trainer.optimizer.step = capture
    return seen


def _whole_batch_reference(trainer, model, packing):
    """Loss and gradients of the first step's ``global_batch`` rows in float64: each row (``eos``) or each
    document piece of a row (``cu_seqlens``) run as a sequence of its own, the cross-entropy summed over
    every target of the batch and divided by their count."""
    t = trainer.cfg.train
    rows = PackedRows(trainer.train_rows.shards, trainer.cfg.data.seq_len)
    order = RowOrder(len(rows), t.seed)
    model = copy.deepcopy(model).double()
    total, count = 0.0, 0
    for n in range(t.global_batch):
        tokens, starts = rows.row(order[n])
        tokens = torch.from_numpy(tokens)
        cuts = [0, *(int(p) for p in starts), len(tokens) - 1] if packing == "cu_seqlens" else [0, len(tokens) - 1]
        for a, b in zip(cuts[:-1], cuts[1:]):
            logits = model(input_ids=tokens[a:b][None], use_cache=False).logits[0]
            total = total + F.cross_entropy(logits, tokens[a + 1:b + 1], reduction="sum")
            count += b - a
    loss = total / count
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("packing", ["cu_seqlens", "eos"])
def test_accumulated_micro_batches_are_the_whole_batchs_token_mean(tmp_path, packing):
    """Global batch 4 in 1, 2 or 4 micro-batches: the logged loss of step 1 and the gradient the optimizer
    steps with (clipping off) are the mean over all the batch's targets, as one float64 pass over its rows
    gives; every micro-batch holds micro_batch x seq_len targets, so the mean of micro-batch means is it."""
    for micro_batch in (4, 2, 1):
        raw = recipe(tmp_path, f"mb{micro_batch}-{packing}", steps=1, micro_batch=micro_batch, eval_every=0)
        raw["data"]["packing"] = packing
        raw["optim"].update(clip_grad_norm=0.0, warmup_steps=1)
        trainer = Trainer(config_from_dict(raw))
        try:
            assert trainer.accum == 4 // micro_batch
            ref_loss, ref_grads = _whole_batch_reference(trainer, trainer.core, packing)
            seen = gradients_at_step(trainer)
            trainer.train()
        finally:
            trainer.close()
        (logged,) = [l for _, l in losses(tmp_path / f"mb{micro_batch}-{packing}")]
        assert abs(logged - ref_loss) <= 2e-6 * ref_loss, (micro_batch, logged, ref_loss)
        for name, grad in ref_grads.items():
            scale = grad.abs().max().item()
            err = (seen[name].double() - grad).abs().max().item()
            assert err <= 3e-5 * scale + 1e-9, (micro_batch, name, err, scale)


def test_resume_refuses_a_validation_source_that_moves_documents_into_training(tmp_path):
    """Without data.val_source every val_every-th document is held out of training; setting one puts them
    back, so the checkpoint's data position would point into other rows: refused. Another validation file,
    where one was set, changes no training row and is taken."""
    from test_train import write_corpus

    write_corpus(tmp_path / "val.jsonl", n=30, seed=1)
    write_corpus(tmp_path / "val2.jsonl", n=30, seed=2)
    run_trainer(recipe(tmp_path, "held-out"), stop_at=2)
    raw = recipe(tmp_path, "held-out")
    raw["data"].update(val_source=str(tmp_path / "val.jsonl"), out_dir=str(tmp_path / "data-val"))
    with pytest.raises(ValueError, match=r"\(data\.val_source None there, '.*val\.jsonl' here\)"):
        Trainer(config_from_dict(raw))

    run_trainer(raw | {"train": raw["train"] | {"out_dir": str(tmp_path / "own")}}, stop_at=2)
    raw2 = recipe(tmp_path, "own")
    raw2["data"].update(val_source=str(tmp_path / "val2.jsonl"), out_dir=str(tmp_path / "data-val2"), val_every=5)
    trainer = Trainer(config_from_dict(raw2))
    try:
        assert trainer.step == 2
    finally:
        trainer.close()
    raw2["data"].update(val_source=None, out_dir=str(tmp_path / "data-none"))
    with pytest.raises(ValueError, match=r"\(data\.val_source '.*val\.jsonl' there, None here[;)]"):
        Trainer(config_from_dict(raw2))


def test_a_resume_path_that_is_no_checkpoint_names_train_resume(tmp_path):
    run_trainer(recipe(tmp_path, "run"), stop_at=2)
    for path in (tmp_path / "run", tmp_path / "absent"):
        with pytest.raises(ValueError, match=rf"^train\.resume={str(path)!r} is no complete checkpoint"):
            Trainer(config_from_dict(recipe(tmp_path, "other", resume=str(path))))


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@fsdp2_on_cpu
def test_checkpoints_move_between_one_process_and_fsdp2(tmp_path):
    """One process stopped at step 2 resumes under 2-process FSDP2 (gloo), and an FSDP2 run stopped at
    step 2 resumes in one process: both log the uninterrupted one-process run's losses and evaluations to
    float32 rounding, and end with its weights; the FSDP2 checkpoint holds the one-process names and shapes."""
    def raw(out, strategy):
        return recipe(tmp_path, out, strategy=strategy, micro_batch=1)

    full = run_trainer(raw("full", "single"))
    run_trainer(raw("single-then-fsdp2", "single"), stop_at=2)
    paths = {}
    for name in ("single-then-fsdp2", "fsdp2-then-single"):
        paths[name] = str(tmp_path / f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(raw(name, "fsdp2"), f)
    _torchrun(tmp_path, [[paths["fsdp2-then-single"], 2], [paths["single-then-fsdp2"], None]])
    state = load_checkpoint(latest_checkpoint(str(tmp_path / "fsdp2-then-single" / "checkpoints")))
    assert state["data"]["world_size"] == 2 and state["step"] == 2
    reference = full.core.state_dict()
    assert {k: v.shape for k, v in state["model"].items()} == {k: v.shape for k, v in reference.items()}
    run_trainer(raw("fsdp2-then-single", "single"))
    for name in ("single-then-fsdp2", "fsdp2-then-single"):
        for key in ("loss", "val_loss"):
            a, b = losses(tmp_path / "full", key), losses(tmp_path / name, key)
            assert [s for s, _ in a] == [s for s, _ in b], (name, key)
            for (_, x), (_, y) in zip(a, b):
                assert abs(x - y) <= 1e-5 * abs(x), (name, key, a, b)
        weights = final_weights(tmp_path / name)
        for k, v in reference.items():
            torch.testing.assert_close(weights[k], v, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name} {k}: {m}")
