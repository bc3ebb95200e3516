"""The plot of one kernel-benchmark process (benchmarks/plot_kernels.py): the Falcon / fla ratios it draws,
which rows it takes them from, the pairs it skips, its errors, and the PNG, from the command line and from
``bench_kernels.py --plot``."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

MIB = 2**20
BENCH_SHAPE = dict(B=8, T=2048, H=16, K=128, V=128)  # the shape the targets are set at


def _row(op, ms, peak_mib, mode="fwdbwd", graph_ms=None, **shape):
    row = dict(op=op, mode=mode, ms=ms, peak_mem_bytes=int(peak_mib * MIB), commit="abc1234", **(shape or BENCH_SHAPE))
    if graph_ms is not None:
        row["graph_ms"] = graph_ms
    return row


def _rows():
    """falcon-1 has no graph time (eager ratio 1.5 / 2.0), falcon-2 and falcon-1a have one on both sides (2.4 / 1.6,
    0.6 / 0.8), falcon-2a has no fla-gla row, falcon-3a and the other variants no row of their own; the fwd rows
    and the second shape's rows must not be read."""
    other = dict(B=2, T=8192, H=16, K=128, V=128)
    return [
        _row("fla-gated-delta-rule", 9.0, 99, mode="fwd"),
        _row("fla-gated-delta-rule", 2.0, 4, graph_ms=1.6),
        _row("fla-simple-gla", 1.0, 2, graph_ms=0.8),
        _row("falcon-1", 100.0, 1, mode="fwd"),
        _row("falcon-1", 1.5, 3),
        _row("falcon-2", 9.0, 4.4, graph_ms=2.4),
        _row("falcon-1a", 0.5, 1, graph_ms=0.6),
        _row("falcon-2a", 3.0, 1, graph_ms=3.0),
        _row("fla-gated-delta-rule", 7.0, 8, **other),
        _row("falcon-1", 70.0, 80, **other),
    ]


def test_ratios_are_the_hand_computed_ones_at_the_first_shape_with_the_targets():
    import plot_kernels
    shape, pairs, _ = plot_kernels.pair_ratios(_rows())
    assert shape == (8, 2048, 16, 128, 128)
    found = {p["op"]: p for p in pairs}
    assert list(found) == ["falcon-1a", "falcon-1", "falcon-2"]  # in the order of the pairings
    # falcon-1: its row has no graph time, so both sides' eager medians: 1.5 / 2.0 (not 1.5 / 1.6)
    assert found["falcon-1"]["time_ratio"] == pytest.approx(0.75) and found["falcon-1"]["device"] is False
    assert found["falcon-1"]["mem_ratio"] == pytest.approx(3 / 4)
    # graph times preferred where both rows have them: 2.4 / 1.6 and 0.6 / 0.8, not 9.0 / 2.0 and 0.5 / 1.0
    assert found["falcon-2"]["time_ratio"] == pytest.approx(1.5) and found["falcon-2"]["device"] is True
    assert found["falcon-1a"]["time_ratio"] == pytest.approx(0.75) and found["falcon-1a"]["device"] is True
    assert found["falcon-2"]["mem_ratio"] == pytest.approx(4.4 / 4)
    assert found["falcon-1a"]["mem_ratio"] == pytest.approx(1 / 2)
    assert found["falcon-2"]["fla_op"] == "fla-gated-delta-rule" and found["falcon-1a"]["fla_op"] == "fla-simple-gla"
    # the benchmark's targets: rule 1 <= 0.8x, rule 1A <= 1.0x, rule 2 <= 1.5x of the counterpart
    assert (found["falcon-1"]["target"], found["falcon-1a"]["target"], found["falcon-2"]["target"]) == (0.8, 1.0, 1.5)


def test_graph_times_count_only_where_both_rows_have_them():
    import plot_kernels
    # the Falcon side has a graph time, the fla side none: both eager medians, 3.0 / 4.0 (not 1.0 / 4.0)
    _, pairs, _ = plot_kernels.pair_ratios([_row("falcon-2a", 3.0, 1, graph_ms=1.0), _row("fla-gla", 4.0, 1)])
    assert [(p["op"], p["time_ratio"], p["device"]) for p in pairs] == [("falcon-2a", pytest.approx(0.75), False)]


def test_a_first_shape_other_than_the_benchmark_shape_has_no_targets():
    import plot_kernels
    wide = dict(B=4, T=2048, H=16, K=256, V=256)
    shape, pairs, _ = plot_kernels.pair_ratios([_row("falcon-1", 3.0, 3, **wide),
                                                _row("fla-gated-delta-rule", 2.0, 2, **wide)] + _rows())
    assert shape == (4, 2048, 16, 256, 256)
    assert [(p["op"], p["time_ratio"], p["target"]) for p in pairs] == [("falcon-1", pytest.approx(1.5), None)]


