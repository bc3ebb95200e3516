"""``addition-compare``, ``addition`` and their plots held to docs/addition.md and their docstrings, by hand:
which runs count as started or unfinished and how the summary lists them; each run started with the
evaluation seed and every override the lineup was given; the summary's wall-time range of runs trained before
it, its verdict's baseline/variant labels, its Scale's rule names by carry window, an Abacus offset of 0 and a
curriculum of 0 steps stated as such, its failed runs and training command listed; the command recorded as
typed; a lineup that trains: exit status 1 with a failed run, the failures of its own training, no notes
carried over, the position plot at the largest training width and the first and last OOD widths; one seed for
every row when no seed has every model; the commands' documented defaults, counts, threads and window refused
below their bounds naming the option as typed, a CPU run on the preset's threads unless told; the heat map's
column k for answer position k and rows from the smallest width, none without positions; the lineup position
plot's guessing at 1/10 for runs from before the base option and both ends of the training widths named
training; the lineup's runs started seed-major, --jobs at a time, skipping finished ones, failures named;
every config mixer nameable, a misspelt config field refused."""
import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

from falcon_fwa.tasks.addition import cli, compare

RECORD = Path(__file__).resolve().parents[1] / "results" / "addition" / "paper_runs"


def _write_run(runs, model, seed, **fields):
    run_dir = compare._run_dir(runs, model, seed)
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json.dumps(fields))
    return run_dir


def _compare_args(argv):
    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    return p.parse_args(argv)


def _row(model, mean, seeds=(0,), walls=(1.0,)):
    """A summary row as :func:`compare.summarize` writes it, OOD widths 4-5."""
    row = {"model": model, "seeds": list(seeds), "steps_done": [40] * len(seeds), "paper": None,
           "per_seed": [{"seed": s, "wall_time_s": w} for s, w in zip(seeds, walls)]}
    for key in ("best_step", "val_acc", "mean_acc_4_5", "digit_mean_acc_4_5"):
        row[key], row[f"{key}_std"] = mean, 0.0
    for key in ("acc_d4", "acc_d5", "digit_acc_d4", "digit_acc_d5"):
        row[key] = mean
    return row


def _meta(**over):
    meta = {"preset_name": "x", "train_widths": [1, 3], "ood_widths": [4, 5], "size": {}, "steps": 40,
            "batch_size": 4, "lr": 1e-3, "val_per_width": 2, "ood_per_width": 2, "seeds": [0], "device": "cpu",
            "wall_time_s": 1.0, "command": "c", "commit": "x"}
    return {**meta, **over}


def test_a_run_counts_as_started_once_it_has_a_best_step(tmp_path):
    """--partial tables unfinished runs at their best step so far: a run folder without results.json, or
    whose results.json has no best step yet, has nothing to table."""
    assert not compare._started(tmp_path / "none")
    assert not compare._started(_write_run(tmp_path, "Transformer", 0, best=None, steps_done=0))
    assert compare._started(_write_run(tmp_path, "Transformer", 1, best={"step": 2}, steps_done=2))


def test_unfinished_runs_lists_each_missing_or_short_run_seed_major(tmp_path):
    """Budget 40: Transformer seed 0 finished at 40; Mamba-2 seed 0 stopped at 10; Transformer seed 1
    finished under a shorter budget of 20 (continued, so unfinished); Mamba-2 seed 1 never ran."""
    _write_run(tmp_path, "Transformer", 0, finished=True, steps_done=40)
    _write_run(tmp_path, "Mamba-2", 0, finished=False, steps_done=10)
    _write_run(tmp_path, "Transformer", 1, finished=True, steps_done=20)
    assert compare.unfinished_runs(tmp_path, ["Transformer", "Mamba-2"], [0, 1], 40) == [
        "Mamba-2 seed 0 (unfinished: 10 of 40 steps)", "Transformer seed 1 (unfinished: 20 of 40 steps)",
        "Mamba-2 seed 1 (no run)"]
    assert compare.unfinished_runs(tmp_path, ["Transformer"], [0], 40) == []
    # at the last step of the budget but not marked finished (stopped before its end): not skipped
    _write_run(tmp_path, "RetNet", 0, finished=False, steps_done=40)
    assert not compare._finished(compare._run_dir(tmp_path, "RetNet", 0), 40)
    assert compare.unfinished_runs(tmp_path, ["RetNet"], [0], 40) == ["RetNet seed 0 (unfinished: 40 of 40 steps)"]


