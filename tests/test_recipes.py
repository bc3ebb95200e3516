"""The shipped recipes as their docs describe them: the paper's ten (configs/paper/README.md, base.yaml, Section 5.1
and Appendix B) train every model on the same data and schedule, with the optimizer groups of the stated muP
multipliers; the seven small ones (configs/small/base.yaml) share one schedule and land within 1% of
Falcon-1A.3's parameters; the Table 2 average is the paper's own Avg. column."""
import dataclasses
import glob
import os

import pytest
import torch

from falcon_fwa.eval.harness import paper_columns
from falcon_fwa.models import FalconForCausalLM, count_parameters, get_preset
from falcon_fwa.train.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _recipes(kind):
    paths = sorted(glob.glob(os.path.join(ROOT, "configs", kind, "*.yaml")))
    return {os.path.basename(p)[:-5]: load_config(p) for p in paths if not p.endswith("base.yaml")}


def _shared(cfg):
    """Everything of a recipe but its model and run folder."""
    raw = dataclasses.asdict(cfg)
    raw.pop("model")
    raw["train"].pop("out_dir")
    return raw


def test_paper_recipes_train_every_model_on_the_same_data_and_schedule():
    """One recipe per model of Tables 1-2 (and Falcon-1.3), all alike but for the model: GPT-2 tokens of
    FineWeb-Edu sample-100BT (0.1% held out), rows of 1,024, 480 rows a step (20 a GPU on one 4-GPU node, 6
    accumulation steps), 100k steps, bf16, AdamW (0.9, 0.95), eps 1e-8, 2,000 warmup steps then cosine to 10%,
    weight decay 0.1, clipping 1.0, validation on 8 x 480 rows; the presets' vocabulary holds GPT-2's 50,257."""
    recipes = _recipes("paper")
    assert sorted(recipes) == sorted([
        "transformer-124m", "retnet-130m", "mamba2-130m", "deltanet-130m", "gated_deltanet-130m",
        "falcon-1a.1-130m", "falcon-1a.2-130m", "falcon-1a.3-130m", "falcon-3a.3-130m", "falcon-1.3-130m"])
    first = _shared(next(iter(recipes.values())))
    for name, cfg in recipes.items():
        assert cfg.model.preset == name and cfg.model.overrides == {}, name
        assert cfg.train.out_dir == f"runs/paper/{name}"
        assert _shared(cfg) == first, name
        assert get_preset(name).vocab_size == 50304 >= 50257 and get_preset(name).tie_word_embeddings
    cfg = recipes["falcon-1a.3-130m"]
    d, o, t = cfg.data, cfg.optim, cfg.train
    assert (d.train_source, d.val_source, d.val_every, d.tokenizer, d.text_field, d.seq_len, d.packing) == (
        "hf:HuggingFaceFW/fineweb-edu:sample-100BT", None, 1000, "gpt2", "text", 1024, "cu_seqlens")
    assert (o.lr, o.betas, o.eps, o.weight_decay, o.warmup_steps, o.min_lr_ratio, o.clip_grad_norm) == (
        1e-3, [0.9, 0.95], 1e-8, 0.1, 2000, 0.1, 1.0)
    assert (t.steps, t.global_batch, t.micro_batch, t.dtype) == (100_000, 480, 20, "bf16")
    assert t.global_batch // (4 * t.micro_batch) == 6 and t.global_batch % (4 * t.micro_batch) == 0
    assert t.eval_batches * t.global_batch == 3840


@pytest.mark.parametrize("name", ["falcon-1a.3-130m", "transformer-124m"])
def test_paper_models_run_the_hidden_matrices_at_a_third_of_the_peak(name):
    """muP at width 768 over the base width 256: every matrix but the embedding at lr / 3 with weight decay, the
    tied embedding at lr with weight decay, vectors (norm gains, gate offsets, convolution taps) at lr without;
    the groups hold every parameter once."""
    with torch.device("meta"):
        model = FalconForCausalLM(get_preset(name))
    groups = {g["name"]: g for g in model.param_groups(lr=1e-3, weight_decay=0.1)}
    assert (groups["matrices"]["lr"], groups["matrices"]["weight_decay"]) == (pytest.approx(1e-3 / 3), 0.1)
    assert (groups["embedding"]["lr"], groups["embedding"]["weight_decay"]) == (1e-3, 0.1)
    assert (groups["vectors"]["lr"], groups["vectors"]["weight_decay"]) == (1e-3, 0.0)
    assert all(p.dim() == 2 for p in groups["matrices"]["params"])
    assert all(p.dim() != 2 for p in groups["vectors"]["params"])
    assert groups["embedding"]["params"] == [model.get_input_embeddings().weight]
    counted = sum(p.numel() for g in groups.values() for p in g["params"])
    assert counted == count_parameters(get_preset(name))["total"]