def test_missing_pairs_are_skipped_and_named():
    import plot_kernels
    _, pairs, skipped = plot_kernels.pair_ratios(_rows())
    assert "falcon-2a / fla-gla (no row of fla-gla)" in skipped  # its own row is there, the counterpart's is not
    assert "falcon-3a / fla-simple-gla (no row of falcon-3a)" in skipped
    assert "falcon-3 / fla-gated-delta-rule (no row of falcon-3)" in skipped
    assert {s.split(" / ")[0] for s in skipped}.isdisjoint(p["op"] for p in pairs)


@pytest.mark.parametrize("rows, match", [
    ([], "no fwd\\+bwd rows"),
    ([_row("falcon-1", 1.0, 1, mode="fwd"), _row("fla-gated-delta-rule", 1.0, 1, mode="fwd")], "no fwd\\+bwd rows"),
    ([_row("falcon-1", 1.0, 1), _row("fla-simple-gla", 1.0, 1)], "no row of fla-gated-delta-rule"),
    ([dict(_row("falcon-1", 1.0, 1), process="a"), dict(_row("fla-gated-delta-rule", 1.0, 1), process="b")],
     "2 processes"),
])
def test_unsuitable_rows_raise_naming_what_is_missing(rows, match):
    import plot_kernels
    with pytest.raises(ValueError, match=match):
        plot_kernels.pair_ratios(rows)