def test_each_run_is_started_with_the_evaluation_seed_and_every_override(tmp_path):
    """docs/addition.md lists the settings that override the preset for every model of a lineup alike; the
    command a run is started with, read back by ``falcon-fwa addition``'s own parser, carries each of them,
    with the model, seed, folder, preset, device, dtype and evaluation seed."""
    given = {"steps": 7, "batch_size": 3, "lr": 0.002, "hidden_size": 24, "num_hidden_layers": 2, "num_heads": 3,
             "matmul_precision": "high", "curriculum_steps": 5, "operand_order": "lsd", "base": 3,
             "abacus_offset": 0, "train_widths": [2, 4], "ood_widths": [6, 9], "eval_every": 2,
             "val_per_width": 5, "ood_per_width": 6, "threads": 1}
    argv = ["--preset", "paper", "--dtype", "bfloat16", "--eval-seed", "77"]
    for field, value in given.items():
        argv += [f"--{field.replace('_', '-')}", *map(str, value if isinstance(value, list) else [value])]
    args = _compare_args(argv)
    args.device = "cpu"  # as check_machine_options resolves it
    cmd = compare._command(args, "Falcon-1A.2", 4, tmp_path / "out")
    assert cmd[:3] == [sys.executable, "-m", "falcon_fwa.tasks.addition.cli"]
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    run = p.parse_args(cmd[3:])
    assert (run.model, run.seed, run.out, run.preset, run.device, run.dtype, run.eval_seed, run.no_progress) == (
        "Falcon-1A.2", 4, str(tmp_path / "out"), "paper", "cpu", "bfloat16", 77, True)
    assert {field: getattr(run, field) for field in given} == given
    # options left out stay out: the run takes the preset's values
    bare = p.parse_args(compare._command(_compare_args(["--device", "cpu"]), "Transformer", 0, tmp_path)[3:])
    assert all(getattr(bare, field) is None for field in given) and bare.eval_seed == 1234


def test_a_summary_of_runs_trained_before_it_gives_the_range_of_their_wall_times():
    rows = [_row("Falcon-3A.3", 50.0, seeds=(0, 1), walls=(7.4, 3.2)), _row("Transformer", 40.0, walls=(12.6,))]
    table = compare.markdown(rows, _meta(wall_time_s=None))
    assert "wall time of each run: 3-13 s (a summary of runs trained before it" in table
    assert "wall time of the comparison" not in table


def test_the_verdict_names_each_other_model_a_baseline_or_a_variant():
    """The paper's baselines are the Transformer, Mamba-2 and RetNet; the other Falcon rows are variants."""
    rows = [_row("Falcon-3A.3", 80.0), _row("RetNet", 70.0), _row("Falcon-1A.3", 90.0), _row("Mamba-2", 80.0)]
    lines = compare._verdict(rows, "mean_acc_4_5", paper_widths=False)[1:]
    assert lines == ["- vs RetNet (baseline): 70.0, Falcon-3A.3 ahead by 10.0.",
                     "- vs Falcon-1A.3 (variant): 90.0, Falcon-3A.3 behind by 10.0.",
                     "- vs Mamba-2 (baseline): 80.0, Falcon-3A.3 tied."]


def test_the_verdict_shows_a_second_decimal_where_one_would_hide_the_difference():
    """The rows keep two decimals. A mean of 87.15 is 0.05 short of the paper's 87.2, and a lead of 0.04 is a
    lead: one decimal would print 87.2 against 87.2, short by 0.1, and a lead of 0.0."""
    rows = [_row("Falcon-3A.3", 87.15), _row("Transformer", 87.11), _row("Mamba-2", 85.0)]
    for row in rows:
        row["mean_acc_33_48"] = row["digit_mean_acc_33_48"] = row["mean_acc_4_5"]
    lines = compare._verdict(rows, "mean_acc_33_48")
    assert lines[0] == "- Falcon-3A.3 mean exact-match accuracy 87.15 vs the paper's 87.2: short by 0.05 points (-0.05)."
    assert lines[2:] == ["- vs Transformer (baseline): 87.11, Falcon-3A.3 ahead by 0.04.",
                         "- vs Mamba-2 (baseline): 85.0, Falcon-3A.3 ahead by 2.15."]


