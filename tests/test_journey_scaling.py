"""The sizing and measuring commands a run is planned with: ``falcon-fwa params`` against counts of each
layer's weights by hand, and ``falcon-fwa throughput``'s ``--out`` file."""
from __future__ import annotations

import json

import pytest

from falcon_fwa.cli import main

D, H, KD, VD, M, L, TAPS = 48, 3, 8, 24, 40, 3, 4  # width, heads, key/value width per head, MLP, layers, taps
SHAPE = f"hidden_size={D},num_heads={H},head_k_dim={KD},head_v_dim={VD},intermediate_size={M}," \
        f"num_hidden_layers={L},conv_size={TAPS}"

# one layer's mixer weights, each term a weight of the layer (no biases but the gates' per-head offsets)
_QKV_O = D * H * KD * 2 + D * H * VD + H * VD * D  # q, k (3 heads of 8), v (3 of 24), o back to the width
_OUT_GATE = D * H * VD  # g_proj
_O_NORM = VD  # the per-head output RMSNorm's gain (shared by the heads)
_CONV = TAPS * H * (KD + KD + VD)  # depthwise kernels on q, k, v
_GATE = D * H + H  # one per-head projection from the width and its offset
MIXER = {
    "falcon": _QKV_O + _OUT_GATE + _O_NORM + _CONV + 2 * _GATE,  # ctx-eta gain and the ridge
    "deltanet": _QKV_O + _O_NORM + _CONV + _GATE,  # sigmoid beta; no output gate
    "gated_deltanet": _QKV_O + _OUT_GATE + _O_NORM + _CONV + 2 * _GATE + H,  # beta, decay and A_log
    "mamba2": _QKV_O + _OUT_GATE + _O_NORM + _CONV + _GATE + H + H,  # dt, A_log and D
    "retnet": _QKV_O + _OUT_GATE + _O_NORM,  # fixed decays: no gate weights, no convolution
    "transformer": 4 * D * D,  # q, k, v, o at the full width
}


def _table(capsys, argv):
    assert main(["params", *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):  # the closing line that names the commit
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[1]] = [int(c.split()[0].replace(",", "")) for c in cells[7:12]]
    return rows


def test_params_counts_every_mixer_at_overridden_shapes_as_its_layers_weights_by_hand(capsys):
    """Every mixer at width 48, 3 heads of 8-wide keys and 24-wide values, MLP 40, 3 layers, 4 taps, by the
    table's columns (embedding, mixers, MLPs, norms, total): ``--vocab-size 50`` on every preset but one whose
    own ``vocab_size=70`` wins, and untied heads counted twice."""
    specs = {"falcon": f"tiny-falcon:{SHAPE}", "deltanet": f"tiny-deltanet:{SHAPE},tie_word_embeddings=false",
             "gated_deltanet": f"tiny-gated_deltanet:{SHAPE}", "mamba2": f"tiny-mamba2:{SHAPE},vocab_size=70",
             "retnet": f"tiny-retnet:{SHAPE}",
             "transformer": f"tiny-transformer:hidden_size={D},num_heads={H},intermediate_size={M},"
                            f"num_hidden_layers={L},tie_word_embeddings=false"}
    rows = _table(capsys, ["--vocab-size", "50", *specs.values()])
    for mixer, spec in specs.items():
        vocab = 70 if mixer == "mamba2" else 50
        embedding = vocab * D * (2 if "tie_word_embeddings=false" in spec else 1)
        mlp = L * 3 * D * M  # gate, up and down
        norms = L * 2 * D + D  # the two pre-norms of each block and the final norm
        want = [embedding, L * MIXER[mixer], mlp, norms, embedding + L * MIXER[mixer] + mlp + norms]
        assert rows[mixer] == want, mixer


def test_throughput_out_in_a_folder_not_made_yet_holds_every_row(tmp_path, capsys):
    """``--out`` in a folder that does not exist yet: the folder is made and each row is appended as it is
    measured (the first row's write used to end the command with the file's error after one measurement);
    the file's rows are those of standard output, and each one's tokens/s is its tokens per step over its
    mean timed step."""
    out = tmp_path / "new" / "rows.jsonl"
    assert main(["throughput", "--preset", "tiny-transformer", "--seq-len", "8", "16", "--batch-tokens", "16",
                 "--steps", "2", "--warmup", "0", "--device", "cpu", "--fp32", "--no-progress",
                 "--out", str(out)]) == 0
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert kept == printed and [(r["seq_len"], r["batch_size"]) for r in kept] == [(8, 2), (16, 1)]
    for r in kept:
        assert r["tokens_per_step"] == 16 and r["timed_steps"] == 2
        assert r["tokens_per_s"] == pytest.approx(16 / r["step_s"], rel=1e-12)