def _is_png(path):
    data = open(path, "rb").read()
    return len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_is_written_and_names_the_skipped_pairs(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import plot_kernels
    out = tmp_path / "sub" / "rows.png"
    assert plot_kernels.plot_ratios(_rows(), out, gpu="GPU") == out
    assert _is_png(out)
    assert "falcon-2a / fla-gla (no row of fla-gla)" in capsys.readouterr().out


def test_command_line_writes_the_png_and_names_its_argument_on_bad_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import plot_kernels
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_rows()))
    plot_kernels.main([str(good), "--out", str(tmp_path / "good.png")])
    assert _is_png(tmp_path / "good.png") and "wrote" in capsys.readouterr().out
    plot_kernels.main([str(good)])  # the default: next to the rows
    assert _is_png(tmp_path / "good.png")
    cases = {"empty.json": "[]", "fwd.json": json.dumps([_row("falcon-1", 1.0, 1, mode="fwd")]),
             "lonely.json": json.dumps([_row("falcon-1", 1.0, 1)]), "dict.json": "{}", "broken.json": "[{"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(SystemExit) as exc:
            plot_kernels.main([str(tmp_path / name), "--out", str(tmp_path / f"{name}.png")])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and f"ROWS.json {tmp_path / name}:" in err, (name, err)
        assert not (tmp_path / f"{name}.png").exists()
    with pytest.raises(SystemExit):
        plot_kernels.main([str(tmp_path / "absent.json")])
    assert "ROWS.json" in capsys.readouterr().err


def test_committed_h100_rows_give_the_readme_ratios():
    # README.md, "Kernel speed and memory": on the H100 of h100-bf2b865.md the device ratios are 0.77x (1A),
    # 0.78x (1), 1.13x (3A), 0.94x (2A), 2.51x (2) and 2.70x (3)
    import plot_kernels
    with open(os.path.join(ROOT, "benchmarks", "results", "h100-bf2b865.json")) as f:
        _, pairs, _ = plot_kernels.pair_ratios(json.load(f))
    found = {p["op"]: round(p["time_ratio"], 2) for p in pairs if p["device"]}
    assert found == {"falcon-1a": 0.77, "falcon-1": 0.78, "falcon-3a": 1.13, "falcon-2a": 0.94, "falcon-2": 2.51,
                     "falcon-3": 2.70}


def test_kernel_benchmark_plot_option_draws_its_rows_through_the_same_function(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import bench_kernels as bk
    import plot_kernels
    monkeypatch.setattr(bk, "_versions", lambda: dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p"))
    monkeypatch.setattr(bk, "autotune_picks", lambda prefix="fla": {})
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    times = {id(bk.OPS["falcon-1"]): 1.5, id(bk.OPS["fla-gated-delta-rule"]): 2.0}
    monkeypatch.setattr(bk, "measure", lambda build, shape, mode: (times[id(build)], MIB))
    drawn = []
    real = plot_kernels.plot_ratios
    monkeypatch.setattr(plot_kernels, "plot_ratios", lambda rows, path, gpu=None: drawn.append(
        (plot_kernels.pair_ratios(rows)[1], path, gpu)) or real(rows, path, gpu=gpu))
    bk.main(["--out", str(tmp_path), "--name", "n", "--shapes", "0", "--ops", "falcon-1", "fla-gated-delta-rule",
             "--commit", "x", "--plot"])
    [(pairs, path, gpu)] = drawn
    assert path == os.path.join(str(tmp_path), "n.png") and gpu == "GPU" and _is_png(path)
    assert [(p["op"], p["time_ratio"]) for p in pairs] == [("falcon-1", pytest.approx(0.75))]
    drawn.clear()
    bk.main(["--out", str(tmp_path), "--name", "m", "--shapes", "0", "--ops", "falcon-1", "fla-gated-delta-rule",
             "--commit", "x"])
    assert not drawn and not (tmp_path / "m.png").exists()


def _markdown_ratio_lines(text):
    """``{(op, fla_op, (B, T, H, K, V)): cells after the shape}`` of the ratio table of ``bench_kernels._markdown``."""
    section = text.split("## Ratios against the fla counterparts")[1].split("\n## ")[0]
    found = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 7 and cells[0].startswith("falcon"):
            found[(cells[0], cells[1], tuple(int(c) for c in cells[2:7]))] = cells[7:]
    return found


def test_plot_ratios_are_the_markdown_table_ratios():
    """On one set of rows, the plot draws the ratios the table of ``<name>.md`` lists at the plot's shape: a
    pair with graph times on both sides (their ratio), one with a graph time on one side (eager medians), an
    op timed twice at a shape (its first row, in both), a pair with a failed side (listed as failed, not
    drawn) and a second shape (in the table, not in the plot)."""
    import bench_kernels
    import plot_kernels
    versions = dict(gpu="GPU", torch="t", triton="tr", fla="f", cuda="c", python="p")
    other = dict(B=2, T=8192, H=16, K=128, V=128)
    rows = [
        _row("fla-gated-delta-rule", 4.0, 8, mode="fwd"),
        _row("fla-gated-delta-rule", 2.0, 4, graph_ms=1.6),
        _row("fla-simple-gla", 1.0, 2, graph_ms=0.8),
        _row("fla-gla", 4.0, 5),
        _row("falcon-1", 1.5, 3),
        _row("falcon-1", 3.0, 30),  # the same op again at the same shape: its first row counts
        _row("falcon-2", 9.0, 4.4, graph_ms=2.4),
        _row("falcon-1a", 0.5, 1, graph_ms=0.6),
        _row("falcon-2a", 3.0, 1, graph_ms=1.0),
        dict(op="falcon-3", mode="fwdbwd", error="RuntimeError: out of memory", **BENCH_SHAPE),
        _row("fla-gated-delta-rule", 7.0, 8, **other),
        _row("falcon-1", 14.0, 80, **other),
    ]
    table = _markdown_ratio_lines(bench_kernels._markdown(rows, versions, "x", [], []))
    shape, pairs, _ = plot_kernels.pair_ratios(bench_kernels.timed(rows))
    assert shape == (8, 2048, 16, 128, 128)
    drawn = {(p["op"], p["fla_op"]): p for p in pairs}
    listed = {(op, fla): cells for (op, fla, s), cells in table.items()
              if s == shape and not cells[0].startswith("failed")}
    assert set(drawn) == set(listed) == {("falcon-1a", "fla-simple-gla"), ("falcon-1", "fla-gated-delta-rule"),
                                         ("falcon-2a", "fla-gla"), ("falcon-2", "fla-gated-delta-rule")}
    for key, p in drawn.items():
        eager, graph, target, mem = listed[key]
        assert f"{p['time_ratio']:.2f}" == (graph if p["device"] else eager), key
        assert f"{p['mem_ratio']:.2f}" == mem, key
        assert target == f"<= {p['target']}", key
    # hand-computed: graph 0.6 / 0.8 and 2.4 / 1.6; eager 1.5 / 2.0 (falcon-1's first row) and 3.0 / 4.0
    assert [(p["op"], round(p["time_ratio"], 4), p["device"]) for p in pairs] == [
        ("falcon-1a", 0.75, True), ("falcon-1", 0.75, False), ("falcon-2a", 0.75, False), ("falcon-2", 1.5, True)]
    assert drawn[("falcon-1", "fla-gated-delta-rule")]["mem_ratio"] == pytest.approx(3 / 4)
    assert table[("falcon-3", "fla-gated-delta-rule", shape)][0] == "failed (falcon-3)"
    assert table[("falcon-1", "fla-gated-delta-rule", (2, 8192, 16, 128, 128))] == ["2.00", "-", "-", "10.00"]