def test_the_scale_names_each_rule_by_its_carry_window():
    """Window 0 takes no carry, window 1 the carry from the one place below, window k from k places."""
    reference = {"uniform": {"digit": 10.0, "exact": 0.0}, "carry_window_0": {"digit": 81.25, "exact": 0.5},
                 "carry_window_1": {"digit": 95.04, "exact": 16.0}, "carry_window_2": {"digit": 99.5, "exact": 90.0}}
    lines = compare.markdown([_row("Transformer", 50.0)], _meta(reference=reference)).splitlines()
    start = lines.index("| rule | digits | exact |")
    assert lines[start + 2: start + 6] == ["| uniform guessing | 10.0 | 0.0 |", "| no carry | 81.2 | 0.5 |",
                                           "| carry from the 1 place below | 95.0 | 16.0 |",
                                           "| carry from the 2 places below | 99.5 | 90.0 |"]
    assert "## Scale: what simple rules score on widths 4-5" in lines


def test_the_run_line_states_digit_places_at_an_offset_of_zero_and_none_without():
    """``--abacus-offset 0`` embeds each digit's place, unshifted: a setting of its own (``-abacus0``)."""
    note = "each digit's place in its number embedded (training offset up to {})"
    rows = [_row("Transformer", 50.0)]
    assert note.format(0) in compare.markdown(rows, _meta(abacus_offset=0))
    assert note.format(8) in compare.markdown(rows, _meta(abacus_offset=8))
    assert "place in its number" not in compare.markdown(rows, _meta(abacus_offset=None))
    assert "place in its number" not in compare.markdown(rows, _meta())


def test_the_summary_lists_its_failed_runs():
    failed = ["Mamba-2 seed 1 (no run)"]
    assert "- failed runs: ['Mamba-2 seed 1 (no run)']" in compare.markdown([_row("Transformer", 1.0)],
                                                                             _meta(failed=failed))
    assert "failed runs" not in compare.markdown([_row("Transformer", 1.0)], _meta(failed=[]))


@pytest.mark.parametrize("script", ["falcon-fwa", "falcon_fwa/cli.py"])
def test_the_command_is_recorded_as_typed(monkeypatch, script):
    """Through the falcon-fwa command or python -m falcon_fwa.cli: the subcommand once, then the arguments
    as a shell reads them back."""
    monkeypatch.setattr(sys, "argv", [script, "addition-compare", "--models", "Falcon-3A.3", "--name", "a b"])
    assert compare._invocation() == "falcon-fwa addition-compare --models Falcon-3A.3 --name 'a b'"


