"""``addition-compare``'s summary: the JSON keeps each mean and spread to two decimals (the per-seed wall times
to one), and the .md table gives one decimal of each figure itself, not of its two-decimal rounding. Two runs
written by hand put the means on the boundaries where the two differ: a mean of 82.25125 is 82.25 in the JSON
and 82.3 in the table (82.2 from 82.25), a mean of 82.1451 is 82.15 in the JSON and 82.1 in the table (82.2
from 82.15), and wall times of 12.54 s and 3.45 s are 12.5 and 3.5 in the JSON, a range of 3-13 s in the .md
(4-12 s from 3.5 and 12.5). Every expected figure is computed here with :mod:`statistics` from the runs'
figures. The verdict keeps stating the JSON's two decimals."""
import json
import statistics
from pathlib import Path

from falcon_fwa.tasks.addition import compare

RECORD = Path(__file__).resolve().parents[1] / "results" / "addition" / "paper_runs"

# seed -> the best step's figures and the run's wall time, chosen so the means sit on rounding boundaries
RUNS = {
    0: ({"step": 1900, "val_acc": 82.25, "mean_acc_ood": 82.14, "acc_d33": 100.0, "acc_d48": 60.0,
         "val_digit_acc": 99.0, "digit_mean_acc_ood": 95.0, "digit_acc_d33": 99.0, "digit_acc_d48": 90.0}, 12.54),
    1: ({"step": 2000, "val_acc": 82.2525, "mean_acc_ood": 82.1502, "acc_d33": 100.0, "acc_d48": 70.0,
         "val_digit_acc": 99.0, "digit_mean_acc_ood": 95.0, "digit_acc_d33": 99.0, "digit_acc_d48": 90.0}, 3.45),
}


def _summary(tmp_path, monkeypatch, capsys):
    """``addition-compare --no-train`` over the two hand-made runs of Falcon-3A.3: its JSON rows and .md."""
    held = json.loads((compare._run_dir(RECORD, "Falcon-3A.3", 0) / "results.json").read_text())
    runs = tmp_path / "runs"
    for seed, (best, wall) in RUNS.items():
        run_dir = compare._run_dir(runs, "Falcon-3A.3", seed)
        run_dir.mkdir(parents=True)
        (run_dir / "results.json").write_text(json.dumps(
            {**held, "seed": seed, "best": {**held["best"], **best}, "wall_time_s": wall}))
    monkeypatch.setattr(compare, "_ood_reference", lambda *a: {})  # the Scale is tested elsewhere
    from falcon_fwa.tasks.addition import plot

    monkeypatch.setattr(plot, "plot_accuracy_vs_width", lambda *a, **k: None)
    monkeypatch.setattr(plot, "plot_lineup_positions", lambda *a, **k: None)
    assert compare.main(["--preset", "paper", "--device", "cpu", "--models", "Falcon-3A.3", "--seeds", "0", "1",
                         "--no-train", "--partial", "--runs", str(runs), "--results", str(tmp_path / "res"),
                         "--name", "t"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "res" / "t.json").read_text())
    md = (tmp_path / "res" / "t.md").read_text()
    assert md in printed  # the summary printed is the one written
    return rows, md


def _figure(key):
    xs = [best[key] for best, _ in RUNS.values()]
    return statistics.mean(xs), statistics.stdev(xs)


def test_the_json_keeps_two_decimals_of_each_mean(tmp_path, monkeypatch, capsys):
    rows, _ = _summary(tmp_path, monkeypatch, capsys)
    (row,) = rows
    assert row["val_acc"] == 82.25 and row["mean_acc_33_48"] == 82.15
    for key, out in (("val_acc", "val_acc"), ("mean_acc_ood", "mean_acc_33_48"), ("acc_d48", "acc_d48"),
                     ("step", "best_step")):
        mean, std = _figure(key)
        assert row[out] == round(mean, 2) and row[f"{out}_std"] == round(std, 2)
    assert [p["wall_time_s"] for p in row["per_seed"]] == [12.5, 3.5]
    assert [p["val_acc"] for p in row["per_seed"]] == [82.25, 82.25]  # 82.2525 to two decimals


def test_the_table_gives_one_decimal_of_each_mean_itself(tmp_path, monkeypatch, capsys):
    _, md = _summary(tmp_path, monkeypatch, capsys)
    (line,) = [ln for ln in md.splitlines() if ln.startswith("| Falcon-3A.3 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    one = lambda key: "{:.1f} ± {:.1f}".format(*_figure(key))  # noqa: E731
    assert cells[3] == one("val_acc") == "82.3 ± 0.0"
    assert cells[4] == one("mean_acc_ood") == "82.1 ± 0.0"
    assert cells[2] == "{:.0f} ± {:.0f}".format(*_figure("step")) == "1950 ± 71"
    assert cells[5] == f"{_figure('acc_d33')[0]:.1f}/{_figure('acc_d48')[0]:.1f}" == "100.0/65.0"
    # the runs' wall times, 12.54 s and 3.45 s, to whole seconds
    assert "wall time of each run: 3-13 s" in md


def test_the_verdict_states_the_jsons_two_decimals(tmp_path, monkeypatch, capsys):
    """Against the paper's 87.2: the mean 82.1451 is 82.15 as the JSON keeps it, short by 5.05."""
    _, md = _summary(tmp_path, monkeypatch, capsys)
    assert "- Falcon-3A.3 mean exact-match accuracy 82.15 vs the paper's 87.2: short by 5.05 points (-5.05)." in md


def test_unrounded_rows_are_the_means_over_the_seeds():
    """``summarize(..., rounded=False)``: each figure the plain mean and sample spread of the seeds'."""
    held = json.loads((compare._run_dir(RECORD, "Falcon-3A.3", 0) / "results.json").read_text())
    results = {"Falcon-3A.3": [{**held, "seed": s, "best": {**held["best"], **best}, "wall_time_s": wall}
                               for s, (best, wall) in RUNS.items()]}
    (exact,) = compare.summarize(results, rounded=False)
    (kept,) = compare.summarize(results)
    for key, out in (("val_acc", "val_acc"), ("mean_acc_ood", "mean_acc_33_48"), ("acc_d48", "acc_d48")):
        mean, std = _figure(key)
        assert abs(exact[out] - mean) < 1e-12 and abs(exact[f"{out}_std"] - std) < 1e-12
        assert kept[out] == round(exact[out], 2)
    assert [p["wall_time_s"] for p in exact["per_seed"]] == [12.54, 3.45]
