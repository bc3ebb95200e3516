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