def test_a_lineup_that_trains_reports_its_failures_and_starts_without_notes(tmp_path, monkeypatch, capsys):
    """Seed 0 of Falcon-3A.3 and the Transformer finished (the record's runs), seed 1 missing: the lineup
    trains, and its training (replaced here) fails seed 1 of the Transformer. The command ends with status 1,
    the summary lists that failure, carries over none of the notes of the summary it replaces (kept whole in
    t.before.md), and draws the position plot at the largest training width 32 and the OOD widths 33 and 48.
    A rewrite from the runs (--no-train) lists instead every run missing at the time."""
    runs = tmp_path / "runs"
    for model in ("Falcon-3A.3", "Transformer"):
        shutil.copytree(compare._run_dir(RECORD, model, 0), compare._run_dir(runs, model, 0))
    (tmp_path / "res").mkdir()
    earlier = "# an earlier table\n\n## Notes\n\nwritten by hand\n"
    (tmp_path / "res" / "t.md").write_text(earlier)
    (tmp_path / "res" / "t_meta.json").write_text(json.dumps({"notes": "of the meta", "command": "c"}))
    failure = ["Transformer seed 1 (exit 1, see log.txt)"]
    trained = []
    monkeypatch.setattr(compare, "train_all", lambda args, r: trained.append(r) or (list(failure), 0))
    monkeypatch.setattr(compare, "_ood_reference", lambda *a: {})
    from falcon_fwa.tasks.addition import plot

    monkeypatch.setattr(plot, "plot_accuracy_vs_width", lambda *a, **k: None)

    def positions(results, path, widths=None, title=None):
        drawn.append(list(widths))

    drawn = []
    monkeypatch.setattr(plot, "plot_lineup_positions", positions)
    argv = ["--preset", "paper", "--device", "cpu", "--models", "Falcon-3A.3", "Transformer", "--seeds", "0", "1",
            "--partial", "--runs", str(runs), "--results", str(tmp_path / "res"), "--name", "t"]
    assert compare.main(argv) == 1
    assert trained == [runs] and drawn == [[32, 33, 48]]
    meta = json.loads((tmp_path / "res" / "t_meta.json").read_text())
    assert meta["failed"] == failure and meta["notes"] == "" and meta["seeds"] == [0]
    md = (tmp_path / "res" / "t.md").read_text()
    assert "## Notes" not in md and "written by hand" not in md and f"- failed runs: {failure}" in md
    assert (tmp_path / "res" / "t.before.md").read_text() == earlier
    # from the runs alone: every run missing at the time, and the status of a summary that failed nothing
    assert compare.main([*argv, "--no-train"]) == 0
    meta = json.loads((tmp_path / "res" / "t_meta.json").read_text())
    assert meta["failed"] == ["Falcon-3A.3 seed 1 (no run)", "Transformer seed 1 (no run)"]
    assert len(trained) == 1 and drawn[-1] == [32, 33, 48]
    capsys.readouterr()


def _cli_args(argv):
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_the_commands_defaults_are_the_documented_ones():
    """``falcon-fwa addition`` with no arguments trains Falcon-3A.3 on the tiny preset, seed 0, evaluation
    seed 1234; ``addition-compare`` trains the paper's whole table of eight models, seed 0, one run at a
    time, and writes to results/addition."""
    run = _cli_args([])
    assert (run.model, run.preset, run.seed, run.eval_seed, run.device, run.dtype) == (
        "Falcon-3A.3", "tiny", 0, 1234, "auto", "float32")
    lineup = _compare_args([])
    assert sorted(lineup.models) == sorted(["Falcon-3A.3", "Falcon-1A.3", "Falcon-1.3", "Transformer", "Mamba-2",
                                            "RetNet", "Falcon-1A.1", "Falcon-1A.2"])
    assert (lineup.preset, lineup.seeds, lineup.jobs, lineup.results, lineup.eval_seed) == (
        "tiny", [0], 1, "results/addition", 1234)


def test_a_curriculum_of_zero_steps_is_the_whole_range_and_a_negative_one_is_refused():
    assert cli.preset_from_args(_cli_args(["--curriculum-steps", "0"])).curriculum_steps == 0
    assert cli.preset_from_args(_cli_args(["--curriculum-steps", "3"])).curriculum_steps == 3
    with pytest.raises(ValueError, match=r"^--curriculum-steps must be >= 0, got -1$"):
        cli.preset_from_args(_cli_args(["--curriculum-steps", "-1"]))


@pytest.mark.parametrize("option", ["--steps", "--batch-size", "--eval-every", "--hidden-size",
                                    "--num-hidden-layers", "--num-heads", "--val-per-width", "--ood-per-width"])
def test_each_count_below_one_is_refused_naming_the_option_as_typed(option):
    with pytest.raises(ValueError, match=rf"^{option} must be >= 1, got 0$"):
        cli.preset_from_args(_cli_args([option, "0"]))


@pytest.mark.parametrize("option", ["--threads", "--window"])
def test_threads_and_window_below_one_are_refused_naming_the_option(option):
    args = _cli_args([option, "0", "--device", "cpu"])
    with pytest.raises(ValueError, match=rf"^{option} must be >= 1, got 0$"):
        cli.check_machine_options(args)
    args = _cli_args([option, "1", "--device", "cpu"])
    cli.check_machine_options(args)
    assert args.device == "cpu"