def test_small_recipes_share_one_schedule_within_one_percent_of_falcon_1a3():
    """configs/small/base.yaml: 6 layers, width 384, 6 heads, byte tokens (257, vocabulary 320), rows of 512,
    32 a step, 1,500 steps (24.6M tokens); every model within 1% of Falcon-1A.3's 11,685,192 parameters."""
    recipes = _recipes("small")
    assert len(recipes) == 7
    first = _shared(recipes["falcon-1a.3"])
    reference = count_parameters(get_preset("falcon-1a.3-130m", **recipes["falcon-1a.3"].model.overrides))["total"]
    assert reference == 11_685_192
    for name, cfg in recipes.items():
        assert _shared(cfg) == first, name
        config = get_preset(cfg.model.preset, **cfg.model.overrides)
        assert (config.num_hidden_layers, config.hidden_size, config.num_heads) == (6, 384, 6), name
        assert config.vocab_size == 64 * -(-257 // 64) == 320, name
        assert abs(count_parameters(config)["total"] / reference - 1) < 0.01, name
    assert recipes["falcon-1.3"].model.overrides["rule"] == "1"
    t = recipes["falcon-1a.3"].train
    assert t.steps * t.global_batch * recipes["falcon-1a.3"].data.seq_len == 24_576_000


# Table 2 of the paper, zero-shot then one-shot: PIQA, Hella.*, Wino., ARC-e, ARC-c*, OBQA*, Social IQA, SciQ, Avg.
TABLE2 = [
    [65.67, 37.54, 51.70, 52.36, 27.65, 31.60, 38.84, 79.90, 48.16],
    [64.91, 35.36, 49.64, 57.62, 26.28, 32.20, 37.97, 80.40, 48.05],
    [66.32, 36.89, 50.75, 58.16, 26.62, 32.60, 38.38, 80.70, 48.80],
    [66.38, 37.15, 52.33, 57.37, 26.79, 34.00, 39.00, 78.00, 48.88],
    [65.51, 37.75, 49.72, 58.88, 27.90, 31.60, 38.28, 80.60, 48.78],
    [66.05, 37.27, 50.67, 57.62, 27.65, 31.60, 38.95, 81.10, 48.86],
    [67.03, 37.29, 52.33, 57.37, 25.94, 33.20, 38.84, 82.40, 49.30],
    [66.10, 37.55, 50.12, 59.01, 26.79, 32.00, 37.82, 82.20, 48.95],
    [65.34, 37.30, 50.99, 57.37, 26.37, 33.60, 39.41, 81.60, 49.00],
    [66.43, 37.55, 50.28, 59.64, 29.01, 30.00, 39.82, 84.60, 49.67],
    [65.13, 35.19, 49.64, 56.78, 25.85, 28.80, 36.44, 81.50, 47.42],
    [66.70, 36.61, 51.07, 58.63, 26.96, 32.40, 37.97, 82.90, 49.16],
    [66.27, 36.67, 50.36, 57.70, 27.39, 32.00, 37.72, 79.90, 48.50],
    [65.40, 37.81, 51.30, 58.29, 26.88, 30.00, 37.26, 81.60, 48.57],
    [66.81, 37.41, 50.75, 57.53, 27.99, 32.40, 37.92, 81.80, 49.08],
    [66.38, 36.97, 52.96, 57.32, 27.82, 31.40, 37.56, 83.20, 49.20],
    [65.78, 37.22, 49.72, 58.88, 27.73, 31.40, 37.97, 82.40, 48.89],
    [65.72, 36.47, 51.78, 58.29, 26.54, 32.00, 38.23, 83.20, 49.03],
]


def test_table2_columns_reproduce_the_papers_average_of_every_row():
    """Each of the paper's 18 rows, given to ``paper_columns`` as the harness reports it (the starred tasks'
    acc_norm, the others' acc, as fractions; the other metric a decoy), gives back its eight columns and its
    Avg. to the table's two decimals."""
    tasks = [("piqa", "acc"), ("hellaswag", "acc_norm"), ("winogrande", "acc"), ("arc_easy", "acc"),
             ("arc_challenge", "acc_norm"), ("openbookqa", "acc_norm"), ("social_iqa", "acc"), ("sciq", "acc")]
    for row in TABLE2:
        results = {"results": {}}
        for (task, metric), value in zip(tasks, row):
            decoy = "acc" if metric == "acc_norm" else "acc_norm"
            results["results"][task] = {f"{metric},none": value / 100, f"{decoy},none": 0.0}
        cols = list(paper_columns(results)["table2"].values())
        assert cols[:8] == pytest.approx(row[:8], abs=1e-9)
        assert abs(cols[8] - row[8]) <= 0.005 + 1e-9, row