@pytest.mark.parametrize("warmup", [1, 0])
def test_the_first_step_counts_in_the_timing_only_under_warmup_0(monkeypatch, warmup):
    """Steps of 10, 1, 1 and 1 s on the module's clock: with one warm-up step the 10-s first step is
    ``first_step_s`` only and the three 1-s steps are timed (mean 1 s: 16 tokens per second); with
    ``--warmup 0`` the first step is the first timed one and, 10 s against ``max_seconds`` 5, ends the
    timing after it (16 tokens in 10 s)."""
    from falcon_fwa.train import throughput

    ticks = iter([0.0, 10.0, 11.0, 12.0, 13.0])  # the start, then the end of each step
    monkeypatch.setattr(throughput, "_clock", lambda: next(ticks))
    row = throughput.measure(throughput.parse_preset("tiny-transformer"), seq_len=8, batch_size=2, steps=3,
                             warmup=warmup, min_steps=1, max_seconds=5.0, device="cpu", bf16=False)
    assert row["first_step_s"] == 10.0
    if warmup:
        assert (row["timed_steps"], row["step_s"], row["stopped"], row["warmup_s"]) == (3, 1.0, None, 10.0)
        assert row["tokens_per_s"] == 16.0
    else:
        assert (row["timed_steps"], row["step_s"], row["stopped"], row["warmup_s"]) == (1, 10.0, "max_seconds", 0.0)
        assert row["tokens_per_s"] == 1.6


@pytest.mark.parametrize("width", [64, 256])
def test_mup_init_and_learning_rates_of_every_mixer_follow_the_width_multiplier(width):
    """Width 64 and 256 over a base width of 16 (``m`` = 4 and 16), untied heads, ``initializer_range`` 0.05:
    the ``matrices`` group is exactly every ``nn.Linear`` weight (output head included) at ``lr / m``, each drawn
    with std ``0.05 / sqrt(m)`` (``o_proj`` and ``down_proj`` also ``/ sqrt(2L)``); the embedding keeps std 0.05
    and ``lr``; the rest (gains, offsets, kernels) ``lr`` without weight decay."""
    import math

    import torch
    from torch import nn

    from falcon_fwa.models import FalconForCausalLM, get_preset
    from falcon_fwa.train.model_factory import param_groups

    m = width / 16
    for mixer in MIXER:
        torch.manual_seed(0)
        config = get_preset(f"tiny-{mixer}", hidden_size=width, num_heads=2, mup_base_width=16, vocab_size=256,
                            tie_word_embeddings=False, initializer_range=0.05)
        model = FalconForCausalLM(config)
        groups = {g["name"]: g for g in param_groups(model, lr=1e-3, weight_decay=0.1)}
        linear = {name: mod.weight for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
        assert {id(p) for p in groups["matrices"]["params"]} == {id(p) for p in linear.values()}, mixer
        assert "lm_head" in linear and groups["matrices"]["lr"] == pytest.approx(1e-3 / m, rel=1e-15)
        assert (groups["matrices"]["weight_decay"], groups["embedding"]["lr"], groups["embedding"]["weight_decay"],
                groups["vectors"]["lr"], groups["vectors"]["weight_decay"]) == (0.1, 1e-3, 0.1, 1e-3, 0.0)
        assert groups["embedding"]["params"] == [model.model.embed_tokens.weight]
        for name, w in linear.items():
            want = 0.05 / math.sqrt(m) / (math.sqrt(2 * config.num_hidden_layers)
                                          if name.endswith(("o_proj", "down_proj")) else 1.0)
            if w.numel() >= 2000:  # enough draws for a std within 10 %
                assert float(w.detach().double().std()) == pytest.approx(want, rel=0.1), (mixer, name)
        assert float(model.model.embed_tokens.weight.detach().std()) == pytest.approx(0.05, rel=0.05)


def test_a_sweep_of_recipes_of_two_sequence_lengths_names_each_models_length(tmp_path, monkeypatch, cpu_machine):
    """Two recipes, rows of 32 and of 16 tokens: the table's header gives each model its own length (it gave
    the first recipe's for every run); recipes of one length keep the single number."""
    from conftest import tiny_lm_recipe
    from falcon_fwa.train import scaling

    recipe = json.loads(open(tiny_lm_recipe(tmp_path)).read())
    recipe["data"]["seq_len"] = 16
    short = tmp_path / "short.json"
    short.write_text(json.dumps(recipe))
    seen = {}
    monkeypatch.setattr(scaling, "_sweep", lambda args, names, meta, micro, global_batch: seen.update(meta) or 0)
    argv = ["scaling", "--names", "long", "short", "--gpus", "1", "--strategies", "ddp", "--noise-seeds", "0",
            "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "RESULTS"), "--machine", "M", "--commit", "c"]
    assert main([argv[0], "--configs", str(tmp_path / "recipe.json"), str(short), *argv[1:]]) == 0
    head = scaling.markdown([], seen).splitlines()[2]
    assert "2 rows x (long: 32, short: 16) tokens (micro batch 2 per process;" in head
    assert "the same for every run of a model." in head
    seen.clear()
    assert main([argv[0], "--configs", str(tmp_path / "recipe.json"), str(tmp_path / "recipe.json"), *argv[1:]]) == 0
    head = scaling.markdown([], seen).splitlines()[2]
    assert "2 rows x 32 tokens (micro batch 2 per process;" in head and "the same for every run." in head