class _Started(Exception):
    pass


@pytest.mark.parametrize("argv,threads", [([], 1), (["--threads", "3"], 3)])
def test_a_cpu_run_takes_the_presets_threads_unless_told(tmp_path, monkeypatch, argv, threads):
    """The tiny preset's choice on the CPU is one thread; ``--threads`` overrides it. The run is
    stopped where training would start."""
    import torch

    from falcon_fwa.tasks.addition import train

    told = []
    monkeypatch.setattr(torch, "set_num_threads", told.append)

    def start(spec, out, **kw):
        raise _Started(out)

    monkeypatch.setattr(train, "train_run", start)
    with pytest.raises(_Started):
        cli.run(_cli_args(["--device", "cpu", "--out", str(tmp_path / "r"), "--model", "Transformer", *argv]))
    assert told == [threads]


def _spy_axes(monkeypatch, *names):
    """Records the positional arguments of some ``matplotlib.axes.Axes`` methods, which still draw."""
    import matplotlib.axes

    calls = {name: [] for name in names}
    for name in names:
        original = getattr(matplotlib.axes.Axes, name)

        def spy(ax, *args, _name=name, _original=original, **kwargs):
            calls[_name].append(args)
            return _original(ax, *args, **kwargs)

        monkeypatch.setattr(matplotlib.axes.Axes, name, spy)
    return calls


def test_the_heat_map_puts_answer_position_k_in_column_k(tmp_path, monkeypatch):
    """x is the answer position, k = 0 the units digit: a width-3 run right on its units digit only has 100
    in column 0 and 0 in columns 1-3; a width-2 run wrong on its final carry only, 0 in column 2."""
    pytest.importorskip("matplotlib")
    import numpy as np

    from falcon_fwa.tasks.addition.plot import plot_accuracy_by_position

    calls = _spy_axes(monkeypatch, "imshow")
    per = {"2": [100.0, 100.0, 0.0], "3": [100.0, 0.0, 0.0, 0.0]}
    result = {"model": "m", "preset": {"train_widths": [1, 2]}, "best": {"step": 1, "per_position": per}}
    assert plot_accuracy_by_position(result, tmp_path / "h.png").stat().st_size > 0
    (grid,), = calls["imshow"]
    assert grid.shape == (2, 4)
    assert list(grid[1]) == [100.0, 0.0, 0.0, 0.0]
    assert list(grid[0, :3]) == [100.0, 100.0, 0.0] and np.isnan(grid[0, 3])


def test_the_lineup_position_plot_of_runs_before_the_base_option_dots_guessing_at_10(tmp_path, monkeypatch):
    """Runs from before an option count as its default: base 10, guessing right on 10 % of the digits."""
    pytest.importorskip("matplotlib")
    from falcon_fwa.tasks.addition.plot import plot_lineup_positions

    calls = _spy_axes(monkeypatch, "axhline")
    run = {"preset": {"train_widths": [1, 3]}, "best": {"step": 1, "per_position": {"4": [50.0] * 5}}}
    assert plot_lineup_positions({"m": [run]}, tmp_path / "p.png", widths=[4]).stat().st_size > 0
    assert calls["axhline"] == [(10.0,)]


def test_the_lineup_position_plot_names_both_ends_of_the_training_widths_training(tmp_path, monkeypatch):
    """Training widths 3-5 include 3 and 5; 6 is past them."""
    pytest.importorskip("matplotlib")
    from falcon_fwa.tasks.addition.plot import plot_lineup_positions

    calls = _spy_axes(monkeypatch, "set_title")
    per = {str(w): [100.0] * (w + 1) for w in (3, 5, 6)}
    run = {"preset": {"train_widths": [3, 5], "base": 10}, "best": {"step": 1, "per_position": per}}
    assert plot_lineup_positions({"m": [run]}, tmp_path / "p.png", widths=[3, 5, 6]).stat().st_size > 0
    assert [c[0] for c in calls["set_title"]] == ["width 3 (training)", "width 5 (training)",
                                                  "width 6 (out of distribution)"]


