"""More host-side checks of benchmarks/bench_kernels.py and plot_kernels.py (CPU only, stand-ins for the GPU)."""
from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MIB = 2**20
B8 = dict(B=8, T=2048, H=16, K=128, V=128)  # the benchmark shape: targets of rules 1A, 1, 2A, 2
B4 = dict(B=4, T=2048, H=16, K=128, V=128)  # the batch the targets of rules 3A and 3 are set at


def _row(op, ms, peak_mib, shape):
    return dict(op=op, mode="fwdbwd", ms=ms, peak_mem_bytes=int(peak_mib * MIB), commit="abc", **shape)


def _rows():
    rows = []
    for shape in (B8, B4):
        rows += [_row("fla-simple-gla", 1.0, 2, shape), _row("fla-gated-delta-rule", 2.0, 4, shape),
                 _row("falcon-1a", 0.5, 1, shape), _row("falcon-1", 1.5, 3, shape),
                 _row("falcon-3a", 1.2, 1, shape), _row("falcon-3", 5.0, 8, shape)]
    return rows


def test_rule_3_and_3a_targets_are_taken_at_batch_4_and_the_others_at_the_benchmark_shape():
    import bench_kernels as bk
    found = {(p["op"], p["shape"][0]): p["target"] for p in bk.fwdbwd_ratios(_rows())}
    # Falcon-3A <= 1.3x chunk_simple_gla and Falcon-3 <= 3x chunk_gated_delta_rule are set at B=4
    assert (found[("falcon-3a", 4)], found[("falcon-3", 4)]) == (1.3, 3.0)
    assert (found[("falcon-3a", 8)], found[("falcon-3", 8)]) == (None, None)
    # Falcon-1A <= 1.0x and Falcon-1 <= 0.8x at the benchmark shape B=8
    assert (found[("falcon-1a", 8)], found[("falcon-1", 8)]) == (1.0, 0.8)
    assert (found[("falcon-1a", 4)], found[("falcon-1", 4)]) == (None, None)


def test_markdown_marks_the_rule_3_target_at_batch_4_only():
    import bench_kernels as bk
    versions = dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p")
    md = bk._markdown(_rows(), versions, "x", [], [])
    assert "| falcon-3 | fla-gated-delta-rule | 4 | 2048 | 16 | 128 | 128 | 2.50 | <= 3.0 | 2.00 |" in md
    assert "| falcon-3 | fla-gated-delta-rule | 8 | 2048 | 16 | 128 | 128 | 2.50 | - | 2.00 |" in md
    paired = dict(op="falcon-3", fla_op="fla-gated-delta-rule", mode="fwdbwd-paired", ms=5.0, fla_ms=2.0, ratio=2.5,
                  ratio_min=2.4, ratio_max=2.6, rounds=3, target=3.0, commit="x", **B4)
    md = bk._markdown([paired], versions, "x", [], [])
    assert "| falcon-3 | fla-gated-delta-rule | 4 | 2048 | 3 | 2.50 | 2.40-2.60 | 5.000 | 2.000 | <= 3.0 |" in md


def test_plot_of_the_committed_batch_4_run_draws_the_rule_3_targets():
    import plot_kernels
    with open(os.path.join(ROOT, "benchmarks", "results", "h200-b4-cf468ed.json")) as f:
        shape, pairs, _ = plot_kernels.pair_ratios(json.load(f))
    assert shape == (4, 2048, 16, 128, 128)
    found = {p["op"]: p["target"] for p in pairs}
    assert (found["falcon-3a"], found["falcon-3"]) == (1.3, 3.0)
    with open(os.path.join(ROOT, "benchmarks", "results", "h200-cf468ed.json")) as f:
        shape, pairs, _ = plot_kernels.pair_ratios(json.load(f))
    found = {p["op"]: p["target"] for p in pairs}
    assert shape == (8, 2048, 16, 128, 128) and (found["falcon-1"], found["falcon-2"]) == (0.8, 1.5)
    assert (found["falcon-3a"], found["falcon-3"]) == (None, None)  # B=8 is not where their targets are set


def test_sweep_runs_at_the_shape_asked_for(tmp_path, monkeypatch):
    import bench_kernels as bk
    monkeypatch.setattr(bk, "_versions", lambda: dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p"))
    monkeypatch.setattr(bk, "autotune_picks", lambda prefix="fla": {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    swept = []
    monkeypatch.setattr(bk, "sweep", lambda shape: swept.append(tuple(shape)) or [])
    bk.main(["--out", str(tmp_path), "--name", "s", "--shape", "1", "64", "2", "16", "16", "--ops", "--sweep",
             "--commit", "x"])
    bk.main(["--out", str(tmp_path), "--name", "t", "--shapes", "1", "--ops", "--sweep", "--commit", "x"])
    assert swept == [(1, 64, 2, 16, 16), bk.SHAPES[1]]