def test_without_a_seed_common_to_all_models_the_table_takes_one_seed_for_every_row(tmp_path, monkeypatch, capsys):
    """Falcon-3A.3 ran seed 0 only and the Transformer seed 1 only: no seed has every model, so the table
    takes the first seed that has a run (0) and leaves out the model without it, rather than rows that
    average different seeds. The runs' evaluation seed (7) is recorded, and the Scale is computed with it."""
    runs = tmp_path / "runs"
    for model, seed in (("Falcon-3A.3", 0), ("Transformer", 1)):
        held = json.loads((compare._run_dir(RECORD, model, 0) / "results.json").read_text())
        compare._run_dir(runs, model, seed).mkdir(parents=True)
        (compare._run_dir(runs, model, seed) / "results.json").write_text(
            json.dumps({**held, "seed": seed, "eval_seed": 7}))  # as runs of evaluation seed 7
    scale_seeds = []
    monkeypatch.setattr(compare, "_ood_reference", lambda eval_seed, preset: scale_seeds.append(eval_seed) or {})
    from falcon_fwa.tasks.addition import plot

    monkeypatch.setattr(plot, "plot_accuracy_vs_width", lambda *a, **k: None)
    monkeypatch.setattr(plot, "plot_lineup_positions", lambda *a, **k: None)
    assert compare.main(["--preset", "paper", "--device", "cpu", "--models", "Falcon-3A.3", "Transformer",
                         "--seeds", "0", "1", "--no-train", "--partial", "--runs", str(runs),
                         "--results", str(tmp_path), "--name", "t", "--eval-seed", "7"]) == 0
    capsys.readouterr()
    assert [(r["model"], r["seeds"]) for r in json.loads((tmp_path / "t.json").read_text())] == [("Falcon-3A.3", [0])]
    meta = json.loads((tmp_path / "t_meta.json").read_text())
    assert meta["seeds"] == [0] and meta["eval_seed"] == 7 and scale_seeds == [7]  # the Scale on their OOD set


def test_the_summary_names_the_command_that_trained_its_runs():
    rows = [_row("Transformer", 1.0)]
    command = "falcon-fwa addition-compare --models Transformer"
    assert f"- the runs were trained by: `{command}`" in compare.markdown(rows, _meta(trained_by=command))
    assert "trained by" not in compare.markdown(rows, _meta(trained_by=None))


def test_a_curriculum_of_zero_steps_is_not_stated_as_one():
    """0 curriculum steps is the whole range from the start, as in the paper."""
    rows = [_row("Transformer", 1.0)]
    assert "widths growing" not in compare.markdown(rows, _meta(curriculum_steps=0))
    assert "widths growing from 1 to 3 over the first 5 steps" in compare.markdown(rows, _meta(curriculum_steps=5))


def test_a_best_step_without_positions_draws_no_heat_map(tmp_path, capsys):
    from falcon_fwa.tasks.addition.plot import plot_accuracy_by_position

    for best in ({"step": 1, "per_position": {}}, {"step": 1}):
        result = {"model": "m", "preset": {"train_widths": [1, 2]}, "best": best}
        assert plot_accuracy_by_position(result, tmp_path / "h.png") is None
        assert "no heat map" in capsys.readouterr().out and not (tmp_path / "h.png").exists()


@pytest.mark.parametrize("seed", [-2 ** 63 - 1, 2 ** 64])
def test_a_seed_torch_does_not_take_is_refused_naming_seeds(seed):
    args = _compare_args(["--seeds", "0", str(seed)])
    with pytest.raises(ValueError, match=rf"^--seeds must lie in \[-2\^63, 2\^64\), got {seed}$"):
        compare.check_compare_options(args)
    compare.check_compare_options(_compare_args(["--seeds", "0", str(-2 ** 63), str(2 ** 64 - 1)]))


def test_a_runs_seed_torch_does_not_take_is_refused_before_anything_is_written(tmp_path):
    for seed in (-2 ** 63 - 1, 2 ** 64):
        with pytest.raises(ValueError, match=rf"^--seed must lie in \[-2\^63, 2\^64\), got {seed}$"):
            cli.run(_cli_args(["--device", "cpu", "--seed", str(seed), "--out", str(tmp_path / "r")]))
    assert not any(tmp_path.iterdir())


def test_every_mixer_of_the_config_can_be_named_and_a_misspelt_field_is_refused():
    """A variant is trained under its mixer's name: every mixer a config takes is one. A field the config
    does not have raises instead of being stored unused."""
    from falcon_fwa.models import configuration
    from falcon_fwa.tasks.addition.lineup import MIXERS, build_model, resolve_model

    assert set(MIXERS) == set(configuration.MIXERS)
    for mixer in configuration.MIXERS:
        assert resolve_model(mixer) == {"mixer": mixer}
    size = {"hidden_size": 8, "num_hidden_layers": 1, "num_heads": 2}
    with pytest.raises(ValueError, match="unknown config field 'rulee'"):
        build_model({"mixer": "falcon", "rulee": "3A"}, size, vocab_size=14)
    assert build_model({"mixer": "falcon", "rule": "3A"}, size, vocab_size=14).config.rule == "3A"


class _FakeRun:
    """Stands for a run's process: alive for one poll, then ended with the exit status its (model, seed)
    is given; a run that ends with 0 has written its results.json, as a finished run does."""
    alive, started, most = set(), [], 0
    status = {}

    def __init__(self, cmd, **kw):
        self.model, self.seed = cmd[cmd.index("--model") + 1], int(cmd[cmd.index("--seed") + 1])
        self.out, self.returncode, self.polls = Path(cmd[cmd.index("--out") + 1]), None, 0
        _FakeRun.started.append((self.model, self.seed))
        _FakeRun.alive.add(self)
        _FakeRun.most = max(_FakeRun.most, len(_FakeRun.alive))

    def poll(self):
        self.polls += 1
        if self.polls > 1 and self.returncode is None:
            self.returncode = _FakeRun.status.get((self.model, self.seed), 0)
            _FakeRun.alive.discard(self)
            if self.returncode == 0:
                (self.out / "results.json").write_text(json.dumps(
                    {"finished": True, "steps_done": 2, "best": {"val_acc": 1.0, "mean_acc_ood": 0.0}}))
        return self.returncode

    def wait(self):
        while self.poll() is None:
            pass
        return self.returncode


def test_train_all_starts_the_missing_runs_seed_major_at_most_jobs_at_a_time(tmp_path, monkeypatch):
    """Two models, seeds 0-2, Mamba-2 seed 0 already finished at the budget of 2 steps: the other five
    runs start in seed-major order (every model's seed 0 before any seed 1), two at a time with --jobs 2;
    the one that exits with status 3 is the failure reported, naming its log."""
    import subprocess

    monkeypatch.setattr(_FakeRun, "alive", set())
    monkeypatch.setattr(_FakeRun, "started", [])
    monkeypatch.setattr(_FakeRun, "most", 0)
    monkeypatch.setattr(_FakeRun, "status", {("Transformer", 1): 3})
    monkeypatch.setattr(subprocess, "Popen", _FakeRun)
    monkeypatch.setattr(compare.time, "sleep", lambda s: None)
    runs = tmp_path / "runs"
    _write_run(runs, "Mamba-2", 0, finished=True, steps_done=2)
    args = _compare_args(["--models", "Transformer", "Mamba-2", "--seeds", "0", "1", "2", "--jobs", "2",
                          "--steps", "2", "--device", "cpu"])
    failed, stopped_by = compare.train_all(args, runs)
    assert _FakeRun.started == [("Transformer", 0), ("Transformer", 1), ("Mamba-2", 1), ("Transformer", 2),
                                ("Mamba-2", 2)]
    assert _FakeRun.most == 2 and stopped_by == 0
    assert failed == [f"Transformer seed 1 (exit 3, see {compare._run_dir(runs, 'Transformer', 1)}/log.txt)"]
    assert compare.unfinished_runs(runs, ["Transformer", "Mamba-2"], [0, 1, 2], 2) == [
        "Transformer seed 1 (no run)"]
